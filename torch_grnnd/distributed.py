"""Indexes and exact k-NN over data spread across the ranks of a ``torch.distributed`` group.

Works in any initialised process group (NCCL between GPUs, gloo on CPUs, one or many hosts, any
number of ranks), with the collectives PyTorch already runs:

- :class:`ShardedIndex`: each rank indexes its own rows (its shard). A search gathers every
  rank's queries, searches them on every shard, and returns to each rank the best k of its own
  queries over all shards (one all-gather of the queries, one all-to-all of the per-shard top k).
  Built with ``partition=True``, the rows move first to the rank of their cell (a balanced
  k-means over all ranks' rows: a centre a rank, or cells grouped by rank), and a search sends
  each query only to the shards of its nearest cells, or to its own cell's shard and then to the
  shards whose cells' borders lie within the k-th distance found there (all-to-alls of the
  queries and of the answers), so that the work per query does not grow with the number of
  shards.
- :class:`ReplicatedIndex`: every rank holds the whole index; a batch that every rank passes is
  split between them and each rank gets the whole answer (throughput).
- :func:`knn` and :func:`knn_graph`: exact neighbours over sharded data, the same exchange.

Ids are global: a shard's rows are numbered after the rows of the ranks before it (rank offset
plus local row), unless the rows carry user ids. Before any exchange the ranks compare what must
agree (width, dtype, k, metric, ids or not) in one small all-gather, and if anything differs
every rank raises the same error instead of some of them waiting in a collective that the others
never enter. Collectives otherwise wait as long as the process group's ``timeout`` (given to
``init_process_group``) allows.

Each rank's state is its own (:meth:`ShardedIndex.state_dict`): save it per rank, or with
``torch.distributed.checkpoint``; :meth:`ShardedIndex.from_state_dicts` restores them onto fewer
ranks. A sharded index takes :meth:`~ShardedIndex.add`, :meth:`~ShardedIndex.remove` and
:meth:`~ShardedIndex.compact` with every rank taking part.
"""
import dataclasses
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .index import Index, merge
from .params import BuildParams, SearchParams
from .progress import Progress
from .results import best_k, padded, without_own

# One all-gather into one tensor: all_gather_single in newer PyTorch, which deprecates the older name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_METRICS = ["l2", "ip", "cosine"]


def init_process_group(device: str = "cuda") -> torch.device:
    """Join the process group that ``torchrun`` describes (its environment variables) and return
    this process's device: with ``device="cuda"``, GPU ``LOCAL_RANK`` made current and NCCL
    between the GPUs; with ``"cpu"``, gloo. Call it once per process, before any op of this
    module.

    Example (``torchrun --nproc_per_node=4 job.py``)::

        device = grnnd.distributed.init_process_group()
        index = grnnd.distributed.ShardedIndex.build(my_rows.to(device))
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f'device: expected "cuda" or "cpu", got {device!r}')
    if device == "cuda":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return where


def _comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Host-side (gloo) groups beside NCCL ones, for agreements made while the GPU works (_agree with
# on_host). A few ints gathered by NCCL queue behind every collective queued before them on the
# GPU (the previous call's exchange, and so its search), and reading them back makes the host wait
# for all of that: each call would start only once the GPU had drained. Gathered by gloo they wait
# for the other ranks alone. On an idle GPU NCCL's round trip is the cheaper one (sharded searches
# of 10 000 queries on two H200s: 1.58-1.75M q/s with every agreement on gloo, 1.71-1.89M on
# NCCL), so only a call that has queued its own GPU work before agreeing takes this path
# (ReplicatedIndex.search).
_HOST_GROUPS: Dict[Any, dist.ProcessGroup] = {}


def _host_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """A gloo group of ``group``'s ranks when ``group`` is NCCL's and spans every rank, made on
    first use and kept; else ``group`` itself. Every rank of ``group`` makes its agreements in the
    same order, so with ``group`` spanning the world all ranks reach ``new_group`` together, as a
    plain ``new_group`` needs. A group of fewer ranks would need ``use_local_synchronization``,
    whose creation hangs once any other group has been made (gloo, torch 2.11 and 2.13): such a
    group agrees over NCCL."""
    if dist.get_backend(group) != "nccl" or dist.get_world_size(group) != dist.get_world_size():
        return group
    key = group if group is not None else dist.group.WORLD
    host = _HOST_GROUPS.get(key)
    if host is None:
        host = dist.new_group(backend="gloo")
        _HOST_GROUPS[key] = host
    return host


def _agree(group: Optional[dist.ProcessGroup], what: str, on_host: bool = False, **fields: int) -> List[List[int]]:
    """Every rank's values of ``fields`` (ints), after checking that they are equal on all ranks
    (fields named ``*_each`` may differ); raises on every rank where they are not. ``on_host``:
    gathered on the host where _host_group gives a host group, waiting for no GPU work."""
    names = list(fields)
    gather_group = _host_group(group) if on_host else group
    device = _comm_device(gather_group)  # a subgroup under NCCL still agrees through NCCL, on the GPU
    mine = torch.tensor([fields[n] for n in names], dtype=torch.long, device=device)
    everyone = torch.empty(dist.get_world_size(group) * len(names), dtype=torch.long, device=device)
    _all_gather_single(everyone, mine, group=gather_group)
    table = everyone.view(-1, len(names)).tolist()
    # A rank that failed before it knew a setting sends -1 for it, which is not compared.
    failed = [bool(row[names.index("failed_each")]) for row in table] if "failed_each" in fields else None
    for j, name in enumerate(names):
        if name.endswith("_each"):
            continue
        values = [row[j] for row in table]
        if len({v for r, v in enumerate(values) if not (failed and failed[r] and v == -1)}) > 1:
            raise ValueError(f"{what}: the ranks disagree on {name}: {values} (rank by rank); every rank must "
                             "pass the same")
    return table


def _all_gather_rows(t: Tensor, sizes: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every rank's ``t`` ([sizes[r], ...] on rank r), concatenated in rank order (one collective
    into one tensor; shorter shares are padded to the longest for it)."""
    device = _comm_device(group)
    most = max(sizes)
    mine = t.to(device)
    if t.shape[0] < most:
        mine = torch.cat([mine, mine.new_zeros((most - t.shape[0], *t.shape[1:]))])
    everyone = torch.empty((len(sizes) * most, *t.shape[1:]), dtype=t.dtype, device=device)
    _all_gather_single(everyone, mine.contiguous(), group=group)
    if min(sizes) < most:
        everyone = torch.cat([everyone[r * most:r * most + s] for r, s in enumerate(sizes)])
    return everyone.to(t.device)


