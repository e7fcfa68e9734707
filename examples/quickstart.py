"""Index clustered embeddings, search them, and compare with exact search.

    python examples/quickstart.py              # 50k x 128 on CUDA if available, else CPU
    python examples/quickstart.py --n 200000 --dim 384 --dtype float16
"""
import argparse
import time

import torch

import torch_grnnd as grnnd


def clustered_embeddings(n: int, dim: int, clusters: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g) * 3
    x = centres[torch.randint(clusters, (n,), generator=g)] + torch.randn(n, dim, generator=g)
    return x.to(device=device, dtype=dtype)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    data = clustered_embeddings(args.n + args.queries, args.dim, 200, args.device, dtype)
    emb, queries = data[: args.n], data[args.n:]
    print(f"{args.n} x {args.dim} {args.dtype} embeddings on {args.device}")

    index, build_s = timed(lambda: grnnd.Index.build(emb))
    print(f"build        {build_s:8.3f} s   {index}")
    (dists, ids), search_s = timed(lambda: index.search(queries, k=args.k))
    (_, exact_ids), exact_s = timed(lambda: grnnd.knn(emb, queries, args.k))
    print(f"graph search {search_s:8.3f} s   {args.queries / search_s:10.0f} queries/s")
    print(f"exact knn    {exact_s:8.3f} s   {args.queries / exact_s:10.0f} queries/s")
    print(f"recall@{args.k} of graph search against exact search: {grnnd.recall(ids, exact_ids):.4f}")


if __name__ == "__main__":
    main()
