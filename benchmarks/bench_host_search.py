#!/usr/bin/env python3
"""Searching rows that stay in host memory: read through unified addressing, or shard by shard.

    python -m benchmarks.bench_host_search --sets blobs:10000000x1024 --budget 8GB
    python -m benchmarks.bench_host_search --sets blobs:10000000x128 --budget 1GB --name d128

Clustered float16 rows as bench_scale.py makes them, one graph built in memory. Three ways to
search them, each at batches of 100, 1 000 and 10 000 queries (the first min(Q, 20 batches) of
--queries queries) and lists 32 / 64 / 128 (batch 10 000) or 64 (smaller batches):

- gpu: rows and graph on the GPU (what the others are measured against);
- unified: rows in pinned host memory, graph on the GPU; the search kernel reads each row it
  needs over the bus (`grnnd.search(pinned_rows, graph, queries)`);
- shards: GGNN's swapping mode, `grnnd.SwappingIndex.build(host_rows, max_gpu_memory=budget)`:
  consecutive shards of what --budget holds (a shard's build, or two shards' rows and graphs),
  each with its own graph (build time reported); a batch is searched on every shard in turn
  while the next shard is copied in on a second stream, and the per-shard top-k are merged.

Reports queries/s (wall clock, the copies in included; the median of three passes) and recall@10
against exact neighbours (grnnd.knn). Writes host_search_<gpu>[_<name>].{json,md} under --out.
"""
import argparse
import json
import sys
import time
from typing import Tuple

import torch
from torch import Tensor

import torch_grnnd as grnnd
from torch_grnnd.memory import within_budget
from benchmarks.datasets import make_set, parse_sets
from benchmarks.report import gpu_result_stem, machine, machine_line

K = 10
BATCHES = (100, 1000, 10000)
LISTS = (32, 64, 128)
MAX_BATCHES = 20


def timed(search, queries: Tensor, batch: int, passes: int = 3) -> Tuple[float, Tensor]:
    """(queries/s of the median of ``passes`` passes, ids) of searching the queries batch by batch."""
    search(queries[:batch])  # warm up: kernels loaded, caches and allocator primed
    rates = []
    for _ in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = torch.cat([search(part)[1] for part in queries.split(batch)])
        torch.cuda.synchronize()
        rates.append(queries.shape[0] / (time.perf_counter() - start))
    return sorted(rates)[passes // 2], ids


def measure(family: str, n: int, d: int, budget: str, queries: int) -> dict:
    base, queries = make_set(family, n, d, queries=queries)
    truth = grnnd.knn(base, queries, K)[1]
    # the same kind of build as SwappingIndex's shards (pair codes only where asked: memory.within_budget)
    params = within_budget(grnnd.BuildParams())
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph = grnnd.build(base, params)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    host = torch.empty(base.shape, dtype=base.dtype, pin_memory=True)
    host.copy_(base)
    modes = {"gpu": lambda q, size: grnnd.search(base, graph, q, K, list_size=size),
             "unified": lambda q, size: grnnd.search(host, graph, q, K, list_size=size)}
    results = []
    for mode in ("gpu", "unified", "shards"):
        if mode == "shards":
            del base, graph
            torch.cuda.empty_cache()
            start = time.perf_counter()
            shards = grnnd.SwappingIndex.build(host, params, device="cuda", max_gpu_memory=budget)
            torch.cuda.synchronize()
            shards_build_s = time.perf_counter() - start
            modes["shards"] = lambda q, size: shards.search(q, K, list_size=size)
        for batch in BATCHES:
            asked = queries[:min(queries.shape[0], batch * MAX_BATCHES)]
            for size in LISTS if batch == max(BATCHES) else (64,):
                qps, ids = timed(lambda q: modes[mode](q, size), asked, batch)
                recall = grnnd.recall(ids, truth[:asked.shape[0]])
                results.append({"mode": mode, "batch": batch, "list_size": size, "queries": int(asked.shape[0]),
                                "qps": qps, "recall": recall})
                print(json.dumps(results[-1]), flush=True)
    return {"set": f"{family}:{n}x{d}", "budget": budget, "build_s": build_s, "shards": len(shards.bounds),
            "shard_rows": shards.bounds[0][1], "shards_build_s": shards_build_s,
            "graph_gib": n * params.degree * 4 / 2**30, "results": results}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="blobs:10000000x1024", help="family:NxD, comma separated")
    p.add_argument("--budget", default="8GB", help="GPU memory the shards may use (bytes or a size like 8GB)")
    p.add_argument("--queries", type=int, default=10000)
    p.add_argument("--name", default="", help="suffix of the result files")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    sets = [measure(family, n, d, args.budget, args.queries) for family, n, d in parse_sets(args.sets)]
    m = machine(threads=torch.get_num_threads(), cuda=True)
    stem = gpu_result_stem(args.out, "host_search", args.name)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": m, "sets": sets}, f, indent=1)
    lines = [f"# Search over rows in host memory, {torch.cuda.get_device_name()}", "",
             f"Machine: {machine_line(m)}. `python -m benchmarks.bench_host_search {' '.join(sys.argv[1:])}`; "
             "float16 clustered rows; queries/s (wall clock, copies included, median of 3 passes) and recall@10 "
             "against exact neighbours. gpu: rows on the GPU; unified: rows in pinned host memory read by the "
             "search kernel; shards: a graph per shard of the budget, shards copied in turn (GGNN's "
             "swapping mode).", ""]
    for s in sets:
        lines += [f"## {s['set']}, budget {s['budget']}", "",
                  f"Graph built in memory in {s['build_s']:.2f} s; {s['shards']} shards of up to "
                  f"{s['shard_rows']:,} rows, their graphs built in {s['shards_build_s']:.2f} s. The unified "
                  f"reads keep the graph on the GPU ({s['graph_gib']:.2f} GiB, outside the budget).", "",
                  "| batch | list | gpu q/s | recall | unified q/s | recall | shards q/s | recall |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        cells = {(r["mode"], r["batch"], r["list_size"]): r for r in s["results"]}
        for batch, size in sorted({(r["batch"], r["list_size"]) for r in s["results"]}):
            row = [f"{batch:,}", str(size)]
            for mode in ("gpu", "unified", "shards"):
                r = cells[mode, batch, size]
                row += [f"{r['qps']:,.0f}", f"{r['recall']:.4f}"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
