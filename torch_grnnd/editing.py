"""Editing a built graph: the relative-neighbourhood rule applied to chosen rows, new rows linked
in (as an insertion into HNSW or DiskANN links a new vertex), and the repair of the rows that
pointed at removed vertices (as FreshDiskANN consolidates its deletes).

Tensor operations around one op, ``torch.ops.grnnd.prune_rows`` (the build's rule applied to
chosen rows, on the CPU or the GPU), so the same code runs wherever the index lives.
"""
import math
from typing import Tuple

import torch
from torch import Tensor

# The fewest out-edges a repaired row keeps where its candidates allow; prune_rows fills rows to the
# full degree from its candidates (csrc/build/prune.h), so only a row with few candidates looks further.
MIN_OUT_DEGREE = 8
# Candidate columns one prune_rows call takes (csrc/build/prune.h, kMaxPruneCandidates).
MAX_CANDIDATES = 2048
# Candidate ids gathered at once when repairing rows after removals (int64 entries).
CHUNK_ENTRIES = 1 << 26


def prune_rows(data: Tensor, metric: str, vertices: Tensor, candidates: Tensor, degree: int,
               rule: bool = True, fixed: int = 0, shrink: bool = False) -> Tensor:
    """New out-rows for ``vertices`` (int64 [m]) from ``candidates`` (int64 [m, c], -1 padded,
    repeats allowed): int32 [m, degree], ascending by distance, -1 padded.

    The build's rule on the nearest 2 x degree candidates, then the nearest dropped ones in the free places;
    with ``rule=False`` the nearest ``degree``, sorted; candidates in the first ``fixed``
    columns are kept whatever the rule says and however far (the nearest ``degree`` of them),
    the others take the places left; with ``shrink=True`` the first ``degree`` columns are a
    row of the graph (ascending by distance) and the others its newcomers, and only the surplus
    over ``degree`` goes, farthest covered first (``torch.ops.grnnd.prune_rows``, csrc/build/prune.h).
    """
    if not shrink:  # a shrink's first `degree` columns are the row, where they are
        candidates = torch.cat([candidates[:, :fixed], _packed(candidates[:, fixed:])], dim=1)
    return torch.ops.grnnd.prune_rows.default(data, vertices, candidates, degree, metric=metric, rule=rule,
                                              fixed=fixed, shrink=shrink)


def relabel(entries: Tensor, table: Tensor) -> Tensor:
    """Graph entries (-1 padded) mapped through ``table`` (new id of each old id); -1 stays."""
    return torch.where(entries >= 0, table[entries.clamp_min(0).long()].to(entries.dtype), entries)


def _packed(candidates: Tensor) -> Tensor:
    """The ids (>= 0) of each row first, cut to as many columns as the fullest row needs."""
    if candidates.numel() == 0:
        return candidates
    candidates = candidates.gather(1, torch.argsort((candidates < 0).to(torch.int8), dim=1, stable=True))
    return candidates[:, :max(1, int((candidates >= 0).sum(1).max()))]


