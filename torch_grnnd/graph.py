"""k-NN graphs of point sets in the PyTorch Geometric convention."""
import itertools
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .ops import Metric
from .progress import Progress, run_reporting


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
    edges run from each neighbour (row 0) to the point it is a neighbour of (row 1), and with
    ``batch`` every example gets its own graph (ids stay global, no edge joins two examples).

    Args:
        x: [N, D] points.
        k: neighbours per point (excluding itself), ``k < N``, and with ``batch`` smaller
            than the smallest example.
        batch: optional int64 [N], the example of each point, sorted (PyG's convention). The
            examples are processed one after the other; reading their sizes costs one host
            synchronisation (and ends a ``torch.compile`` graph).
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        exact: exact instead of approximate neighbours.
        loop: also link every point to itself (k neighbours + the self loop per point).
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

    def neighbours(points: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.ops.grnnd.knn_graph.default(points, k, metric=metric, exact=exact, list_size=list_size,
                                                 seed=seed)

    def all_neighbours() -> Tuple[Tensor, Tensor]:
        if batch is None:
            return neighbours(x)
        parts = []
        for start, size in _example_rows(batch, x, k):
            dists, ids = neighbours(x.narrow(0, start, size))
            parts.append((dists, ids + start))
        return tuple(torch.cat(column) for column in zip(*parts))

    dists, ids = run_reporting(progress, "knn_graph", all_neighbours)

    n = x.shape[0]
    center = torch.arange(n, device=ids.device).unsqueeze(1)
    if loop:
        ids = torch.cat([center, ids], dim=1)
        dists = torch.cat([_self_distance(x, metric).unsqueeze(1), dists], dim=1)
    center = center.expand_as(ids)
    neighbour, center = ids.reshape(-1), center.reshape(-1)
    edge_index = torch.stack([neighbour, center] if flow == "source_to_target" else [center, neighbour])
    return (edge_index, dists.reshape(-1)) if return_distances else edge_index


def _example_rows(batch: Tensor, x: Tensor, k: int) -> List[Tuple[int, int]]:
    """``(first row, rows)`` of each example of a sorted ``batch`` vector, checked against ``k``."""
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
    smallest = min(range(len(sizes)), key=sizes.__getitem__)
    if k >= sizes[smallest]:
        raise ValueError(f"k: expected k < {sizes[smallest]}, the size of the smallest example (example "
                         f"{labels[smallest]} has {sizes[smallest]} points), got {k}")
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def _self_distance(x: Tensor, metric: Metric) -> Tensor:
    """Distance of each row to itself, as the kernels report it (float32)."""
    if metric == "ip":
        return -x.float().pow(2).sum(1)
    return x.new_zeros(x.shape[0], dtype=torch.float32)
