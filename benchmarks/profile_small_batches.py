#!/usr/bin/env python3
"""Where a small batch spends its time, and which split of the search serves it best.

    python -m benchmarks.profile_small_batches [--data SPEC] [--sweep] [--profile] > profile.txt

--data: as bench_gpu.py's (default: 1M x 384 normalised clustered float16 rows, 1 000 clusters).
Default build. Each timing: 20 calls of warm-up, then back-to-back calls from Python, each on its
own slice of the first 1 000 queries, synchronised at the end (wall clock, as a caller sees it);
recall@10 against exact neighbours over those 1 000 queries.

  - the batch-1 table: with and without codes, with and without hub entry points;
  - with --sweep: batches of 1, 10 and 100 over independent searches per query (0 = automatic),
    search width and list size, with the distances each query computed;
  - with --profile: torch.profiler's kernel and host tables for 50 calls of one query.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torch_grnnd as grnnd
from benchmarks.datasets import load_data


def per_call(run, queries, batch, calls=200):
    """Milliseconds per call of run(q) over consecutive slices of `batch` queries, and their ids."""
    slices = [queries[s:s + batch] for s in range(0, queries.shape[0] - batch + 1, batch)]
    for i in range(20):
        run(slices[i % len(slices)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    ids = [run(slices[i % len(slices)])[1] for i in range(max(calls, len(slices)))]
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / len(ids) * 1e3
    return ms, torch.cat(ids[:len(slices)])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=384,clusters=1000,queries=1000")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--lists", default="32,64")
    p.add_argument("--codes", default="int8", help="the code kind of the coded rows (int8, int4)")
    args = p.parse_args()
    name, x, queries, _ = load_data(args.data, "cuda")
    if name.startswith("clustered"):
        x = torch.nn.functional.normalize(x.float(), dim=1).half()
        queries = torch.nn.functional.normalize(queries.float(), dim=1).half()
    queries = queries[:1000].contiguous()
    _, truth = grnnd.knn(x, queries, 10)
    graph = grnnd.build(x)
    codes = grnnd.encode(x, args.codes)
    print(f"{name}: {tuple(x.shape)} {x.dtype}, degree {graph.shape[1]}, on {torch.cuda.get_device_name()}")
    lists = [int(v) for v in args.lists.split(",")]

    for lst in lists:
        for coded in (None, codes):
            for hub_entries in (-1, 0):
                ms, ids = per_call(lambda q: grnnd.search(x, graph, q, 10, list_size=lst, codes=coded,
                                                          hub_entries=hub_entries), queries, 1)
                print(f"batch 1 list {lst} codes {coded is not None} hub_entries {hub_entries}: {ms:.3f} ms/call, "
                      f"recall@10 {grnnd.recall(ids, truth, 10):.4f}", flush=True)

    if args.sweep:
        for batch in (1, 10, 100):
            for lst in lists:
                for width in (1, 2, 4):
                    for searches in (0, 1, 4, 8, 16, 32):
                        if searches * 10 > 4096 or (batch == 100 and searches > 16):
                            continue
                        kw = dict(list_size=lst, search_width=width, searches=searches, codes=codes)
                        ms, ids = per_call(lambda q: grnnd.search(x, graph, q, 10, **kw), queries, batch, calls=100)
                        # Counted batch by batch: the automatic split depends on the batch.
                        counts = torch.cat([grnnd.search_distance_counts(x, graph, queries[s:s + batch], 10, **kw)
                                            for s in range(0, ids.shape[0], batch)]).float().mean().item()
                        print(f"sweep batch {batch} list {lst} width {width} searches {searches or 'auto'}: "
                              f"{ms:.3f} ms/call, {batch / ms * 1e3:,.0f} q/s, recall@10 "
                              f"{grnnd.recall(ids, truth[:ids.shape[0]], 10):.4f}, {counts:,.0f} distances/query",
                              flush=True)

    if args.profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(50):
                grnnd.search(x, graph, queries[i:i + 1], 10, list_size=lists[0], codes=codes)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
