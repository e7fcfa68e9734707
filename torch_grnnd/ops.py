"""Thin wrappers over ``torch.ops.grnnd.*`` with their fake (meta) kernels.

All logic and validation lives in the C++ kernels (csrc/); this module gives each op a
documented Python signature and tells torch.compile the shapes of its outputs. The build and
search settings and their defaults (the schema's, csrc/grnnd.cpp) are defined once, in
params.py. Gradients of the returned distances are registered in autograd.py.
"""
import logging
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .codes import PAIR_CODE_METRICS, Codes, pair_codes
from .memory import build_extra_bytes, free_bytes
from .params import CODES_DELTA, PAIR_CODES_MIN_DIM, ROWS_DELTA, BuildParams, SearchParams
from .progress import Progress, run_reporting

logger = logging.getLogger(__name__)  # under "torch_grnnd"

Metric = str  # "l2" (squared Euclidean) | "ip" (negative inner product) | "cosine" (1 - cosine similarity)


def build(data: Tensor, params: Optional[BuildParams] = None, *, metric: Metric = "l2", progress: Progress = False,
          init: Optional[Tensor] = None, init_split: int = 0, init_mode: str = "merge", **settings: Any) -> Tensor:
    """The build op on ``data``'s device: :func:`torch_grnnd.build` without its ``device`` and
    ``max_gpu_memory`` (the builds in shards of :mod:`torch_grnnd.out_of_core` call this)."""
    p = BuildParams.merge(params, **settings)
    code_rows, code_scale = None, 0.0
    if _builds_on_pair_codes(p, data, metric, from_scratch=init is None):
        code_rows, code_scale = pair_codes(data, metric)
    delta = p.delta if p.delta is not None else (CODES_DELTA if code_rows is not None else ROWS_DELTA)

    def run() -> Tensor:
        return torch.ops.grnnd.build.default(
            data, degree=p.degree, initial_degree=p.initial_degree, pool_size=p.pool_size,
            outer_iters=p.outer_iters, inner_iters=p.inner_iters, reverse_ratio=p.reverse_ratio,
            update_order=p.update_order, metric=metric, seed=p.seed, delta=delta, start=p.start, init=init,
            init_split=init_split, init_mode=init_mode, pair_code_rows=code_rows, pair_code_scale=code_scale,
            widen=p.widen)

    if not torch.compiler.is_compiling():  # a compiled graph cannot hold a host-side log call
        logger.debug("build: %s %s on %s, metric=%s, pairs compared on the %s, %s", tuple(data.shape), data.dtype,
                     data.device, metric, "rows" if code_rows is None else "pair codes", p)
    return run_reporting(progress, "build" if code_rows is None else "build on pair codes", run)


def _builds_on_pair_codes(p: BuildParams, data: Tensor, metric: Metric, from_scratch: bool = True) -> bool:
    """``p.pair_codes``, or where it is None (the default) whether the codes pay for this build:
    a build from scratch of floating rows of at least ``PAIR_CODES_MIN_DIM`` dimensions under a
    metric the codes serve, outside torch.compile, and on a GPU, free memory for the codes and
    the pools (``BuildParams.pair_codes``)."""
    if p.pair_codes is not None and not isinstance(p.pair_codes, bool):
        raise TypeError(f"pair_codes: expected True, False or None, got {p.pair_codes!r}")
    codable = isinstance(data, Tensor) and data.dim() == 2 and data.is_floating_point()
    if p.pair_codes is not None or not codable:
        # pair_codes checks the metric; rows the codes cannot be made of are the op's to refuse
        return bool(p.pair_codes) and codable
    # Builds from ``init`` (adds, merges) would encode every row for the rounds of a few: not
    # measured, so they keep the rows unless asked.
    if not from_scratch or data.shape[1] < PAIR_CODES_MIN_DIM or metric not in PAIR_CODE_METRICS:
        return False
    # A compiled graph keeps the rows: the codes' step is a host value read off the rows' range, a
    # break in the graph (and it cannot ask the allocator what is free either).
    if torch.compiler.is_compiling():
        return False
    if data.is_cuda:
        n, dim = data.shape
        needed = build_extra_bytes(n, dim, data.element_size(), p.replace(pair_codes=True), metric)
        free = free_bytes(data.device)
        if needed > free:
            logger.info("build: %d x %d rows compared on the rows, not pair codes: the build with codes needs "
                        "%.1f GiB, %.1f GiB free", n, dim, needed / 2**30, free / 2**30)
            return False
    return True


def _search_arguments(params: Optional[SearchParams], k: Optional[int], settings: dict, codes: Optional[Codes],
                      metric: Metric) -> tuple:
    p = SearchParams.merge(params, k=k, **settings)
    kwargs = dict(list_size=p.list_size, search_width=p.search_width, max_iters=p.max_iters, seed=p.seed,
                  filter=p.filter, searches=p.searches, hub_entries=p.hub_entries)
    if codes is not None:
        if not isinstance(codes, Codes):
            raise TypeError(f"codes: expected torch_grnnd.Codes (torch_grnnd.encode), got {type(codes).__name__}")
        if codes.metric != metric:
            raise ValueError(f"codes: made for metric {codes.metric!r}, but the search uses {metric!r}")
        kwargs.update(codes=codes.rows, code_grid=codes.grid)
    return p.k, kwargs


