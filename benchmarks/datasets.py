"""Benchmark data: clustered synthetic sets and real model embeddings, with exact ground truth.

The CPU benchmarks' loaders return a dict {"name", "base": float32 [N, D], "queries": float32
[Q, D], "gt": int64 [Q, >=10], "metric"}; ground truth is exact (faiss-cpu IndexFlat). The GPU
benchmarks' data (``load_data``, the synthetic families of ``make_set``, described in
bench_scale.py) is made on the GPU in float16, its ground truth computed where it is measured.

A dataset is named on the command line by a spec (see ``load``):
    clustered:n=20000,d=64,clusters=100,queries=500,seed=0
    .data/text100k.pt                  (a {"base","queries","gt"} file, e.g. from embed_cpu.py)
    .data/text100k.pt:n=30000          (its first 30 000 base rows; ground truth recomputed)
"""
import math
import os

import numpy as np
import torch


def exact_gt(base: torch.Tensor, queries: torch.Tensor, k: int = 100, metric: str = "l2") -> torch.Tensor:
    """Exact k nearest neighbours (int64 [Q, k]) by faiss-cpu IndexFlat; cosine/ip by inner product."""
    import faiss  # here: the GPU scripts use this module without faiss
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


# The synthetic families of the GPU benchmarks (bench_scale.py describes them), made on the GPU in
# float16 from one seed, and the GPU benchmarks' --data specs.
FAMILY_QUERIES = 1000


def parse_sets(spec: str) -> list:
    """``"blobs:1000000x384,zipf:..."`` -> ``[("blobs", 1000000, 384), ...]``."""
    sets = []
    for item in spec.split(","):
        family, _, size = item.partition(":")
        n, d = (int(v) for v in size.split("x"))
        sets.append((family, n, d))
    return sets


FAMILIES = ("blobs", "zipf", "aniso", "zipf_aniso", "zipf_tiny", "zipf_iso", "zipf_aniso_apart")
# Rows per cluster on average: about 1 000, or 20 for zipf_tiny (most of its clusters then hold a
# few rows, and most of its rare queries come from such clusters).
_ROWS_PER_CLUSTER = {"zipf_tiny": 20}
# The root mean square of the anisotropic families' noise scales (log-uniform over 10^-1 ..
# 10^0.25): sqrt((10^0.5 - 10^-2) / (2.5 ln 10)), about 0.74.
_ANISO_NOISE_RMS = math.sqrt((10 ** 0.5 - 10 ** -2) / (2.5 * math.log(10)))
# Spread of the cluster centres (the noise is about 1 a dimension): well apart, or overlapping.
# zipf_aniso_apart's centres lie as far apart against its noise as zipf's (3) against theirs.
_CENTRE_SPREAD = {"zipf_aniso": 1.5, "zipf_tiny": 1.0, "zipf_iso": 1.5, "zipf_aniso_apart": 3 * _ANISO_NOISE_RMS}
# zipf_aniso and its two variants, which change one thing each against zipf: zipf_iso the noise's
# shape (isotropic within each cluster, of the cluster's own energy), zipf_aniso_apart the
# centres' distance against the noise (zipf's). The four make a two-by-two: noise isotropic or
# not, centres overlapping or apart. The same seed draws the same sizes, centre directions and
# scales for the three.
_ANISO_DRAWS = ("zipf_aniso", "zipf_tiny", "zipf_iso", "zipf_aniso_apart")


