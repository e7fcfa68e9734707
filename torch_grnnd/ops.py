"""Thin wrappers over ``torch.ops.grnnd.*`` with their fake (meta) kernels.

All logic and validation lives in the C++ kernels (csrc/); this module gives each op a
documented Python signature and tells torch.compile the shapes of its outputs. The defaults
here are the schema's (csrc/grnnd.cpp); a test keeps the two equal. Gradients of the returned
distances are registered in autograd.py.
"""
import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from .progress import Progress, run_reporting

logger = logging.getLogger(__name__)  # under "torch_grnnd"

Metric = str  # "l2" (squared Euclidean) | "ip" (negative inner product) | "cosine" (1 - cosine similarity)


def build(
    data: Tensor,
    *,
    degree: int = 32,
    initial_degree: int = 16,
    pool_size: int = 48,
    outer_iters: int = 3,
    inner_iters: int = 6,
    reverse_ratio: float = 0.6,
    update_order: str = "random",
    metric: Metric = "l2",
    seed: int = 0,
    progress: Progress = False,
) -> Tensor:
    """Build a GRNND graph (GPU-parallel Relative NN-Descent) over the rows of ``data``.

    Starting from ``S`` random neighbours per vertex, ``T1`` outer iterations each run ``T2``
    rounds in which every vertex applies the relative-neighbourhood rule to its pool in random
    order (of two neighbours closer to each other than the farther is to the vertex, the
    farther is handed to the closer), then give a reverse edge to the closest ``rho`` share
    of each pool.

    Args:
        data: [N, D] float32/float16/bfloat16 (float64 accepted), CPU or CUDA.
        degree: out-degree of the returned graph (rows are cut to it, then -1 padded).
        initial_degree: ``S``, random neighbours each vertex starts with.
        pool_size: ``R``, capacity of each vertex's candidate pool; more finds better
            neighbours at more memory (2 * N * R * 8 bytes) and time.
        outer_iters: ``T1``, outer iterations; each adds reverse edges before the next.
        inner_iters: ``T2``, update rounds per outer iteration.
        reverse_ratio: ``rho``, share of each pool (closest first) that gets a reverse edge.
        update_order: ``"random"`` (GRNND's disordered propagation), ``"ascending"`` or
            ``"descending"`` distance order, or ``"descending_then_random"``: descending in
            every outer iteration but the last, random in the last. On real sentence
            embeddings descending built the better graph (recall@10 0.962 against 0.941 at list
            64) for 1.35x the random build's time, and descending_then_random most of that
            (0.960) at 0.9x descending's time (README, Measured).
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        seed: seeds every random choice; with one CPU thread the graph is reproducible.
        progress: report each outer iteration: ``True`` for a tqdm bar (or log records), or a
            callable ``progress(done, total)``; see :mod:`torch_grnnd.progress`. Ignored inside
            ``torch.compile``; on CUDA each report costs a stream synchronisation.

    Returns:
        int32 [N, degree]: neighbour ids of each row, ascending by distance, -1 padded.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> x = torch.randn(1000, 16)
        >>> graph = grnnd.build(x, degree=16)
        >>> graph.shape, graph.dtype
        (torch.Size([1000, 16]), torch.int32)
    """
    def run() -> Tensor:
        return torch.ops.grnnd.build.default(
            data,
            degree=degree,
            initial_degree=initial_degree,
            pool_size=pool_size,
            outer_iters=outer_iters,
            inner_iters=inner_iters,
            reverse_ratio=reverse_ratio,
            update_order=update_order,
            metric=metric,
            seed=seed,
        )

    if not torch.compiler.is_compiling():  # a compiled graph cannot hold a host-side log call
        logger.debug("build: %s %s on %s, metric=%s, degree=%d, T1=%d, T2=%d", tuple(data.shape), data.dtype,
                     data.device, metric, degree, outer_iters, inner_iters)
    return run_reporting(progress, "build", run)


