"""Editing a built graph: the relative-neighbourhood rule applied to chosen rows, new rows linked
in (as an insertion into HNSW or DiskANN links a new vertex), and the repair of the rows that
pointed at removed vertices (as FreshDiskANN consolidates its deletes).

Plain tensor operations, so the same code runs wherever the index lives. Distances are the
build's: squared l2 on the rows as the build prepared them (cosine rows normalised, inner-product
rows lifted by one coordinate so that l2 ranks as inner product does; see ``csrc/params.h``).
"""
from typing import Tuple

import torch
from torch import Tensor

# The fewest out-edges a row keeps where its candidates allow (csrc/min_degree.h, kMinOutDegree).
MIN_OUT_DEGREE = 8
# Float32 values formed at once per chunk of rows (their candidates' rows, [rows, c, D]).
CHUNK_VALUES = 1 << 26


def build_space(data: Tensor, metric: str) -> Tensor:
    """float32 rows whose squared l2 distances order pairs as the build's distances do."""
    x = data.float()
    if metric == "cosine":
        return torch.nn.functional.normalize(x, dim=1)
    if metric == "ip":
        sq = x.pow(2).sum(1)
        lift = (sq.max() - sq).clamp_min(0).sqrt() if sq.numel() else sq
        return torch.cat([x, lift.unsqueeze(1)], dim=1)
    return x


def prune_rows(space: Tensor, vertices: Tensor, candidates: Tensor, degree: int, prune: bool = True) -> Tensor:
    """New out-rows for ``vertices`` (int64 [m]) from ``candidates`` (int64 [m, c], -1 padded):
    int32 [m, degree], ascending by distance, -1 padded.

    The build's rule, in ascending order of distance: a candidate is kept unless a kept one is
    closer to it than it is to the vertex. At most ``degree`` are kept; a row left with fewer
    than MIN_OUT_DEGREE takes the nearest of the pruned ones, as the build's fill does. With
    ``prune=False`` the nearest ``degree`` candidates are kept, sorted.
    """
    rows = []
    per_chunk = max(1, CHUNK_VALUES // max(1, candidates.shape[1] * space.shape[1]))
    for start in range(0, vertices.shape[0], per_chunk):
        rows.append(_prune_chunk(space, vertices[start:start + per_chunk], candidates[start:start + per_chunk],
                                 degree, prune))
    if not rows:
        return torch.empty(0, degree, dtype=torch.int32, device=space.device)
    return torch.cat(rows)


def _prune_chunk(space: Tensor, vertices: Tensor, candidates: Tensor, degree: int, prune: bool) -> Tensor:
    m, c = candidates.shape
    ids = candidates.clone()
    ids[ids == vertices.unsqueeze(1)] = -1
    # One copy of each candidate: sort by id, mark repeats.
    ids = ids.sort(dim=1).values
    if c > 1:
        ids[:, 1:][ids[:, 1:] == ids[:, :-1]] = -1
    valid = ids >= 0
    rows = space[ids.clamp_min(0)]                                        # [m, c, D]
    to_vertex = (rows - space[vertices].unsqueeze(1)).pow(2).sum(2).masked_fill(~valid, float("inf"))
    # The nearest 2 x degree candidates only (as DiskANN's list L): farther ones are almost
    # always blocked by a kept one, and the rule's cost grows as the square of their number.
    order = torch.argsort(to_vertex, dim=1, stable=True)[:, :2 * degree]
    c = order.shape[1]
    ids, to_vertex = ids.gather(1, order), to_vertex.gather(1, order)
    rows = rows.gather(1, order.unsqueeze(2).expand(-1, -1, rows.shape[2]))
    valid = torch.isfinite(to_vertex)
    kept = torch.zeros(m, c, dtype=torch.bool, device=ids.device)
    between = torch.cdist(rows, rows).pow(2) if prune else None          # [m, c, c]
    for j in range(c if prune else 0):
        blocked = (kept[:, :j] & (between[:, j, :j] < to_vertex[:, j:j + 1])).any(dim=1)
        kept[:, j] = valid[:, j] & ~blocked & (kept.sum(1) < degree)
    # Short rows take the nearest pruned candidates up to the minimum out-degree.
    short = (MIN_OUT_DEGREE - kept.sum(1, keepdim=True)).clamp_min(0)
    pruned = valid & ~kept
    kept |= pruned & (pruned.cumsum(1) <= (short if prune else degree))
    # Kept entries first (already ascending by distance), then padding.
    position = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :degree]
    out = ids.gather(1, position).masked_fill(~kept.gather(1, position), -1)
    if out.shape[1] < degree:
        out = torch.cat([out, out.new_full((m, degree - out.shape[1]), -1)], dim=1)
    return out.to(torch.int32)