def search(data: Tensor, graph: Tensor, queries: Tensor, k: Optional[int] = None, *,
           params: Optional[SearchParams] = None, metric: Metric = "l2", codes: Optional[Codes] = None,
           **settings: Any) -> Tuple[Tensor, Tensor]:
    """Approximate k nearest neighbours of each query by greedy search over ``graph``.

    The settings (list size, width, iterations, independent searches, seed, filter) and how
    they trade recall for speed are those of :class:`~torch_grnnd.SearchParams`.

    Args:
        data, graph: the vectors and the graph ``build`` made of them.
        queries: [Q, D], same dtype family and device as ``data``; on a GPU, ``data`` may
            instead lie in pinned host memory (``data.pin_memory()``), read row by row through
            unified addressing: an index larger than the GPU's memory (``graph`` on the GPU).
        k: neighbours returned per query (overrides ``params.k``; 10 when neither is given).
        params: the search settings, :class:`~torch_grnnd.SearchParams`.
        metric: must be the metric the graph was built with.
        codes: the rows' compact codes (:func:`torch_grnnd.encode`, same metric), on the
            queries' device: the walk computes its distances from them, reading an eighth to
            half the bytes, and its final list is re-ranked by exact distances to ``data``'s
            rows (which may then lie in pinned host memory: only the list's rows are read).
        **settings: any field of :class:`~torch_grnnd.SearchParams` (``list_size=128``, ...),
            overriding ``params``.

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
    k, kwargs = _search_arguments(params, k, settings, codes, metric)
    return torch.ops.grnnd.search.default(data, graph, queries, k, metric=metric, **kwargs)


def search_distance_counts(data: Tensor, graph: Tensor, queries: Tensor, k: Optional[int] = None, *,
                           params: Optional[SearchParams] = None, metric: Metric = "l2",
                           codes: Optional[Codes] = None, **settings: Any) -> Tensor:
    """How many distances :func:`search` computes for each query (int32 [Q]), with the same arguments.

    Runs the same search and counts instead of returning results: the work behind a point on a
    recall/throughput curve. On CUDA a node the visited hash forgot and met again is counted
    each time it is computed; the CPU never forgets, so its counts can be slightly lower. With
    ``codes`` these are the walk's code distances; the re-rank adds one exact distance per entry
    of the final list.
    """
    k, kwargs = _search_arguments(params, k, settings, codes, metric)
    return torch.ops.grnnd.search_distance_counts.default(data, graph, queries, k, metric=metric, **kwargs)


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
    # dispatch already went to a single device (a meta tensor among CPU ones lands here). A
    # search (given a graph) on a GPU may read data rows from (pinned) host memory.
    host_rows = graph is not None and queries.device.type == "cuda" and data.device.type == "cpu"
    if queries.device != data.device and not host_rows:
        raise ValueError(f"data is on {data.device} but queries is on {queries.device}; move them to the same device")
    if graph is not None and graph.device != queries.device:
        raise ValueError(f"queries is on {queries.device} but graph is on {graph.device}; move them to the same device")
    q = queries.shape[0]
    return queries.new_empty((q, k), dtype=torch.float32), queries.new_empty((q, k), dtype=torch.int64)


# Fake kernels receive the arguments as the caller passed them (defaults not filled in).
@torch.library.register_fake("grnnd::build")
def _build_fake(data, *, degree=BuildParams.degree, pool_size=BuildParams.pool_size,
                outer_iters=BuildParams.outer_iters, delta=ROWS_DELTA, metric="l2", init=None, widen=BuildParams.widen,
                **_):
    p = BuildParams(degree=degree, pool_size=pool_size, outer_iters=outer_iters, delta=delta, widen=widen)
    width = degree
    if p.may_widen(metric, from_scratch=init is None) and p.wide_degree > degree:  # as the data decides
        width = torch.library.get_ctx().new_dynamic_size(min=degree, max=p.wide_degree)
    return data.new_empty((data.shape[0], width), dtype=torch.int32)


@torch.library.register_fake("grnnd::search")
def _search_fake(data, graph, queries, k, *_, **__):
    return _query_outputs(data, queries, k, graph)


@torch.library.register_fake("grnnd::search_distance_counts")
def _search_distance_counts_fake(data, graph, queries, k, *_, **__):
    _query_outputs(data, queries, k, graph)
    return queries.new_empty((queries.shape[0],), dtype=torch.int32)


@torch.library.register_fake("grnnd::connect")
def _connect_fake(data, graph, **_):
    return torch.empty_like(graph, memory_format=torch.contiguous_format)


@torch.library.register_fake("grnnd::fill")
def _fill_fake(data, graph, **_):
    return torch.empty_like(graph, memory_format=torch.contiguous_format)


@torch.library.register_fake("grnnd::gather_rows")
def _gather_rows_fake(data, ids):
    return torch.empty((ids.shape[0], data.shape[1]), dtype=data.dtype, device=ids.device)


@torch.library.register_fake("grnnd::hub_ids")
def _hub_ids_fake(data):
    return data.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64)


@torch.library.register_fake("grnnd::nearest_hubs")
def _nearest_hubs_fake(data, queries, k, metric="l2"):
    return queries.new_empty((queries.shape[0], torch.library.get_ctx().new_dynamic_size()), dtype=torch.int64)


@torch.library.register_fake("grnnd::knn")
def _knn_fake(data, queries, k, **_):
    return _query_outputs(data, queries, k)


@torch.library.register_fake("grnnd::knn_graph")
def _knn_graph_fake(data, k, **_):
    return _query_outputs(data, data, k)


@torch.library.register_fake("grnnd::knn_segments")
def _knn_segments_fake(x, y, ptr_x, batch_y, k, method="auto", *, batch_x=None, examples=-1):
    return _query_outputs(x, y, k)


@torch.library.register_fake("grnnd::segment_edges")
def _segment_edges_fake(dists, ids, **_):
    return ids.new_empty((2, torch.library.get_ctx().new_dynamic_size()))


@torch.library.register_fake("grnnd::prune_rows")
def _prune_rows_fake(data, vertices, candidates, degree, **_):
    return data.new_empty((vertices.shape[0], degree), dtype=torch.int32)
