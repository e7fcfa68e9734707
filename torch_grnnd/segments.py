"""Batches of examples searched together, as PyTorch Geometric batches them.

The one path of every function that takes a batch vector (:func:`torch_grnnd.knn_graph`,
:class:`torch_grnnd.nn.KNNGraph`, and :mod:`torch_grnnd.pyg`'s ``knn``, ``knn_graph``, ``radius``,
``radius_graph`` and ``KNNGraph``): the batch vectors checked, the number of examples read in one
host synchronisation that also tells whether x's examples are sorted, then one call of
``torch.ops.grnnd.knn_segments`` for the whole batch (one kernel launch on a GPU, which finds each
query's rows in the batch vector itself), exact, each query among the rows of its own example.

Two cases take the examples one after another instead: an approximate search of examples larger
than :data:`EXACT_EXAMPLE_ROWS` (a GRNND build and search of each: the segment kernel is exact,
its scan's cost grows with the square of the example, and one graph over the whole batch would
link examples), and the ``"ip"`` metric, which the segment kernel does not rank by (it ranks by
squared l2: cosine's order on unit rows, but not inner product's in general).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .ops import Metric

#: An approximate search of a batch whose examples have at most this many rows is answered exactly
#: (by the segment kernel, or under ip by an exact search of each example): an exact scan of such
#: an example costs less than a GRNND build and search of it.
EXACT_EXAMPLE_ROWS = 4096

# Where knn_segments finds each example: (x's example per row, or None for one example; y's
# example per row; the number of examples).
Segments = Tuple[Optional[Tensor], Tensor, int]


def as_points(t: Tensor, name: str) -> Tensor:
    """``t`` as [n, dim] points (a 1-D tensor holds points of one coordinate)."""
    if t.dim() == 1:
        t = t.view(-1, 1)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 1-D or 2-D tensor, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    return t


def check_batch(batch: Tensor, points: Tensor, name: str, points_name: str) -> None:
    if batch.dim() != 1 or batch.shape[0] != points.shape[0]:
        raise ValueError(f"{name}: expected shape [{points.shape[0]}] (one example index per row of "
                         f"{points_name}), got {tuple(batch.shape)}")
    if batch.dtype.is_floating_point or batch.dtype.is_complex or batch.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int64), got {batch.dtype}")
    if batch.device != points.device:
        raise ValueError(f"{name} is on {batch.device} but {points_name} is on {points.device}; "
                         "move them to the same device")


def _unsorted(name: str, descents: int) -> ValueError:
    return ValueError(f"{name}: expected examples in ascending order (a sorted batch vector, as torch_cluster and "
                      f"PyG's batches have), found {descents} descents; sort the points by example first "
                      "(torch.sort(batch, stable=True))")


def examples_of(x: Tensor, y: Tensor, batch_x: Optional[Tensor], batch_y: Optional[Tensor],
                batch_size: Optional[int], names: Tuple[str, str] = ("batch_x", "batch_y")) -> Optional[Segments]:
    """The examples of the rows of ``x`` and ``y`` (points, see :func:`as_points`) for
    :func:`nearest`, or None when either has no rows. ``batch_y is batch_x``: one batch vector for both
    (a graph of ``x``). ``names`` are the arguments' names in error messages.

    Without ``batch_size`` the number of examples is read from the batch vectors (one host
    synchronisation), and with it whether x's examples are sorted: each example's rows are found
    by binary search in ``batch_x``, so an unsorted one would give wrong edges, and it raises
    instead (y's rows may come in any order). Given ``batch_size``, a batch vector on the CPU is
    checked all the same (no synchronisation there); one on a GPU is trusted, as checking it would
    cost the synchronisation ``batch_size`` spares."""
    shared = batch_y is batch_x  # one batch vector for both (a graph, or x's examples asked of themselves)
    for name, batch, points, points_name in ((names[0], batch_x, x, "x"), (names[1], batch_y, y, "y")):
        if batch is not None:
            check_batch(batch, points, name, points_name)
    if x.shape[0] == 0 or y.shape[0] == 0:
        return None
    batch_x = None if batch_x is None else _as_long(batch_x)
    batch_y = batch_x if shared else None if batch_y is None else _as_long(batch_y)
    if batch_size is None:
        batch_size = 1
        reads = []
        if batch_x is not None:
            steps = batch_x.diff()
            reads += [batch_x.max(), (steps < 0).sum(), (steps != 0).sum()]
        if batch_y is not None and not shared:
            reads.append(batch_y.max())
        values = torch.stack(reads).tolist() if reads else []  # the one host synchronisation
        if batch_x is not None:
            largest, descents, changes = values[:3]
            if descents:
                raise _unsorted(names[0], descents)
            batch_size = max(batch_size, largest + 1)
            if shared and largest != changes:
                # Example ids with gaps (or below 0): numbered 0, 1, ... in order, so that the
                # kernel's examples are the ones there are, whatever the ids.
                batch_x = batch_y = torch.cat([steps.new_zeros(1), (steps != 0).long()]).cumsum(0)
                batch_size = changes + 1
        if batch_y is not None and not shared:
            batch_size = max(batch_size, values[-1] + 1)
    elif batch_x is not None and batch_x.device.type == "cpu":
        descents = int((batch_x.diff() < 0).sum())
        if descents:
            raise _unsorted(names[0], descents)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if batch_size > 1 and (batch_x is None or batch_y is None):
        raise ValueError(f"{names[0]}, {names[1]}: both are needed when there is more than one example")
    if batch_y is None:
        batch_y = torch.zeros(y.shape[0], dtype=torch.long, device=y.device)
    return batch_x, batch_y, batch_size


# The conversions below are skipped when there is nothing to convert: each torch call costs
# microseconds of host time, which a k-NN graph of a batch of small clouds on a GPU
# (a fraction of a millisecond of kernels) shows.
def _as_long(batch: Tensor) -> Tensor:
    return batch if batch.dtype == torch.long else batch.long()


def search_space(points: Tensor, metric: Metric) -> Tensor:
    """The rows the search runs on: float32, contiguous, unit rows under cosine (on unit rows
    |a - b|^2 = 2 (1 - cos): the segment kernel's order is cosine's), detached (the distances
    returned with edges are recomputed from the points, see :func:`distances`)."""
    points = points.detach()
    if points.dtype != torch.float32:
        points = points.float()
    if metric == "cosine":
        points = torch.nn.functional.normalize(points, dim=1)
    return points if points.is_contiguous() else points.contiguous()


def nearest(xs: Tensor, ys: Tensor, segments: Segments, k: int, *, metric: Metric = "l2",
            approximate: bool = False, list_size: int = 0, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """(dists float32, ids int64) [len(y), k] of each query's k nearest rows of its example, nearest
    first, (inf, -1) padded where it has fewer; ``xs`` and ``ys`` from :func:`search_space`
    (``ys is xs`` for a graph). Exact, but for the examples of more than
    :data:`EXACT_EXAMPLE_ROWS` rows when ``approximate``, whose graphs' search takes ``list_size``
    (0: max(k, 64)) and ``seed``. The whole batch in one segment-kernel call, unless either those
    graphs or the ip metric make it example by example."""
    if metric != "ip" and not approximate:
        return _scan(xs, ys, segments, k)
    bounds = _bounds(xs, segments)  # a host synchronisation, on these paths only
    approximate = approximate and max(b - a for a, b in zip(bounds, bounds[1:])) > EXACT_EXAMPLE_ROWS
    if metric != "ip" and not approximate:
        return _scan(xs, ys, segments, k)
    return _one_by_one(xs, ys, segments, bounds, k, metric, approximate, list_size, seed)


def _scan(xs: Tensor, ys: Tensor, segments: Segments, k: int) -> Tuple[Tensor, Tensor]:
    """knn_segments' (distances, ids). x's examples go to it as the batch vector they come as: on
    a GPU the kernel finds each example's rows in it, and no ptr is made first (the launches and
    host time of two more torch calls, before the one kernel that matters)."""
    batch_x, batch_y, examples = segments
    if batch_x is None:
        ptr_x = torch.tensor([0, xs.shape[0]], device=xs.device)
        return torch.ops.grnnd.knn_segments.default(xs, ys, ptr_x, batch_y, k)
    return torch.ops.grnnd.knn_segments.default(xs, ys, None, batch_y, k, batch_x=batch_x, examples=examples)


def _bounds(xs: Tensor, segments: Segments) -> List[int]:
    """The first row of each example of x and the end of the last, read to the host."""
    batch_x, _, examples = segments
    if batch_x is None:
        return [0, xs.shape[0]]
    return torch.searchsorted(batch_x, torch.arange(examples + 1, device=xs.device)).tolist()


def _one_by_one(xs: Tensor, ys: Tensor, segments: Segments, bounds: List[int], k: int, metric: Metric,
                approximate: bool, list_size: int, seed: int) -> Tuple[Tensor, Tensor]:
    """:func:`nearest`'s results from a search of each example in turn: with ``approximate`` by a
    GRNND graph of its rows where it has more than :data:`EXACT_EXAMPLE_ROWS`, else exact."""
    batch_x, batch_y, _ = segments
    graph = ys is xs and batch_y is batch_x  # an example's queries are its rows
    dists = torch.full((ys.shape[0], k), float("inf"), device=ys.device)
    ids = torch.full((ys.shape[0], k), -1, dtype=torch.long, device=ys.device)
    for example, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end == start:
            continue
        where = slice(start, end) if graph else (batch_y == example).nonzero().flatten()
        queries = ys[where]
        if queries.shape[0] == 0:
            continue
        rows, take = xs[start:end], min(k, end - start)
        if approximate and end - start > EXACT_EXAMPLE_ROWS:
            found_dists, found = ops.search(rows, ops.build(rows, metric=metric, seed=seed), queries, take,
                                            metric=metric, list_size=max(list_size or 64, take), search_width=1,
                                            seed=seed)
        else:
            found_dists, found = ops.knn(rows, queries, take, metric=metric)
        dists[where, :take] = found_dists
        ids[where, :take] = torch.where(found >= 0, found + start, found)
    return dists, ids


def distances(a: Tensor, b: Tensor, metric: Metric) -> Tensor:
    """float32 distance of each pair of rows of ``a`` and ``b`` ([E, dim] each), in the library's
    convention (squared l2, 1 - cosine, or minus the inner product), differentiable with respect to
    both."""
    a, b = a.float(), b.float()
    if metric == "cosine":
        return 1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)
    if metric == "ip":
        return -(a * b).sum(-1)
    return (a - b).pow(2).sum(-1)
