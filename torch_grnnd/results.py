"""Search results merged from several parts (shards, swapped-in graphs, ranks): one rule for all.

Every part returns its candidates for a query ascending by distance, padded with (inf, -1). The
merge keeps the k best of all of them, ascending by (distance, id): ties go to the lower id,
whatever part found it, so a result does not depend on how the rows were split.
"""
from typing import Tuple

import torch
from torch import Tensor


def best_k(dists: Tensor, ids: Tensor, k: int, ids_ordered: bool = False) -> Tuple[Tensor, Tensor]:
    """The k best of each row's candidates (``dists`` float32 and ``ids`` int64, [q, m] each),
    ascending by (distance, id), padded with (inf, -1) where a row has fewer than k.
    ``ids_ordered``: within each row the candidates' ids already ascend wherever their distances
    tie (parts concatenated in the order of their ids, as rank offsets are), so one stable sort
    by distance does."""
    if not ids_ordered:
        order = torch.argsort(ids, dim=1, stable=True)  # ties by id ...
        dists, ids = dists.gather(1, order), ids.gather(1, order)
    dists, order = torch.sort(dists, dim=1, stable=True)  # ... then by distance
    return padded(dists[:, :k], ids.gather(1, order[:, :k]), k)


def without_own(dists: Tensor, ids: Tensor, own: Tensor) -> Tuple[Tensor, Tensor]:
    """A k-NN graph's rows from each row's k + 1 nearest ([q, k + 1] each, nearest first): each
    row's own id (``own`` [q, 1]) dropped, or the last entry where duplicates of the row kept its
    own id out (:func:`own_column`); the others keep their order."""
    keep = torch.arange(ids.shape[1] - 1, device=ids.device)
    keep = keep + (keep >= own_column(ids, own))
    return dists.gather(1, keep), ids.gather(1, keep)


def own_column(ids: Tensor, own: Tensor) -> Tensor:
    """[q, 1]: the column :func:`without_own` drops from each row of ``ids``, its own id's
    (``own`` [q, 1]), else the last. Found without a sort, which took a k-NN graph of a batch of
    small clouds longer than making its edges."""
    mine = ids == own
    return torch.where(mine.any(1, keepdim=True), mine.to(torch.uint8).argmax(1, keepdim=True), ids.shape[1] - 1)


def padded(dists: Tensor, ids: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """Results widened to k columns with (inf, -1)."""
    if dists.shape[1] < k:
        dists = torch.nn.functional.pad(dists, (0, k - dists.shape[1]), value=float("inf"))
        ids = torch.nn.functional.pad(ids, (0, k - ids.shape[1]), value=-1)
    return dists, ids
