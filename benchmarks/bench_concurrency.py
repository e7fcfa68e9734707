"""Searches while another thread edits the index: what they return, and what sharing costs them.

    python -m benchmarks.bench_concurrency --data clustered:n=1000000,d=384,clusters=1000,queries=10000   # GPU
    python -m benchmarks.bench_concurrency --device cpu --data clustered:n=100000,d=64,clusters=100,queries=1000

An Index of 90% of the rows; --searchers threads (each on a CUDA stream of its own on a GPU, as a
server's request threads would be) search batches of --batch queries back to back, first for
--seconds with no writer, then while one more thread makes --edits edits in turn: an add of 1% of
the rows (from the held-out 10%, then rows removed earlier, under new ids), a remove of 1% of the
live ids, and every tenth edit a compact. Reported:
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
                done: list, errors: list) -> None:
    """Search consecutive batches until ``stop``: appends (version before, version after, ids on
    the CPU as int32) for each search to ``done``, and any exception to ``errors``."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
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


def run_searchers(index, queries, args, device, stop, done, errors):
    threads = [threading.Thread(target=search_loop, args=(index, queries, args.batch, stop, device, done, errors))
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
    args, device, name, base, queries = setup(__doc__, "clustered:n=1000000,d=384,clusters=1000,queries=10000",
                                              arguments)
    n = base.shape[0]
    first, step = n * 9 // 10, max(n // 100, 1)
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

    # With one. The version recorded after each edit; each id's recorded version from which it is
    # live (absent: from the start) and the one from which it is removed: together the live ids
    # of every recorded version, without a copy of the live set per edit.
    live = set(range(first))
    recorded, added_at, removed_at = [index.version], {}, {}
    pending_added, pending_removed = [], []
    held_out = list(range(first, n))  # rows not in the index: added, and re-added after removal
    next_id, times = n, {"add": [], "remove": [], "compact": []}
    row_of = {i: i for i in range(first)}  # id -> row of base it holds
    g = torch.Generator().manual_seed(0)
    stop, done, errors = threading.Event(), [], []
    threads = run_searchers(index, queries, args, device, stop, done, errors)
    began = time.perf_counter()
    try:
        for edit in range(args.edits):
            kind = "compact" if edit % 10 == 9 else ("add" if edit % 2 == 0 else "remove")
            t0 = time.perf_counter()
            if kind == "add":
                rows = torch.tensor(held_out[:step])
                del held_out[:step]
                ids = torch.arange(next_id, next_id + rows.numel())
                index.add(base[rows.to(device)], ids=ids.to(device))
                for i, r in zip(ids.tolist(), rows.tolist()):
                    row_of[i] = r
                live |= set(ids.tolist())
                pending_added = ids.tolist()
                next_id += rows.numel()
            elif kind == "remove":
                order = sorted(live)
                gone = [order[i] for i in torch.randperm(len(order), generator=g)[:step].tolist()]
                index.remove(torch.tensor(gone, device=device))
                live -= set(gone)
                pending_removed = gone
                held_out += [row_of.pop(i) for i in gone]
            else:
                index.compact()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[kind].append(time.perf_counter() - t0)
            recorded.append(index.version)
            added_at.update(dict.fromkeys(pending_added, recorded[-1]))
            removed_at.update(dict.fromkeys(pending_removed, recorded[-1]))
            pending_added, pending_removed = [], []
    finally:
        stop.set()
        for t in threads:
            t.join()
    writer_s = time.perf_counter() - began
    shared_qps = len(done) * args.batch / writer_s

    # A search may have started or ended inside an edit that made more than one version visible:
    # it may see any recorded state from the last one at or before `before` to the first one at or
    # after `after`.
    def all_live(found: set, v: int) -> bool:
        return all(added_at.get(i, v) <= v < removed_at.get(i, v + 1) for i in found)

    inconsistent = 0
    for before, after, ids in done:
        found = set(ids[ids >= 0].tolist())
        low = max(bisect.bisect_right(recorded, before) - 1, 0)
        high = bisect.bisect_left(recorded, after) + 1
        inconsistent += not any(all_live(found, v) for v in recorded[low:high])
    kept = torch.tensor(sorted(live), device=device)
    rows = torch.tensor([row_of[i] for i in kept.tolist()], device=device)
    truth = kept[grnnd.knn(base[rows], queries, K)[1]]
    results = {
        "data": name, "n": n, "dim": base.shape[1], "device": device.type, "searchers": args.searchers,
        "batch": args.batch, "edits": args.edits, "rows_per_edit": step,
        "machine": machine(threads=torch.get_num_threads(), cuda=device.type == "cuda"),
        "alone_qps": alone_qps, "shared_qps": shared_qps, "ratio": shared_qps / alone_qps,
        "searches_during_edits": len(done), "writer_s": writer_s, "errors": len(errors), "first_error": errors[:1],
        "inconsistent": inconsistent,
        "median_ms": {kind: 1000 * sorted(t)[len(t) // 2] for kind, t in times.items() if t},
        "recall": recall(index, queries, truth), "command": args.command,
    }
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"concurrency_{name}_{device.type}")
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
            f"| {r['searchers']} x {r['batch']} | {r['alone_qps']:,.0f} | {r['shared_qps']:,.0f} | {r['ratio']:.2f} | "
            f"{r['searches_during_edits']:,} | {r['errors']} | {r['inconsistent']} | {r['edits']} of "
            f"{r['rows_per_edit']:,} rows: {medians} | {r['recall']:.4f} |"]


if __name__ == "__main__":
    main()
