#!/usr/bin/env python3
"""Queries/s against the batch size, as a caller who waits for each answer sees it: one index at
the defaults, for each list size and batch, the median of 11 calls each followed by a
synchronisation (after 2 untimed ones), and recall@10 over the first min(batch, 10 000) queries.

    python -m benchmarks.bench_batch_sizes --data clustered:n=10000000,d=384,clusters=10000,queries=50000
    python -m benchmarks.bench_batch_sizes --data .data/text/embeddings.pt --batches 1000,5000,10000 --label after

The batches between bench_gpu.py's small batches (1 to 1 000) and its curves (10 000) are where a
call's fixed costs and the per-query work meet: the hub entry points of batches past the direct
kernels (csrc/build/hubs.h), the share of a replicated search on each GPU. Prints one line a run:
the label, the data, the build time and list/batch: queries/s @ recall. Run two builds of the
extension one after the other, alternating, to compare them (runs of one build spread by up to
10-20% at batches of 1 000).
"""
import argparse
import statistics
import time

import torch

import torch_grnnd as grnnd
from benchmarks.datasets import load_data


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=384,clusters=1000,queries=50000")
    p.add_argument("--lists", default="32,64")
    p.add_argument("--batches", default="1000,2000,5000,10000,20000,50000")
    p.add_argument("--label", default="", help="a name for this run's line (the build compared, say)")
    args = p.parse_args()
    name, base, queries, _ = load_data(args.data, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    index = grnnd.Index.build(base)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    truth = grnnd.knn(base, queries[:10_000], 10)[1]
    points = []
    for lst in (int(v) for v in args.lists.split(",")):
        for batch in (int(v) for v in args.batches.split(",")):
            if batch > queries.shape[0]:
                continue
            q = queries[:batch]
            for _ in range(2):
                index.search(q, 10, list_size=lst)
            times = []
            for _ in range(11):
                torch.cuda.synchronize()
                start = time.perf_counter()
                _, ids = index.search(q, 10, list_size=lst)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            n = min(batch, truth.shape[0])
            points.append(f"L{lst}/{batch}:{batch / statistics.median(times) / 1e6:.3f}M"
                          f"@{grnnd.recall(ids[:n], truth[:n], 10):.4f}")
    print(args.label, name, f"build {build_s:.2f}s", " ".join(points), flush=True)


if __name__ == "__main__":
    main()
