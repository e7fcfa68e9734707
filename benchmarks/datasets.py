"""Benchmark data: clustered synthetic sets and real model embeddings, with exact ground truth.

Every loader returns a dict {"name", "base": float32 [N, D], "queries": float32 [Q, D],
"gt": int64 [Q, >=10], "metric"}; ground truth is exact (faiss-cpu IndexFlat).

A dataset is named on the command line by a spec (see ``load``):
    clustered:n=20000,d=64,clusters=100,queries=500,seed=0
    .data/text100k.pt                  (a {"base","queries","gt"} file, e.g. from embed_cpu.py)
    .data/text100k.pt:n=30000          (its first 30 000 base rows; ground truth recomputed)
"""
import os

import faiss
import numpy as np
import torch


def exact_gt(base: torch.Tensor, queries: torch.Tensor, k: int = 100, metric: str = "l2") -> torch.Tensor:
    """Exact k nearest neighbours (int64 [Q, k]) by faiss-cpu IndexFlat; cosine/ip by inner product."""
    x = np.ascontiguousarray(base.float().numpy())
    q = np.ascontiguousarray(queries.float().numpy())
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-30)
        q = q / np.linalg.norm(q, axis=1, keepdims=True).clip(1e-30)
    index = faiss.IndexFlatL2(x.shape[1]) if metric == "l2" else faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    _, ids = index.search(q, min(k, x.shape[0]))
    return torch.from_numpy(ids).long()


def clustered(n: int, d: int, clusters: int, queries: int, seed: int = 0, k: int = 100) -> dict:
    """Gaussian blobs: ``clusters`` centres spread by 3, unit noise; queries drawn the same way.

    Same generator as tests/conftest.py, so ``clustered(20000, 64, 100, 500)`` is the test suite's
    ``blobs`` fixture. Much easier than real embeddings: never tune on it alone (DESIGN.md).
    """
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=g) * 3
    x = centres[torch.randint(clusters, (n + queries,), generator=g)] + torch.randn(n + queries, d, generator=g)
    base, q = x[:n].contiguous(), x[n:].contiguous()
    return {"name": f"clustered-{n // 1000}k-d{d}-c{clusters}", "base": base, "queries": q,
            "gt": exact_gt(base, q, k), "metric": "l2"}


def load_embeddings(path: str, n: int = 0, queries: int = 0, metric: str = "l2", k: int = 100) -> dict:
    """Read {"base": f16 [N,D], "queries": f16 [Q,D], "gt": int32 [Q,>=10]} (optional "gt").

    The format /work/shared/tools/text_embeddings.py and benchmarks/embed_cpu.py write. With
    ``n`` only the first n base rows are kept, with ``queries`` the first that many queries; the
    ground truth is then (or when absent) recomputed exactly with faiss-cpu IndexFlat.
    """
    blob = torch.load(path, map_location="cpu")
    base, q = blob["base"].float().contiguous(), blob["queries"].float().contiguous()
    gt = blob.get("gt")
    if queries and queries < q.shape[0]:
        q = q[:queries].contiguous()
        gt = gt[:queries] if gt is not None else None
    if n and n < base.shape[0]:
        base, gt = base[:n].contiguous(), None
    if gt is None or metric != "l2":
        gt = exact_gt(base, q, k, metric)
    name = os.path.splitext(os.path.basename(path))[0] + (f"-{n // 1000}k" if n else "")
    return {"name": name, "base": base, "queries": q, "gt": gt.long(), "metric": metric}


def _kv(text: str) -> dict:
    return {k: v for k, v in (item.split("=", 1) for item in text.split(",") if item)}


def load(spec: str) -> dict:
    """A dataset from a command-line spec (module docstring)."""
    if spec.startswith("clustered"):
        kv = _kv(spec.partition(":")[2])
        return clustered(int(kv.get("n", 20000)), int(kv.get("d", 64)), int(kv.get("clusters", 100)),
                         int(kv.get("queries", 500)), int(kv.get("seed", 0)))
    path, _, opts = spec.partition(":")
    kv = _kv(opts)
    return load_embeddings(path, int(kv.get("n", 0)), int(kv.get("queries", 0)), kv.get("metric", "l2"))
