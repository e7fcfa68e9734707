#!/usr/bin/env python3
"""A build from host rows within a GPU memory budget against the in-memory build, same run.

    python -m benchmarks.bench_out_of_core --sets blobs:10000000x1024 --budget 8GB --seeds 0,1,2
    python -m benchmarks.bench_out_of_core --sets blobs:2000000x128,zipf:2000000x384 --budget 1GB
    python -m benchmarks.bench_out_of_core --sets blobs:100000000x96 --budget free --skip-in-memory \
        --name 100m

Float16 rows as bench_scale.py makes them (blobs, zipf, aniso), moved to pinned host memory
(`--source pinned`) or saved to an .npy file under --scratch and memory-mapped (`--source npy`:
`np.load(mmap_mode="c")`, rows gathered on the host into a pinned staging buffer; the file was
just written, so its pages are in the page cache unless memory ran short).
For each set and build seed (`--seeds`; `BuildParams.seed` also draws the shard plan's sample,
which moves the recall): the in-memory build (rows on the GPU), then `grnnd.build(host_rows,
device="cuda", max_gpu_memory=budget)`, with the build time (wall clock, the copies in
included), peak GPU memory beyond what was allocated before, peak host memory of the process
(ru_maxrss), shards and shared rows, and recall@10 at list 64 of a GPU search of each graph against
exact neighbours (grnnd.knn, --queries queries). `--budget free` leaves the budget to the build
(what the GPU has free); `--skip-in-memory` leaves out the in-memory build, for sets whose build
does not fit on the GPU. Writes out_of_core_<gpu>[_<name>].{json,md} under --out.
"""
import argparse
import json
import logging
import os
import resource
import sys
import time

import numpy as np
import torch

import torch_grnnd as grnnd
from torch_grnnd import out_of_core
from torch_grnnd.memory import shard_bytes_per_row, within_budget
from benchmarks.datasets import make_set, parse_sets
from benchmarks.report import gpu_result_stem, machine, machine_line

K, LIST = 10, 64
SOURCES = {"pinned": "in pinned host memory", "npy": "in a memory-mapped .npy file (in the page cache)"}


def recall_of(graph, base, queries, truth) -> float:
    found = grnnd.search(base, graph.cuda(), queries, K, list_size=LIST)[1]
    return grnnd.recall(found, truth)


def peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def rows_file(scratch: str) -> str:
    return os.path.join(scratch, "out_of_core_rows.npy")


def host_rows(base: torch.Tensor, source: str, scratch: str) -> torch.Tensor:
    """``base``'s rows on the host: pinned, or in a memory-mapped .npy file under ``scratch``."""
    if source == "pinned":
        host = torch.empty(base.shape, dtype=base.dtype, pin_memory=True)
        return host.copy_(base)
    os.makedirs(scratch, exist_ok=True)
    path = rows_file(scratch)
    np.save(path, base.cpu().numpy())
    return torch.from_numpy(np.load(path, mmap_mode="c"))  # copy-on-write: writable, nothing written back


def measure(family: str, n: int, d: int, budget: str, queries: int, in_memory: bool, source: str = "pinned",
            scratch: str = "/tmp", seeds=(0,)) -> list:
    """A row of results for each build seed (``BuildParams.seed``, which also draws the plan's
    sample), the in-memory build run with the same seed."""
    base, queries = make_set(family, n, d, queries=queries)
    truth = grnnd.knn(base, queries, K)[1]
    whole = {}
    for seed in seeds if in_memory else ():
        torch.cuda.synchronize()
        start = time.perf_counter()
        # the same kind of build as the shards' (pair codes only where asked: memory.within_budget)
        graph = grnnd.build(base, within_budget(grnnd.BuildParams(seed=seed)))
        torch.cuda.synchronize()
        whole[seed] = (time.perf_counter() - start, recall_of(graph, base, queries, truth))
        del graph
    host = host_rows(base, source, scratch)
    del base
    torch.cuda.empty_cache()
    rows = []
    for seed in seeds:
        rows.append(measure_out_of_core(family, n, d, host, queries, truth, budget, source, seed,
                                        *whole.get(seed, (None, None))))
    if source == "npy":
        os.remove(rows_file(scratch))
    return rows


