#!/usr/bin/env python3
"""Searches from many threads, one query a call: each thread calling index.search itself, against
the same threads calling a grnnd.QueryBatcher.

    python -m benchmarks.bench_batching [--data SPEC] [--threads 1,8,32,64] [--seconds 2] [--list 32]
                                        [--switch-interval S]

--data: as bench_gpu.py's (default: 1M x 384 clustered float16 rows on the GPU, CPU rows if there
is no GPU: 100k x 64). Default build; every call searches one query (a row of the query set, taken
round-robin) with the given list and explicit searches / search width, so both ways answer alike.
Prints queries/s (all threads together, wall clock over --seconds), the batches the batcher ran,
and recall@10 of the answers.
"""
import argparse
import sys
import threading
import time

import torch

import torch_grnnd as grnnd
from benchmarks.datasets import load_data


def run(threads: int, seconds: float, ask, queries: torch.Tensor):
    """Calls/s of `threads` threads each calling ask(query) for `seconds`, and the ids they got."""
    stop = time.perf_counter() + seconds
    counts, found = [0] * threads, {}

    def work(t):
        i = t
        while time.perf_counter() < stop:
            q = i % queries.shape[0]
            found[q] = ask(queries[q])
            counts[t] += 1
            i += threads

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    return sum(counts) / (time.perf_counter() - start), found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="")
    p.add_argument("--threads", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--list", type=int, default=32)
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval (seconds) for the runs: how long a thread may hold the interpreter "
                        "while others wait for it (Python's default: 0.005)")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = args.data or ("clustered:n=1000000,d=384,clusters=1000,queries=1000" if device == "cuda"
                         else "clustered:n=100000,d=64,clusters=100,queries=1000")
    name, base, queries, _ = load_data(spec, device)
    index = grnnd.Index.build(base)
    truth = grnnd.knn(base, queries, 10)[1]  # exact, on the rows' device
    settings = dict(list_size=args.list, searches=1, search_width=1)
    print(f"{name}: {tuple(base.shape)} {base.dtype} on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; "
          f"list {args.list}, one search a query, width 1, switch interval {sys.getswitchinterval() * 1e3:.2f} ms",
          flush=True)

    def direct(q):
        ids = index.search(q[None], 10, **settings)[1]
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        return ids[0]

    for threads in (int(t) for t in args.threads.split(",")):
        batcher = grnnd.QueryBatcher(index, 10, **settings)

        def batched(q):
            ids = batcher.search(q)[1]
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            return ids

        for label, ask in (("index.search", direct), ("QueryBatcher", batched)):
            run(threads, 0.2, ask, queries)  # warm-up
            batcher.batches = 0
            qps, found = run(threads, args.seconds, ask, queries)
            got = sorted(found)
            recall = grnnd.recall(torch.stack([found[q].cpu() for q in got]), truth[got].cpu(), 10)
            extra = f", {batcher.batches:,} batches" if label == "QueryBatcher" else ""
            print(f"  threads {threads:3d} {label:13s}: {qps:10,.0f} q/s, recall@10 {recall:.4f}{extra}", flush=True)


if __name__ == "__main__":
    main()