def search(
    data: Tensor,
    graph: Tensor,
    queries: Tensor,
    k: int,
    *,
    list_size: int = 0,
    search_width: int = 1,
    max_iters: int = 0,
    metric: Metric = "l2",
    seed: int = 0,
    filter: Optional[Tensor] = None,
    searches: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Approximate k nearest neighbours of each query by greedy search over ``graph``.

    Keeps the best ``list_size`` nodes seen; each iteration expands the ``search_width`` best
    not yet expanded; stops when none is left (or after ``max_iters``). A larger list raises
    recall at the cost of speed.

    A query may be answered by several independent searches whose results are merged: each
    starts from its own random entry points and keeps a list of about
    ``2 * list_size / sqrt(searches)`` (at least ``k``, at most ``list_size``). On CUDA they run
    side by side, which is how a small batch uses the whole GPU; by default (``searches=0``) the
    CUDA search splits the queries of a batch too small to fill the GPU, so the same query may
    get slightly different neighbours in a batch of 1 than in a batch of 10 000; pass
    ``searches=1`` to rule that out. The CPU splits only when asked.

    Args:
        data, graph: the vectors and the graph ``build`` made of them.
        queries: [Q, D], same dtype family and device as ``data``.
        k: neighbours returned per query, ``k <= list_size``.
        list_size: internal candidate list (0 = max(k, 64)), at most 1024.
        search_width: parents expanded per iteration.
        max_iters: iteration cap (0 = none).
        metric: must be the metric the graph was built with.
        seed: seeds the random entry points.
        filter: optional bool [N]; rows marked False are traversed but never returned.
        searches: independent searches per query (0 = automatic, at most 32, and
            ``searches * k <= 4096``).

    Returns:
        ``(dists float32 [Q, k], ids int64 [Q, k])`` ascending by distance; where fewer than
        ``k`` allowed rows were found, ids are -1 and dists +inf.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> x = torch.randn(1000, 16)
        >>> d, i = grnnd.search(x, grnnd.build(x), x[:5], k=3)
        >>> i[:, 0].tolist()
        [0, 1, 2, 3, 4]
    """
    return torch.ops.grnnd.search.default(
        data,
        graph,
        queries,
        k,
        list_size=list_size,
        search_width=search_width,
        max_iters=max_iters,
        metric=metric,
        seed=seed,
        filter=filter,
        searches=searches,
    )


def search_distance_counts(
    data: Tensor,
    graph: Tensor,
    queries: Tensor,
    k: int,
    *,
    list_size: int = 0,
    search_width: int = 1,
    max_iters: int = 0,
    metric: Metric = "l2",
    seed: int = 0,
    filter: Optional[Tensor] = None,
    searches: int = 0,
) -> Tensor:
    """How many distances :func:`search` computes for each query (int32 [Q]), with the same arguments.

    Runs the same search and counts instead of returning results: the work behind a point on a
    recall/throughput curve. On CUDA a node the visited hash forgot and met again is counted
    each time it is computed; the CPU never forgets, so its counts can be slightly lower.
    """
    return torch.ops.grnnd.search_distance_counts.default(
        data,
        graph,
        queries,
        k,
        list_size=list_size,
        search_width=search_width,
        max_iters=max_iters,
        metric=metric,
        seed=seed,
        filter=filter,
        searches=searches,
    )


def knn(data: Tensor, queries: Tensor, k: int, *, metric: Metric = "l2") -> Tuple[Tensor, Tensor]:
    """Exact k nearest neighbours of each query among the rows of ``data``.

    Returns ``(dists float32 [Q, k], ids int64 [Q, k])``, ascending; distances are recomputed
    exactly in float32 for the returned neighbours.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> x = torch.randn(100, 8)
        >>> d, i = grnnd.knn(x, x[:2], k=1)
        >>> i.flatten().tolist()
        [0, 1]
    """
    return torch.ops.grnnd.knn.default(data, queries, k, metric=metric)


def _query_outputs(data: Tensor, queries: Tensor, k: int, graph: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    # The one check a fake kernel can make that the real kernel would otherwise make after
    # dispatch already went to a single device (a meta tensor among CPU ones lands here).
    for name, other in (("queries", queries), ("graph", graph)):
        if other is not None and other.device != data.device:
            raise ValueError(f"data is on {data.device} but {name} is on {other.device}; move them to the same device")
    q = queries.shape[0]
    return queries.new_empty((q, k), dtype=torch.float32), queries.new_empty((q, k), dtype=torch.int64)


def _schema_default(op, name: str):
    return next(a.default_value for a in op.default._schema.arguments if a.name == name)


_DEFAULT_DEGREE = _schema_default(torch.ops.grnnd.build, "degree")


# Fake kernels receive the arguments as the caller passed them (defaults not filled in).
@torch.library.register_fake("grnnd::build")
def _build_fake(data, *, degree=_DEFAULT_DEGREE, **_):
    return data.new_empty((data.shape[0], degree), dtype=torch.int32)


@torch.library.register_fake("grnnd::search")
def _search_fake(data, graph, queries, k, *_, **__):
    return _query_outputs(data, queries, k, graph)


@torch.library.register_fake("grnnd::search_distance_counts")
def _search_distance_counts_fake(data, graph, queries, k, *_, **__):
    _query_outputs(data, queries, k, graph)
    return queries.new_empty((queries.shape[0],), dtype=torch.int32)


@torch.library.register_fake("grnnd::knn")
def _knn_fake(data, queries, k, **_):
    return _query_outputs(data, queries, k)


@torch.library.register_fake("grnnd::knn_graph")
def _knn_graph_fake(data, k, **_):
    return _query_outputs(data, data, k)
