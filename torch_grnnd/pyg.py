"""torch_cluster's k-NN and radius API, for PyTorch Geometric models.

``from torch_grnnd.pyg import knn_graph`` replaces ``from torch_cluster import knn_graph`` (and
``torch_grnnd.pyg.KNNGraph`` PyG's ``transforms.KNNGraph``): the
same arguments in the same order with the same defaults, and the same edges. Examples are
batched as PyG batches them (a sorted ``batch`` vector); every example of a batch is searched in
one call of ``torch.ops.grnnd.knn_segments`` (one kernel launch on a GPU, which finds each
query's rows in the batch vector itself), exactly, each query
among the rows of its own example only, and the edges come out of one call of
``torch.ops.grnnd.segment_edges``. Passing ``batch_size`` (the number of examples) spares
the host synchronisation that reading it from ``batch`` costs, and with it the check that ``batch``
is sorted (an unsorted one raises a ValueError otherwise). Points of up to three coordinates
in examples of a few hundred points or more are found through a uniform grid (the cells around
each query, ring after ring, until no unvisited cell can hold a nearer point; ``csrc/grid.h``):
the same neighbours as the scan of every row, at one more host synchronisation (the bounding
box).

Semantics, as torch_cluster's:
  - ``knn(x, y, k)`` returns ``[2, E]`` with row 0 the index into ``y`` and row 1 the index into
    ``x``, each query's neighbours nearest first (ties to the lower index); an example with fewer
    than ``k`` rows gives all it has, an empty example none, empty input an empty ``[2, 0]``.
  - ``knn_graph(x, k, loop=False)`` asks ``knn`` for ``k + 1`` neighbours of every point and drops
    the self edges, so each point keeps ``k`` neighbours (a duplicate point may keep ``k + 1``);
    with ``loop=True`` the point counts among its own ``k`` nearest. ``flow="source_to_target"``
    puts the neighbour in row 0 and the point in row 1.
  - ``radius(x, y, r)`` links each query to the rows of its example within distance ``r``
    (squared distance < ``r * r``), at most ``max_num_neighbors`` of them: here the nearest ones.
    torch_cluster's CUDA kernel keeps the first ones in row order instead, so when an example has
    more than ``max_num_neighbors`` rows within ``r`` the two may keep different ones.
  - ``cosine=True`` ranks by ``1 - cosine similarity``; ``num_workers`` is accepted and unused (the
    CPU kernel uses torch's threads).

Beyond torch_cluster (keyword-only): ``return_distances=True`` also returns each edge's distance
(squared l2, or 1 - cosine), differentiable with respect to ``x`` and ``y``; ``approximate=True``
answers each example from a GRNND graph (``build`` + ``search``) instead of exactly, one example
after another.

Example:
    >>> import torch
    >>> from torch_grnnd.pyg import knn, knn_graph
    >>> x = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0]])
    >>> batch = torch.tensor([0, 0, 0, 1, 1])
    >>> knn_graph(x, 1, batch).tolist()           # each point's nearest other point of its example
    [[1, 0, 1, 4, 3], [0, 1, 2, 3, 4]]
    >>> knn(x, torch.tensor([[2.9]]), 2).tolist() # row 0 indexes y, row 1 indexes x
    [[0, 0], [2, 1]]
"""
import copy
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops

EdgeIndex = Union[Tensor, Tuple[Tensor, Tensor]]


def knn(x: Tensor, y: Tensor, k: int, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None,
        cosine: bool = False, num_workers: int = 1, batch_size: Optional[int] = None, *,
        approximate: bool = False, return_distances: bool = False) -> EdgeIndex:
    """For each row of ``y``, its ``k`` nearest rows of ``x`` in the same example: ``[2, E]``,
    row 0 indexing ``y``, row 1 indexing ``x``. See the module docstring for the semantics."""
    x, y, found = _knn_found(x, y, k, batch_x, batch_y, cosine, batch_size, approximate)
    edge_index = _edge_index(x, found)
    return _edges(x, y, edge_index, cosine, return_distances)