def measure_out_of_core(family: str, n: int, d: int, host: torch.Tensor, queries: torch.Tensor,
                        truth: torch.Tensor, budget: str, source: str, seed: int, whole_s, whole_recall) -> dict:
    params = grnnd.BuildParams(seed=seed)
    max_memory = None if budget == "free" else budget
    bytes_free = out_of_core.parse_bytes(budget) if max_memory else out_of_core.free_bytes(torch.device("cuda"))
    rows = bytes_free // shard_bytes_per_row(d, host.element_size(), params)
    plan = out_of_core.plan_shards(host, rows, "l2", torch.device("cuda"), params.seed, bytes_free)
    shards, shared = len(plan.members), float((plan.secondary >= 0).float().mean())
    shard_rows = sum(m.numel() for m in plan.members)  # progress counts rows: the shards' then the joined ones
    del plan
    steps = []
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    graph = grnnd.build(host, device="cuda", max_gpu_memory=max_memory, seed=seed,
                        progress=lambda done, total: steps.append((done, total, time.perf_counter() - start)))
    sharded_s = time.perf_counter() - start
    shards_done = next(t for done, _, t in steps if done >= shard_rows)
    peak_gpu = torch.cuda.max_memory_allocated() - before
    base = host.cuda()
    graph = graph.cuda()
    sharded_recall = recall_of(graph, base, queries, truth)
    print(f"out-of-core build {sharded_s:.2f} s, recall {sharded_recall:.4f}, peak host {peak_host_gib():.1f} GiB",
          flush=True)
    reached = float(grnnd.diagnostics.reachable(graph, grnnd.diagnostics.hubs(base)).float().mean())
    row = {"set": f"{family}:{n}x{d}", "seed": seed, "source": source, "budget": budget,
           "in_memory_s": whole_s, "in_memory_recall": whole_recall,
           "out_of_core_s": sharded_s, "out_of_core_recall": sharded_recall,
           "ratio": sharded_s / whole_s if whole_s else None, "queries": int(queries.shape[0]),
           "shards": shards, "shared_rows": shared, "steps": steps,
           "shards_done_s": shards_done, "joins_s": steps[-1][2] - shards_done,
           "peak_gpu_bytes": peak_gpu, "peak_host_gib": peak_host_gib(), "reachable": reached,
           "degree_min": min(int((rows >= 0).sum(1).min()) for rows in graph.split(1 << 22))}
    print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
    del base, graph
    torch.cuda.empty_cache()
    return row


def _or_dash(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="blobs:10000000x1024", help="family:NxD, comma separated")
    p.add_argument("--budget", default="8GB", help="bytes, a size like 8GB, or free (what the GPU has free)")
    p.add_argument("--queries", type=int, default=10000)
    p.add_argument("--seeds", default="0", help="build seeds (BuildParams.seed, which draws the plan), comma separated")
    p.add_argument("--skip-in-memory", action="store_true", help="no in-memory build (it would not fit)")
    p.add_argument("--source", choices=["pinned", "npy"], default="pinned",
                   help="host rows pinned, or a memory-mapped .npy file under --scratch")
    p.add_argument("--scratch", default="/tmp", help="where --source npy writes its file")
    p.add_argument("--name", default="", help="suffix of the result files")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the stages' times
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = [row for family, n, d in parse_sets(args.sets)
            for row in measure(family, n, d, args.budget, args.queries, not args.skip_in_memory, args.source,
                               args.scratch, seeds)]
    m = machine(threads=torch.get_num_threads(), cuda=True)
    stem = gpu_result_stem(args.out, "out_of_core", args.name)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": m, "rows": rows}, f, indent=1)
    lines = [f"# Out-of-core build against the in-memory build, {torch.cuda.get_device_name()}", "",
             f"Machine: {machine_line(m)}. `python -m benchmarks.bench_out_of_core {' '.join(sys.argv[1:])}`; "
             f"float16 rows (bench_scale.py's families) {SOURCES[args.source]}; recall@10 at list {LIST} "
             f"(GPU search, {args.queries} queries, exact neighbours from grnnd.knn).", "",
             "| set | seed | budget | in-memory s | recall | out-of-core s (plan + shards, joins) | ratio (x) | recall | "
             "shards | shared rows | peak GPU GiB | peak host GiB | reachable | min degree |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['seed']} | {r['budget']} | {_or_dash(r['in_memory_s'], '.2f')} | "
                     f"{_or_dash(r['in_memory_recall'], '.4f')} | {r['out_of_core_s']:.2f} ({r['shards_done_s']:.1f}, "
                     f"{r['joins_s']:.1f}) | {_or_dash(r['ratio'], '.2f')} | {r['out_of_core_recall']:.4f} | "
                     f"{r['shards']} | "
                     f"{r['shared_rows']:.2f} | {r['peak_gpu_bytes'] / 2**30:.2f} | {r['peak_host_gib']:.1f} | "
                     f"{r['reachable']:.6f} | {r['degree_min']} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
