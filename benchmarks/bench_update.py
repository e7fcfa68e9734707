"""An index that grows and shrinks: Index.add / remove / compact against fresh builds, same run.

    python -m benchmarks.bench_update --data DIR/embeddings.pt --out DIR            # GPU
    python -m benchmarks.bench_update --data clustered:n=1000000,d=384,clusters=1000,queries=10000
    python -m benchmarks.bench_update --device cpu --data clustered:n=20000,d=48,clusters=20,queries=1000

Data as benchmarks/bench_gpu.py loads it (a text_embeddings.py file, or clustered blobs made on
the device). Four scenarios (--scenarios runs some of them), each against a fresh build of the
same rows in the same run, recall@10 at list 64 (exact ground truth from grnnd.knn over the rows the index holds):
  daily inserts  build 90%, then add the other 10% in ten batches of 1% (time of each add),
                 twice: the process's first adds, and the same adds again;
  bulk growth    build the first half, add the second half in one call (the graph grows in one
                 build); and grnnd.merge of the halves' indexes;
  large adds     build 90% (75%, 50%), add the other 10% (25%, 50%) in one call, once by a
                 search of the graph for each row and once grown (the two ways Index.add takes,
                 forced by torch_grnnd.index.LARGE_ADD_SHARE);
  deletes        remove a random 10% (no removed id may come back), then compact.
Times: CUDA events on a GPU, wall clock on the CPU, after one pass of every path on a few rows
(the process's first launch of each kernel is not an add's cost; the first add's growth of the
storage is, and stays in). Writes update_<name>.{json,md} under --out (update_<name>_<scenarios>
when not all of them ran).
"""
import json
import os

import torch

import torch_grnnd as grnnd
from benchmarks.common import K, LIST, recall, setup, timed
from benchmarks.report import machine, machine_line