def knn_graph(x: Tensor, k: int, batch: Optional[Tensor] = None, loop: bool = False,
              flow: str = "source_to_target", cosine: bool = False, num_workers: int = 1,
              batch_size: Optional[int] = None, *, approximate: bool = False,
              return_distances: bool = False) -> EdgeIndex:
    """The k-NN graph of the rows of ``x``, each example on its own: ``[2, E]``. With
    ``flow="source_to_target"`` row 0 holds the neighbour and row 1 the point."""
    _check_flow(flow)
    x, _, found = _knn_found(x, x, k if loop else k + 1, batch, batch, cosine, batch_size, approximate)
    edge_index = _edge_index(x, found, drop_self=not loop, neighbour_first=flow == "source_to_target")
    return _edges(x, x, edge_index, cosine, return_distances, flow)


def radius(x: Tensor, y: Tensor, r: float, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None,
           max_num_neighbors: int = 32, num_workers: int = 1, batch_size: Optional[int] = None, *,
           return_distances: bool = False) -> EdgeIndex:
    """For each row of ``y``, the rows of ``x`` of its example within distance ``r`` (at most
    ``max_num_neighbors``, the nearest): ``[2, E]``, row 0 indexing ``y``, row 1 ``x``."""
    x, y, found = _within(x, y, r, batch_x, batch_y, max_num_neighbors, batch_size)
    edge_index = _edge_index(x, found, max_distance=r * r)
    return _edges(x, y, edge_index, False, return_distances)


def radius_graph(x: Tensor, r: float, batch: Optional[Tensor] = None, loop: bool = False,
                 max_num_neighbors: int = 32, flow: str = "source_to_target", num_workers: int = 1,
                 batch_size: Optional[int] = None, *, return_distances: bool = False) -> EdgeIndex:
    """The graph linking the rows of ``x`` closer than ``r``, each example on its own: ``[2, E]``."""
    _check_flow(flow)
    x, _, found = _within(x, x, r, batch, batch, max_num_neighbors if loop else max_num_neighbors + 1, batch_size)
    edge_index = _edge_index(x, found, max_distance=r * r, drop_self=not loop,
                             neighbour_first=flow == "source_to_target")
    return _edges(x, x, edge_index, False, return_distances, flow)


class KNNGraph:
    """PyTorch Geometric's ``transforms.KNNGraph``: sets ``data.edge_index`` to the k-NN graph of
    ``data.pos`` (each example of ``data.batch`` on its own) and drops ``data.edge_attr``.

    The same arguments as PyG's transform, plus ``approximate`` (keyword-only). With
    ``force_undirected=True`` every edge also appears reversed, each once, sorted by source and
    then target as PyG's ``to_undirected`` leaves them. Works on ``torch_geometric.data.Data``
    and on any object with those attributes; the input is copied (shallowly), not changed.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from torch_grnnd.pyg import KNNGraph
        >>> data = SimpleNamespace(pos=torch.tensor([[0.0], [1.0], [3.0]]), edge_attr=None)
        >>> KNNGraph(k=1)(data).edge_index.tolist()
        [[1, 0, 1], [0, 1, 2]]
        >>> KNNGraph(k=1, force_undirected=True)(data).edge_index.tolist()
        [[0, 1, 1, 2], [1, 0, 2, 1]]
    """

    def __init__(self, k: int = 6, loop: bool = False, force_undirected: bool = False,
                 flow: str = "source_to_target", cosine: bool = False, num_workers: int = 1, *,
                 approximate: bool = False):
        _check_flow(flow)
        self.k, self.loop, self.force_undirected, self.flow = k, loop, force_undirected, flow
        self.cosine, self.num_workers, self.approximate = cosine, num_workers, approximate

    def __call__(self, data: Any) -> Any:
        data = copy.copy(data)
        data.edge_attr = None
        batch = getattr(data, "batch", None)
        edge_index = knn_graph(data.pos, self.k, batch, loop=self.loop, flow=self.flow, cosine=self.cosine,
                               num_workers=self.num_workers, approximate=self.approximate)
        if self.force_undirected:
            edge_index = _to_undirected(edge_index, data.pos.shape[0])
        data.edge_index = edge_index
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k})"


