#!/usr/bin/env python3
"""Searches by compact codes with rows on the GPU or in pinned host memory, against the same
searches by the rows, in one run on one graph.

    python -m benchmarks.bench_codes_host [--rows N] [--codes int8,int4] > benchmarks/results/codes_host_rows_<gpu>.txt

Clustered float16 rows as bench_scale.py makes them ("blobs", 2M x 1024 by default), 10 000
queries, recall@10 against grnnd.knn. The ways at each (batch, list): rows on the GPU; the same
with each kind of codes (codes on the GPU, the re-rank reads the rows); rows in pinned host memory
read by the search kernel over the bus (every distance reads a row there); and pinned rows with
each kind of codes on the GPU, where only the final list's rows cross the bus. Queries/s are wall
clock over the first min(10 000, 20 batches) queries after one warm-up batch.
"""
import argparse
import time

import torch

import torch_grnnd as grnnd
from benchmarks.datasets import make_set


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--codes", default="int8", help="code kinds, comma-separated (int8, int4)")
    args = p.parse_args()
    n, d = args.rows, args.dim
    base, queries = make_set("blobs", n, d, queries=10_000)
    truth = grnnd.knn(base, queries, 10)[1]
    graph = grnnd.build(base)
    coded = {}
    for kind in args.codes.split(","):
        torch.cuda.synchronize()
        start = time.perf_counter()
        coded[kind] = grnnd.encode(base, kind)
        torch.cuda.synchronize()
        print(f"encode {kind}: {time.perf_counter() - start:.2f} s, {coded[kind].rows.shape[1]} B a row", flush=True)
    pinned = base.cpu().pin_memory()

    def rate(rows, cd, batch, lst):
        def search(q):
            return grnnd.search(rows, graph, q, 10, list_size=lst, codes=cd)
        q = queries[:min(10_000, 20 * batch)]
        search(q[:batch])
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = torch.cat([search(part)[1] for part in q.split(batch)])
        torch.cuda.synchronize()
        return q.shape[0] / (time.perf_counter() - start), grnnd.recall(ids, truth[:q.shape[0]], 10)

    print(torch.cuda.get_device_name(), f"blobs {n}x{d} float16")
    ways = [("gpu rows", base, None)] + [(f"gpu rows + {kind}", base, c) for kind, c in coded.items()]
    ways += [("host rows", pinned, None)] + [(f"host rows + {kind} on gpu", pinned, c) for kind, c in coded.items()]
    for batch, lst in ((1000, 64), (10000, 64), (10000, 32)):
        for name, rows, cd in ways:
            r, rec = rate(rows, cd, batch, lst)
            print(f"batch {batch:6d} list {lst:3d} {name:24s} {r:12,.0f} q/s recall@10 {rec:.4f}", flush=True)


if __name__ == "__main__":
    main()
