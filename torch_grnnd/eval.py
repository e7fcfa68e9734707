"""Measuring search quality."""
import torch
from torch import Tensor


def recall(found: Tensor, truth: Tensor, k: int = 0) -> float:
    """Recall@k: the share of the true k nearest neighbours present among the k found.

    Args:
        found: [Q, >= k] ids returned by a search (-1 entries never match).
        truth: [Q, >= k] exact neighbour ids, nearest first.
        k: how many to compare (0 = ``found.shape[1]``).

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> grnnd.recall(torch.tensor([[1, 2]]), torch.tensor([[2, 3]]))
        0.5
    """
    k = k or found.shape[1]
    if found.shape[0] != truth.shape[0] or found.shape[1] < k or truth.shape[1] < k:
        raise ValueError(f"recall: need [Q, >={k}] for both, got {tuple(found.shape)} and {tuple(truth.shape)}")
    f = found[:, :k].to(torch.int64).cpu()
    t = truth[:, :k].to(torch.int64).cpu()
    hits = (f.unsqueeze(2) == t.unsqueeze(1)) & (f.unsqueeze(2) >= 0)
    return hits.any(dim=2).sum().item() / t.numel()