def truth_over(rows: torch.Tensor, ids: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Exact top-10 ids among ``rows`` (whose ids are ``ids``)."""
    return ids[grnnd.knn(rows, queries, K)[1]]


def warm_up(base: torch.Tensor, queries: torch.Tensor) -> None:
    """Build, both kinds of add, merge, remove, compact and search once on the first 20 000 rows."""
    rows = base[:20_000]
    index = grnnd.Index.build(rows[:15_000])
    index.add(rows[15_000:15_100])               # through the search
    index.add(rows[15_100:])                     # grown (a quarter of the rows or more)
    index.remove(torch.arange(0, rows.shape[0], 10, device=rows.device))
    index.compact()
    index.search(queries[:100], K, list_size=LIST)
    grnnd.knn(rows, queries[:100], K)


def daily_inserts(base, queries, device) -> dict:
    n = base.shape[0]
    first, step = n * 9 // 10, n // 100
    truth = truth_over(base, torch.arange(n, device=device), queries)
    fresh, fresh_s = timed(lambda: grnnd.Index.build(base), device)
    # The same ten adds twice, each time from a new build of 90%: the first sequence of a process
    # also pays the caching allocator's first reservations of blocks this large (cudaMalloc);
    # the second is what a process that has already added sees.
    sequences = []
    for _ in range(2):
        index, build_s = timed(lambda: grnnd.Index.build(base[:first]), device)
        adds = []
        for start in range(first, n, step):
            _, secs = timed(lambda: index.add(base[start:min(n, start + step)]), device)
            adds.append(secs)
        sequences.append(adds)
    return {"fresh_build_s": fresh_s, "build_90_s": build_s, "add_s": sequences[0], "add_again_s": sequences[1],
            "rows_per_add": step, "recall": recall(index, queries, truth),
            "fresh_recall": recall(fresh, queries, truth)}


def bulk_growth(base, queries, device) -> dict:
    n = base.shape[0]
    truth = truth_over(base, torch.arange(n, device=device), queries)
    fresh, fresh_s = timed(lambda: grnnd.Index.build(base), device)
    index, build_s = timed(lambda: grnnd.Index.build(base[:n // 2]), device)
    other = grnnd.Index.build(base[n // 2:])
    merged, merge_s = timed(lambda: grnnd.merge(index, other), device)
    _, add_s = timed(lambda: index.add(base[n // 2:]), device)
    return {"fresh_build_s": fresh_s, "build_half_s": build_s, "add_half_s": add_s,
            "recall": recall(index, queries, truth), "fresh_recall": recall(fresh, queries, truth),
            "merge_halves_s": merge_s, "merge_recall": recall(merged, queries, truth)}


SHARES = (0.1, 0.25, 0.5)
WAYS = {"search": "by search", "grown": "grown in one build"}


def large_adds(base, queries, device) -> dict:
    n = base.shape[0]
    truth = truth_over(base, torch.arange(n, device=device), queries)
    fresh, fresh_s = timed(lambda: grnnd.Index.build(base), device)
    out = {"fresh_build_s": fresh_s, "fresh_recall": recall(fresh, queries, truth)}
    del fresh
    for share in SHARES:
        first = n - int(n * share)
        index = grnnd.Index.build(base[:first])
        for way, threshold in (("search", float("inf")), ("grown", 0.0)):
            grnnd.index.LARGE_ADD_SHARE, default = threshold, grnnd.index.LARGE_ADD_SHARE
            try:
                copy = grnnd.Index(index.data, index.graph, index.metric, index.build_params)
                _, secs = timed(lambda: copy.add(base[first:]), device)
            finally:
                grnnd.index.LARGE_ADD_SHARE = default
            out[f"{share}_{way}_s"], out[f"{share}_{way}_recall"] = secs, recall(copy, queries, truth)
    return out


def deletes(base, queries, device) -> dict:
    n = base.shape[0]
    ids = torch.arange(n, device=device)
    gone = torch.randperm(n, device=device, generator=torch.Generator(device=device).manual_seed(0))[: n // 10]
    kept = torch.ones(n, dtype=torch.bool, device=device)
    kept[gone] = False
    truth = truth_over(base[kept], ids[kept], queries)
    index = grnnd.Index.build(base)
    _, remove_s = timed(lambda: index.remove(gone), device)
    tombstoned = index.search(queries, K, list_size=LIST)[1]
    removed_returned = int(torch.isin(tombstoned, gone).sum())
    before = recall(index, queries, truth)
    _, compact_s = timed(index.compact, device)
    fresh, fresh_s = timed(lambda: grnnd.Index.build(base[kept], ids=ids[kept]), device)
    return {"remove_s": remove_s, "removed_ids_returned": removed_returned, "recall_before_compact": before,
            "compact_s": compact_s, "recall": recall(index, queries, truth), "fresh_build_s": fresh_s,
            "fresh_recall": recall(fresh, queries, truth)}


SCENARIOS = {f.__name__: f for f in (daily_inserts, bulk_growth, large_adds, deletes)}


def main():
    def arguments(p):
        p.add_argument("--scenarios", default=",".join(SCENARIOS),
                       help="which to run, comma-separated (at 10M x 1024 one takes minutes)")
    args, device, name, base, queries = setup(__doc__, "clustered:n=1000000,d=384,clusters=1000,queries=10000",
                                              arguments)
    chosen = args.scenarios.split(",")
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    results = {"data": name, "n": base.shape[0], "dim": base.shape[1], "list_size": LIST,
               "machine": machine(threads=torch.get_num_threads(), cuda=device.type == "cuda")}
    warm_up(base, queries)
    for scenario in chosen:
        results[scenario] = SCENARIOS[scenario](base, queries, device)
        print(scenario, json.dumps(results[scenario]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    # A run of some scenarios only is named after them, so it never overwrites a whole run.
    stem = os.path.join(args.out, f"update_{name}" + ("" if len(chosen) == len(SCENARIOS) else "_" + "_".join(chosen)))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(report_lines(results, name, args.command)) + "\n")
    print("wrote", stem + ".json", stem + ".md")


def report_lines(results: dict, name: str, command: str) -> list:
    """The markdown table of a run, a row for each scenario it ran."""
    lines = [f"# Index updates, {name} ({results['n']:,} x {results['dim']})", "",
             f"Machine: {machine_line(results['machine'])}. recall@10 at list {LIST}; `{command}`.", "",
             "| scenario | time | recall | fresh build: time, recall |", "|---|---|---:|---|"]
    if "daily_inserts" in results:
        d = results["daily_inserts"]
        adds, again = sorted(d["add_s"]), sorted(d["add_again_s"])
        lines.append(
            f"| daily inserts: build 90%, 10 adds of {d['rows_per_add']:,} | build {d['build_90_s']:.2f} s, "
            f"add median {adds[len(adds) // 2] * 1000:.1f} ms (max {adds[-1] * 1000:.1f}; the first, which grows "
            f"the storage, {d['add_s'][0] * 1000:.1f}); the same adds again in the process: median "
            f"{again[len(again) // 2] * 1000:.1f} ms, max {again[-1] * 1000:.1f} | {d['recall']:.4f} | "
            f"{d['fresh_build_s']:.2f} s, {d['fresh_recall']:.4f} |")
    if "bulk_growth" in results:
        b = results["bulk_growth"]
        fresh = f"{b['fresh_build_s']:.2f} s, {b['fresh_recall']:.4f}"
        lines += [f"| bulk growth: build half, add half | build {b['build_half_s']:.2f} s + add "
                  f"{b['add_half_s']:.2f} s ({b['add_half_s'] / b['fresh_build_s']:.0%} of the fresh build) | "
                  f"{b['recall']:.4f} | {fresh} |",
                  f"| bulk growth: merge the two halves' indexes | merge {b['merge_halves_s']:.2f} s | "
                  f"{b['merge_recall']:.4f} | {fresh} |"]
    if "large_adds" in results:
        a = results["large_adds"]
        fresh_s, fresh_recall = a["fresh_build_s"], a["fresh_recall"]
        lines += [f"| large add: build {1 - s:.0%}, add {s:.0%} {WAYS[way]} | {a[f'{s}_{way}_s']:.3f} s "
                  f"({a[f'{s}_{way}_s'] / fresh_s:.0%} of the fresh build) | {a[f'{s}_{way}_recall']:.4f} | "
                  f"{fresh_s:.2f} s, {fresh_recall:.4f} |" for s in SHARES for way in ("search", "grown")]
    if "deletes" in results:
        r = results["deletes"]
        lines.append(
            f"| deletes: remove 10%, compact | remove {r['remove_s'] * 1000:.1f} ms, compact {r['compact_s']:.2f} s "
            f"(removed ids returned before compact: {r['removed_ids_returned']}; recall then "
            f"{r['recall_before_compact']:.4f}) | {r['recall']:.4f} | {r['fresh_build_s']:.2f} s, "
            f"{r['fresh_recall']:.4f} |")
    return lines


if __name__ == "__main__":
    main()
