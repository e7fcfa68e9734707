#!/usr/bin/env python3
"""Where a batch of one query spends its time: wall clock per call with and without codes and hub
entry points, then torch.profiler's kernel and host tables for 50 calls.

    python benchmarks/profile_small_batches.py > profile.txt

1M x 384 normalised clustered float16 rows (1 000 clusters), default build, list 32: 20 calls of
warm-up, then 200 calls one after another, each on its own query, synchronised at the end.
"""
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torch_grnnd as grnnd


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    centres = torch.randn(1000, 384, generator=g, device="cuda") * 3
    labels = torch.randint(1000, (1_000_000,), generator=g, device="cuda")
    x = (centres[labels] + torch.randn(1_000_000, 384, generator=g, device="cuda")).half()
    x = torch.nn.functional.normalize(x.float(), dim=1).half()
    graph = grnnd.build(x)
    codes = grnnd.encode(x)
    q = x[:1000].clone()
    for coded in (None, codes):
        for hub_entries in (-1, 0):
            def run(i):
                return grnnd.search(x, graph, q[i:i + 1], 10, list_size=32, codes=coded, hub_entries=hub_entries)
            for i in range(20):
                run(i)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(200):
                run(i)
            torch.cuda.synchronize()
            print("codes", coded is not None, "hub_entries", hub_entries,
                  f"{(time.perf_counter() - start) / 200 * 1e3:.3f} ms/call")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for i in range(50):
            grnnd.search(x, graph, q[i:i + 1], 10, list_size=32, codes=codes)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
