"""torch_cluster's k-NN and radius API, for PyTorch Geometric models.

``from torch_grnnd.pyg import knn_graph`` replaces ``from torch_cluster import knn_graph`` (and
``torch_grnnd.pyg.KNNGraph`` PyG's ``transforms.KNNGraph``): the
same arguments in the same order with the same defaults, and the same edges. Examples are
batched as PyG batches them (a sorted ``batch`` vector); every example of a batch is searched in
one call of ``torch.ops.grnnd.knn_segments`` (one kernel launch on a GPU, which finds each
query's rows in the batch vector itself), exactly, each query
among the rows of its own example only (:mod:`torch_grnnd.segments`, the path
:func:`torch_grnnd.knn_graph` takes too), and the edges come out of one call of
``torch.ops.grnnd.segment_edges``. Reading the number of examples from ``batch`` costs a host
synchronisation, which also checks that ``batch`` is sorted (an unsorted one raises a
ValueError). Passing ``batch_size`` (the number of examples) spares it; a batch vector on a GPU
is then trusted to be sorted (on the CPU it is checked all the same). Points of up to three
coordinates in examples of a few hundred points or more are found through a uniform grid (the
cells around each query, ring after ring, until no unvisited cell can hold a nearer point;
``csrc/pyg/grid.h``): the same neighbours as the scan of every row, at one more host
synchronisation (the bounding box).

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
answers each example from a GRNND graph (``build`` + ``search``), one example after another, where
some example has more than ``segments.EXACT_EXAMPLE_ROWS`` (4 096) rows, and exactly otherwise
(the exact scan of such examples costs less than their builds), as :func:`torch_grnnd.knn_graph`.

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

from . import nn
from .graph import check_flow
from .segments import Segments, as_points, distances, examples_of, nearest, search_space

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
    check_flow(flow)
    x, _, found = _knn_found(x, x, k if loop else k + 1, batch, batch, cosine, batch_size, approximate,
                             names=("batch", "batch"))
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
    check_flow(flow)
    x, _, found = _within(x, x, r, batch, batch, max_num_neighbors if loop else max_num_neighbors + 1, batch_size,
                          names=("batch", "batch"))
    edge_index = _edge_index(x, found, max_distance=r * r, drop_self=not loop,
                             neighbour_first=flow == "source_to_target")
    return _edges(x, x, edge_index, False, return_distances, flow)


class KNNGraph(nn.KNNGraph):
    """PyTorch Geometric's ``transforms.KNNGraph``: sets ``data.edge_index`` to the k-NN graph of
    ``data.pos`` (each example of ``data.batch`` on its own) and drops ``data.edge_attr``.

    :class:`torch_grnnd.nn.KNNGraph` with PyG's arguments (the same, in the same order, with the
    same defaults, plus ``approximate``, keyword-only), called on a data object instead of tensors,
    and with torch_cluster's edges (:func:`knn_graph` here: exact unless ``approximate``, a
    duplicate point may keep k + 1 neighbours). With ``force_undirected=True`` every edge also
    appears reversed, each once, sorted by source and then target as PyG's ``to_undirected``
    leaves them. Works on ``torch_geometric.data.Data`` and on any object with those attributes;
    the input is copied (shallowly), not changed.

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
        super().__init__(k, metric="cosine" if cosine else "l2", exact=not approximate, loop=loop, flow=flow)
        self.force_undirected, self.num_workers = force_undirected, num_workers

    # PyG's names for the settings the module holds as metric and exact.
    @property
    def cosine(self) -> bool:
        return self.metric == "cosine"

    @cosine.setter
    def cosine(self, value: bool) -> None:
        self.metric = "cosine" if value else "l2"

    @property
    def approximate(self) -> bool:
        return not self.exact

    @approximate.setter
    def approximate(self, value: bool) -> None:
        self.exact = not value

    def forward(self, data: Any) -> Any:
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


def _knn_found(x: Tensor, y: Tensor, k: int, batch_x: Optional[Tensor], batch_y: Optional[Tensor], cosine: bool,
               batch_size: Optional[int], approximate: bool, names: Tuple[str, str] = ("batch_x", "batch_y")
               ) -> Tuple[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """``x`` and ``y`` as points, and the (distances, ids) [len(y), k] of each query's nearest rows
    of its example (-1 where it has fewer), or None when either set has no rows."""
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    x, y = _points(x, y)
    segments = _segments(x, y, batch_x, batch_y, batch_size, names)
    if segments is None:
        return x, y, None
    metric = "cosine" if cosine else "l2"
    xs = search_space(x, metric)
    ys = xs if y is x else search_space(y, metric)  # knn_graph: one conversion
    return x, y, nearest(xs, ys, segments, k, metric=metric, approximate=approximate)


def _within(x: Tensor, y: Tensor, r: float, batch_x: Optional[Tensor], batch_y: Optional[Tensor],
            max_num_neighbors: int, batch_size: Optional[int], names: Tuple[str, str] = ("batch_x", "batch_y")
            ) -> Tuple[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """``x`` and ``y`` as points, and the (squared distances, ids) [len(y), max_num_neighbors] of
    each query's nearest rows of its example; None when either set has no rows."""
    if not r >= 0:
        raise ValueError(f"r: expected >= 0, got {r}")
    if max_num_neighbors < 1:
        raise ValueError(f"max_num_neighbors: expected >= 1, got {max_num_neighbors}")
    x, y = _points(x, y)
    segments = _segments(x, y, batch_x, batch_y, batch_size, names)
    if segments is None:
        return x, y, None
    xs = search_space(x, "l2")
    return x, y, nearest(xs, xs if y is x else search_space(y, "l2"), segments, max_num_neighbors)


def _points(x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
    """``x`` and ``y`` as points; one tensor where they are one (a graph: searched as such)."""
    x, same = as_points(x, "x"), y is x
    return x, x if same else as_points(y, "y")


def _segments(x: Tensor, y: Tensor, batch_x: Optional[Tensor], batch_y: Optional[Tensor],
              batch_size: Optional[int], names: Tuple[str, str]) -> Optional[Segments]:
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"y: expected dim {x.shape[1]} to match x, got {y.shape[1]}")
    return examples_of(x, y, batch_x, batch_y, batch_size, names)


def _edge_index(x: Tensor, found: Optional[Tuple[Tensor, Tensor]], **edge_filter) -> Tensor:
    """segment_edges of knn_segments' (distances, ids), with its filter; an empty [2, 0] when
    there were no rows to search."""
    if found is None:
        return torch.empty(2, 0, dtype=torch.long, device=x.device)
    return torch.ops.grnnd.segment_edges.default(*found, **edge_filter)


def _edges(x: Tensor, y: Tensor, edge_index: Tensor, cosine: bool, return_distances: bool,
           flow: str = "target_to_source") -> EdgeIndex:
    """The edges as returned (for a graph with flow="source_to_target" the row comes first, else
    the query); with return_distances, each edge's distance too."""
    if not return_distances:
        return edge_index
    query, row = (edge_index[1], edge_index[0]) if flow == "source_to_target" else (edge_index[0], edge_index[1])
    return edge_index, distances(y[query], x[row], "cosine" if cosine else "l2")
