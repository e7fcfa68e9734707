"""Builds over more rows than one device holds: overlapping shards, built one at a time and joined.

A build needs its rows and 2 x N x pool_size x 8 bytes of pools on the device at once. When
that exceeds the budget, the rows are split into shards that fit, with DiskANN's overlap: the
data is cut into cells (k-means on a sample), cells are grouped into spatially coherent shards,
and a row whose two nearest cells lie in two shards belongs to both when it lies near enough to
the border between them that neighbours may lie across it (``_share_margin``). Each shard is
copied in (pinned host rows read by the GPU where they lie; other rows gathered on the host by a
worker thread while the device builds the previous shard), built by the ordinary build, and its
rows stored on the host with global ids.
A row of two shards then has two rows, each pruned within its own shard; they are joined by
the build's rule (``prune_rows``), which gives the edges that cross between shards. A join
needs only the rows it reads: the shared rows go in chunks, each with the rows its two rows name
copied in (as many as the budget holds), not the two shards. Rows of one shard keep the row its
build gave them.

Shards alone leave a walk no way between distant regions (no shard holds both ends of such an
edge), so the centres, which include the search's hubs and sit in every shard, also get a graph
of their own, the skeleton, joined into their rows: a search enters at the hubs and crosses
regions along it, as through the top layer of HNSW.

Cells around sampled rows, with every row of two shards shared, built 18.9M rows for 10M
clustered rows x 1024 in 8 GB (89% shared; in a one-off run on one H100, 41.8 and 42.5 s against
10.4 s in memory, recall 0.9846 against 0.9807): those cells cut the clusters apart, so every row
lay near a border. K-means cells follow the clusters, and 31% of the rows were shared:
`bench_out_of_core.py` took 27.3 s against 10.6 s, recall 0.9771 (benchmarks/README.md,
"K-means cells"). With one centre per 64 rows (ROWS_PER_CENTRE), five plan seeds recalled
0.9749-0.9789, at most 0.005 below the in-memory build with the same seed, in 2.56-2.76x its time
(10 000 queries; "Centres as landing sites").

The result is one graph over all rows, on the host (or wherever ``data`` is), searched as any
other: a graph of 100M rows is 19.2 GB of int32 at the default degree 48.
"""
import concurrent.futures
import logging
import math
import time
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import editing, ops
from .memory import bytes_per_row, free_bytes, parse_bytes, row_bytes, shard_bytes_per_row, within_budget
from .params import BuildParams
from .progress import Progress, steps_reporter

logger = logging.getLogger(__name__)

# Cells per shard: finer cells make shard borders follow the data more closely.
CELLS_PER_SHARD = 32
# The centres (sampled rows, with the search's hubs) are in every shard and get a graph of their
# own, the skeleton, which joins the shards: a walk crosses between regions through them, and a
# row links to the centres of regions other shards own. At least CENTRES_PER_CELL per cell and
# one per ROWS_PER_CENTRE rows, at most a quarter of a shard: fewer lost the queries whose region
# holds no hub (benchmarks/README.md, "Centres as landing sites" and "Small checks behind the
# out-of-core constants").
CENTRES_PER_CELL = 4
ROWS_PER_CENTRE = 64
# The most shards a plan may have: each owns at least this share of the rows that fit. It also
# sets the number of cells (CELLS_PER_SHARD for each of that many shards).
PRIMARY_SHARE = 0.5
# The cells are k-means centroids: Lloyd's iterations on this many sampled rows per cell, starting
# from sampled rows. Cells around sampled rows cut clusters apart; k-means cells follow them, so
# fewer rows lie near a border (benchmarks/README.md, "K-means cells").
TRAIN_ROWS_PER_CELL = 64
LLOYD_ITERS = 8
# A row may also join the shard of its second-nearest cell; only a row near the border does:
# PROBES rows' exact PROBE_NEIGHBOURS nearest neighbours (among all rows) show how near the border
# neighbours still cross it, and the shared rows cover SHARE_COVERAGE of those crossings
# (_share_margin). Sharing every row with a second cell in another shard shared 37-42% of them.
PROBES = 1024
PROBE_NEIGHBOURS = 10
SHARE_COVERAGE = 0.99
# Shards are planned to hold this share of the rows that fit: shard sizes vary with the cells.
SHARD_FILL = 0.9
# Rows whose nearest cells are found in one pass over the device, and their scores (256 MiB).
# Within a budget under PLAN_BUDGET_SHARE x 2^26 bytes (2 GiB) the passes are smaller: the
# scores, a pass's rows and the training rows at most budget / PLAN_BUDGET_SHARE floats each. A
# pass holds a few float32 copies of its rows beside their scores: with full passes the plan of
# 300 000 x 1 024 float16 rows took 991 MiB whatever the budget (one H200).
ASSIGN_CHUNK_ROWS = 1 << 18
ASSIGN_CHUNK_SCORES = 1 << 26
PLAN_BUDGET_SHARE = 32
# Rows joined per prune_rows call.
JOIN_CHUNK_ROWS = 1 << 19
# Device bytes a join takes per candidate beside the rows it reads: the int64 copies of the ids
# that _join and prune_rows make (mapped to the chunk, packed, sorted), about seven.
JOIN_BYTES_PER_CANDIDATE = 56
# Rows a staged copy gathers on the host at once (64 MiB of them): the worker gathers the next
# block while the previous one is copied to the device.
STAGE_BLOCK_BYTES = 1 << 26

