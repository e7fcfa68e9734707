"""Where the time of one torch_grnnd.pyg.knn_graph call goes, on the GPU.

    python -m benchmarks.profile_pyg [--clouds 32 --points 1024 --dims 3 64 --k 20]

For each dimension: the median time of the whole call and of the knn_segments op alone (CUDA
events, as benchmarks/bench_pyg.py times them), then torch.profiler's table of one call: the
host time of each op and the kernels it launched. The difference between the two medians is
the wrapper's share. For the kernels themselves use ncu, e.g.

    ncu -k regex:knn_segments --set full -o pyg python -m benchmarks.profile_pyg --dims 64
"""
import argparse

import torch

from benchmarks.common import median_ms
from torch_grnnd.pyg import knn_graph


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clouds", type=int, default=32)
    p.add_argument("--points", type=int, default=1024)
    p.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--rows", type=int, default=25, help="rows of the profiler's table")
    args = p.parse_args()
    clouds, n, k = args.clouds, args.points, args.k
    batch = torch.arange(clouds, device="cuda").repeat_interleave(n)
    for dim in args.dims:
        x = torch.randn(clouds * n, dim, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
        call = lambda: knn_graph(x, k, batch, batch_size=clouds)  # noqa: E731
        whole = median_ms(call, 20)
        op = median_ms(lambda: torch.ops.grnnd.knn_segments(x, x, None, batch, k + 1, batch_x=batch,
                                                            examples=clouds), 20)
        print(f"{clouds} x {n}, d = {dim}, k = {k}: knn_graph {whole:.3f} ms, knn_segments op {op:.3f} ms, "
              f"wrapper {whole - op:.3f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows), flush=True)


if __name__ == "__main__":
    main()
