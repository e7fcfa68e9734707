#!/usr/bin/env python3
"""Sweep the GRNND CPU build parameters on one dataset, with faiss HNSW as the yardstick.

For each configuration: build time, all-points graph quality (10-NN recall of the graph's
first 10 neighbours on a sample of rows) and the search curve (list_size sweep) reduced to the
QPS at recall@10 = --target. faiss IndexHNSWFlat(M=32, efC=40) is built before the first
configuration and again after every --hnsw-every configurations, and its search curve measured
each time, so each configuration's ratios are taken against the HNSW runs next to it in time
(the machine is shared; see the load averages in the JSON).

    python3 -m benchmarks.tune_build --data .data/text100k.pt:n=30000 --threads 2
    python3 -m benchmarks.tune_build --data .data/text100k.pt --threads 2 \
        --configs "degree=32,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=0.6" \
                  "degree=32,initial_degree=8,pool_size=32,outer_iters=2,inner_iters=4,reverse_ratio=0.5"

Writes --out/tune_<data>_t<threads>.json and .md.
"""
import argparse
import json
import os
import sys
import time

import faiss
import numpy as np
import torch

import torch_grnnd as grnnd
from benchmarks import datasets, report
from benchmarks.baselines import FaissHNSW
from benchmarks.common import parse_settings

LIST_SIZES = [10, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384]
EF = [10, 16, 24, 32, 48, 64, 96, 128, 192, 256]
K = 10

# First sweep: the schema defaults, then one parameter moved at a time, then combinations.
DEFAULT_CONFIGS = [
    "degree=32,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=0.6",
    "degree=32,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=3,reverse_ratio=0.6",
    "degree=32,initial_degree=16,pool_size=48,outer_iters=2,inner_iters=6,reverse_ratio=0.6",
    "degree=32,initial_degree=8,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=0.6",
    "degree=32,initial_degree=16,pool_size=32,outer_iters=3,inner_iters=6,reverse_ratio=0.6",
    "degree=32,initial_degree=16,pool_size=64,outer_iters=3,inner_iters=6,reverse_ratio=0.6",
    "degree=32,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=0.3",
    "degree=32,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=1.0",
    "degree=32,initial_degree=16,pool_size=48,outer_iters=4,inner_iters=4,reverse_ratio=0.6",
    "degree=24,initial_degree=16,pool_size=48,outer_iters=3,inner_iters=6,reverse_ratio=0.6",
]


def search_curve(search, gt, target, sizes):
    """(curve, qps at target): best of 2 timed batches per point; stops once well past target."""
    curve = []
    search(sizes[0])  # warm-up
    for s in sizes:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            ids = search(s)
            best = min(best, time.perf_counter() - t0)
        curve.append({"param": s, "recall": grnnd.recall(ids, gt[:, :K]), "qps": gt.shape[0] / best})
        if curve[-1]["recall"] >= min(target + 0.03, 0.999) or (len(curve) > 2 and curve[-1]["recall"] >= 0.999):
            break
    return curve, report.qps_at_recall(curve, target)


def graph_recall(graph, sample_truth, sample):
    """Share of each sampled row's true 10 nearest neighbours among its first 10 graph edges."""
    return grnnd.recall(graph[sample, :K].long(), sample_truth)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".data/text100k.pt:n=30000")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--hnsw-every", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    faiss.omp_set_num_threads(a.threads)

    data = datasets.load(a.data)
    base, queries, gt = data["base"], data["queries"], data["gt"]
    sample = torch.randperm(base.shape[0], generator=torch.Generator().manual_seed(0))[:1000]
    sample_truth = datasets.exact_gt(base, base[sample], K + 1)[:, 1:]  # drop the row itself
    print(f"{data['name']}: base {tuple(base.shape)}, {queries.shape[0]} queries, {a.threads} threads")

    hnsw_runs, rows = [], []

    def run_hnsw():
        h = FaissHNSW(32, 40)
        t0 = time.perf_counter()
        h.build(base, "l2")
        build_s = time.perf_counter() - t0
        curve, qps = search_curve(lambda s: h.search(queries, s), gt, a.target, EF)
        hnsw_runs.append({"after_config": len(rows), "build_s": build_s, "qps_at_target": qps, "curve": curve,
                          "loadavg": open("/proc/loadavg").read().split()[:3]})
        print(f"  HNSW M=32 efC=40: build {build_s:.2f} s, QPS@{a.target} {qps:,.0f}", flush=True)

    run_hnsw()
    for i, cfg in enumerate(a.configs):
        params = parse_settings(cfg)
        t0 = time.perf_counter()
        graph = grnnd.build(base, metric=data["metric"], **params)
        build_s = time.perf_counter() - t0
        curve, qps = search_curve(lambda s: grnnd.search(base, graph, queries, K, list_size=max(s, K))[1],
                                  gt, a.target, LIST_SIZES)
        rows.append({"config": cfg, "params": params, "build_s": build_s, "qps_at_target": qps,
                     "graph_recall10": graph_recall(graph, sample_truth, sample),
                     "mean_out_degree": (graph >= 0).sum(1).float().mean().item(), "curve": curve,
                     "loadavg": open("/proc/loadavg").read().split()[:3]})
        print(f"{cfg}: build {build_s:.2f} s, graph recall {rows[-1]['graph_recall10']:.3f}, "
              f"deg {rows[-1]['mean_out_degree']:.1f}, QPS@{a.target} {qps:,.0f}", flush=True)
        if (i + 1) % a.hnsw_every == 0 or i + 1 == len(a.configs):
            run_hnsw()

    # Each configuration against the HNSW runs just before and after it.
    for i, row in enumerate(rows):
        near = [h for h in hnsw_runs if h["after_config"] in (max(h2["after_config"] for h2 in hnsw_runs
                if h2["after_config"] <= i), min(h2["after_config"] for h2 in hnsw_runs if h2["after_config"] > i))]
        hb = float(np.mean([h["build_s"] for h in near]))
        hq = float(np.mean([h["qps_at_target"] for h in near]))
        row["hnsw_build_s"], row["hnsw_qps_at_target"] = hb, hq
        row["build_ratio"] = row["build_s"] / hb  # < 1: ours builds faster
        row["qps_ratio"] = row["qps_at_target"] / hq  # > 1: ours searches faster
    out = {"data": data["name"], "shape": list(base.shape), "machine": report.machine(a.threads),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "target": a.target,
           "hnsw_runs": hnsw_runs, "configs": rows}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, a.name or f"tune_{data['name']}_t{a.threads}")
    json.dump(out, open(stem + ".json", "w"), indent=1)
    lines = [f"# GRNND CPU build sweep, {data['name']} {tuple(base.shape)}, {a.threads} threads", "",
             f"Machine: {report.machine_line(out['machine'])}. HNSW = faiss IndexHNSWFlat M=32 efC=40 "
             f"(runs interleaved, ratios vs the neighbouring runs). QPS at recall@10 {a.target}.", "",
             "| config | build s | HNSW build s | build ratio | graph R@10 | QPS | HNSW QPS | QPS ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['build_s']:.2f} | {r['hnsw_build_s']:.2f} | {r['build_ratio']:.2f} | "
                     f"{r['graph_recall10']:.3f} | {r['qps_at_target']:,.0f} | {r['hnsw_qps_at_target']:,.0f} | "
                     f"{r['qps_ratio']:.2f} |")
    open(stem + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