def join_chunk_rows(budget: int, p: BuildParams) -> int:
    """The most rows a join chunk takes: JOIN_CHUNK_ROWS, or fewer where their candidates would
    take more than half of ``budget``."""
    return max(1, min(JOIN_CHUNK_ROWS, budget // (2 * 2 * p.degree * JOIN_BYTES_PER_CANDIDATE)))


def join_capacity(budget: int, n: int, dim: int, element_size: int, p: BuildParams, metric: str = "l2") -> int:
    """Rows a join chunk may read within ``budget``: the rows alone (with the copy a cosine prune
    makes of them, ``memory.row_bytes``), once the largest chunk's candidates
    (:func:`join_chunk_rows`) and the mark per row are set aside; at least the rows one row's
    join reads. Joins read the rows their chunk names, so the more fit, the more the chunks' rows
    overlap: 10M x 1024 in 8 GB read 160M rows for 8.85M joined at the shards' 1.5M, 113M at
    twice that (one H100). Once the floor was a shard's rows, whose chunk's candidates then took
    the budget's rest and more in budgets under 3 GB at 1 024 dimensions."""
    spare = budget - (n + 1) - join_chunk_rows(budget, p) * 2 * p.degree * JOIN_BYTES_PER_CANDIDATE
    return min(n, max(2 * p.degree + 1, spare // row_bytes(dim, element_size, metric)))


def _prepared(rows: Tensor, metric: str) -> Tensor:
    """Rows as float32 in the space the partition measures: unit rows under cosine."""
    rows = rows.float()
    return torch.nn.functional.normalize(rows, dim=1) if metric == "cosine" else rows


def _plan_floats(budget: Optional[int]) -> int:
    """Floats each of the plan's larger tensors may take (see ASSIGN_CHUNK_SCORES)."""
    if budget is None:
        return ASSIGN_CHUNK_SCORES
    return max(1 << 12, min(ASSIGN_CHUNK_SCORES, budget // PLAN_BUDGET_SHARE))


def _centroids(train: Tensor, cells: int, floats: int = ASSIGN_CHUNK_SCORES) -> Tensor:
    """float32 [c, D], c <= cells: k-means centroids of ``train`` (prepared rows on the device, at
    least ``cells`` of them), starting from its first ``cells`` rows. Cells left with no rows
    (repeated starting rows among them) are dropped, but two are always kept: an empty cell's
    centroid would be every row's second cell at no distance. Sums go through matrix products,
    not atomic adds, so the plan is the same from run to run; the rows go in blocks whose scores
    and assignments take at most ``floats`` floats."""
    centroids = train[:cells].clone()
    block = max(1, floats // (2 * cells))
    for _ in range(LLOYD_ITERS):
        norms = centroids.pow(2).sum(1)
        sums, counts = torch.zeros_like(centroids), torch.zeros(cells, dtype=train.dtype, device=train.device)
        for start in range(0, train.shape[0], block):
            rows = train[start:start + block]
            nearest = torch.addmm(norms, rows, centroids.t(), alpha=-2).argmin(1, keepdim=True)
            assign = torch.zeros(rows.shape[0], cells, dtype=train.dtype, device=train.device).scatter_(1, nearest, 1.0)
            sums.addmm_(assign.t(), rows)
            counts += assign.sum(0)
        centroids = torch.where(counts.unsqueeze(1) > 0, sums / counts.clamp_min(1).unsqueeze(1), centroids)
    keep = counts > 0
    keep[:2] |= int(keep.sum()) < 2
    return centroids[keep]


class _Nearness(NamedTuple):
    cells: Tensor       # int64 [N, 2]: each row's nearest and second-nearest cell
    margin: Tensor      # float32 [N]: how far each row lies from the border of those two cells
    neighbours: Tensor  # int64 [P, PROBE_NEIGHBOURS]: the probes' exact nearest rows, nearest first


def _nearness(data: Tensor, centroids: Tensor, origin: Tensor, probes: Tensor, metric: str,
              device: torch.device, floats: int = ASSIGN_CHUNK_SCORES) -> _Nearness:
    """One pass over the rows (squared l2 on prepared rows, see :class:`_Nearness`). The margin is
    the distance from the row to the hyperplane halfway between its two cells' centroids. Rows
    and ``centroids`` are taken relative to ``origin`` (the training rows' mean): the scores are
    differences of squared norms, which lose their digits far from the origin (clustered rows
    moved 1000 away shared 35% of the rows instead of 3.6%). A pass's rows and their scores take at
    most ``floats`` floats each."""
    n, cells = data.shape[0], centroids.shape[0]
    nearest = torch.empty(n, 2, dtype=torch.int64)
    margin = torch.empty(n, dtype=torch.float32)
    centroid_norms = centroids.pow(2).sum(1)
    probe_rows = _prepared(data[probes.to(data.device)].to(device), metric) - origin
    k = min(PROBE_NEIGHBOURS + 1, n)  # the probe itself is among the rows
    # Per probe, |row|^2 - 2 <probe, row> ranks rows as their distance to it does.
    best = torch.empty(probes.numel(), 0, device=device)
    best_ids = torch.empty(probes.numel(), 0, dtype=torch.int64, device=device)
    chunk = max(1, min(ASSIGN_CHUNK_ROWS, floats // (cells + probes.numel()), floats // max(1, data.shape[1])))
    for start in range(0, n, chunk):
        rows = _prepared(data[start:start + chunk].to(device, non_blocking=True), metric) - origin
        scores, ids = torch.addmm(centroid_norms, rows, centroids.t(), alpha=-2).topk(2, dim=1, largest=False)
        gap = (centroids[ids[:, 0]] - centroids[ids[:, 1]]).norm(dim=1).clamp_min(1e-30)
        margin[start:start + rows.shape[0]] = ((scores[:, 1] - scores[:, 0]) / (2 * gap)).cpu()
        nearest[start:start + rows.shape[0]] = ids.cpu()
        ranks = torch.addmm(rows.pow(2).sum(1).unsqueeze(0), probe_rows, rows.t(), alpha=-2)
        near, at = ranks.topk(min(k, rows.shape[0]), dim=1, largest=False)
        best, pick = torch.cat([best, near], 1).topk(min(k, best.shape[1] + near.shape[1]), dim=1, largest=False)
        best_ids = torch.cat([best_ids, at + start], 1).gather(1, pick)
    # Each probe's own row is dropped (ranked after all others), then the nearest kept.
    best = best.masked_fill(best_ids == probes.to(device).unsqueeze(1), float("inf"))
    order = best.topk(k - 1, dim=1, largest=False).indices
    return _Nearness(nearest, margin, best_ids.gather(1, order).cpu())


def _share_margin(nearness: _Nearness, probes: Tensor) -> float:
    """How near the border between its two nearest cells a row must lie to be shared: the margin
    below which SHARE_COVERAGE of the probes lie that have an exact nearest neighbour in their
    second cell (0 when none has)."""
    second = nearness.cells[probes, 1].unsqueeze(1)
    crossing = (nearness.cells[nearness.neighbours, 0] == second).any(1)
    if not bool(crossing.any()):
        return 0.0
    return float(torch.quantile(nearness.margin[probes][crossing], SHARE_COVERAGE))


def _group_cells(centroids: Tensor, sizes: Tensor, shards: int, capacity: int) -> Tensor:
    """int64 [cells]: the shard of each cell. Shards grow from the outside in: each starts at
    the free cell farthest from the free cells' mean and takes the free cells nearest to it
    until it holds its share of the rows (``sizes`` summed over ``shards``), so every shard is one
    compact region. None takes more than ``capacity`` rows unless one cell alone has more; where
    the shares do not fit, there are more shards."""
    centroids, sizes = centroids.float().cpu(), sizes.cpu()
    shard_of = torch.full((centroids.shape[0],), -1, dtype=torch.int64)
    target = min(capacity, int(sizes.sum()) / shards)
    s = 0
    while bool((shard_of < 0).any()):
        free = (shard_of < 0).nonzero().flatten()
        mean = centroids[free].mean(0)
        seed = free[(centroids[free] - mean).pow(2).sum(1).argmax()]
        order = free[(centroids[free] - centroids[seed]).pow(2).sum(1).argsort()]
        filled = sizes[order].cumsum(0)
        # The cell that reaches the target joins too, if there is room; the last shard the rest.
        take = free.numel() if s == shards - 1 else int((filled < target).sum()) + 1
        shard_of[order[:max(1, min(take, int((filled <= capacity).sum())))]] = s
        s += 1
    return shard_of


class ShardPlan(NamedTuple):
    members: List[Tensor]  # int64 sorted row ids of each shard
    primary: Tensor        # int64 [N]: each row's own shard
    secondary: Tensor      # int64 [N]: the second shard a row also belongs to, -1 for none
    centres: Tensor        # int64 sorted ids of the skeleton's rows (sampled rows, hubs): in every shard
    cell: Tensor           # int64 [N]: each row's nearest cell


def _split_large_cells(cell: Tensor, is_centre: Tensor, cells: int, capacity: int) -> Tuple[Tensor, Tensor]:
    """``(group, origin)``: int64 [N] each row's group, its cell, except that the rows (centres
    aside) of a cell with more than half a shard's ``capacity`` go in groups of that many by row
    id, groups numbered from ``cells`` on; int64 [groups] the cell each group came from. A region
    so dense (repeated rows, say) that one shard could not hold it is cut, not left to break the
    budget."""
    group = cell.clone()
    origin = list(range(cells))
    piece = max(1, capacity // 2)
    sizes = torch.bincount(cell[~is_centre], minlength=cells)
    for c in (sizes > piece).nonzero().flatten().tolist():
        rows = ((cell == c) & ~is_centre).nonzero().flatten()
        for part in rows.split(piece)[1:]:
            group[part] = len(origin)
            origin.append(c)
    return group, torch.tensor(origin, dtype=torch.int64)


def plan_shards(data: Tensor, rows_per_shard: int, metric: str, device: torch.device, seed: int,
                budget: Optional[int] = None) -> ShardPlan:
    """Which rows each shard holds; see :class:`ShardPlan` and the module doc. ``budget``: the
    device bytes the plan may take (ASSIGN_CHUNK_SCORES); None: its full passes."""
    n = data.shape[0]
    floats = _plan_floats(budget)
    generator = torch.Generator().manual_seed(seed)
    most_shards = max(2, math.ceil(n / (PRIMARY_SHARE * rows_per_shard)))
    sample = torch.randperm(n, generator=generator)
    cells = min(n, most_shards * CELLS_PER_SHARD)
    centres = min(max(cells * CENTRES_PER_CELL, n // ROWS_PER_CENTRE), rows_per_shard // 4)
    centre_ids = torch.cat([sample[:centres], torch.ops.grnnd.hub_ids(data[:, :1]).cpu()]).unique()
    # At most `floats` floats of training rows (256 MiB), and at least one a cell.
    training = max(cells, min(cells * TRAIN_ROWS_PER_CELL, floats // data.shape[1]))
    train = _prepared(data[sample[:training].to(data.device)].to(device), metric)
    origin = train.mean(0)
    centroids = _centroids(train.sub_(origin), cells, floats)  # train is a copy of the rows
    del train
    probes = sample[-min(n, PROBES):]
    nearness = _nearness(data, centroids, origin, probes, metric, device, floats)
    near_border = nearness.margin <= _share_margin(nearness, probes)
    is_centre = torch.zeros(n, dtype=torch.bool)
    is_centre[centre_ids] = True
    # As many shards as the rows they own and share fill to SHARD_FILL, once the centres are in.
    capacity = max(1, rows_per_shard - centre_ids.numel())
    shards = min(most_shards, max(2, math.ceil(n * (1 + float(near_border.float().mean())) / (SHARD_FILL * capacity))))
    nearest = nearness.cells
    group, origin_cell = _split_large_cells(nearest[:, 0], is_centre, centroids.shape[0], capacity)
    own_rows = torch.bincount(group[~is_centre], minlength=origin_cell.numel())
    shard_of_group = _group_cells(centroids[origin_cell], own_rows, shards, capacity)
    primary, second = shard_of_group[group], shard_of_group[nearest[:, 1]]
    secondary = torch.where(near_border & (second != primary), second, -1)
    secondary[centre_ids] = -1  # in every shard already
    members = []
    for s in range(int(shard_of_group.max()) + 1):
        own = ((primary == s) & ~is_centre).nonzero().flatten()
        shared = (secondary == s).nonzero().flatten()
        room = max(rows_per_shard - own.numel() - centre_ids.numel(), 0)
        if shared.numel() > room:  # the shard is full: the rows farthest from the border keep one shard
            shared = shared[nearness.margin[shared].argsort(stable=True)]
            secondary[shared[room:]] = -1
            shared = shared[:room]
        members.append(torch.cat([own, shared, centre_ids]).sort().values)
    return ShardPlan(members, primary, secondary, centre_ids, nearest[:, 0])


def build_in_shards(data: Tensor, params: BuildParams, metric: str, device: Union[str, torch.device],
                    max_memory: Optional[Union[int, str]] = None, progress: Progress = False) -> Tensor:
    """The graph of ``data`` (int32 [N, degree], on data's device) built on ``device`` within
    ``max_memory`` bytes (default: what is free there); see the module doc. Four steps: plan the
    shards, build the centres' skeleton, build each shard, join the rows two shards hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    budget = parse_bytes(max_memory) if max_memory is not None else free_bytes(device)
    params = within_budget(params)
    n, dim = data.shape
    per_row = shard_bytes_per_row(dim, data.element_size(), params, metric)
    rows_per_shard = budget // per_row
    if rows_per_shard < 2 * params.pool_size:
        raise ValueError(f"max_gpu_memory: {budget} bytes hold only {rows_per_shard} rows of this build "
                         f"({per_row} bytes a row); give it more")
    if n <= rows_per_shard:
        return ops.build(data.to(device), params, metric=metric, progress=progress).to(data.device)
    report, close = steps_reporter(progress, "out-of-core build (rows built in shards, then rows joined)")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        # A staging buffer, where rows need one, is pinned (seconds per GiB) by the worker while
        # the shards are planned.
        loader = _RowLoader(data, rows_per_shard, device, worker)
        try:
            started = time.perf_counter()
            members, primary, secondary, centre_ids, cell = plan_shards(data, rows_per_shard, metric, device,
                                                                        params.seed, budget)
            logger.info("out-of-core build: %d shards of at most %d rows, %.0f%% of rows in two, planned in %.2f s",
                        len(members), rows_per_shard, 100 * float((secondary >= 0).float().mean()),
                        time.perf_counter() - started)
            shared_rows = _shared_by_cell(secondary, cell)
            steps = _Steps(report, sum(m.numel() for m in members) + shared_rows.numel())
            graph, second_graph, slot = _build_shards(data, loader, members, primary, secondary, centre_ids,
                                                      shared_rows, params, metric, device, steps)
            capacity = join_capacity(budget, n, dim, data.element_size(), params, metric)
            _join_shared(loader, graph, second_graph, slot, shared_rows, capacity, join_chunk_rows(budget, params),
                         params, metric, device, steps)
        finally:
            close()
    return graph.to(data.device)


class _Steps:
    """The rows built or joined so far, reported to ``report`` against ``total``."""

    def __init__(self, report, total: int):
        self.report, self.total, self.done = report, total, 0

    def add(self, rows: int) -> None:
        self.done += rows
        self.report(self.done, self.total)


def _build_shards(data: Tensor, loader: "_RowLoader", members: List[Tensor], primary: Tensor, secondary: Tensor,
                  centre_ids: Tensor, shared_rows: Tensor, params: BuildParams, metric: str, device: torch.device,
                  steps: _Steps) -> Tuple[Tensor, Tensor, Tensor]:
    """``(graph, second_graph, slot)`` on the host: each row's row from the shard that owns it,
    and for the rows two shards hold (``shared_rows``) their row from the second, at ``slot``."""
    started = time.perf_counter()
    n = data.shape[0]
    # The centres' own graph: long edges between regions that no shard holds both ends of.
    # Every shard holds the centres, so their rows join it from the shard that owns them.
    local = ops.build(data[centre_ids.to(data.device)].to(device), params, metric=metric)
    skeleton = editing.relabel(local.long(), centre_ids.to(device))
    graph = torch.full((n, params.degree), -1, dtype=torch.int32)
    slot = torch.full((n,), -1, dtype=torch.int64)
    slot[shared_rows] = torch.arange(shared_rows.numel())
    second_graph = torch.full((shared_rows.numel(), params.degree), -1, dtype=torch.int32)
    shards = ((ids, s) for s, ids in enumerate(members))
    # A shard's rows are stored on the host by a thread of their own while the next shard
    # builds (10M x 1024 within 8 GB on an H100: 42.8 s against 45.5 s storing in turn).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as storer:
        stored = None
        for rows, ids, s in loader.stream(shards):
            if stored is None:
                logger.info("out-of-core build: skeleton of %d rows and staging buffer ready after %.2f s "
                            "more", centre_ids.numel(), time.perf_counter() - started)
            built = _build_shard(rows, ids.to(device), s, primary, centre_ids, skeleton, params, metric)
            del rows
            if stored is not None:
                stored.result()  # one shard's rows waiting on the host at most
            stored = storer.submit(_store_shard, built, ids.cpu(), s, primary, secondary, graph,
                                   second_graph, slot)
            steps.add(ids.numel())
        if stored is not None:
            stored.result()
    logger.info("out-of-core build: %d shards built after %.2f s more", len(members), time.perf_counter() - started)
    return graph, second_graph, slot


def _join_shared(loader: "_RowLoader", graph: Tensor, second_graph: Tensor, slot: Tensor, shared_rows: Tensor,
                 capacity: int, chunk_rows: int, params: BuildParams, metric: str, device: torch.device,
                 steps: _Steps) -> None:
    """Each row two shards hold gets, in ``graph``, the rule's choice among its two rows, a chunk
    of at most ``chunk_rows`` rows at a time (the rows a chunk reads at most ``capacity``)."""
    started = time.perf_counter()
    chunks = _join_chunks(shared_rows, graph, second_graph, slot, capacity, device, chunk_rows)
    for part, candidates, needed in chunks:
        graph[part] = _join(loader.rows(needed), needed, part.to(device), candidates, params, metric)
        steps.add(part.numel())
    logger.info("out-of-core build: %d shared rows joined in %.2f s", shared_rows.numel(),
                time.perf_counter() - started)


def _build_shard(rows: Tensor, ids: Tensor, s: int, primary: Tensor, centre_ids: Tensor, skeleton: Tensor,
                 params: BuildParams, metric: str) -> Tensor:
    """The graph of shard s (``rows`` on the device, global ids ``ids`` ascending), on the host,
    in global ids, its centres' rows joined with their skeleton rows."""
    built = editing.relabel(ops.build(rows, params, metric=metric), ids)
    # The centres this shard owns: their row here joined with their skeleton row.
    centres_here = centre_ids.to(ids.device)
    owned = centres_here[primary[centre_ids].to(ids.device) == s]
    at = torch.searchsorted(ids, owned)
    candidates = torch.cat([built[at].long(), skeleton[torch.searchsorted(centres_here, owned)]], 1)
    candidates = torch.where(candidates >= 0, torch.searchsorted(ids, candidates.clamp_min(0)), -1)
    pruned = editing.prune_rows(rows, metric, at, candidates, params.degree)
    built[at] = editing.relabel(pruned, ids)
    return built.cpu()


def _store_shard(built: Tensor, members: Tensor, s: int, primary: Tensor, secondary: Tensor, graph: Tensor,
                 second_graph: Tensor, slot: Tensor) -> None:
    """Shard s's rows (``built``, host, for the global ids ``members``, host) into ``graph`` for
    the rows it owns and into ``second_graph`` for those it shares as their second. Shards write
    disjoint rows of both."""
    own = primary[members] == s
    graph[members[own]] = built[own]
    shared_here = secondary[members] == s
    second_graph[slot[members[shared_here]]] = built[shared_here]


def _shared_by_cell(secondary: Tensor, cell: Tensor) -> Tensor:
    """The rows of two shards (int64), grouped by their nearest cell, so that the rows of a join
    chunk lie in few regions. On 10M x 1024 clustered rows this did not make the chunks read
    fewer rows (about 18 for each row joined, 17 grouped by pair of shards): a row's second
    shard holds few of its cluster, and the row it got there names rows of other clusters."""
    shared = (secondary >= 0).nonzero().flatten()
    return shared[torch.sort(cell[shared], stable=True).indices]


def _join_chunks(shared: Tensor, graph: Tensor, second_graph: Tensor, slot: Tensor, capacity: int,
                 device: torch.device, chunk_rows: int = JOIN_CHUNK_ROWS) -> Iterator[Tuple[Tensor, Tensor, Tensor]]:
    """``(part, candidates, needed)`` for consecutive chunks of the shared rows: ``part`` the rows
    joined (int64, on the host), ``candidates`` their two rows side by side (int32 [m, 2 x
    degree], global ids, on ``device``), ``needed`` (int64, ascending, on ``device``) the rows a
    join of them reads, at most ``capacity``; at most ``chunk_rows`` rows a chunk.

    Only these rows are copied in, not the two shards of each row (10M x 1024 in 14 shards: the
    joins of 8.8M rows copied 91 pairs of shards of 1.3M rows each and took 26 s; now 12.7 s).
    Which rows a chunk reads is found on the device: found on the host, by the worker thread,
    it took 21-24 s of joins that then took 33-38 s."""
    n = graph.shape[0]
    mark = torch.zeros(n + 1, dtype=torch.bool, device=device)  # the last place takes the -1 padding
    most = max(1, min(chunk_rows, capacity // 4))
    start, take = 0, most
    while start < shared.numel():
        part = shared[start:start + take]
        candidates = torch.cat([graph[part], second_graph[slot[part]]], dim=1).to(device)
        mark[part.to(device)] = True
        mark[candidates.flatten().long()] = True
        mark[n] = False
        needed = mark.nonzero().flatten()
        mark[needed] = False
        if needed.numel() > capacity and take > 1:
            take = max(1, take // 2)  # these rows point far and wide: take fewer at once
            continue
        yield part, candidates, needed
        start += part.numel()
        # The next chunk as large as this one's rows read per row joined lets it be.
        take = max(1, min(most, int(0.9 * capacity * part.numel() / needed.numel())))


class _RowLoader:
    """Chosen rows of ``data`` on the device. Pinned host rows are read by the GPU where they lie
    (``torch.ops.grnnd.gather_rows``, through unified addressing); other host rows are gathered
    on the host into one pinned buffer of ``capacity`` rows, so the copies run at full speed and
    nothing is pinned anew each step (the worker pins it while the caller goes on). In
    :meth:`stream`, the next batch is formed, and its rows gathered on the host where they must
    be, by the worker while the device works on the current one; :meth:`rows` gathers in blocks,
    the worker gathering one while the previous one is copied."""

    def __init__(self, data: Tensor, capacity: int, device: torch.device,
                 worker: concurrent.futures.ThreadPoolExecutor):
        self.data, self.capacity, self.device, self.worker = data, min(capacity, data.shape[0]), device, worker
        host_to_gpu = device.type == "cuda" and data.device.type == "cpu"
        self.direct = host_to_gpu and data.is_contiguous() and data.is_pinned()
        self.staged = host_to_gpu and not self.direct
        self.buffer = worker.submit(self._pin) if self.staged else None
        self.copied: Optional[torch.cuda.Event] = None

    def _pin(self) -> Tensor:
        return torch.empty(self.capacity, self.data.shape[1], dtype=self.data.dtype, pin_memory=True)

    def _gather(self, ids: Tensor) -> Tensor:
        """The rows ``ids`` where data is (in the pinned buffer for a host-to-GPU copy)."""
        ids = ids.to(self.data.device)
        if not self.staged:
            return self.data[ids]
        if self.copied is not None:
            self.copied.synchronize()  # the buffer's last copy to the device has finished
        buffer = self.buffer.result()
        return torch.index_select(self.data, 0, ids, out=buffer[:ids.numel()])

    def _to_device(self, rows: Tensor) -> Tensor:
        rows = rows.to(self.device, non_blocking=True)
        if self.staged:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return rows

    def rows(self, ids: Tensor) -> Tensor:
        """The rows ``ids`` (any number) on the device. Not while a :meth:`stream` is read: both
        gather into the one buffer."""
        if self.direct:
            return torch.ops.grnnd.gather_rows(self.data, ids.to(self.device))
        if not self.staged:
            return self.data[ids.to(self.data.device)].to(self.device)
        # Blocks go through the buffer's two halves in turn: the worker gathers a block into one
        # half once that half's last copy is done, while the other half is being copied (10M x
        # 1024 in 8 GB from a memory-mapped file, one H100: the joins took 24.2 s when each chunk
        # was gathered whole and then copied).
        ids = ids.cpu()
        out = torch.empty(ids.numel(), self.data.shape[1], dtype=self.data.dtype, device=self.device)
        buffer = self.buffer.result()
        block = max(1, min(buffer.shape[0] // 2, STAGE_BLOCK_BYTES // (self.data.shape[1] * self.data.element_size())))
        halves = (buffer[:block], buffer[block:2 * block])
        copied: List[Optional[torch.cuda.Event]] = [self.copied, self.copied]

        def gather(start: int, half: int) -> Tensor:
            if copied[half] is not None:
                copied[half].synchronize()
            part = ids[start:start + block]
            return torch.index_select(self.data, 0, part, out=halves[half][:part.numel()])

        pending = self.worker.submit(gather, 0, 0)
        for i, start in enumerate(range(0, ids.numel(), block)):
            host = pending.result()
            if start + block < ids.numel():
                pending = self.worker.submit(gather, start + block, (i + 1) % 2)
            out[start:start + host.shape[0]].copy_(host, non_blocking=True)
            copied[i % 2] = self.copied = torch.cuda.Event()
            self.copied.record()  # after every copy before it: the whole buffer is free once it is done
        return out

    def stream(self, batches: Iterator[Tuple[Tensor, Any]]) -> Iterator[Tuple[Tensor, Tensor, Any]]:
        """``(rows on the device, ids, payload)`` for each ``(ids, payload)`` of ``batches``
        (which the worker advances), ``ids`` at most ``capacity`` row ids."""
        def next_batch():
            item = next(batches, None)
            if item is None or self.direct:
                return item
            return self._gather(item[0]), item[0], item[1]

        pending = self.worker.submit(next_batch)
        try:
            while True:
                item = pending.result()
                if item is None:
                    return
                if self.direct:
                    (ids, payload), rows = item, self.rows(item[0])
                else:
                    host_rows, ids, payload = item
                    rows = self._to_device(host_rows)
                pending = self.worker.submit(next_batch)
                yield rows, ids, payload
                # Dropped before the next batch's rows come in: held here, two shards' rows were
                # on the device at once.
                del rows
        finally:
            pending.cancel()


def _join(rows: Tensor, needed: Tensor, part: Tensor, candidates: Tensor, params: BuildParams,
          metric: str) -> Tensor:
    """New rows for ``part`` (on the host): each pruned by the build's rule from its two rows (one
    from each shard's build), with ``rows`` the rows ``needed`` (ascending ids) on the device."""
    def local(ids: Tensor) -> Tensor:
        return torch.searchsorted(needed, ids.clamp_min(0).long())

    candidates = torch.where(candidates >= 0, local(candidates), -1)
    pruned = editing.prune_rows(rows, metric, local(part), candidates, params.degree)
    return editing.relabel(pruned, needed).cpu()