def _to_undirected(edge_index: Tensor, nodes: int) -> Tensor:
    """Every edge in both directions, each once, sorted by (source, target)."""
    both = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    keys = torch.unique(both[0] * nodes + both[1])
    return torch.stack([keys // nodes, keys % nodes])


def _as_points(t: Tensor, name: str) -> Tensor:
    if t.dim() == 1:
        t = t.view(-1, 1)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 1-D or 2-D tensor, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    return t


def _knn_found(x: Tensor, y: Tensor, k: int, batch_x: Optional[Tensor], batch_y: Optional[Tensor], cosine: bool,
               batch_size: Optional[int], approximate: bool
               ) -> Tuple[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """``x`` and ``y`` as points, and the (distances, ids) [len(y), k] of each query's nearest rows
    of its example (-1 where it has fewer), or None when either set has no rows."""
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    x, y, segments = _segments(x, y, batch_x, batch_y, batch_size)
    if segments is None:
        return x, y, None
    xs = _search_space(x, cosine)
    ys = xs if y is x else _search_space(y, cosine)  # knn_graph: one conversion
    if approximate:
        return x, y, _approximate(xs, ys, segments, k)
    return x, y, _nearest(xs, ys, segments, k)


def _within(x: Tensor, y: Tensor, r: float, batch_x: Optional[Tensor], batch_y: Optional[Tensor],
            max_num_neighbors: int, batch_size: Optional[int]
            ) -> Tuple[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """``x`` and ``y`` as points, and the (squared distances, ids) [len(y), max_num_neighbors] of
    each query's nearest rows of its example; None when either set has no rows."""
    if not r >= 0:
        raise ValueError(f"r: expected >= 0, got {r}")
    if max_num_neighbors < 1:
        raise ValueError(f"max_num_neighbors: expected >= 1, got {max_num_neighbors}")
    x, y, segments = _segments(x, y, batch_x, batch_y, batch_size)
    if segments is None:
        return x, y, None
    xs = _search_space(x, False)
    return x, y, _nearest(xs, xs if y is x else _search_space(y, False), segments, max_num_neighbors)


def _check_flow(flow: str) -> None:
    if flow not in ("source_to_target", "target_to_source"):
        raise ValueError(f'flow: expected "source_to_target" or "target_to_source", got {flow!r}')


def _edge_index(x: Tensor, found: Optional[Tuple[Tensor, Tensor]], **edge_filter) -> Tensor:
    """segment_edges of knn_segments' (distances, ids), with its filter; an empty [2, 0] when
    there were no rows to search."""
    if found is None:
        return torch.empty(2, 0, dtype=torch.long, device=x.device)
    return torch.ops.grnnd.segment_edges.default(*found, **edge_filter)


# Where knn_segments finds each example: (batch_x [len(x)] or None for one example, batch_y
# [len(y)], the number of examples).
Segments = Tuple[Optional[Tensor], Tensor, int]


def _segments(x: Tensor, y: Tensor, batch_x: Optional[Tensor], batch_y: Optional[Tensor],
              batch_size: Optional[int]) -> Tuple[Tensor, Tensor, Optional[Segments]]:
    """``x`` and ``y`` as [n, dim] points, and their examples for knn_segments, or None when ``x``
    or ``y`` has no rows (no edges)."""
    x, y = _as_points(x, "x"), _as_points(y, "y")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"y: expected dim {x.shape[1]} to match x, got {y.shape[1]}")
    for name, batch, points in (("batch_x", batch_x, x), ("batch_y", batch_y, y)):
        if batch is not None and (batch.dim() != 1 or batch.shape[0] != points.shape[0]):
            raise ValueError(f"{name}: expected shape [{points.shape[0]}] (one example index per row), "
                             f"got {tuple(batch.shape)}")
    if x.shape[0] == 0 or y.shape[0] == 0:
        return x, y, None
    if batch_size is None:  # reading it costs a host synchronisation per batch vector
        batch_size = 1
        for name, batch in (("batch_x", batch_x), ("batch_y", batch_y)):
            if batch is not None:
                # The same synchronisation tells whether x's examples are sorted, as torch_cluster
                # requires: each example's rows are found by binary search in batch_x, so an
                # unsorted one would give wrong edges. (y's rows may come in any order.)
                largest, descents = torch.stack([batch.max().long(), (batch[1:] < batch[:-1]).sum()]).tolist()
                if name == "batch_x" and descents:
                    raise ValueError("batch_x: expected examples in ascending order (a sorted batch vector, as "
                                     f"torch_cluster and PyG's batches have), found {descents} descents; sort the "
                                     "points by example first (torch.sort(batch, stable=True))")
                batch_size = max(batch_size, largest + 1)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if batch_size > 1 and (batch_x is None or batch_y is None):
        raise ValueError("batch_x, batch_y: both are needed when there is more than one example")
    if batch_y is None:
        batch_y = torch.zeros(y.shape[0], dtype=torch.long, device=y.device)
    return x, y, (None if batch_x is None else _as_long(batch_x), _as_long(batch_y), batch_size)


def _nearest(xs: Tensor, ys: Tensor, segments: Segments, k: int) -> Tuple[Tensor, Tensor]:
    """knn_segments' (distances, ids) [len(y), k]. x's examples go to it as the batch vector they
    come as: on a GPU the kernel finds each example's rows in it, and no ptr is made first (the
    launches and host time of two more torch calls, before the one kernel that matters)."""
    batch_x, batch_y, examples = segments
    if batch_x is None:
        ptr_x = torch.tensor([0, xs.shape[0]], device=xs.device)
        return torch.ops.grnnd.knn_segments.default(xs, ys, ptr_x, batch_y, k)
    return torch.ops.grnnd.knn_segments.default(xs, ys, None, batch_y, k, batch_x=batch_x, examples=examples)


# The conversions below are skipped when there is nothing to convert: each torch call costs
# microseconds of host time, which a k-NN graph of a batch of small clouds on a GPU
# (a fraction of a millisecond of kernels) shows.
def _as_long(batch: Tensor) -> Tensor:
    return batch if batch.dtype == torch.long else batch.long()


def _search_space(points: Tensor, cosine: bool) -> Tensor:
    if points.dtype != torch.float32:
        points = points.float()
    if cosine:  # on unit rows |a - b|^2 = 2 (1 - cos): the same order as 1 - cos
        points = torch.nn.functional.normalize(points, dim=1)
    return points if points.is_contiguous() else points.contiguous()


def _approximate(xs: Tensor, ys: Tensor, segments: Segments, k: int) -> Tuple[Tensor, Tensor]:
    """knn_segments' (distances, ids) [len(y), k] from a GRNND graph of each example (one after
    another)."""
    batch_x, batch_y, examples = segments
    dists = torch.full((ys.shape[0], k), float("inf"), device=ys.device)
    ids = torch.full((ys.shape[0], k), -1, dtype=torch.long, device=ys.device)
    if batch_x is None:
        bounds = [0, xs.shape[0]]
    else:
        bounds = torch.searchsorted(batch_x, torch.arange(examples + 1, device=xs.device)).tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        queries = (batch_y == b).nonzero().flatten()
        if end == start or queries.numel() == 0:
            continue
        rows = xs[start:end]
        take = min(k, end - start)
        found_dists, found = ops.search(rows, ops.build(rows), ys[queries], take, list_size=max(64, take))
        dists[queries, :take] = found_dists
        ids[queries, :take] = torch.where(found >= 0, found + start, found)
    return dists, ids


def _edges(x: Tensor, y: Tensor, edge_index: Tensor, cosine: bool, return_distances: bool,
           flow: str = "target_to_source") -> EdgeIndex:
    """The edges as returned (for a graph with flow="source_to_target" the row comes first, else
    the query); with return_distances, each edge's distance too."""
    if not return_distances:
        return edge_index
    query, row = (edge_index[1], edge_index[0]) if flow == "source_to_target" else (edge_index[0], edge_index[1])
    a, b = y[query].float(), x[row].float()
    if cosine:
        dists = 1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)
    else:
        dists = (a - b).pow(2).sum(-1)
    return edge_index, dists