def consolidate(data: Tensor, metric: str, graph: Tensor, removed: Tensor) -> Tuple[Tensor, Tensor]:
    """The graph without the ``removed`` rows (bool [N]): ``(kept_rows int64 [M], graph int32
    [M, degree])`` with ids renumbered to the kept rows.

    A row that pointed at removed vertices is pruned again from its live entries and the live
    entries of the removed vertices' rows (their neighbourhoods, which the removal would cut
    off); other rows only drop nothing and are renumbered.
    """
    n, degree = graph.shape
    hits_removed = (graph >= 0) & removed[graph.clamp_min(0).long()]
    affected = (hits_removed.any(1) & ~removed).nonzero().flatten()
    new_graph = graph.clone()
    # Each removed neighbour's nearest entries, as many as the op takes beside the row's own.
    per_hop = max(1, min(degree, (MAX_CANDIDATES - degree) // degree))
    per_chunk = max(1, CHUNK_ENTRIES // (degree * (1 + per_hop)))
    for start in range(0, affected.numel(), per_chunk):
        rows = affected[start:start + per_chunk]
        own = graph[rows].long()                                          # [m, degree]
        # Only the removed entries' rows are gathered (a tenth of the entries' rows with a tenth
        # removed), each into the block of its rank among its row's removed entries:
        # [m, widest, per_hop], widest the most any row of the chunk has, where masking all the
        # entries' rows took [m, degree, per_hop]. The candidates keep their order: the removed
        # entries in row order, the first per_hop entries of each one's row in that row's order.
        hits = hits_removed[rows]
        at_row, at_column = hits.nonzero(as_tuple=True)
        rank = hits.cumsum(1)[at_row, at_column] - 1
        through = own.new_full((rows.numel(), int(rank.max()) + 1, per_hop), -1)
        through[at_row, rank] = graph[own[at_row, at_column], :per_hop].long()
        candidates = torch.cat([own, through.flatten(1)], dim=1)
        candidates = candidates.masked_fill((candidates < 0) | removed[candidates.clamp_min(0)], -1)
        # The row's live entries stay (the build chose them, reverse edges included); the places
        # of the removed ones go to the removed vertices' neighbours that the rule lets in.
        new_graph[rows] = prune_rows(data, metric, rows, candidates, degree, fixed=degree)
    # A row still short of the build's minimum out-degree looks two hops through all its neighbours.
    short = affected[(new_graph[affected] >= 0).sum(1) < min(MIN_OUT_DEGREE, degree)]
    for start in range(0, short.numel(), per_chunk):
        rows = short[start:start + per_chunk]
        own = new_graph[rows].long()
        through = new_graph[own.clamp_min(0), :per_hop].long().masked_fill((own < 0).unsqueeze(2), -1).flatten(1)
        new_graph[rows] = prune_rows(data, metric, rows, torch.cat([own, through], dim=1), degree)
    kept_rows = (~removed).nonzero().flatten()
    renumber = torch.full((n,), -1, dtype=torch.int32, device=graph.device)
    renumber[kept_rows] = torch.arange(kept_rows.numel(), dtype=torch.int32, device=graph.device)
    out = new_graph[kept_rows]
    out = relabel(out, renumber)
    # Entries of unaffected rows are live, so none turns -1 here; keep padding at the end anyway.
    out = out.gather(1, torch.argsort((out < 0).to(torch.int8), dim=1, stable=True))
    return kept_rows, out


def link_new_rows(data: Tensor, metric: str, graph: Tensor, candidates: Tensor,
                  reverse_share: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """Rows for new vertices and the rows their reverse edges change. ``graph`` int32 [N, degree]
    over the first N rows of ``data``, ``candidates`` int64 [B, c] for the new rows N .. N + B - 1
    (ids into data, -1 padded). Returns ``(new_rows int32 [B, degree], changed int64 [r],
    changed_rows int32 [r, degree])``: the graph with the new vertices is ``graph`` with
    ``graph[changed] = changed_rows``, then ``new_rows`` appended. Nothing is written.

    Each new row is pruned from its candidates. Then every row among the nearest
    ``reverse_share`` of a new row's entries (the build's rho, ``reverse_ratio``: the share of a
    pool, nearest first, that gets a reverse edge) takes the new vertices that link to it (the
    reverse edges, which make the new vertices reachable): where
    they fit, beside its entries, in distance order; where the row would overflow ``degree``,
    the row and its newcomers lose their surplus, farthest covered entries first
    (``prune_rows(shrink=True)``: a binary search for each newcomer's place in the row, which is
    kept ascending by distance, and about one pass over the row, where pruning the whole list
    again, as HNSW shrinks a full neighbour list, costs a pass over every pair).
    """
    n, degree = graph.shape
    b = candidates.shape[0]
    device = graph.device
    new = torch.arange(n, n + b, device=device)
    new_rows = prune_rows(data, metric, new, candidates, degree)
    reverse = max(1, min(degree, math.ceil(reverse_share * degree)))
    # The reverse edges (target row, new vertex), grouped by target; rows are ascending by
    # distance, so the first `reverse` places are the nearest. An empty place sorts last, as the
    # row n + b past every id, and its group is dropped.
    past = n + b
    target = new_rows[:, :reverse].flatten().long()
    target, order = torch.sort(torch.where(target >= 0, target, past), stable=True)
    source = order // reverse + n
    rows, counts = torch.unique_consecutive(target, return_counts=True)
    widest, old_rows, linked_rows = torch.stack([counts.max(), (rows < n).sum(), (rows < past).sum()]).tolist()
    # Each edge's place among its row's newcomers; a row keeps at most `degree` of them (the
    # overflow lands in a column that is cut off).
    width = min(degree, widest)
    group = torch.repeat_interleave(torch.arange(rows.numel(), device=device), counts, output_size=target.numel())
    rank = torch.arange(target.numel(), device=device) - (counts.cumsum(0) - counts)[group]
    incoming = torch.full((rows.numel(), width + 1), -1, dtype=torch.long, device=device)
    incoming[group, rank.clamp_max(width)] = source
    rows, incoming = rows[:linked_rows], incoming[:linked_rows, :width]
    if linked_rows == 0:
        return new_rows, rows, new_rows[:0]
    # Rows below n are the index's (they come first: rows are sorted); the others are new rows.
    current = torch.cat([graph[rows[:old_rows]], new_rows[rows[old_rows:] - n]])
    updated = prune_rows(data, metric, rows, torch.cat([current.long(), incoming], dim=1), degree, rule=False,
                         shrink=True)
    new_rows = new_rows.index_copy(0, rows[old_rows:] - n, updated[old_rows:])
    return new_rows, rows[:old_rows], updated[:old_rows]
