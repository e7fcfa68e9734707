"""Embeddings in a file larger than the GPU allows: build the graph within a memory budget,
then search the rows where they lie.

1. The embeddings are written to an .npy file chunk by chunk, as a model's output would be (here
   clustered float16 rows); the process never holds them all.
2. The file is memory-mapped: its rows stay in the page cache or on disk.
3. ``grnnd.build(rows, device=..., max_gpu_memory=...)`` builds the graph in overlapping shards
   that fit the budget, each copied in while the previous one builds, and joins them. Progress
   counts the rows built.
4. A batch of queries is searched with the rows in pinned host memory, read by the GPU where they
   lie (on the CPU: in place); only the graph and the queries go to the device.
5. The run checks recall@10 against exact neighbours (computed a chunk of rows at a time) and
   exits non-zero if it falls short.

    python examples/beyond_gpu.py                      # 2M x 256 rows, 512 MB budget, CUDA
    python examples/beyond_gpu.py --smoke --device cpu
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

import torch_grnnd as grnnd
from torch_grnnd import memory


def write_rows(path: str, n: int, dim: int, clusters: int, chunk: int, seed: int = 0) -> torch.Tensor:
    """Writes n clustered float16 rows to an .npy file at ``path``, ``chunk`` rows at a time;
    returns the centres (to draw queries from)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=generator) * 3
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, dim))
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        labels = torch.randint(clusters, (size,), generator=generator)
        block = centres[labels] + torch.randn(size, dim, generator=generator)
        rows[start:start + size] = block.half().numpy()
    rows.flush()
    del rows
    return centres


def exact_neighbours(rows: torch.Tensor, queries: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """The k nearest rows of each query (ids), over ``rows`` a chunk at a time on the queries'
    device: the ground truth without holding every row there."""
    queries = queries.float()
    best_d = torch.full((queries.shape[0], 0), float("inf"), device=queries.device)
    best_i = torch.zeros((queries.shape[0], 0), dtype=torch.long, device=queries.device)
    for start in range(0, rows.shape[0], chunk):
        block = rows[start:start + chunk].to(queries.device).float()
        d, i = grnnd.knn(block, queries, min(k, block.shape[0]))
        best_d, order = torch.cat([best_d, d], 1).topk(min(k, best_d.shape[1] + d.shape[1]), dim=1, largest=False)
        best_i = torch.cat([best_i, i + start], 1).gather(1, order)
    return best_i


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--budget", default="512MB", help="device memory the build may use")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", default=None, help="where the .npy file goes (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="20 000 x 32 rows, a budget of a few shards")
    args = p.parse_args()
    if args.smoke:
        args.n, args.dim, args.queries = 20_000, 32, 200
        args.budget = 5000 * memory.shard_bytes_per_row(args.dim, 2, grnnd.BuildParams())
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "embeddings.npy")
        centres = write_rows(path, args.n, args.dim, clusters=max(10, args.n // 1000), chunk=1 << 18)
        # Copy-on-write map: a writable tensor whose changes (none here) never reach the file.
        rows = torch.from_numpy(np.load(path, mmap_mode="c"))
        print(f"{args.n:,} x {args.dim} float16 rows in {path} ({os.path.getsize(path) / 2**30:.2f} GiB), "
              f"building on {device} within {memory.parse_bytes(args.budget) / 2**20:.0f} MiB")

        reports = []
        start = time.perf_counter()
        graph = grnnd.build(rows, device=device, max_gpu_memory=args.budget,
                            progress=lambda done, total: reports.append((done, total)))
        seconds = time.perf_counter() - start
        counted = f"progress counted {reports[-1][1]:,} rows: each shard's, then the rows of two shards joined" \
            if reports else "it fitted: one build"
        print(f"graph {tuple(graph.shape)} on {graph.device} in {seconds:.1f} s ({counted})")

        generator = torch.Generator().manual_seed(1)
        labels = torch.randint(centres.shape[0], (args.queries,), generator=generator)
        queries = (centres[labels] + torch.randn(args.queries, args.dim, generator=generator)).half().to(device)
        if device.type == "cuda":
            host = rows.pin_memory()  # the GPU reads the rows it needs from here; they never move
            ids = grnnd.search(host, graph.to(device), queries, k=10, list_size=64)[1]
        else:
            host = rows
            ids = grnnd.search(rows, graph, queries, k=10, list_size=64)[1]
        truth = exact_neighbours(host, queries, 10, chunk=1 << 20)
        recall = grnnd.recall(ids, truth)
        print(f"recall@10 at list 64 over {args.queries} queries: {recall:.4f}")
        del rows, host  # the map closes before its folder goes
    if recall < 0.9:
        print("FAILED: recall below 0.9")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
