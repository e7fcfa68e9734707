#!/usr/bin/env python3
"""CPU benchmark: torch_grnnd build + search next to faiss-cpu HNSW and NN-Descent, same run.

Build time and the QPS-recall@10 curve of each method on the same data with the same number of
threads (torch.set_num_threads == faiss.omp_set_num_threads). Builds and each point of the
search sweeps are interleaved across methods, so background load hits every method alike;
each search point is the best of --reps timed batches of all queries (one batch = all queries).

    python3 -m benchmarks.bench_cpu --data .data/text100k.pt --threads 2
    python3 -m benchmarks.bench_cpu --data clustered:n=20000,d=64,clusters=100,queries=500
    python3 -m benchmarks.bench_cpu --data .data/text100k.pt:n=30000 --ours "" pool_size=32

Writes --out/cpu_<data>_t<threads>.{json,md,png} (default benchmarks/results/).
"""
import argparse
import os
import sys
import time

import faiss
import torch

import torch_grnnd as grnnd
from benchmarks import datasets, report
from benchmarks.baselines import FaissHNSW, FaissNNDescent
from benchmarks.common import parse_settings

SWEEP = [10, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
K = 10


class Ours:
    sweep_name = "list_size"

    def __init__(self, params, search_width=1):
        self.params, self.search_width = params, search_width
        self.name = "torch_grnnd GRNND" + (f" ({','.join(f'{k}={v}' for k, v in params.items())})" if params else
                                           " (op defaults)")

    def build(self, base, metric):
        self.base, self.metric = base, metric
        self.graph = grnnd.build(base, metric=metric, **self.params)

    def search(self, queries, param):
        return grnnd.search(self.base, self.graph, queries, K, list_size=max(param, K),
                            search_width=self.search_width, metric=self.metric)[1]

    def describe(self):
        return dict(self.params, search_width=self.search_width)


def run(data: dict, methods: list, threads: int, build_reps: int = 1, search_reps: int = 3,
        sweep=SWEEP, log=print) -> dict:
    """Build every method (interleaved, best of build_reps), then sweep search interleaved."""
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    base, queries, gt = data["base"], data["queries"], data["gt"]
    builds = {m.name: [] for m in methods}
    for _ in range(build_reps):
        for m in methods:
            t0 = time.perf_counter()
            m.build(base, data["metric"])
            builds[m.name].append(time.perf_counter() - t0)
            log(f"build {m.name}: {builds[m.name][-1]:.2f} s")
    curves = {m.name: [] for m in methods}
    for m in methods:  # warm-up: first-touch of the index and the thread pools
        m.search(queries, sweep[0])
    for param in sweep:
        for m in methods:
            best = float("inf")
            for _ in range(search_reps):
                t0 = time.perf_counter()
                ids = m.search(queries, param)
                best = min(best, time.perf_counter() - t0)
            r = grnnd.recall(ids, gt[:, :K])
            curves[m.name].append({"param": param, "recall": r, "qps": queries.shape[0] / best})
        log(f"{param:4d}: " + "  ".join(f"{m.name} {curves[m.name][-1]['recall']:.4f}@"
                                         f"{curves[m.name][-1]['qps']:.0f}" for m in methods))
    return {"methods": [{"name": m.name, "build_s": min(builds[m.name]), "build_s_all": builds[m.name],
                         "params": m.describe(), "sweep": m.sweep_name, "curve": curves[m.name]}
                        for m in methods]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="clustered:n=20000,d=64,clusters=100,queries=500",
                    help="clustered:n=..,d=..,clusters=..,queries=.. or PATH[:n=..] (benchmarks/datasets.py)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--ours", nargs="*", default=[""],
                    help="one or more build configs, e.g. '' (the op's defaults) 'pool_size=32,outer_iters=2'")
    ap.add_argument("--search-width", type=int, default=1)
    ap.add_argument("--build-reps", type=int, default=1)
    ap.add_argument("--search-reps", type=int, default=3)
    ap.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="search budgets, comma separated")
    ap.add_argument("--no-nndescent", action="store_true")
    ap.add_argument("--name", default="", help="output file stem (default cpu_<data>_t<threads>)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    faiss.omp_set_num_threads(a.threads)
    data = datasets.load(a.data)
    print(f"{data['name']}: base {tuple(data['base'].shape)} queries {tuple(data['queries'].shape)}")
    methods = [Ours(parse_settings(cfg), a.search_width) for cfg in a.ours] + [FaissHNSW(32, 40)]
    if not a.no_nndescent:
        methods.append(FaissNNDescent(32))
    results = {"title": f"CPU: torch_grnnd vs faiss-cpu, {data['name']}",
               "data": f"{data['name']} base {tuple(data['base'].shape)}, {data['queries'].shape[0]} queries, "
                       f"metric {data['metric']}, recall@10 vs exact",
               "machine": report.machine(a.threads),
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "note": "Builds and search points interleaved across methods in one process; "
                       f"search QPS is the best of {a.search_reps} batches of all queries. "
                       "The machine may be shared with other jobs (load averages in the JSON)."}
    results.update(run(data, methods, a.threads, a.build_reps, a.search_reps, [int(v) for v in a.sweep.split(",")]))
    for p in report.write(a.out, a.name or f"cpu_{data['name']}_t{a.threads}", results):
        print("wrote", p)
    print(report.markdown(results))


if __name__ == "__main__":
    main()