def _packed(candidates: Tensor) -> Tensor:
    """The ids (>= 0) of each row first, cut to as many columns as the fullest row needs."""
    candidates = candidates.gather(1, torch.argsort((candidates < 0).to(torch.int8), dim=1, stable=True))
    return candidates[:, :max(1, int((candidates >= 0).sum(1).max()))]


def consolidate(space: Tensor, graph: Tensor, removed: Tensor) -> Tuple[Tensor, Tensor]:
    """The graph without the ``removed`` rows (bool [N]): ``(kept_rows int64 [M], graph int32
    [M, degree])`` with ids renumbered to the kept rows.

    A row that pointed at removed vertices is pruned again from its live entries and the live
    entries of the removed vertices' rows (their neighbourhoods, which the removal would cut
    off); other rows only drop nothing and are renumbered.
    """
    n, degree = graph.shape
    ids = graph.long()
    hits_removed = (ids >= 0) & removed[ids.clamp_min(0)]
    affected = (hits_removed.any(1) & ~removed).nonzero().flatten()
    new_graph = ids.clone()
    if affected.numel():
        own = ids[affected]                                               # [m, degree]
        through = ids[own.clamp_min(0)]                                   # [m, degree, degree]
        through = through.masked_fill(~hits_removed[affected].unsqueeze(2), -1).flatten(1)
        candidates = torch.cat([own, through], dim=1)
        candidates = candidates.masked_fill((candidates < 0) | removed[candidates.clamp_min(0)], -1)
        new_graph[affected] = prune_rows(space, affected, _packed(candidates), degree).long()
        # A row still short of MIN_OUT_DEGREE looks two hops through all its neighbours.
        short = affected[((new_graph[affected] >= 0).sum(1) < MIN_OUT_DEGREE)]
        if short.numel():
            own = new_graph[short]
            through = new_graph[own.clamp_min(0)].masked_fill((own < 0).unsqueeze(2), -1).flatten(1)
            new_graph[short] = prune_rows(space, short, _packed(torch.cat([own, through], dim=1)), degree).long()
    kept_rows = (~removed).nonzero().flatten()
    renumber = torch.full((n,), -1, dtype=torch.long, device=graph.device)
    renumber[kept_rows] = torch.arange(kept_rows.numel(), device=graph.device)
    out = new_graph[kept_rows]
    out = torch.where(out >= 0, renumber[out.clamp_min(0)], out)
    # Entries of unaffected rows are live, so none turns -1 here; keep padding at the end anyway.
    out = out.gather(1, torch.argsort((out < 0).to(torch.int8), dim=1, stable=True))
    return kept_rows, out.to(torch.int32)


def link_new_rows(space: Tensor, graph: Tensor, candidates: Tensor) -> Tensor:
    """The graph with rows appended for new vertices: ``graph`` int32 [N, degree] over the first
    N rows of ``space``, ``candidates`` int64 [B, c] for rows N .. N + B - 1 (ids into space,
    -1 padded). Returns int32 [N + B, degree].

    Each new row is pruned from its candidates. Then every row a new row links to takes the new
    vertices that link to it (the reverse edges, which make the new vertices reachable): where
    they fit, beside its entries, sorted by distance; where the row would overflow ``degree``,
    it is pruned again from both, as HNSW shrinks a full neighbour list.
    """
    n, degree = graph.shape
    new = torch.arange(n, n + candidates.shape[0], device=graph.device)
    out = torch.cat([graph, prune_rows(space, new, _packed(candidates), degree)]).long()
    target = out[new].flatten()
    source = new.repeat_interleave(degree)
    linked = target >= 0
    target, source = target[linked], source[linked]
    if target.numel() == 0:
        return out.to(torch.int32)
    order = torch.argsort(target, stable=True)
    target, source = target[order], source[order]
    rows, counts = torch.unique_consecutive(target, return_counts=True)
    group = torch.repeat_interleave(torch.arange(rows.numel(), device=graph.device), counts)
    rank = torch.arange(target.numel(), device=graph.device) - (counts.cumsum(0) - counts)[group]
    within = rank < degree
    incoming = torch.full((rows.numel(), degree), -1, dtype=torch.long, device=graph.device)
    incoming[group[within], rank[within]] = source[within]
    candidates = torch.cat([out[rows], incoming], dim=1)
    overflow = (candidates >= 0).sum(1) > degree
    for prune in (False, True):
        chosen = rows[overflow == prune]
        if chosen.numel():
            out[chosen] = prune_rows(space, chosen, _packed(candidates[overflow == prune]), degree, prune).long()
    return out.to(torch.int32)
