"""k-NN graphs of point sets in the PyTorch Geometric convention."""
import itertools
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .ops import Metric
from .progress import Progress, run_reporting
from .pyg import _nearest, _search_space
from .results import without_own

# A batch whose examples have at most this many rows is searched exactly by the segment kernel
# (torch.ops.grnnd.knn_segments, as torch_grnnd.pyg does: one call for the whole batch) even where
# an approximate graph is asked for: an exact scan of such an example costs less than a GRNND
# build and search of it, which ran one example after another.
EXACT_EXAMPLE_ROWS = 4096


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
        batch: optional int64 [N], the example of each point, sorted (PyG's convention). Under
            l2 and cosine, exact graphs, and any graph whose examples have at most
            ``EXACT_EXAMPLE_ROWS`` (4 096) rows, come from one call of the segment kernel for the
            whole batch (exact neighbours, as :func:`torch_grnnd.pyg.knn_graph`); otherwise the
            examples are built one after the other. Reading their sizes costs one host
            synchronisation (and ends a ``torch.compile`` graph).
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        exact: exact instead of approximate neighbours.
        loop: the self loop is one of each point's k edges (in 0.1.0 it came on top of k).
        flow: ``"source_to_target"`` or ``"target_to_source"``.
        list_size: search list for the approximate path (0 = max(k + 1, 64)).
        seed: seeds the build and the search.
        return_distances: also return the distance of every edge, [E] float32 in the order of
            the edges, differentiable with respect to ``x``.
        progress: reports the build(s), as in :func:`torch_grnnd.build`.

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
    if flow not in ("source_to_target", "target_to_source"):
        raise ValueError(f'flow: expected "source_to_target" or "target_to_source", got {flow!r}')
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    others = k - 1 if loop else k  # neighbours per point besides the point itself

    def example_edges(points: Tensor, start: int) -> Tuple[Tensor, Tensor, Tensor]:
        """(neighbour, centre, distance) of the edges of one example, each point's nearest first."""
        n = points.shape[0]
        take = min(others, n - 1)
        if take > 0:
            dists, ids = torch.ops.grnnd.knn_graph.default(points, take, metric=metric, exact=exact,
                                                           list_size=list_size, seed=seed)
        else:
            dists = points.new_zeros(n, 0, dtype=torch.float32)
            ids = torch.zeros(n, 0, dtype=torch.long, device=points.device)
        centre = torch.arange(n, device=ids.device).unsqueeze(1)
        if loop:
            ids = torch.cat([centre, ids], dim=1)
            dists = torch.cat([_self_distance(points, metric).unsqueeze(1), dists], dim=1)
        return ids.reshape(-1) + start, centre.expand_as(ids).reshape(-1) + start, dists.reshape(-1)

    def all_edges() -> Tuple[Tensor, Tensor, Tensor]:
        if batch is None:
            return example_edges(x, 0)
        rows = _example_rows(batch, x)
        if metric in ("l2", "cosine") and (exact or max(size for _, size in rows) <= EXACT_EXAMPLE_ROWS):
            return _segment_edges(x, batch, len(rows), others, metric, loop, return_distances)
        parts = [example_edges(x.narrow(0, start, size), start) for start, size in rows]
        return tuple(torch.cat(column) for column in zip(*parts))

    neighbour, centre, dists = run_reporting(progress, "knn_graph", all_edges)
    edge_index = torch.stack([neighbour, centre] if flow == "source_to_target" else [centre, neighbour])
    return (edge_index, dists) if return_distances else edge_index


def _segment_edges(x: Tensor, batch: Tensor, examples: int, others: int, metric: Metric, loop: bool,
                   distances: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(neighbour, centre, distance) of every point's ``others`` nearest other points of its
    example (and itself first with ``loop``), from one knn_segments call for the whole batch;
    with ``distances`` the distances recomputed from ``x`` (so that they carry gradients), else
    None."""
    n = x.shape[0]
    centre = torch.arange(n, device=x.device)
    if others > 0:
        points = _search_space(x, metric == "cosine")
        # Relabelled 0..examples-1 in order, so that empty example ids cost nothing.
        labels = torch.cat([batch.new_zeros(1), (batch[1:] != batch[:-1]).long()]).cumsum(0)
        # -1 where the example has no more rows.
        _, ids = without_own(*_nearest(points, points, (labels, labels, examples), others + 1), centre[:, None])
    else:
        ids = centre.new_zeros(n, 0)
    if loop:
        ids = torch.cat([centre[:, None], ids], dim=1)
    centres = centre[:, None].expand_as(ids)
    found = ids >= 0
    neighbour, centre = ids[found], centres[found]
    if not distances:
        return neighbour, centre, None
    a, b = x[neighbour].float(), x[centre].float()
    if metric == "cosine":
        dists = 1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)
    else:
        dists = (a - b).pow(2).sum(-1)
    return neighbour, centre, dists


def _example_rows(batch: Tensor, x: Tensor) -> List[Tuple[int, int]]:
    """``(first row, rows)`` of each example of a sorted ``batch`` vector."""
    if batch.dim() != 1 or batch.shape[0] != x.shape[0]:
        raise ValueError(f"batch: expected shape [{x.shape[0]}] (one example index per row of x), "
                         f"got {tuple(batch.shape)}")
    if batch.dtype.is_floating_point or batch.dtype.is_complex or batch.dtype == torch.bool:
        raise TypeError(f"batch: expected an integer tensor (int64), got {batch.dtype}")
    if batch.device != x.device:
        raise ValueError(f"batch is on {batch.device} but x is on {x.device}; move them to the same device")
    labels, sizes = torch.unique_consecutive(batch, return_counts=True)
    labels, sizes = torch.stack([labels.long(), sizes]).tolist()  # the one host synchronisation
    if any(later <= earlier for earlier, later in zip(labels, labels[1:])):
        raise ValueError("batch: expected example indices sorted in ascending order (PyG convention)")
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def _self_distance(x: Tensor, metric: Metric) -> Tensor:
    """Distance of each row to itself, as the kernels report it (float32)."""
    if metric == "ip":
        return -x.float().pow(2).sum(1)
    return x.new_zeros(x.shape[0], dtype=torch.float32)