def _clusters(family: str, n: int, d: int, g: torch.Generator, device):
    """The family's clusters, drawn first from ``g`` (so a generator of the same seed draws them
    again): (centres [C, D], per-cluster noise scales [C, D] or a scalar / [D], cluster weights
    [C] for the rows' labels, None for uniform)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    clusters = max(n // _ROWS_PER_CLUSTER.get(family, 1000), 10)
    centres = torch.randn(clusters, d, generator=g, device=device) * _CENTRE_SPREAD.get(family, 3)
    if family == "aniso":  # the centres above are drawn all the same, so that the rows stay those of earlier runs
        return torch.zeros(1, d, device=device), torch.logspace(0, -1.5, d, device=device), None
    scales = 1.0
    if family in _ANISO_DRAWS:
        scales = 10 ** (torch.rand(clusters, d, generator=g, device=device) * 1.25 - 1.0)
    if family == "zipf_iso":
        scales = scales.pow(2).mean(1, keepdim=True).sqrt()
    weights = None
    if family == "zipf" or family in _ANISO_DRAWS:
        weights = (1.0 / torch.arange(1, clusters + 1, device=device, dtype=torch.float64)).float()
    return centres, scales, weights


def _rows(centres, scales, labels, d, g, device, chunk) -> torch.Tensor:
    """float16 rows of the clusters ``labels``, made chunk by chunk (10M x 1024 is 20 GB)."""
    x = torch.empty(labels.shape[0], d, dtype=torch.float16, device=device)
    for start in range(0, labels.shape[0], chunk):
        end = min(labels.shape[0], start + chunk)
        part = labels[start:end]
        noise = torch.randn(end - start, d, generator=g, device=device)
        noise *= scales[part] if torch.is_tensor(scales) and scales.dim() == 2 else scales
        x[start:end] = (centres[part] + noise).half()
    return x


def make_set(family: str, n: int, d: int, seed: int = 0, chunk: int = 1 << 20, want_labels: bool = False,
             queries: int = FAMILY_QUERIES, device="cuda"):
    """(base, queries) float16 on ``device``, the queries drawn like the rows. With
    ``want_labels``, also the cluster of every row: (base, queries, base_labels, query_labels)."""
    g = torch.Generator(device=device).manual_seed(seed)
    centres, scales, weights = _clusters(family, n, d, g, device)
    total = n + queries
    if weights is not None:
        labels = torch.multinomial(weights, total, replacement=True, generator=g)
    elif family == "aniso":
        labels = torch.zeros(total, dtype=torch.int64, device=device)
    else:
        labels = torch.randint(centres.shape[0], (total,), generator=g, device=device)
    x = _rows(centres, scales, labels, d, g, device, chunk)
    if want_labels:
        return x[:n], x[n:], labels[:n], labels[n:]
    return x[:n], x[n:]


def make_rare_queries(family: str, n: int, d: int, seed: int = 0, queries: int = FAMILY_QUERIES, device="cuda"):
    """(queries, labels): queries of make_set's clusters for the same seed, each from a cluster
    chosen uniformly rather than by its size: the rare categories."""
    centres, scales, _ = _clusters(family, n, d, torch.Generator(device=device).manual_seed(seed), device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    labels = torch.randint(centres.shape[0], (queries,), generator=g, device=device)
    return _rows(centres, scales, labels, d, g, device, 1 << 20), labels


# Cluster sizes the queries are grouped by (by_cluster_size).
SIZE_EDGES = (0, 1_000, 10_000, 100_000, 1_000_000, float("inf"))


def by_cluster_size(ids, truth, base_labels, query_labels) -> list:
    """Recall@10 of the queries grouped by the size of their own cluster, with the share of the
    returned rows that lie in that cluster: a search lost between clusters returns rows of other
    clusters, one that reached the right cluster but not its nearest rows returns its own."""
    sizes = torch.bincount(base_labels, minlength=int(query_labels.max()) + 1)[query_labels]
    hits = (ids[:, :10, None] == truth[:, None, :10]).any(2).float().mean(1)
    own = ((base_labels[ids.clamp_min(0)] == query_labels[:, None]) & (ids >= 0)).float().mean(1)
    groups = []
    for low, high in zip(SIZE_EDGES, SIZE_EDGES[1:]):
        member = (sizes >= low) & (sizes < high)
        if member.any():
            groups.append({"sizes": [low, None if high == float("inf") else high], "queries": int(member.sum()),
                           "recall": float(hits[member].mean()), "in_own_cluster": float(own[member].mean())})
    return groups


def sizes_text(sizes: list) -> str:
    """A by_cluster_size group's sizes, [low, high or None], as words."""
    low, high = sizes
    return f"{low:,} or more" if high is None else f"{low:,} to {high - 1:,}"

def load_data(spec: str, device: str):
    """(name, base, queries, ground truth or None) of a GPU benchmark's --data: a family
    ("zipf:2000000x128"), "clustered:n=...,d=...,clusters=...,queries=...,seed=...", or a saved
    {"base", "queries", "gt"} file (":pca=D" projects it to D dimensions)."""
    family, _, shape = spec.partition(":")
    if family in FAMILIES:  # the synthetic families: "zipf:2000000x128"
        n, d = (int(v) for v in shape.split("x"))
        base, queries = make_set(family, n, d, queries=10_000)
        return f"{family}-{n // 1000}k-d{d}", base.to(device), queries.to(device), None
    if spec.startswith("clustered"):
        kv = dict(item.split("=", 1) for item in spec.partition(":")[2].split(",") if item)
        n, d = int(kv.get("n", 1_000_000)), int(kv.get("d", 128))
        clusters, nq = int(kv.get("clusters", 1000)), int(kv.get("queries", 10_000))
        g = torch.Generator(device=device).manual_seed(int(kv.get("seed", 0)))
        centres = torch.randn(clusters, d, generator=g, device=device) * 3
        labels = torch.randint(clusters, (n + nq,), generator=g, device=device)
        x = centres[labels] + torch.randn(n + nq, d, generator=g, device=device)
        x = x.half()
        return f"clustered-{n // 1000}k-d{d}-c{clusters}", x[:n].contiguous(), x[n:].contiguous(), None
    path, _, opts = spec.partition(":")
    blob = torch.load(path, map_location=device)
    base, queries, gt = blob["base"].contiguous(), blob["queries"].contiguous(), blob.get("gt")
    name = os.path.splitext(os.path.basename(path))[0]
    if opts.startswith("pca="):
        dim = int(opts[4:])
        sample = base[torch.randperm(base.shape[0], device=device)[:100_000]].float()
        mean = sample.mean(0)
        _, _, v = torch.linalg.svd(sample - mean, full_matrices=False)
        project = lambda t: torch.nn.functional.normalize((t.float() - mean) @ v[:dim].T, dim=1).half()  # noqa: E731
        base, queries, gt, name = project(base).contiguous(), project(queries).contiguous(), None, f"{name}-pca{dim}"
    return name, base, queries, gt
