"""What a built graph looks like: out-degrees, which vertices a search can reach, and which it finds.

A graph search only finds vertices it can walk to from its entry points, and only walks well
through vertices with enough out-edges. These functions measure both on any device, without
leaving it (plain tensor operations; a breadth-first search costs one host synchronisation per
level). A row that is reachable may still be missed by a search that heads for it:
:func:`unfound_share` measures that, by searching for rows themselves.

Example:
    >>> import torch, torch_grnnd as grnnd
    >>> graph = torch.tensor([[1, -1], [2, -1], [0, 1], [-1, -1]], dtype=torch.int32)
    >>> grnnd.diagnostics.reachable(graph, torch.tensor([0])).tolist()
    [True, True, True, False]
    >>> grnnd.diagnostics.out_degrees(graph).tolist()
    [1, 1, 2, 0]
"""
from typing import Dict

import torch
from torch import Tensor

from . import ops


def out_degrees(graph: Tensor) -> Tensor:
    """int64 [N]: the neighbours each row holds (ids >= 0; -1 is padding)."""
    return (graph >= 0).sum(1)


def degree_summary(graph: Tensor, below: int = 8) -> Dict[str, float]:
    """Minimum, first percentile, mean and maximum out-degree, and the share of rows under ``below``."""
    degrees = out_degrees(graph)
    if degrees.numel() == 0:
        return {"min": 0, "p1": 0.0, "mean": 0.0, "max": 0, f"share_below_{below}": 0.0}
    first_percentile = degrees.kthvalue(max(1, degrees.numel() // 100)).values
    return {"min": int(degrees.min()), "p1": float(first_percentile), "mean": float(degrees.double().mean()),
            "max": int(degrees.max()),
            f"share_below_{below}": float((degrees < below).double().mean())}


# Frontier rows whose edges one step of reachable() reads at once.
REACH_CHUNK_ROWS = 1 << 22


def reachable(graph: Tensor, sources: Tensor) -> Tensor:
    """bool [N]: the rows a walk along ``graph``'s edges reaches from the rows ``sources``
    (breadth first). Ids outside [0, N) are ignored."""
    n = graph.shape[0]
    seen = torch.zeros(n + 1, dtype=torch.bool, device=graph.device)  # the last place takes ids out of range
    frontier = sources.to(device=graph.device, dtype=torch.long)
    frontier = frontier[(frontier >= 0) & (frontier < n)]
    seen[frontier] = True
    while frontier.numel() > 0:
        # The next frontier marked row by row, a chunk of the frontier at a time: one step of a
        # 100M-row graph would otherwise hold all its edges as int64 at once (38 GB).
        marked = torch.zeros_like(seen)
        for rows in frontier.split(REACH_CHUNK_ROWS):
            following = graph[rows].flatten().long()
            marked[torch.where((following >= 0) & (following < n), following, n)] = True
        marked[n] = False
        marked &= ~seen
        seen |= marked
        frontier = marked.nonzero().flatten()
    return seen[:n]


def connect(data: Tensor, graph: Tensor, metric: str = "l2") -> Tensor:
    """A copy of ``graph`` (int32 [N, degree] over ``data``'s rows, rows ascending by distance as
    :func:`torch_grnnd.build` returns them) in which every vertex is reachable from the search's
    entry points (the hubs; row 0 under 16 000 rows). The repair a build ends with, for graphs
    edited or assembled by hand: each unreachable vertex gets an edge from the nearest reachable
    vertex a search finds for it; a full row makes room by giving up its farthest entry that
    another reachable vertex also links to."""
    return torch.ops.grnnd.connect(data, graph, metric=metric)


def fill(data: Tensor, graph: Tensor, metric: str = "l2") -> Tensor:
    """A copy of ``graph`` (int32 [N, degree] over ``data``'s rows) whose short rows are filled to
    the full degree, as a build fills the rows the relative-neighbourhood rule left short: each
    row keeps its entries and takes the nearest of its neighbours' neighbours into its free
    places, ascending by distance (three passes, each reading the rows the last one wrote). Rows
    that are empty or already full stay as they are."""
    return torch.ops.grnnd.fill(data, graph, metric=metric)


def hubs(data: Tensor) -> Tensor:
    """int64 ids of the hubs of ``data``'s rows: the sample whose nearest members give the build
    its start and the search its first entry points (empty under 16 000 rows)."""
    return torch.ops.grnnd.hub_ids(data)


def nearest_hubs(data: Tensor, queries: Tensor, k: int, metric: str = "l2") -> Tensor:
    """int64 [q, min(k, hubs)]: for each query, the ids of its ``k`` nearest hubs among ``data``'s
    rows, nearest first, as the search picks its entry points (no columns under 16 000 rows)."""
    return torch.ops.grnnd.nearest_hubs(data, queries, k, metric=metric)


def neighbourhood_dimensions(data: Tensor, metric: str = "l2") -> float:
    """The share of their dimensions that ``data``'s rows' neighbourhoods spread over, as a build
    that widens measures it to size its pools (``BuildParams.wide_pool_size_for``): for 512 rows
    spread over the data, each row's 20 exact nearest rows paired off into 10 differences, and one
    over D times the mean squared cosine between two differences of one row (two independent steps
    of covariance C meet at tr(C²) / tr(C)² on average: one over the number of directions C
    spreads over evenly). At most 1, and 1 under 21 rows. About 1 in isotropic clusters whatever
    D, lower where the rows' noise is larger along some directions than others: 0.36-0.43 on the
    anisotropic families of ``benchmarks/datasets.py`` (``zipf_aniso``, ``zipf_tiny``, ``aniso``),
    0.98-1.00 on ``zipf`` and ``blobs`` (1M rows and more, one H200). ``metric``: l2, or cosine (on
    the unit rows). An exact search of 512 rows, over 64 slices of the rows (80 ms on 10M x 1024
    rows, one H200)."""
    return torch.ops.grnnd.neighbourhood_dimensions(data, metric=metric)


def unfound_share(data: Tensor, graph: Tensor, metric: str = "l2", sample: int = 10_000, list_size: int = 16,
                  seed: int = 0) -> float:
    """The share of rows that a search for the row itself misses: ``sample`` rows drawn at random
    (all of them when there are fewer), each searched for as a query with a list of ``list_size``,
    counted as missed when neither it nor a copy of it is among the 4 results (under inner product
    a row need not be its own best match, so there it measures the rows a search fails to return
    among their own four). Rows a search cannot find are where a graph still lacks the links into its
    sparse regions: small clusters inside large ones keep it high while more build rounds lower it,
    large low-contrast clusters keep it high whatever the rounds (benchmarks/README.md, "Where
    builds stop"). One search of ``sample`` queries."""
    n = data.shape[0]
    if n == 0:
        return 0.0
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=generator)[:sample].to(data.device)
    k = min(4, n)
    _, ids = ops.search(data, graph, data[rows], k, metric=metric, list_size=max(list_size, k))
    # The row or a copy of it (a row with k copies need not come first among them).
    found = ((data[ids.clamp_min(0)] == data[rows].unsqueeze(1)).all(2) & (ids >= 0)).any(1)
    return float((~found).double().mean())
