"""k-NN graphs of point sets in the PyTorch Geometric convention."""
import torch
from torch import Tensor

from .ops import Metric


def knn_graph(
    x: Tensor,
    k: int,
    *,
    metric: Metric = "l2",
    exact: bool = False,
    loop: bool = False,
    flow: str = "source_to_target",
    list_size: int = 0,
    seed: int = 0,
) -> Tensor:
    """``edge_index`` [2, N * k] linking each row of ``x`` to its k nearest other rows.

    Approximate by default (a GRNND graph, then a graph search from every row); ``exact=True``
    uses exact k-NN. Follows ``torch_cluster.knn_graph``: with ``flow="source_to_target"``
    edges run from each neighbour (row 0) to the point it is a neighbour of (row 1).

    Args:
        x: [N, D] points.
        k: neighbours per point (excluding itself), ``k < N``.
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        exact: exact instead of approximate neighbours.
        loop: also link every point to itself (k neighbours + the self loop per point).
        flow: ``"source_to_target"`` or ``"target_to_source"``.
        list_size: search list for the approximate path (0 = max(k + 1, 64)).
        seed: seeds the build and the search.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> edge_index = grnnd.knn_graph(torch.randn(500, 8), k=6)
        >>> edge_index.shape
        torch.Size([2, 3000])
    """
    if flow not in ("source_to_target", "target_to_source"):
        raise ValueError(f'flow: expected "source_to_target" or "target_to_source", got {flow!r}')
    _, ids = torch.ops.grnnd.knn_graph.default(x, k, metric=metric, exact=exact, list_size=list_size, seed=seed)
    n = x.shape[0]
    center = torch.arange(n, device=ids.device).unsqueeze(1)
    if loop:
        ids = torch.cat([center, ids], dim=1)
    center = center.expand_as(ids)
    neighbour, center = ids.reshape(-1), center.reshape(-1)
    if flow == "source_to_target":
        return torch.stack([neighbour, center])
    return torch.stack([center, neighbour])