def _packed(dists: Tensor, ids: Tensor) -> Tensor:
    """Results ``(float32 [q, k], int64 [q, k])`` as one int32 tensor [q, k, 3] (the bits of each),
    so that one collective moves both."""
    return torch.cat([dists.contiguous().view(torch.int32).unsqueeze(2),
                      ids.contiguous().view(torch.int32).view(*ids.shape, 2)], dim=2)


def _unpacked(packed: Tensor) -> Tuple[Tensor, Tensor]:
    """Inverse of :func:`_packed`."""
    if packed.numel() == 0:  # an empty slice keeps its offset, which a view as int64 refuses
        return (torch.empty(packed.shape[:-1], device=packed.device),
                torch.empty(packed.shape[:-1], dtype=torch.long, device=packed.device))
    return (packed[..., 0].contiguous().view(torch.float32),
            packed[..., 1:].contiguous().view(torch.int64).squeeze(-1))


def _exchange(dists: Tensor, ids: Tensor, sizes: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, Tensor]:
    """This rank's answers for every rank's queries (rows in rank order, ``sizes`` each) in, the
    answers of every rank for this rank's queries out: ``[world, my queries, k]`` each (one
    all-to-all)."""
    device, home = _comm_device(group), dists.device
    mine = sizes[dist.get_rank(group)]
    send = _packed(dists, ids).to(device)
    receive = torch.empty((len(sizes) * mine, *send.shape[1:]), dtype=send.dtype, device=device)
    dist.all_to_all_single(receive, send, output_split_sizes=[mine] * len(sizes), input_split_sizes=list(sizes),
                           group=group)
    return _unpacked(receive.view(len(sizes), mine, *send.shape[1:]).to(home))


def _best(dists: Tensor, ids: Tensor, k: int, ids_follow_ranks: bool = False) -> Tuple[Tensor, Tensor]:
    """The k best of ``[parts, q, k']`` candidates per query (:func:`results.best_k`: ascending by
    (distance, id), (inf, -1) padded). ``ids_follow_ranks``: every id of a part is below every id
    of the parts after it (rank offsets), so a single sort does."""
    return best_k(dists.permute(1, 0, 2).flatten(1), ids.permute(1, 0, 2).flatten(1), k, ids_ordered=ids_follow_ranks)


class RanksFailed(RuntimeError):
    """Raised on every rank of a collective call whose work failed on some ranks (the others'
    error; a failed rank raises its own)."""


def _matrix_fields(t: Any) -> Tuple[int, int, int]:
    """(rows, columns, index in _DTYPES) of ``t`` as the ranks compare them, -1 for each that
    ``t`` lacks (not a 2-D tensor, not a floating dtype): read without raising, so that a rank
    passing something else enters the agreement and every rank raises there."""
    tensor = isinstance(t, Tensor)
    matrix = tensor and t.dim() == 2
    return (t.shape[0] if matrix else -1, t.shape[1] if matrix else -1,
            _DTYPES.index(t.dtype) if tensor and t.dtype in _DTYPES else -1)


def _type_name(t: Any) -> str:
    return str(t.dtype) if isinstance(t, Tensor) else type(t).__name__


def _setup(what: str, group: Optional[dist.ProcessGroup], data: Tensor, metric: str,
           queries: Optional[Tensor] = None, on_host: bool = False, failure: Optional[Exception] = None,
           **extra: int) -> Tuple[int, int, List[int]]:
    """``(offset, total, query_sizes)``: this rank's first global id, the rows on all ranks and
    every rank's number of queries, once the ranks agree on everything that must be equal.
    Nothing here raises on one rank alone: what is checked is the same on every rank. A
    ``failure`` (this rank's own work failed, or would) is part of the agreement: after the
    checks, a rank with one raises it and the others RanksFailed (a setting the failed rank could
    not know, passed as -1, is not compared). ``on_host``: as :func:`_agree`."""
    rows, dim, dtype = _matrix_fields(data)
    fields = dict(rows_each=rows, dim=dim, dtype=dtype,
                  metric=_METRICS.index(metric) if metric in _METRICS else -1,
                  failed_each=int(failure is not None), **extra)
    if queries is not None:
        rows, dim, dtype = _matrix_fields(queries)
        fields.update(queries_each=rows, query_dim=dim, query_dtype=dtype)
    table = _agree(group, what, on_host, **fields)
    column = {name: [row[j] for row in table] for j, name in enumerate(fields)}
    if min(column["rows_each"]) < 0 or fields["dim"] < 0 or (queries is not None and min(column["queries_each"]) < 0):
        raise ValueError(f"{what}: expected 2-D tensors [rows, dim] on every rank")
    if fields["dtype"] < 0 or (queries is not None and fields["query_dtype"] < 0):
        raise TypeError(f"{what}: expected floating-point tensors, got {_type_name(data)}"
                        + ("" if queries is None else f" and {_type_name(queries)}"))
    if fields["metric"] < 0:
        raise ValueError(f'{what}: metric must be "l2", "ip" or "cosine", got {metric!r}')
    if queries is not None and fields["query_dim"] != fields["dim"]:
        raise ValueError(f"{what}: queries have {fields['query_dim']} columns, the data {fields['dim']}")
    if failure is not None:
        raise failure
    failed = [r for r, flag in enumerate(column["failed_each"]) if flag]
    if failed:
        raise RanksFailed(f"{what}: failed on rank(s) {failed}, see their error")
    sizes = column["rows_each"]
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes), column.get("queries_each", [])


def _search_everywhere(local_search, queries: Tensor, k: int, sizes: Sequence[int],
                       group: Optional[dist.ProcessGroup], ids_follow_ranks: bool) -> Tuple[Tensor, Tensor]:
    """Every rank's queries (``sizes`` each) searched on every shard by
    ``local_search(all_queries, k)``, which returns global ids; this rank's queries' best k.
    Nothing here waits for the GPU: the search returns once its kernels are queued, and the
    exchange and the merge queue behind them."""
    everyone = _all_gather_rows(queries, sizes, group)
    dists, ids = local_search(everyone, k)
    dists, ids = _exchange(dists, ids, sizes, group)
    return _best(dists, ids, k, ids_follow_ranks)


