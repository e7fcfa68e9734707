"""k-NN graphs of point sets in the PyTorch Geometric convention."""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .ops import Metric
from .progress import Progress, run_reporting
from .segments import as_points, distances, examples_of, nearest, search_space


def knn_graph(
    x: Tensor,
    k: int,
    batch: Optional[Tensor] = None,
    *,
    metric: Metric = "l2",
    exact: bool = False,
    loop: bool = False,
    flow: str = "source_to_target",
    list_size: int = 0,
    seed: int = 0,
    return_distances: bool = False,
    progress: Progress = False,
    batch_size: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``edge_index`` [2, N * k] linking each row of ``x`` to its k nearest other rows.

    Approximate by default (a GRNND graph, then a graph search from every row); ``exact=True``
    uses exact k-NN. Follows ``torch_cluster.knn_graph``: with ``flow="source_to_target"``
    edges run from each neighbour (row 0) to the point it is a neighbour of (row 1), with
    ``loop=True`` the point counts as one of its own k nearest (its self loop and k - 1 others),
    and with ``batch`` every example gets its own graph (ids stay global, no edge joins two
    examples). An example with too few points gives each point all the others it has, so the
    graph has fewer than N * k edges.

    Args:
        x: [N, D] points.
        k: edges per point.
        batch: optional int64 [N], the example of each point, sorted (PyG's convention; an
            unsorted one raises a ValueError). The whole batch is searched as
            :func:`torch_grnnd.pyg.knn_graph` searches it (:mod:`torch_grnnd.segments`): under l2
            and cosine by one call of the segment kernel, exactly, unless an approximate graph
            is asked of examples larger than ``segments.EXACT_EXAMPLE_ROWS`` (4 096 rows), which
            are then built one after the other; under ip each example on its own, by the same
            rule. Reading the number of examples costs one host synchronisation (and ends a
            ``torch.compile`` graph) unless ``batch_size`` is given.
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        exact: exact instead of approximate neighbours.
        loop: the self loop is one of each point's k edges (in 0.1.0 it came on top of k).
        flow: ``"source_to_target"`` or ``"target_to_source"``.
        list_size: search list for the approximate path (0 = max(k + 1, 64)).
        seed: seeds the build and the search.
        return_distances: also return the distance of every edge, [E] float32 in the order of
            the edges, differentiable with respect to ``x``.
        progress: reports the build(s), as in :func:`torch_grnnd.build`.
        batch_size: the number of examples, when ``batch`` is given (torch_cluster's argument):
            spares the host synchronisation that reads it, and with it the check that ``batch``
            is sorted on a GPU (a batch vector on the CPU is checked all the same).

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> edge_index = grnnd.knn_graph(torch.randn(500, 8), k=6)
        >>> edge_index.shape
        torch.Size([2, 3000])
        >>> batch = torch.tensor([0] * 200 + [1] * 300)
        >>> edge_index, dists = grnnd.knn_graph(torch.randn(500, 8), k=6, batch=batch, return_distances=True)
        >>> bool((batch[edge_index[0]] == batch[edge_index[1]]).all()), dists.shape
        (True, torch.Size([3000]))
    """
    check_flow(flow)
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    others = k - 1 if loop else k  # neighbours per point besides the point itself

    def all_edges() -> Tuple[Tensor, Optional[Tensor]]:
        if batch is not None:
            return _batch_edges(x, batch, others, metric, exact, loop, flow, list_size, seed, return_distances,
                                batch_size)
        neighbour, centre, dists = _graph_edges(x, others, metric, exact, loop, list_size, seed)
        return torch.stack([neighbour, centre] if flow == "source_to_target" else [centre, neighbour]), dists

    edge_index, dists = run_reporting(progress, "knn_graph", all_edges)
    return (edge_index, dists) if return_distances else edge_index


def _graph_edges(x: Tensor, others: int, metric: Metric, exact: bool, loop: bool, list_size: int,
                 seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(neighbour, centre, distance) of the edges of one example, each point's nearest first, by
    the knn_graph op (which torch.compile traces whole)."""
    n = x.shape[0]
    take = min(others, n - 1)
    if take > 0:
        dists, ids = torch.ops.grnnd.knn_graph.default(x, take, metric=metric, exact=exact, list_size=list_size,
                                                       seed=seed)
    else:
        dists = x.new_zeros(n, 0, dtype=torch.float32)
        ids = torch.zeros(n, 0, dtype=torch.long, device=x.device)
    centre = torch.arange(n, device=ids.device).unsqueeze(1)
    if loop:
        ids = torch.cat([centre, ids], dim=1)
        dists = torch.cat([_self_distance(x, metric).unsqueeze(1), dists], dim=1)
    return ids.reshape(-1), centre.expand_as(ids).reshape(-1), dists.reshape(-1)


def _batch_edges(x: Tensor, batch: Tensor, others: int, metric: Metric, exact: bool, loop: bool, flow: str,
                 list_size: int, seed: int, return_distances: bool,
                 batch_size: Optional[int]) -> Tuple[Tensor, Optional[Tensor]]:
    """The edge index of every point's ``others`` nearest other points of its example (and itself
    first with ``loop``), the whole batch searched at once (:func:`torch_grnnd.segments.nearest`,
    as :mod:`torch_grnnd.pyg` searches it) and its edges made by one segment_edges call; with
    ``return_distances`` their distances recomputed from ``x`` (so that they carry gradients),
    else None."""
    x = as_points(x, "x")
    n = x.shape[0]
    segments = examples_of(x, x, batch, batch, batch_size, names=("batch", "batch"))
    if others > 0 and segments is not None:
        points = search_space(x, metric)
        dists, ids = nearest(points, points, segments, others + 1, metric=metric, approximate=not exact,
                             list_size=list_size, seed=seed)
    else:
        dists, ids = x.new_zeros(n, 0, dtype=torch.float32), torch.zeros(n, 0, dtype=torch.long, device=x.device)
    # segment_edges drops the point's own id and entries -1 (examples with fewer rows) and keeps
    # each point's first `others`: k others whatever the duplicates (where duplicates kept the
    # point out of its k + 1 nearest, its farthest goes; torch_cluster's rule, pyg's, keeps k + 1
    # then). Each point's edges together, nearest first.
    source_to_target = flow == "source_to_target"
    if loop:  # the point first, then its others: its own id is dropped where the search found it
        centre = torch.arange(n, device=x.device)[:, None]
        ids = torch.cat([centre, ids.masked_fill(ids == centre, -1)], dim=1)
        dists = torch.cat([dists.new_zeros(n, 1), dists], dim=1)  # segment_edges reads them only to filter
    edge_index = torch.ops.grnnd.segment_edges.default(dists, ids, drop_self=not loop,
                                                       neighbour_first=source_to_target, most=others + loop)
    if not return_distances:
        return edge_index, None
    neighbour, point = (edge_index[0], edge_index[1]) if source_to_target else (edge_index[1], edge_index[0])
    return edge_index, distances(x[neighbour], x[point], metric)


def check_flow(flow: str) -> None:
    if flow not in ("source_to_target", "target_to_source"):
        raise ValueError(f'flow: expected "source_to_target" or "target_to_source", got {flow!r}')


def _self_distance(x: Tensor, metric: Metric) -> Tensor:
    """Distance of each row to itself, as the kernels report it (float32)."""
    if metric == "ip":
        return -x.float().pow(2).sum(1)
    return x.new_zeros(x.shape[0], dtype=torch.float32)
