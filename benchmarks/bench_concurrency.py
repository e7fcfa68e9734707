"""Searches while another thread edits the index: what they return, and what sharing costs them.

    python -m benchmarks.bench_concurrency --data clustered:n=1000000,d=384,clusters=1000,queries=10000   # GPU
    python -m benchmarks.bench_concurrency --device cpu --data clustered:n=100000,d=64,clusters=100,queries=1000

An Index of 90% of the rows; --searchers threads (each on a CUDA stream of its own on a GPU, as a
server's request threads would be) search batches of --batch queries back to back, first for
--seconds with no writer, then while one more thread makes --edits edits back to back: adds of 1%
of the rows (from the held-out 10%, then rows removed earlier, under new ids) and removes of 1% of
the live ids in turn, and every tenth edit a compact (--writer mixed), or adds of 1% only (--writer
adds: the index starts with all rows but those the adds bring). --search-priority high puts the searchers'
streams above the writer's (a server's choice: the GPU then runs their blocks first); --writer-sms N
runs the writer's edits on a stream of a CUDA green context of N SMs (torch.cuda.green_contexts),
so that they never take more of the GPU than that and the searchers keep the rest. Reported:
  - queries/s of all searchers without and with the writer, and their ratio (the goal: >= 80%);
  - errors raised by a search, and inconsistent results: a batch whose ids are not all live in
    one of the index versions between the version read before the search and the one after (a
    mix of two states, or a removed id);
  - each kind of edit's median time, and recall@10 at list 64 of the edited index at the end
    against exact neighbours over the rows it holds.
Writes concurrency_<name>.{json,md} under --out.
"""
import bisect
import contextlib
import json
import os
import threading
import time

import torch

import torch_grnnd as grnnd
from benchmarks.common import K, LIST, recall, setup
from benchmarks.report import machine, machine_line


def search_loop(index: grnnd.Index, queries: torch.Tensor, batch: int, stop: threading.Event, device: torch.device,
                done: list, errors: list, priority: int = 0) -> None:
    """Search consecutive batches until ``stop``: appends (version before, version after, ids on
    the CPU as int32) for each search to ``done``, and any exception to ``errors``. ``priority``:
    the CUDA stream's (0 as the default stream's, negative: higher)."""
    stream = torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None
    start = 0
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while not stop.is_set():
                q = queries[start:start + batch]
                start = (start + batch) % max(queries.shape[0] - batch, 1)
                before = index.version
                ids = index.search(q, K, list_size=LIST)[1]
                done.append((before, index.version, ids.to("cpu", torch.int32)))
    except Exception as error:  # noqa: BLE001 - reported, not raised
        errors.append(repr(error))


# The green contexts of the writers' streams: a context is destroyed with its Python object, and
# a stream of a destroyed context fails every launch.
_GREEN_CONTEXTS = []


def writer_stream_on(device: torch.device, sms: int):
    """A stream of a CUDA green context of ``sms`` SMs on ``device`` (None for 0, or off a GPU):
    kernels launched on it run on those SMs only. The context lives as long as the process."""
    if sms <= 0 or device.type != "cuda":
        return None
    from torch.cuda.green_contexts import GreenContext  # torch 2.11 and later
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = GreenContext.create(num_sms=sms, device_id=index)
    _GREEN_CONTEXTS.append(context)
    return context.Stream()


def run_searchers(index, queries, args, device, stop, done, errors):
    priority = -1 if args.search_priority == "high" else 0  # torch maps -1 to a high priority the GPU has
    threads = [threading.Thread(target=search_loop,
                                args=(index, queries, args.batch, stop, device, done, errors, priority))
               for _ in range(args.searchers)]
    for t in threads:
        t.start()
    return threads


