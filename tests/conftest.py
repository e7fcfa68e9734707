"""Shared by the tests: the devices an op's tests run on, clustered synthetic vectors and
faiss-cpu exact neighbours."""
import contextlib
import os

import faiss
import numpy as np
import pytest
import torch

# The devices a test of both twins runs on: the CUDA variant is marked "cuda" and skips without
# a GPU (so `pytest -m cuda` selects every CUDA test, and a CPU run lists them as skipped).
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def pytest_collection_modifyitems(config, items):
    """GRNND_TEST_PART=K/N keeps every N-th test from the K-th (1 <= K <= N): N runs, one a part,
    run the suite once, for a machine that lends GPU time a call shorter than the whole suite.
    Every worker of pytest-xdist collects the same tests in the same order, so it keeps the same."""
    part = os.environ.get("GRNND_TEST_PART")
    if not part:
        return
    k, _, n = part.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"GRNND_TEST_PART: expected K/N with 1 <= K <= N, got {part!r}")
    k, n = int(k), int(n)
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
    items[:] = kept


def clustered(n: int, dim: int, clusters: int, seed: int = 0, spread: float = 3.0, noise: float = 1.0) -> torch.Tensor:
    """Points around `clusters` Gaussian centres: centres ~ N(0, spread^2), points ~ N(centre, noise^2)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g) * spread
    return centres[torch.randint(clusters, (n,), generator=g)] + torch.randn(n, dim, generator=g) * noise


@contextlib.contextmanager
def one_thread():
    """The CPU build on one thread, where its graph depends on the seed alone: with more, the
    timing of concurrent inserts decides some edges (the build's `seed` documentation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cuda_peak_bytes(run):
    """``(run(), bytes)``: the most CUDA memory allocated while ``run()`` ran, above what was
    allocated before it (the GPU synchronised on both sides)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def exact_neighbours(data: torch.Tensor, queries: torch.Tensor, k: int, metric: str = "l2"):
    """faiss-cpu IndexFlat results as (dists, ids) in this library's distance convention, over
    float32 copies of the values stored (whatever their dtype and device)."""
    x = np.ascontiguousarray(data.float().cpu().numpy())
    q = np.ascontiguousarray(queries.float().cpu().numpy())
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    index = faiss.IndexFlatL2(x.shape[1]) if metric == "l2" else faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    d, i = index.search(q, k)
    d = torch.from_numpy(d)
    if metric == "ip":
        d = -d
    elif metric == "cosine":
        d = 1 - d
    return d, torch.from_numpy(i).long()


@pytest.fixture(scope="session")
def blobs():
    """20k x 64, 100 clusters, with 500 held-out queries from the same distribution."""
    data = clustered(20_500, 64, 100, seed=0)
    return data[:20_000].contiguous(), data[20_000:].contiguous()


@pytest.fixture(scope="session")
def blobs_truth(blobs):
    data, queries = blobs
    return exact_neighbours(data, queries, 10)[1]


@pytest.fixture(scope="session")
def blobs_graph(blobs):
    import torch_grnnd as grnnd

    return grnnd.build(blobs[0])
