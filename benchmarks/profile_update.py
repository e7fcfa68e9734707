"""Where the time of one small Index.add goes, on the GPU.

    python -m benchmarks.profile_update [--data clustered:n=1000000,d=384 | --data DIR/embeddings.pt]

Builds an index of all rows but the last ``share`` (1% by default, the daily-inserts scenario of
benchmarks/bench_update.py), adds them in batches of that share of N, and prints the median
time of an add (CUDA events; the first add, which grows the storage, apart), then
torch.profiler's table of one add (host time of each op and the kernels it launched), sorted
by GPU time. For the kernels themselves use ncu, e.g.

    ncu -k regex:prune --set full -o add python -m benchmarks.profile_update
"""
import argparse

import torch

import torch_grnnd as grnnd
from benchmarks.common import parse_settings, timed
from benchmarks.datasets import load_data


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=384", help="as benchmarks/bench_gpu.py takes it")
    p.add_argument("--share", type=float, default=0.01, help="rows per add, as a share of N")
    p.add_argument("--adds", type=int, default=5, help="timed adds (after the first)")
    p.add_argument("--build", default="", help="build settings, name=value,...")
    p.add_argument("--rows", type=int, default=30, help="rows of the profiler's table")
    args = p.parse_args()
    device = torch.device("cuda")
    base = load_data(args.data, "cuda")[1]
    n = base.shape[0]
    step = max(1, int(n * args.share))
    first = n - step * (args.adds + 2)
    params = grnnd.BuildParams(**parse_settings(args.build))
    index = grnnd.Index.build(base[:first], params)
    batches = [base[first + i * step:first + (i + 1) * step] for i in range(args.adds + 2)]
    _, grow = timed(lambda: index.add(batches[0]), device)
    times = sorted(timed(lambda b=b: index.add(b), device)[1] for b in batches[1:-1])
    print(f"{n:,} x {base.shape[1]}, degree {index.graph.shape[1]}: adds of {step:,} rows, first (grows the storage) "
          f"{grow * 1e3:.1f} ms, median of {len(times)} {times[len(times) // 2] * 1e3:.1f} ms "
          f"(min {times[0] * 1e3:.1f}, max {times[-1] * 1e3:.1f})", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        index.add(batches[-1])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows), flush=True)


if __name__ == "__main__":
    main()
