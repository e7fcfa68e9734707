"""The settings of a build and of a search, each defined once.

Every function that builds or searches (``build``, ``search``, ``search_distance_counts``,
``Index.build``, ``Index.search``, ``nn.Retriever``) takes a :class:`BuildParams` or a
:class:`SearchParams` as ``params=``, and the same settings as keyword arguments, which override
the ones in ``params``. The defaults are the op schemas' (csrc/grnnd.cpp), read from there, so the
C++ ops called directly behave the same.

Example:
    >>> import torch, torch_grnnd as grnnd
    >>> x = torch.randn(2000, 16)
    >>> wide = grnnd.SearchParams(k=5, list_size=128)
    >>> graph = grnnd.build(x, grnnd.BuildParams(degree=16))
    >>> a = grnnd.search(x, graph, x[:3], params=wide)
    >>> b = grnnd.search(x, graph, x[:3], k=5, list_size=128)      # the same, as keywords
    >>> torch.equal(a[1], b[1])
    True
    >>> wide.replace(k=10).k
    10
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


def _default(op, name: str):
    return next(a.default_value for a in op.default._schema.arguments if a.name == name)


_build = torch.ops.grnnd.build
_search = torch.ops.grnnd.search


class _Settings:
    """What the two kinds of settings share: checked replacement and merging with keywords."""

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied; an unknown name raises TypeError naming it."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown setting(s) {unknown}; expected some of {sorted(known)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def merge(cls, params: Optional[Any], **settings: Any):
        """``params`` (or the defaults) with the keyword ``settings`` that are not None applied."""
        if params is not None and not isinstance(params, cls):
            raise TypeError(f"params: expected {cls.__name__}, got {type(params).__name__}")
        # Every search call merges its keywords: without params and with plain values only (no
        # tensor a cache would keep alive) the result is looked up instead of rebuilt, which took
        # about 10 us a call on a 2-core CPU (dataclasses.replace; timeit, a one-off measurement).
        key = None
        if params is None and all(type(v) in _PLAIN for v in settings.values()):
            key = (cls, tuple((name, type(v), v) for name, v in settings.items()))  # 1, 1.0, True apart
            merged = _MERGED.get(key)
            if merged is not None:
                return merged
        base = params if params is not None else cls()
        merged = base.replace(**{name: value for name, value in settings.items() if value is not None})
        if key is not None:
            if len(_MERGED) >= _MERGED_MAX:
                _MERGED.clear()
            _MERGED[key] = merged
        return merged


_PLAIN = (int, float, str, bool, type(None))
_MERGED: dict = {}  # (settings class, keyword settings in call order, with types) -> merged settings
_MERGED_MAX = 256


# The default convergence threshold (BuildParams.delta) of a build on the rows (the op schema's), and
# of one on pair codes, whose cheaper rounds pay for a finer one (benchmarks/README.md, "Building on
# one-byte codes").
ROWS_DELTA: float = _default(_build, "delta")
CODES_DELTA = ROWS_DELTA / 2
# The narrowest rows a default build (BuildParams.pair_codes=None) makes pair codes of: where the
# codes' graphs searched as fast as the rows' at equal recall and built twice as fast (1 024-d on an
# H200); at 384 dimensions they built 1.2x faster but small batches searched them up to 15% slower.
PAIR_CODES_MIN_DIM = 1024


@dataclass(frozen=True)
class BuildParams(_Settings):
    """How :func:`torch_grnnd.build` builds a graph (GRNND, seed 000; the paper's symbols in brackets).

    Attributes:
        degree: out-degree of the returned graph (at most 256): each row keeps what the
            relative-neighbourhood rule left of its pool, nearest first, and is filled up to the
            degree with the nearest vertices two hops away, then -1 padded where there are none;
            so the degree may exceed ``pool_size``. Wider rows find more at each list size and
            cost more per search step: on data of high intrinsic dimension (clustered synthetic
            sets) 48 and 64 reach a recall at more queries/s than 32, on real sentence
            embeddings 32 is a few percent faster at equal recall; the default 48 is never far
            from the best of the three (benchmarks/README.md, "Degree").
        initial_degree: [S] random neighbours each vertex starts with.
        pool_size: [R] capacity of each vertex's candidate pool (at most 256); more finds better
            neighbours for more memory (2 * N * R * 8 bytes) and time.
        outer_iters: [T1] outer iterations; each adds reverse edges before the next.
        inner_iters: [T2] update rounds per outer iteration.
        reverse_ratio: [rho] share of each pool, closest first, that gets a reverse edge.
        update_order: ``"descending"`` distance order (the default), ``"random"`` (GRNND's
            disordered propagation), ``"ascending"``, or ``"descending_then_random"`` (descending in
            every outer iteration but the last). With ``delta=0.02`` descending built better graphs
            than random with ``delta=0.01`` on real sentence embeddings and clustered data from 1M
            to 10M rows, in about the same time at 1M real rows (benchmarks/README.md, defaults).
        seed: seeds every random choice; on one CPU thread the graph depends on it alone.
        delta: [delta] convergence: a round that changes at most ``delta * N * pool_size`` pool
            entries ends its outer iteration, and an outer iteration whose first round changes at
            most ten times that ends the build, from the third outer iteration on (the second for a
            build from ``init``), so ``outer_iters`` and ``inner_iters`` are caps. A build from
            scratch also searches for a sample of 4 096 of its rows in the graph so far after each
            outer iteration from the second on, and an outer iteration that lowered the share it
            misses by more than ``delta / 2`` does not end it (rows of tiny clusters inside big
            ones become findable late). 0 runs every round (seed 000's fixed schedule). None (the
            default): ``ROWS_DELTA`` (0.02), or ``CODES_DELTA`` (0.01) for a build on pair codes.
        start: ``"hubs"``: most initial neighbours come from the cells of each row's two nearest
            hubs (a sample of one row in 1000, found by matrix products), a start that is already
            local; ``"random"``: all uniform (seed 000). Below 16 000 rows both are uniform.
        pair_codes: l2 and cosine. The update rounds take the distance of each pair they compare from
            one-byte codes of the rows (one step for every dimension, :func:`torch_grnnd.codes.pair_codes`)
            instead of the rows: half the bytes of float16 rows, read four dimensions an
            instruction pair on the GPU. The start, the fill, the repair and the search read the
            rows as before. The rounds cost so much less that the default ``delta`` is halved for
            them (``CODES_DELTA``). True or False: the codes or the rows. None (the default): the
            codes in a build from scratch of floating rows of at least ``PAIR_CODES_MIN_DIM``
            (1 024) dimensions under l2 or cosine, on the CPU always and on a GPU where its free
            memory holds the coded build's extra (the codes, N x D bytes, beside the pools and the
            rest ``memory.bytes_per_row`` counts); the rows otherwise, and also inside
            torch.compile (the codes' step is a host value, which would break the graph), for
            host rows built on a device within a budget (``device``, ``max_gpu_memory``,
            :class:`~torch_grnnd.SwappingIndex`: the codes would take rows from every shard) and
            for builds from ``init`` (merges, and the adds that grow an index's graph), which would
            encode every row for rounds over a few. On an H200 builds of 1 024-d float16 clustered rows
            ran 1.8-2.3x faster on the codes (10M x 1024 Zipf/anisotropic clusters: 7.2 s against
            12.7-13.3 s), 384-d rows 1.16-1.5x (real sentence embeddings: 0.37 s against 0.43 s),
            128-d rows no faster, with recall@10 as good or better on every family measured.
            Searches of the codes' graphs of 1 024-d rows were as fast as of the rows' at equal
            recall over four build seeds each, at batches of 100 to 10 000; at 384 dimensions
            small batches (100 to 1 000 queries, list 32) searched the codes' graphs of real
            embeddings 2-15% slower, which is why narrower rows keep the rows by default
            (benchmarks/README.md, "Building on one-byte codes").
        widen: a build from scratch whose rows stay hard to find goes on wider. After its second
            outer iteration the build measures the share of a sample of its rows that a search of
            its graph so far misses (the unfound share, as :func:`torch_grnnd.diagnostics.unfound_share`
            measures a graph); where that passes 0.05 its pools grow in place, to twice
            ``pool_size`` where its rows' neighbourhoods spread over few of their dimensions
            (:meth:`wide_pool_size_for`, :func:`torch_grnnd.diagnostics.neighbourhood_dimensions`),
            by a third elsewhere, and it returns rows of twice ``degree`` where that share reaches
            0.15, a third wider below it (:meth:`wide_degree_for`: 96 or 64 over pools of 96 or 64
            at the defaults). On the families
            of large low-contrast clusters (Zipf-sized, anisotropic: shares of 0.18 and more from
            1M rows) the wide graph finds at list 64 about what the narrow one finds at list 128,
            at 0.95-1.3x its queries/s at equal recall; where fewer rows are unfound, rows of 64
            cost a query less for what they find (benchmarks/README.md, "How wide a widened row
            is"); blobs and real sentence embeddings (0.013 and 0.005)
            keep their width, where a wider graph only cost (benchmarks/README.md, "Widening the
            hard builds"). So the graph's width depends on the data: ``graph.shape[1]`` is
            ``degree`` or one of the widths above (and inside torch.compile a size known when
            the build has run). A widened build holds its wider pools at its peak
            (``memory.bytes_per_row`` counts them where a build may widen). False keeps
            ``degree``; builds under inner product (where a row need not be its own best match, so
            the share says nothing of reach), from ``init`` (merges, the adds that grow an index's
            graph), with ``delta=0`` or fewer than three outer iterations never widen, and neither
            do the shards of out-of-core builds.
    """

    degree: int = _default(_build, "degree")
    initial_degree: int = _default(_build, "initial_degree")
    pool_size: int = _default(_build, "pool_size")
    outer_iters: int = _default(_build, "outer_iters")
    inner_iters: int = _default(_build, "inner_iters")
    reverse_ratio: float = _default(_build, "reverse_ratio")
    update_order: str = _default(_build, "update_order")
    seed: int = _default(_build, "seed")
    delta: Optional[float] = None
    start: str = _default(_build, "start")
    pair_codes: Optional[bool] = None
    widen: bool = _default(_build, "widen")

    def may_widen(self, metric: str = "l2", from_scratch: bool = True) -> bool:
        """Whether a build with these settings may widen (``widen``): from scratch, under l2 or
        cosine, measuring its unfound share (``delta`` > 0, three outer iterations or more) and with
        wider widths to go to; the condition of csrc/build/build_schedule.h, ``may_widen``."""
        delta = self.delta if self.delta is not None else ROWS_DELTA
        return (self.widen and metric != "ip" and from_scratch and delta > 0 and self.outer_iters > 2
                and (self.wide_degree > self.degree or self.wide_pool_size > self.pool_size))

    @property
    def wide_degree(self) -> int:
        """The widest rows a widened build may return (BuildParams::wide_degree in
        csrc/core/params.h): twice ``degree``, at most 256."""
        return self.wide_degree_for(1.0)

    def wide_degree_for(self, unfound_share: float) -> int:
        """The width of the rows a build returns that widened on this first unfound share
        (BuildParams::wide_degree_for in csrc/core/params.h): a third wider than ``degree`` below
        a share of 0.15, twice ``degree`` from there (64 or 96 at the defaults)."""
        wider = self.degree // 3 if unfound_share < TWICE_THE_DEGREE_SHARE else self.degree
        return min(self.degree + wider, MAX_DEGREE)

    @property
    def wide_pool_size(self) -> int:
        """The largest pools a widened build may go on with (BuildParams::wide_pool_size in
        csrc/core/params.h): twice ``pool_size``, at most 256."""
        return self.wide_pool_size_for(0.0)

    def wide_pool_size_for(self, neighbourhood_dimensions: float) -> int:
        """The pools a widened build goes on with where its rows' neighbourhoods spread over this
        share of their dimensions (:func:`torch_grnnd.diagnostics.neighbourhood_dimensions`;
        BuildParams::wide_pool_size_for in csrc/core/params.h): twice ``pool_size`` below 0.65
        (anisotropic clusters), a third larger from there (96 or 64 at the defaults)."""
        wider = self.pool_size if neighbourhood_dimensions < FEW_NEIGHBOURHOOD_DIMENSIONS else self.pool_size // 3
        return min(self.pool_size + wider, MAX_DEGREE)


# The widest rows a build returns (kMaxPoolSize in csrc/core/params.h).
MAX_DEGREE = 256
# A widened build whose first unfound share reaches this returns rows of twice its degree, one below
# it rows a third wider (kTwiceTheDegreeShare in csrc/core/params.h).
TWICE_THE_DEGREE_SHARE = 0.15
# A widened build whose rows' neighbourhoods spread over fewer than this share of their dimensions grows
# pools of twice its pool size, one above it pools a third larger (kFewNeighbourhoodDimensions in
# csrc/core/params.h).
FEW_NEIGHBOURHOOD_DIMENSIONS = 0.65


# The longest candidate list a search keeps, and so the most neighbours it returns (kMaxListSize
# in csrc/core/params.h, which checks every search's settings).
MAX_LIST_SIZE = 1024


@dataclass(frozen=True, eq=False)  # a filter tensor has no truth value to compare by
class SearchParams(_Settings):
    """How :func:`torch_grnnd.search` answers queries (the greedy graph search of CAGRA, seed 002).

    A search keeps the best ``list_size`` nodes seen; each iteration expands the ``search_width``
    best not yet expanded; it stops when none is left or after ``max_iters`` iterations. A query
    may be answered by several independent searches whose results are merged: each starts from
    its own random entry points and keeps a list of about ``2 * list_size / sqrt(searches)``
    (at least ``k``, at most ``list_size``). On CUDA they run side by side, which is how a small
    batch uses the whole GPU; by default (``searches=0``) the CUDA search splits the queries of a
    batch too small to fill the GPU, into more searches the longer the list, so a query may get
    slightly different neighbours in a batch of 1 than in a batch of 10 000 (``searches=1``
    rules that out; so does ``search_width=1, searches=1`` between the GPU and the CPU). The CPU
    splits only when asked.

    Attributes:
        k: neighbours returned per query, ``k <= list_size``.
        list_size: internal candidate list (CAGRA's itopk, HNSW's ef); 0 means max(k, 64); at
            most 1024. Longer lists raise recall and cost speed.
        search_width: parents expanded per iteration; 0 (the default) lets the backend choose:
            on a GPU 4 (2 for graphs of degree 65-128, 1 above), and 6 for lists longer than 128
            per search (5 for degree 86-102, fewer above: rounds of at most 512 candidates),
            where wider iterations shorten each query's chain of dependent steps for a few more
            distances and won at equal recall at every batch size measured; 1 on the CPU, where
            each core already runs one query at full speed.
        max_iters: iteration cap; 0 means until no unexpanded parent is left.
        searches: independent searches per query; 0 lets the backend choose; at most 32, and
            ``searches * k <= 4096``.
        seed: seeds the random entry points.
        hub_entries: entry points taken from the hubs nearest to the query (one data row in 1000,
            ranked by a matrix product) before the random ones; -1 means half the list, 0 only
            random entry points. Data under 16 000 rows has no hubs.
        filter: optional bool [N] over the data rows; rows marked False are traversed but never
            returned.
    """

    k: int = 10
    list_size: int = _default(_search, "list_size")
    search_width: int = _default(_search, "search_width")
    max_iters: int = _default(_search, "max_iters")
    searches: int = _default(_search, "searches")
    seed: int = _default(_search, "seed")
    hub_entries: int = _default(_search, "hub_entries")
    filter: Optional[Tensor] = None