def _on_this_rank(state: Dict[str, Any], group: Optional[dist.ProcessGroup]) -> Dict[str, Any]:
    """A saved shard's state (nested dicts of tensors) on this rank's device when another rank's
    shard comes here: under NCCL this rank's GPU (a state loaded as saved keeps the saving rank's
    GPU), else where it was saved (gloo ranks share their devices)."""
    if dist.get_backend(group) != "nccl":
        return state
    device = _comm_device(group)

    def moved(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.to(device)
        return {key: moved(item) for key, item in value.items()} if isinstance(value, dict) else value
    return moved(state)


def _no_rows(queries: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The answer of a shard without rows: all padding."""
    return (torch.full((queries.shape[0], k), float("inf"), device=queries.device),
            torch.full((queries.shape[0], k), -1, dtype=torch.long, device=queries.device))


def knn(local_data: Tensor, queries: Tensor, k: int, *, metric: ops.Metric = "l2",
        group: Optional[dist.ProcessGroup] = None) -> Tuple[Tensor, Tensor]:
    """Exact k nearest neighbours of this rank's ``queries`` among the rows of every rank's
    ``local_data``: ``(dists float32 [Q, k], ids int64 [Q, k])`` with global ids (rank offset
    plus row), ascending, (inf, -1) padded where all ranks together hold fewer than k rows.
    Called by every rank of ``group``."""
    offset, total, sizes = _setup("knn", group, local_data, metric, queries, k=k)
    if k < 1 or k > total:
        raise ValueError(f"k: expected 1 <= k <= {total} (rows on all ranks), got {k}")

    def local(everyone: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        n = local_data.shape[0]
        if n == 0:
            return _no_rows(everyone, k)
        dists, ids = ops.knn(local_data, everyone.to(local_data.dtype), min(k, n), metric=metric)
        return padded(dists, ids + offset, k)

    return _search_everywhere(local, queries, k, sizes, group, ids_follow_ranks=True)


def knn_graph(local_data: Tensor, k: int, *, metric: ops.Metric = "l2",
              group: Optional[dist.ProcessGroup] = None) -> Tuple[Tensor, Tensor]:
    """Exact k nearest other rows of each of this rank's rows among the rows of all ranks:
    ``(dists [n, k], ids [n, k])``, global ids, the row itself left out (a duplicate of it may
    stay). Called by every rank of ``group``."""
    offset, total, _ = _setup("knn_graph", group, local_data, metric, k=k)
    if k < 1 or k >= total:
        raise ValueError(f"k: expected 1 <= k <= {total - 1} (rows on all ranks minus the row itself), got {k}")
    dists, ids = knn(local_data, local_data, k + 1, metric=metric, group=group)
    return without_own(dists, ids, torch.arange(offset, offset + local_data.shape[0], device=ids.device)[:, None])


# Partitioned shards. A k-means runs on a sample of every rank's rows (_SAMPLE_PER_CELL rows a
# cell, _PARTITION_ROUNDS Lloyd rounds): one balanced centre a rank, or several cells a rank that
# are then grouped into one part a rank by a k-means of their centres weighted by their rows; a
# bias a rank, found in _BALANCE_ROUNDS rounds, evens the parts' rows.
_PARTITION_SAMPLE = 32_768
_SAMPLE_PER_CELL = 512  # half fits the cells, half sizes and balances them
_PARTITION_ROUNDS = 12
_BALANCE_ROUNDS = 64
_ASSIGN_ROWS = 1 << 16  # rows scored against the cells at a time


def _centre_distances(x: Tensor, centres: Tensor, metric: str) -> Tensor:
    """float32 [n, C]: each row's distance to each centre under ``metric`` (squared l2; 1 - cos;
    -<x, c>), in chunks that bound the float32 copy of the rows."""
    parts = []
    c = centres.float()
    if metric == "cosine":
        c = torch.nn.functional.normalize(c, dim=1)
    for start in range(0, x.shape[0], _ASSIGN_ROWS):
        rows = x[start:start + _ASSIGN_ROWS].float()
        if metric == "cosine":
            rows = torch.nn.functional.normalize(rows, dim=1)
        dots = rows @ c.T
        if metric == "l2":
            parts.append(rows.square().sum(1, keepdim=True) - 2 * dots + c.square().sum(1))
        else:
            parts.append((1 - dots) if metric == "cosine" else -dots)
    return torch.cat(parts) if parts else x.new_zeros(0, c.shape[0], dtype=torch.float32)


def _balanced_parts(dists: Tensor, weights: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(parts [n], bias [W])``: each row's part argmin(dists + bias), with the bias raised for
    parts above an equal share of the rows' ``weights`` (ones by default) and lowered for those
    below until the shares are about equal."""
    n, w = dists.shape
    bias = torch.zeros(w, device=dists.device)
    total = float(weights.sum()) if weights is not None else float(n)
    scale = float(dists[dists.isfinite()].std()) if n > 1 else 1.0
    best, best_bias = float("inf"), bias.clone()
    for step in range(_BALANCE_ROUNDS):
        parts = (dists + bias).argmin(1)
        share = torch.bincount(parts, weights=weights, minlength=w).float() * w / max(total, 1e-30)
        worst = float((share - 1).abs().max())
        if worst < best:  # the most even bias seen: a step may overshoot where few rows move at once
            best, best_bias = worst, bias.clone()
        bias += scale * (share - 1) / (4 + step)  # steps that shrink: it settles
    return (dists + best_bias).argmin(1), best_bias


def _kmeans(x: Tensor, k: int, metric: str, generator: torch.Generator, weights: Optional[Tensor] = None,
            balanced: bool = False) -> Tuple[Tensor, Tensor]:
    """``(centres [k, D], parts [n])``: Lloyd rounds from k distinct random rows of ``x`` (float32),
    weighted by ``weights``; ``balanced``: each round's assignment evens the parts' weights
    (:func:`_balanced_parts`). An empty part keeps its centre."""
    first = torch.randperm(x.shape[0], generator=generator)[:k].to(x.device)
    c = x[first].clone()
    w = torch.ones(x.shape[0], device=x.device) if weights is None else weights.float()
    for round_ in range(_PARTITION_ROUNDS + 1):
        dists = _centre_distances(x, c, metric)
        parts = _balanced_parts(dists, w)[0] if balanced else dists.argmin(1)
        if round_ == _PARTITION_ROUNDS:  # the last assignment, to the final centres
            break
        sums = torch.zeros_like(c).index_add_(0, parts, x * w[:, None])
        counts = torch.zeros(k, device=x.device).index_add_(0, parts, w)[:, None]
        c = torch.where(counts > 0, sums / counts.clamp_min(1e-30), c)
    return c, parts


@dataclasses.dataclass
class Partition:
    """Where a partitioned index's rows live. A row belongs to the cell j of least
    ``distance(row, centres[j]) + bias[j]`` (a power diagram of the cells), on rank ``owner[j]``;
    ``bias`` is the same for every cell of a rank. Under l2 and cosine a search can tell which
    shards may hold a query's neighbours: a cell's rows lie beyond the border between it and the
    query's own cell, so a shard none of whose cells has that border within the query's k-th
    distance holds none of them (:meth:`reachable`). ``bias=None`` (a partition saved before the
    biases were kept) and the ip metric, which has no such borders, route by nearness alone."""

    centres: Tensor  # float32 [C, D]
    bias: Optional[Tensor]  # float32 [C]
    owner: Tensor  # int64 [C]
    world: int
    metric: str

    def __post_init__(self):
        c = self.centres.float()
        if self.metric == "cosine":
            c = torch.nn.functional.normalize(c, dim=1)
        # Twice the distance between each two cells' centres: the scale of their power border.
        self._apart = (2 * torch.cdist(c, c)).fill_diagonal_(float("inf")).clamp_min(1e-30)
        # A centre a rank, in rank order: the cells' order is the ranks' (no reduction per rank).
        self._cell_a_rank = self.owner.numel() == self.world and bool(
            (self.owner == torch.arange(self.world, device=self.owner.device)).all())

    def scores(self, x: Tensor) -> Tensor:
        """float32 [n, C]: each row's power (distance + bias) to each cell."""
        d = _centre_distances(x, self.centres, self.metric)
        return d if self.bias is None else d + self.bias

    def ranks(self, x: Tensor) -> Tensor:
        """int64 [n]: the rank whose shard holds (or would hold) each row, in chunks of rows."""
        parts = [self.owner[self.scores(x[s:s + _ASSIGN_ROWS]).argmin(1)] for s in range(0, x.shape[0], _ASSIGN_ROWS)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=x.device)

    def rank_order(self, scores: Tensor) -> Tensor:
        """int64 [n, W]: the ranks by each row's best cell on them, nearest first."""
        if self._cell_a_rank:
            return scores.argsort(1)
        best = torch.full((scores.shape[0], self.world), float("inf"), device=scores.device)
        best.scatter_reduce_(1, self.owner.expand(scores.shape[0], -1), scores, reduce="amin")
        return best.argsort(1)

    def reachable(self, scores: Tensor, radius_sq: Tensor) -> Tensor:
        """bool [n, W]: the shards that may hold rows within ``radius_sq`` (a distance under the
        metric: squared l2, or 1 - cos) of each row whose ``scores`` these are. A cell j can hold
        such a row only if the border between it and the row's own cell h, the hyperplane where
        their powers are equal, lies within that radius: ``(power_j - power_h) / (2 norm(c_j -
        c_h))``, on unit vectors for cosine (where squared l2 is twice 1 - cos). The borders are
        taken a thousandth nearer for float32's rounding."""
        own = scores.argmin(1)
        to_sq_l2 = 2.0 if self.metric == "cosine" else 1.0
        gap = to_sq_l2 * (scores - scores.gather(1, own[:, None])) / self._apart[own]
        radius = (to_sq_l2 * radius_sq.clamp_min(0)).sqrt()
        near = (gap <= radius[:, None] * 1.001).float()
        return torch.zeros(scores.shape[0], self.world, device=scores.device).index_add_(1, self.owner, near) > 0

    def state(self) -> Dict[str, Any]:
        return {"centres": self.centres, "bias": self.bias, "owner": self.owner}


def _plan_partition(sample: Tensor, world: int, metric: str, seed: int, cells: int = 1) -> Partition:
    """The partition of ``world`` ranks that a sample of all rows (float32) gives. ``cells=1``:
    a balanced k-means with one centre a rank (each Lloyd round's assignment evened by the bias).
    More ``cells`` a rank: cells by k-means on one half of the sample, grouped into parts by a
    balanced k-means of the cell centres weighted by the rows of the other half in each, then a
    bias a rank that evens the other half's rows between the ranks. Sizes and balance come from
    rows the cells were not fitted to: in high dimensions a cell is nearer to the rows it was
    fitted to than to other rows of the same places (at 100M x 1024 in 100 000 clusters,
    balanced on the fitted rows, two ranks got 36M and 41M rows of 25M shares)."""
    generator = torch.Generator().manual_seed(seed)
    if cells == 1:
        centres, _ = _kmeans(sample, world, metric, generator, balanced=True)
        _, bias = _balanced_parts(_centre_distances(sample, centres, metric))
        return Partition(centres, bias, torch.arange(world, device=sample.device), world, metric)
    order = torch.randperm(sample.shape[0], generator=generator).to(sample.device)
    half = max(1, sample.shape[0] // 2)
    fit, held = sample[order[:half]], sample[order[half:]] if sample.shape[0] > 1 else sample
    cells = min(cells * world, fit.shape[0])
    centres, _ = _kmeans(fit, cells, metric, generator)
    dists = _centre_distances(held, centres, metric)
    rows = torch.bincount(dists.argmin(1), minlength=cells).float()
    kept = rows > 0  # a cell without rows owns nothing and borders nothing
    centres, rows, dists = centres[kept], rows[kept], dists[:, kept]
    _, owner = _kmeans(centres, world, metric, generator, weights=rows, balanced=True)
    per_rank = torch.full((held.shape[0], world), float("inf"), device=held.device)
    per_rank.scatter_reduce_(1, owner.expand(held.shape[0], -1), dists, reduce="amin")
    _, rank_bias = _balanced_parts(per_rank)
    return Partition(centres, rank_bias[owner], owner, world, metric)


def _partition(local_data: Tensor, metric: str, sizes: Sequence[int], group: Optional[dist.ProcessGroup],
               seed: int, cells: int) -> Partition:
    """The partition (:func:`_plan_partition`) of a sample of every rank's rows, planned on rank
    0 and broadcast, so that every rank holds the same."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    total = sum(sizes)
    wanted = max(_PARTITION_SAMPLE, _SAMPLE_PER_CELL * cells * world)
    take = [min(s, -(-wanted * s // max(total, 1))) for s in sizes]
    generator = torch.Generator(device="cpu").manual_seed(seed + rank)
    picked = torch.randperm(sizes[rank], generator=generator)[:take[rank]].to(local_data.device)
    sample = _all_gather_rows(local_data[picked].float(), take, group)
    device = _comm_device(group)
    count = torch.zeros(1, dtype=torch.long, device=device)
    if rank == 0:
        plan = _plan_partition(sample.to(device), world, metric, seed, cells)
        parts = [plan.centres, plan.bias, plan.owner]
        count[0] = plan.centres.shape[0]
    dist.broadcast(count, 0, group=group)
    if rank != 0:
        c = int(count)
        parts = [torch.empty(c, local_data.shape[1], device=device), torch.empty(c, device=device),
                 torch.empty(c, dtype=torch.long, device=device)]
    for t in parts:
        dist.broadcast(t, 0, group=group)
    centres, bias, owner = (t.to(local_data.device) for t in parts)
    return Partition(centres, bias, owner, world, metric)


def _all_to_all_rows(rows: Tensor, counts: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, List[int]]:
    """Rows sent to the ranks in rank order (``counts[r]`` to rank r), and the rows every rank
    sent here, in rank order, with how many came from each (one all-to-all of the counts, one of
    the rows)."""
    device, home = _comm_device(group), rows.device
    world = dist.get_world_size(group)
    sent = torch.tensor(list(counts), dtype=torch.long, device=device)
    got = torch.empty(world, dtype=torch.long, device=device)
    dist.all_to_all_single(got, sent, group=group)
    got_counts = got.tolist()
    received = torch.empty((sum(got_counts), *rows.shape[1:]), dtype=rows.dtype, device=device)
    dist.all_to_all_single(received, rows.to(device).contiguous(), output_split_sizes=got_counts,
                           input_split_sizes=list(counts), group=group)
    return received.to(home), got_counts


# Rows sorted and sent per round of a partition's exchange: the sorted copy stays this small
# while the rows it moves may fill most of a GPU.
_EXCHANGE_BYTES = 1 << 30


def _to_ranks(rows: Tensor, ids: Tensor, parts: Tensor,
              group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, Tensor]:
    """This rank's share of every rank's ``rows`` (and their ids) once each row has gone to its
    rank in ``parts`` (by a partition, :meth:`Partition.ranks`, or to even the shards,
    :func:`_least_loaded_ranks`). The rows move in rounds of at most ``_EXCHANGE_BYTES`` per
    rank, each received straight into its place in one buffer, so the memory it needs beyond the
    rows it keeps and gets is one round's."""
    world, n = dist.get_world_size(group), rows.shape[0]
    device = _comm_device(group)
    per_round = max(1, _EXCHANGE_BYTES // max(1, rows[:1].numel() * rows.element_size()))
    rounds = torch.tensor([-(-n // per_round)], dtype=torch.long, device=device)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)
    counts = torch.bincount(parts, minlength=world).to(device)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    received = torch.empty((int(got.sum()), *rows.shape[1:]), dtype=rows.dtype, device=device)
    received_ids = torch.empty(received.shape[0], dtype=ids.dtype, device=device)
    filled = 0
    for start in range(0, int(rounds) * per_round, per_round):  # a rank out of rows sends nothing
        block = parts[start:start + per_round]
        order = torch.argsort(block, stable=True) + start
        sent = torch.bincount(block, minlength=world).to(device)
        dist.all_to_all_single(got, sent, group=group)
        out, into = sent.tolist(), got.tolist()
        end = filled + sum(into)
        for source, place in ((rows, received), (ids, received_ids)):
            dist.all_to_all_single(place[filled:end], source[order].to(device).contiguous(), output_split_sizes=into,
                                   input_split_sizes=out, group=group)
        filled = end
    return received.to(rows.device), received_ids.to(ids.device)


def _least_loaded_ranks(rows_each: Sequence[int], live_each: Sequence[int], rank: int,
                        device: torch.device) -> Tensor:
    """The rank each of this rank's ``rows_each[rank]`` new rows goes to so that the shards' live
    rows (``live_each``) end as even as they can: every rank's new rows, in rank order, fill the
    least-loaded shards up to a common level (water filling), what rounding leaves over going
    to the lower ranks at that level. Every rank computes the same placement from the same
    table."""
    total = sum(rows_each)
    # The lowest level with room for every new row: the i least-loaded shards filled to
    # ceil((total + their rows) / i), for the first i where that leaves the next shard untouched.
    order, held = sorted(live_each), 0
    for i, live in enumerate(order, 1):
        held += live
        level = -(-(total + held) // i)
        if i == len(order) or level <= order[i]:
            break
    quotas = [max(0, level - live) for live in live_each]
    excess = sum(quotas) - total  # < the ranks at the level: one fewer for the highest of them
    for r in reversed(range(len(quotas))):
        if excess == 0:
            break
        if quotas[r] > 0 and live_each[r] + quotas[r] == level:
            quotas[r] -= 1
            excess -= 1
    ends = torch.tensor(quotas, dtype=torch.long).cumsum(0)
    first = sum(rows_each[:rank])
    places = torch.arange(first, first + rows_each[rank], dtype=torch.long)
    return torch.searchsorted(ends, places, right=True).to(device)


def _routed(local_search, queries: Tensor, pairs: Tensor, k: int,
            group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, Tensor]:
    """``(dists, ids)`` [P, k] of (query, rank) ``pairs`` [P, 2]: each pair's query searched on
    its rank's shard by ``local_search(received_queries, k)`` (one all-to-all of the queries
    there, one of the answers back; every rank calls it, with pairs or none)."""
    world = dist.get_world_size(group)
    order = torch.argsort(pairs[:, 1], stable=True)  # the pairs by the rank they go to
    counts = torch.bincount(pairs[:, 1], minlength=world).tolist()
    received, got_counts = _all_to_all_rows(queries[pairs[order, 0]], counts, group)
    dists, ids = local_search(received, k)
    # Back where each pair came from: the answers arrive in the order the pairs were sent.
    device, home = _comm_device(group), queries.device
    back = torch.empty((pairs.shape[0], k, 3), dtype=torch.int32, device=device)
    dist.all_to_all_single(back, _packed(dists, ids).to(device), output_split_sizes=counts,
                           input_split_sizes=got_counts, group=group)
    answers = torch.empty_like(back)
    answers[order.to(device)] = back
    return _unpacked(answers.to(home))


def _saved_partition(state: Dict[str, Any], world: int, local: Index) -> Optional[Partition]:
    """The partition a rank's saved state holds: its cells, or the one centre a rank (no biases)
    of states saved before cells; checked against the shard's width and the ranks."""
    saved = state.get("partition")
    if saved is None and state.get("centres") is not None:  # one centre a rank, routed by nearness
        saved = {"centres": state["centres"], "bias": None, "owner": torch.arange(world)}
    if saved is None:
        return None
    centres, bias, owner = saved.get("centres"), saved.get("bias"), saved.get("owner")
    dim = local.data.shape[1]
    ok = (isinstance(centres, Tensor) and centres.dim() == 2 and centres.shape[1] == dim
          and isinstance(owner, Tensor) and tuple(owner.shape) == (centres.shape[0],)
          and bool(((owner >= 0) & (owner < world)).all())
          and (bias is None or (isinstance(bias, Tensor) and tuple(bias.shape) == (centres.shape[0],))))
    if not ok:
        raise ValueError(f"state: partition must hold centres [C, {dim}], owner [C] of ranks below {world} and "
                         "bias [C] or None")
    where = local.data.device
    return Partition(centres.float().to(where), None if bias is None else bias.float().to(where),
                     owner.long().to(where), world, local.metric)


class ShardedIndex:
    """One index over the rows of every rank: each rank holds and searches its own shard.

    Example (under ``torchrun``, after ``dist.init_process_group``)::

        index = ShardedIndex.build(my_rows)            # my_rows: this rank's [n_r, D]
        dists, ids = index.search(my_queries, k=10)    # global ids over all ranks' rows
    """

    def __init__(self, local: Index, offset: int, total: int, group: Optional[dist.ProcessGroup] = None,
                 user_ids: bool = True, partition: Optional[Partition] = None, probes: Optional[int] = None):
        """Wrap this rank's ``local`` index (whose search returns global ids) of ``total`` rows
        in all, this shard's first being global id ``offset``. ``user_ids=False`` says the ids
        are rank offset plus row, so that no id of a rank exceeds one of a later rank (a merge of
        the shards' answers then needs one sort instead of two). ``partition``: where a
        partitioned index's rows live, which its searches route by; ``probes``: the shards a
        query visits there (None: every shard that may hold its neighbours, see :meth:`build`)."""
        self.local, self.offset, self.total, self.group = local, offset, total, group
        self.user_ids = user_ids
        self.partition, self.probes = partition, probes
        # Without user ids the index numbers the vectors it gets: the next number to give.
        self.next_id: Optional[int] = None
        # Shards a query of this rank visited in its last search, on average: 1 for a partitioned
        # index whose queries all stayed in their own shard, the ranks for the all-shards search.
        self.shards_per_query = float("nan")

    @classmethod
    def build(cls, local_data: Tensor, params: Optional[BuildParams] = None, *, metric: ops.Metric = "l2",
              ids: Optional[Tensor] = None, group: Optional[dist.ProcessGroup] = None, progress: Progress = False,
              partition: bool = False, probes: Optional[int] = 2, cells: int = 1,
              **settings: Any) -> "ShardedIndex":
        """Build this rank's shard of ``local_data`` (every rank of ``group`` calls it with its
        own rows, the same width, dtype and metric). ``ids``: optional int64 user ids of the
        local rows (on every rank or none; distinct across all ranks, which is not checked);
        without them a row's id is the rank offset plus its local row.

        ``partition=True``: first place the rows by proximity. A balanced k-means on a sample
        of all ranks' rows gives each rank a centre (``cells=1``), or cuts the data into
        ``cells`` cells a rank that are grouped into one part a rank with their neighbours; every
        row goes to the rank of its cell (all-to-all; its id goes with it, so ids keep naming the
        rows the callers passed). The shards differ in size by a few percent of a share.

        A search sends each query to the ``probes`` shards of its nearest cells (one exchange).
        ``probes=None`` (l2 and cosine): to the shard of its own cell, then to every other shard
        that may hold rows nearer than the k-th it found there (:meth:`Partition.reachable`; a
        second exchange), which finds what a search of every shard finds. That pays where
        neighbourhoods seldom cross the cells' borders: in a few dimensions, and with many cells
        a rank, which keep small clusters whole there. In hundreds of dimensions every border is
        near every query and it visits every shard; there, and with cells a rank, a cluster that
        the sample missed can be split between the ranks (``benchmarks/README.md``, several
        GPUs)."""
        offset, total, sizes = _setup("ShardedIndex.build", group, local_data, metric, has_ids=int(ids is not None),
                                      partition=int(partition), probes=-1 if probes is None else probes,
                                      cells=cells)
        user_ids = ids is not None
        numbered = ids is None
        if ids is None:
            ids = torch.arange(offset, offset + local_data.shape[0], device=local_data.device)
        placed = None
        if partition:
            world = dist.get_world_size(group)
            if probes is not None and not 1 <= probes <= world:
                raise ValueError(f"probes: expected 1 <= probes <= {world} (the ranks) or None, got {probes}")
            sizes = _agree(group, "ShardedIndex.build", rows_each=local_data.shape[0])
            if cells < 1:
                raise ValueError(f"cells: expected at least 1 a rank, got {cells}")
            placed = _partition(local_data, metric, [row[0] for row in sizes], group,
                                BuildParams.merge(params, seed=settings.get("seed")).seed, cells)
            local_data, ids = _to_ranks(local_data, ids, placed.ranks(local_data), group)
            user_ids = True  # a shard's ids no longer follow the ranks
        local = Index.build(local_data, params, metric=metric, ids=ids, progress=progress, **settings)
        index = cls(local, offset if placed is None else 0, total, group, user_ids, placed, probes)
        index.next_id = total if numbered else None
        return index

    def add(self, vectors: Tensor, ids: Optional[Tensor] = None, *, balance: bool = False,
            progress: Progress = False) -> None:
        """Add this rank's ``vectors`` [B, D] (every rank calls it, each with its own, possibly
        none). A partitioned index sends each to the shard its partition gives it; otherwise they
        join this rank's shard (:meth:`Index.add`), or with ``balance=True`` (the same on every
        rank) the least-loaded shards, so that the shards' live vectors end as even as they can
        (a stream of new vectors that reaches one rank, or shards that ``remove`` thinned
        unevenly). ``ids``: their user ids, on every rank or none, as the build had them;
        without, the vectors are numbered after every id so far, rank by rank."""
        what = "ShardedIndex.add"
        # Checked before the agreement, whose failures every rank hears of: a rank that raised
        # alone would leave the others waiting in the exchange of the rows.
        bad_ids = None
        if ids is not None and isinstance(vectors, Tensor) and vectors.dim() == 2:  # else _setup says what is wrong
            if not isinstance(ids, Tensor) or ids.shape != (vectors.shape[0],):
                got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
                bad_ids = ValueError(f"{what}: ids: expected shape [{vectors.shape[0]}], got {got}")
        offset, added, _ = _setup(what, self.group, vectors, self.local.metric, failure=bad_ids,
                                  has_ids=int(ids is not None), balance=int(balance))
        if balance and self.partition is not None:
            raise ValueError(f"{what}: balance: a partitioned index places each vector in the shard of its cell")
        if (ids is None) != (self.next_id is not None):
            raise ValueError(f"{what}: ids are " + ("required: the index has user ids" if ids is None else
                                                    "not taken: the index numbers its vectors itself"))
        if ids is None:
            ids = torch.arange(self.next_id + offset, self.next_id + offset + vectors.shape[0], device=vectors.device)
            self.next_id += added
        if self.partition is not None:
            vectors, ids = _to_ranks(vectors, ids.to(vectors.device), self.partition.ranks(vectors), self.group)
        elif balance:
            table = _agree(self.group, what, rows_each=vectors.shape[0], live_each=len(self.local))
            places = _least_loaded_ranks([row[0] for row in table], [row[1] for row in table],
                                         dist.get_rank(self.group), vectors.device)
            vectors, ids = _to_ranks(vectors, ids.to(vectors.device), places, self.group)
        if vectors.shape[0] > 0:
            self.local.add(vectors, ids.to(self.local.device), progress=progress)
        self.total += added
        self.user_ids = True  # new ids no longer follow the ranks

    def remove(self, ids: Tensor) -> None:
        """Hide the vectors with these ids from every later search (every rank calls it, each
        with any ids, possibly none, of vectors on any rank). Ids that no shard holds live, or
        that repeat, raise on every rank and change nothing."""
        what = "ShardedIndex.remove"
        ids = ids.reshape(-1).long() if isinstance(ids, Tensor) else None  # None: said in the agreement
        sizes = [row[0] for row in _agree(self.group, what, ids_each=-1 if ids is None else ids.shape[0])]
        if min(sizes) < 0:
            raise TypeError(f"{what}: expected a tensor of ids on every rank; rank(s) "
                            f"{[r for r, size in enumerate(sizes) if size < 0]} passed something else")
        if sum(sizes) == 0:  # the same table on every rank: all return here
            return
        everyone = _all_gather_rows(ids[:, None], sizes, self.group)[:, 0].to(self.local.device)
        live = self.local.ids if self.local.removed is None else self.local.ids[~self.local.removed]
        mine = everyone[torch.isin(everyone, live)]
        counts = torch.tensor([mine.shape[0], everyone.unique().shape[0]], device=_comm_device(self.group))
        found = counts.clone()
        dist.all_reduce(found, group=self.group)
        if found[0] != everyone.shape[0] or counts[1] != everyone.shape[0]:
            raise ValueError(f"{what}: of {everyone.shape[0]} ids from all ranks, {int(counts[1])} distinct and "
                             f"{int(found[0])} live in a shard; every id must name one live vector, once")
        if mine.shape[0] > 0:
            self.local.remove(mine)
        self.total -= everyone.shape[0]

    def compact(self) -> None:
        """Drop the removed vectors of this rank's shard for good (:meth:`Index.compact`; no
        collective, each rank when it likes)."""
        self.local.compact()

    def search(self, queries: Tensor, k: Optional[int] = None, *, params: Optional[SearchParams] = None,
               **settings: Any) -> Tuple[Tensor, Tensor]:
        """``(dists, ids)`` of this rank's queries over every shard (every rank calls it, with
        its own queries and the same k and settings); see :meth:`Index.search`."""
        what = "ShardedIndex.search"
        # Settings a rank cannot use fail on that rank, inside the agreement (which every rank enters).
        try:
            p, failure = SearchParams.merge(params, k=k, **settings), None
            if p.filter is not None:
                failure = ValueError(f"{what}: a filter is over one shard's rows; remove rows with local.remove "
                                     "instead")
        except (TypeError, ValueError) as e:
            p, failure = None, e
        _, _, sizes = _setup(what, self.group, self.local.data, self.local.metric, queries, failure=failure,
                             k=-1 if p is None else p.k, list_size=-1 if p is None else p.list_size)

        def local(everyone: Tensor, k: int) -> Tuple[Tensor, Tensor]:
            n = len(self.local)
            if n == 0 or everyone.shape[0] == 0:  # no rows here, or no query routed here
                return _no_rows(everyone, k)
            dists, ids = self.local.search(everyone.to(self.local.data.dtype), min(k, n), params=p)
            return padded(dists, ids, k)

        if self.partition is not None:
            return self._search_routed(local, queries, p.k)
        self.shards_per_query = float(dist.get_world_size(self.group))
        return _search_everywhere(local, queries, p.k, sizes, self.group, ids_follow_ranks=not self.user_ids)

    def _search_routed(self, local_search, queries: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """A partitioned index's search: each query to the ``probes`` shards of its nearest
        cells, or with ``probes=None`` (l2 and cosine, the partition's biases known) to the shard
        of its own cell and then to the other shards that may hold rows nearer than the k-th
        found there (ip and older partitions: 2 shards). Its answers from them are merged."""
        part, world, q = self.partition, dist.get_world_size(self.group), queries.shape[0]
        every = torch.arange(q, device=queries.device)
        scores = part.scores(queries) if q > 0 else torch.zeros(0, part.centres.shape[0], device=queries.device)
        order = part.rank_order(scores)  # [q, W] the ranks by the query's nearest cell on them
        if self.probes is not None or part.bias is None or part.metric == "ip":
            visits = order[:, :min(self.probes or 2, world)]
            pairs = torch.stack([every.repeat_interleave(visits.shape[1]), visits.flatten()], 1)
            d, i = _routed(local_search, queries, pairs, k, self.group)  # query-major: [q x probes, k]
            self.shards_per_query = float(visits.shape[1])
            return best_k(d.view(q, visits.shape[1] * k), i.view(q, visits.shape[1] * k), k)
        d = torch.full((q, world, k), float("inf"), device=queries.device)
        i = torch.full((q, world, k), -1, dtype=torch.long, device=queries.device)
        home = order[:, 0]
        first = torch.stack([every, home], 1)
        d[every, home], i[every, home] = _routed(local_search, queries, first, k, self.group)
        more = part.reachable(scores, d[every, home, k - 1])
        more[every, home] = False
        pairs = more.nonzero()
        d[pairs[:, 0], pairs[:, 1]], i[pairs[:, 0], pairs[:, 1]] = _routed(local_search, queries, pairs, k,
                                                                           self.group)
        self.shards_per_query = 1 + pairs.shape[0] / max(q, 1)
        return best_k(d.flatten(1), i.flatten(1), k)

    def __len__(self) -> int:
        """Live vectors on all ranks."""
        return self.total

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard and where it sits: save one per rank."""
        return {"local": self.local.state_dict(), "offset": self.offset, "total": self.total,
                "user_ids": self.user_ids, "rank": dist.get_rank(self.group),
                "world_size": dist.get_world_size(self.group), "probes": self.probes, "next_id": self.next_id,
                "partition": None if self.partition is None else self.partition.state()}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], group: Optional[dist.ProcessGroup] = None) -> "ShardedIndex":
        """Inverse of :meth:`state_dict` in a group of the same size, each rank loading its own
        (see :meth:`from_state_dicts` for another number of ranks)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if state.get("world_size") != world or state.get("rank") != rank:
            raise ValueError(f"state: saved by rank {state.get('rank')} of {state.get('world_size')}, loaded by rank "
                             f"{rank} of {world}; load each rank's own state in a group of the same size, or all "
                             "of them with ShardedIndex.from_state_dicts")
        local = Index.from_state_dict(state["local"])
        index = cls(local, state["offset"], state["total"], group, state.get("user_ids", True),
                    _saved_partition(state, world, local), state.get("probes"))
        index.next_id = state.get("next_id")
        return index

    @classmethod
    def from_state_dicts(cls, states: Sequence[Dict[str, Any]], group: Optional[dist.ProcessGroup] = None
                         ) -> "ShardedIndex":
        """The shards saved by every rank of a group of any size (``states`` in their rank order,
        the same list on every rank), restored onto this group. Onto as many ranks: each loads its
        own. Onto fewer: rank r takes the saved shards r, r + W, r + 2W, ... and merges them
        (:func:`torch_grnnd.merge`, no rebuild). Onto more: the ranks that share saved shard
        j (r = j, j + S, j + 2S, ... for S saved shards) split its live vectors into equal runs
        and each builds its run's graph anew with the saved settings (a graph's rows have no
        subgraph as good as a build). The ids stay those of the saved index. A partitioned
        index, whose cells belong to ranks, restores onto the same number of ranks only."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        saved = len(states)
        if saved == 0 or any(s.get("world_size") != saved or s.get("rank") != j for j, s in enumerate(states)):
            raise ValueError("states: expected every saved rank's state once, in rank order")
        if saved != world and (states[0].get("partition") or states[0].get("centres")) is not None:
            raise ValueError(f"states: a partitioned index of {saved} shards restores onto {saved} ranks only, "
                             f"not {world}")
        if saved == world:
            return cls.from_state_dict(states[rank], group)
        if saved < world:
            return cls._split_shard(states, group)
        mine = [Index.from_state_dict(_on_this_rank(states[j]["local"], group)) for j in range(rank, saved, world)]
        local = mine[0]
        for other in mine[1:]:
            local = merge(local, other)
        index = cls(local, 0, states[0]["total"], group, True)  # merged shards' ids no longer follow the ranks
        index.next_id = states[0].get("next_id")
        return index

    @classmethod
    def _split_shard(cls, states: Sequence[Dict[str, Any]], group: Optional[dist.ProcessGroup]) -> "ShardedIndex":
        """:meth:`from_state_dicts` onto more ranks than saved shards: this rank's run of the live
        vectors of saved shard rank % S, built into a graph of its own."""
        rank, world, saved = dist.get_rank(group), dist.get_world_size(group), len(states)
        sharing = [len(range(j, world, saved)) for j in range(saved)]  # ranks that split saved shard j
        # Checked on every rank alike (each holds every state), so all raise or none does.
        for j, state in enumerate(states):
            removed = state["local"].get("removed")
            live = state["local"]["data"].shape[0] - (int(removed.sum()) if isinstance(removed, Tensor) else 0)
            if live < sharing[j]:
                raise ValueError(f"states: saved shard {j} holds {live} live vectors, fewer than the {sharing[j]} "
                                 "ranks that would split it; restore onto fewer ranks")
        # Without the room it was saved with (reserving it would copy the whole shard here).
        saved_state = _on_this_rank({key: value for key, value in states[rank % saved]["local"].items()
                                     if key != "capacity"}, group)
        shard = Index.from_state_dict(saved_state)
        live = slice(None) if shard.removed is None else ~shard.removed
        rows = shard.data[live]
        ids = shard.ids if shard.ids is not None else torch.arange(shard.data.shape[0], device=rows.device) + \
            states[rank % saved]["offset"]
        ids = ids[live]
        part, n = rank // saved, rows.shape[0]
        run = slice(part * n // sharing[rank % saved], (part + 1) * n // sharing[rank % saved])
        codes = shard.codes.kind if shard.codes is not None else None
        # Copies of the run alone: the index keeps none of the rest of the saved shard.
        local = Index.build(rows[run].clone(), shard.build_params, metric=shard.metric, ids=ids[run].clone(),
                            codes=codes)
        index = cls(local, 0, states[0]["total"], group, True)  # split shards' ids no longer follow the ranks
        index.next_id = states[0].get("next_id")
        return index


@dataclasses.dataclass
class ReplicatedIndex:
    """The same index on every rank; a batch every rank passes is split between the ranks, and
    each rank gets the whole answer (one all-gather)."""

    index: Index
    group: Optional[dist.ProcessGroup] = None

    def search(self, queries: Tensor, k: Optional[int] = None, *, params: Optional[SearchParams] = None,
               **settings: Any) -> Tuple[Tensor, Tensor]:
        """``(dists, ids)`` of the whole batch, searched a share per rank (every rank passes the
        same ``queries``, ``k`` and settings); the same as ``index.search`` on one rank."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        batch = max(_matrix_fields(queries)[0], 0)
        bounds = [batch * r // world for r in range(world + 1)]
        sizes = [bounds[r + 1] - bounds[r] for r in range(world)]
        # The share is searched first and the ranks agree on the host while its kernels run
        # (_agree), so the call returns with the gather queued behind the search, as
        # index.search does, and the next call's search is queued before this one's ends.
        # A search that fails on one rank alone (a filter of the wrong length, say, which the
        # agreement does not see) says so in the agreement, and every rank raises before any
        # enters the gather.
        p, failure = None, None
        try:
            p = SearchParams.merge(params, k=k, **settings)
            share = _packed(*self.index.search(queries[bounds[rank]:bounds[rank + 1]], params=p))
        except Exception as error:  # re-raised below, once the other ranks have heard of it
            failure = error
        _setup("ReplicatedIndex.search", self.group, self.index.data, self.index.metric, queries, on_host=True,
               failure=failure, k=-1 if p is None else p.k, list_size=-1 if p is None else p.list_size,
               rows=self.index.data.shape[0], batch=batch)
        return _unpacked(_all_gather_rows(share, sizes, self.group))

    def __len__(self) -> int:
        """Live vectors (every rank holds them all)."""
        return len(self.index)

    def state_dict(self) -> Dict[str, Any]:
        """The index every rank holds (save it from one rank)."""
        return self.index.state_dict()

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], group: Optional[dist.ProcessGroup] = None) -> "ReplicatedIndex":
        """Inverse of :meth:`state_dict`, on every rank of ``group``."""
        return cls(Index.from_state_dict(state), group)