def main():
    def arguments(p):
        p.add_argument("--searchers", type=int, default=3, help="threads searching at once")
        p.add_argument("--batch", type=int, default=100, help="queries a search")
        p.add_argument("--edits", type=int, default=100, help="edits the writer makes")
        p.add_argument("--seconds", type=float, default=10.0, help="length of the phase without a writer")
        p.add_argument("--writer", choices=("mixed", "adds"), default="mixed",
                       help="mixed: adds, removes and compacts; adds: adds of 1%% only (the index starts "
                            "with all rows but --edits %% of them)")
        p.add_argument("--search-priority", choices=("default", "high"), default="default",
                       help="the searchers' CUDA streams: the default priority, or the highest")
        p.add_argument("--writer-sms", type=int, default=0,
                       help="the writer's edits on a green context of this many SMs (0: the whole GPU)")
    args, device, name, base, queries = setup(__doc__, "clustered:n=1000000,d=384,clusters=1000,queries=10000",
                                              arguments)
    n = base.shape[0]
    step = max(n // 100, 1)
    # Mixed edits draw on 10% of the rows held out (removed rows go back to them); adds only
    # need a row for each edit, so the index starts that much smaller.
    first = n * 9 // 10 if args.writer == "mixed" else n - args.edits * step
    if first < n // 10:
        raise SystemExit(f"--writer adds: {args.edits} adds of 1% need fewer edits (at most 90)")
    index = grnnd.Index.build(base[:first], ids=torch.arange(first, device=device))
    index.reserve(n + step)  # the adds land in room reserved up front, as a server would do
    index.search(queries[:args.batch], K, list_size=LIST)

    # Without a writer.
    stop, done, errors = threading.Event(), [], []
    threads = run_searchers(index, queries, args, device, stop, done, errors)
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    alone_qps = len(done) * args.batch / args.seconds

    # With one. The writer's own bookkeeping is tensors (their ops release the GIL), so that it
    # takes no time from the searchers' Python: per id, the row of base it holds and the recorded
    # version from which it is live and from which it is removed (max_version: never), which
    # together give the live ids of every recorded version.
    never = torch.iinfo(torch.int64).max
    adds = (args.edits + 1) // 2 if args.writer == "mixed" else args.edits
    ids_ever = n + adds * step
    row_of = torch.full((ids_ever,), -1, dtype=torch.int64)
    row_of[:first] = torch.arange(first)
    added_at = torch.full((ids_ever,), -1, dtype=torch.int64)  # -1: before the writer
    added_at[first:] = never
    removed_at = torch.full((ids_ever,), never, dtype=torch.int64)
    live = torch.zeros(ids_ever, dtype=torch.bool)
    live[:first] = True
    recorded = [index.version]
    held_out = torch.arange(first, n)  # rows not in the index: added, and re-added after removal
    next_id, times = n, {"add": [], "remove": [], "compact": []}
    g = torch.Generator().manual_seed(0)
    writer_stream = writer_stream_on(device, args.writer_sms)
    stop, done, errors = threading.Event(), [], []
    threads = run_searchers(index, queries, args, device, stop, done, errors)
    began = time.perf_counter()
    try:
        changes = 0  # adds and removes alternate, so that the held-out rows never run out
        for edit in range(args.edits):
            kind = "add" if args.writer == "adds" else (
                "compact" if edit % 10 == 9 else ("add" if changes % 2 == 0 else "remove"))
            changes += kind != "compact"
            t0 = time.perf_counter()
            with torch.cuda.stream(writer_stream) if writer_stream is not None else contextlib.nullcontext():
                if kind == "add":
                    rows, held_out = held_out[:step], held_out[step:]
                    ids = torch.arange(next_id, next_id + rows.numel())
                    index.add(base[rows.to(device)], ids=ids.to(device))
                    next_id += rows.numel()
                elif kind == "remove":
                    candidates = live.nonzero().squeeze(1)
                    gone = candidates[torch.randperm(candidates.numel(), generator=g)[:step]]
                    index.remove(gone.to(device))
                else:
                    index.compact()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[kind].append(time.perf_counter() - t0)
            recorded.append(index.version)
            if kind == "add":
                row_of[ids], added_at[ids], live[ids] = rows, recorded[-1], True
            elif kind == "remove":
                removed_at[gone], live[gone] = recorded[-1], False
                held_out = torch.cat([held_out, row_of[gone]])
    finally:
        stop.set()
        for t in threads:
            t.join()
    writer_s = time.perf_counter() - began
    shared_qps = len(done) * args.batch / writer_s

    # A search may have started or ended inside an edit that made more than one version visible:
    # it may see any recorded state from the last one at or before `before` to the first one at or
    # after `after`.
    def all_live(found: torch.Tensor, v: int) -> bool:
        return bool(((added_at[found] <= v) & (v < removed_at[found])).all())

    inconsistent = 0
    for before, after, ids in done:
        found = ids[ids >= 0].long()
        low = max(bisect.bisect_right(recorded, before) - 1, 0)
        high = bisect.bisect_left(recorded, after) + 1
        inconsistent += not any(all_live(found, v) for v in recorded[low:high])
    kept = live.nonzero().squeeze(1)
    rows = row_of[kept].to(device)
    kept = kept.to(device)
    truth = kept[grnnd.knn(base[rows], queries, K)[1]]
    results = {
        "data": name, "n": n, "dim": base.shape[1], "device": device.type, "searchers": args.searchers,
        "batch": args.batch, "search_priority": args.search_priority, "writer": args.writer,
        "writer_sms": args.writer_sms, "edits": args.edits, "rows_per_edit": step,
        "machine": machine(threads=torch.get_num_threads(), cuda=device.type == "cuda"),
        "alone_qps": alone_qps, "shared_qps": shared_qps, "ratio": shared_qps / alone_qps,
        "searches_during_edits": len(done), "writer_s": writer_s, "errors": len(errors), "first_error": errors[:1],
        "inconsistent": inconsistent,
        "median_ms": {kind: 1000 * sorted(t)[len(t) // 2] for kind, t in times.items() if t},
        "recall": recall(index, queries, truth), "command": args.command,
    }
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"concurrency_{name}_{device.type}" + ("_adds" if args.writer == "adds" else "")
                        + ("_high" if args.search_priority == "high" else "")
                        + (f"_sms{args.writer_sms}" if args.writer_sms else ""))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(report_lines(results)) + "\n")
    print("wrote", stem + ".json", stem + ".md")


def report_lines(r: dict) -> list:
    medians = ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in r["median_ms"].items())
    return [f"# Searches during edits, {r['data']} ({r['n']:,} x {r['dim']}, {r['device']})", "",
            f"Machine: {machine_line(r['machine'])}. `{r['command']}`.", "",
            "| searchers x batch | q/s alone | q/s with a writer | ratio | searches during edits | errors | "
            "inconsistent | edits (median) | recall@10 after |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|",
            f"| {r['searchers']} x {r['batch']}"
            f"{' (high-priority streams)' if r.get('search_priority') == 'high' else ''}"
            f"{f' (writer on {sms} SMs)' if (sms := r.get('writer_sms')) else ''}"
            f" | {r['alone_qps']:,.0f} | {r['shared_qps']:,.0f} | {r['ratio']:.2f} | "
            f"{r['searches_during_edits']:,} | {r['errors']} | {r['inconsistent']} | {r['edits']} "
            f"{'adds' if r.get('writer') == 'adds' else 'edits'} of "
            f"{r['rows_per_edit']:,} rows: {medians} | {r['recall']:.4f} |"]


if __name__ == "__main__":
    main()
