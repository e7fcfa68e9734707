"""A build's start, convergence and connectivity: what keeps quality from depending on N.

Hubs (csrc/build/hubs.h) give the build a local start and the search entry points near each query;
the build stops rounds when they change little (delta) and ends with every vertex reachable
from the hubs (csrc/build/reachability.h). CPU here, CUDA where available.
"""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered



def islands(n: int, d: int, count: int, size: int, seed: int = 0) -> torch.Tensor:
    """n rows in one Gaussian cloud plus `count` far islands of `size` rows each: the
    relative-neighbourhood rule keeps the islands' edges among themselves, and no hub lies in
    an island, so without the repair nothing leads into them."""
    g = torch.Generator().manual_seed(seed)
    cloud = torch.randn(n, d, generator=g)
    centres = torch.randn(count, d, generator=g) * 8
    far = centres.repeat_interleave(size, 0) + 0.1 * torch.randn(count * size, d, generator=g)
    return torch.cat([cloud, far])[torch.randperm(n + count * size, generator=g)]


def hub_scores(hubs: torch.Tensor, queries: torch.Tensor, metric: str) -> torch.Tensor:
    """[q, h] float64: how far each hub is from each query under the metric, smaller nearer."""
    h, q = hubs.double(), queries.double()
    if metric == "l2":
        return torch.cdist(q, h).pow(2)
    if metric == "ip":
        return -q @ h.T
    return 1 - torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(h, dim=1).T


def check_nearest_hubs(ids, hubs, score, k, tolerance):
    """ids [q, k] of nearest_hubs: hub ids, none twice, and the k nearest by score [q, h] (the
    float64 truth of all hubs), nearest first, up to rounding of near ties."""
    assert ids.shape == (score.shape[0], k) and ids.dtype == torch.int64
    position = torch.searchsorted(hubs, ids)
    assert torch.equal(hubs[position], ids), "an id that is no hub"
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "a hub twice"
    exact = score.sort(dim=1).values
    assert (score.gather(1, position) - exact[:, :k]).abs().max() <= tolerance * exact.abs().max()


def test_hubs_are_one_row_per_stratum():
    assert grnnd.diagnostics.hubs(torch.empty(15_999, 2)).numel() == 0  # too small: random starts
    for n in (16_000, 123_457):
        hubs = grnnd.diagnostics.hubs(torch.empty(n, 2))
        count = n // 1000
        assert hubs.dtype == torch.int64 and hubs.numel() == count
        assert torch.equal(hubs // 1, hubs.sort().values) and hubs.unique().numel() == count
        stratum = torch.arange(count)
        assert ((hubs >= stratum * n // count) & (hubs < (stratum + 1) * n // count)).all()
        assert torch.equal(hubs, grnnd.diagnostics.hubs(torch.empty(n, 7)))  # a function of N alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nearest_hubs_rank_hubs_as_the_metric_does(device, metric, dtype):
    # 80 hubs: on CUDA every k goes through the fused selection (one, two and four slots a lane).
    g = torch.Generator().manual_seed(3)
    data = (torch.randn(80_000, 24, generator=g) * torch.rand(80_000, 1, generator=g)).to(device, dtype)
    queries = torch.randn(700, 24, generator=g).to(device, dtype)
    hubs = grnnd.diagnostics.hubs(data)
    score = hub_scores(data[hubs], queries, metric)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for k in (1, 2, 5, 32, 64, 70):
        check_nearest_hubs(grnnd.diagnostics.nearest_hubs(data, queries, k, metric=metric), hubs, score, k, tolerance)
    assert grnnd.diagnostics.nearest_hubs(data[:15_000], queries, 4).shape == (700, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused product is a CUDA kernel")
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_nearest_hubs_select_as_the_score_matrix_does(metric, dtype):
    # Batches of half-precision rows large enough to fill the GPU, for one or two hubs, take the
    # fused product (csrc/cuda/hubs_cuda.cu); three hubs go through the score matrix. 40 001 rows
    # end in a partial block, 300 hubs in a partial tile, d = 40 in a partial stage.
    g = torch.Generator().manual_seed(5)
    data = (torch.randn(300_000, 40, generator=g) * torch.rand(300_000, 1, generator=g)).cuda().to(dtype)
    queries = torch.randn(40_001, 40, generator=g).cuda().to(dtype)
    hubs = grnnd.diagnostics.hubs(data)
    assert hubs.numel() == 300
    score = hub_scores(data[hubs], queries, metric)
    matrix = grnnd.diagnostics.nearest_hubs(data, queries, 3, metric=metric)
    for k in (1, 2):
        ids = grnnd.diagnostics.nearest_hubs(data, queries, k, metric=metric)
        check_nearest_hubs(ids, hubs, score, k, 5e-2)
        # Both ways sum the same products in float32, in other orders: only near ties may differ.
        agree = (ids == matrix[:, :k]).all(dim=1).double().mean().item()
        assert agree >= 0.999, f"{agree:.4f} of the rows chose as the score matrix does"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gathered hub rows are a CUDA kernel")
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_batches_rank_the_gathered_hub_rows(metric, dtype):
    # 1 000 queries against 300 hubs are more pairs than the direct kernels take: up to 128 hubs a
    # query, one kernel gathers the hub rows and their terms and the selection writes hub rows
    # (csrc/build/hubs.h, gather_hubs_cuda); 130 go through the hub ids and at::topk.
    g = torch.Generator().manual_seed(9)
    data = (torch.randn(300_000, 40, generator=g) * torch.rand(300_000, 1, generator=g)).to(dtype)
    queries = torch.randn(1_000, 40, generator=g).to(dtype).cuda()
    on_device = data.cuda()
    hubs = grnnd.diagnostics.hubs(on_device)
    score = hub_scores(on_device[hubs], queries, metric)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    by_topk = grnnd.diagnostics.nearest_hubs(on_device, queries, 130, metric=metric)
    check_nearest_hubs(by_topk, hubs, score, 130, tolerance)
    for k in (1, 5, 64, 70, 128):
        ids = grnnd.diagnostics.nearest_hubs(on_device, queries, k, metric=metric)
        check_nearest_hubs(ids, hubs, score, k, tolerance)
        # Both sum the same products in float32; the hubs' norms are summed in other orders.
        agree = (ids == by_topk[:, :k]).all(dim=1).double().mean().item()
        assert agree >= 0.95, f"{agree:.4f} of the queries got the hubs at::topk chose"
    # Rows in pinned host memory are gathered where they lie: the same entry points, the same walk.
    graph = torch.randint(0, data.shape[0], (data.shape[0], 16), generator=g, dtype=torch.int32).cuda()
    on_host = grnnd.search(data.pin_memory(), graph, queries, 10, list_size=32, metric=metric)
    on_gpu = grnnd.search(on_device, graph, queries, 10, list_size=32, metric=metric)
    assert torch.equal(on_host[1], on_gpu[1]) and torch.equal(on_host[0], on_gpu[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, queries_count", [(300_000, 1_000), (20_000, 20_000)])
def test_hub_selection_keeps_exact_order_among_equal_scores(device, dtype, rows, queries_count):
    # Small integer rows make many hubs score exactly alike (inner product: -<q, hub>, exact in
    # float32). The selection must return the k smallest by (score, hub), ascending, ties to the
    # lower hub, on the CPU as on CUDA. There, both shapes are past the direct kernels and go
    # through the warp-list selection: k of one slot a lane (1, 5, 20, 32), of two (33, 64) and of
    # four (65, 128), 300 hubs (a last round of 44 columns) and 20 (fewer than a warp's lanes).
    g = torch.Generator().manual_seed(11)
    data = torch.randint(-2, 3, (rows, 8), generator=g).to(dtype).to(device)
    queries = torch.randint(-2, 3, (queries_count, 8), generator=g).to(dtype).to(device)
    hubs = grnnd.diagnostics.hubs(data)
    score = -(queries.double() @ data[hubs].double().T)
    assert (score.sort(dim=1).values.diff(dim=1) == 0).double().mean() > 0.3  # many ties
    expected = hubs[score.sort(dim=1, stable=True).indices]
    for k in (1, 5, 20, 32, 33, 64, 65, 128):
        if k > hubs.numel():
            continue
        ids = grnnd.diagnostics.nearest_hubs(data, queries, k, metric="ip")
        assert torch.equal(ids, expected[:, :k]), f"k = {k}: {int((ids != expected[:, :k]).any(1).sum())} rows differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct hub distances are CUDA kernels")
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batches_find_the_hubs_a_large_batch_finds(metric, dtype):
    # A few queries take the direct kernels (csrc/build/hubs.h, direct_hub_entries_cuda), 600 of them the
    # matrix product (600 x 2 100 pairs is more than kMaxDirectHubPairs); 2 100 hubs make a sort
    # of 4 096 keys across more than one pass of the block's threads.
    g = torch.Generator().manual_seed(8)
    data = (torch.randn(2_100_000, 16, generator=g) * torch.rand(2_100_000, 1, generator=g)).cuda().to(dtype)
    queries = torch.randn(600, 16, generator=g).cuda().to(dtype)
    hubs = grnnd.diagnostics.hubs(data)
    assert hubs.numel() == 2_100
    score = hub_scores(data[hubs], queries, metric)
    large = grnnd.diagnostics.nearest_hubs(data, queries, 70, metric=metric)
    small = torch.cat([grnnd.diagnostics.nearest_hubs(data, queries[s:s + 5], 70, metric=metric)
                       for s in range(0, 600, 5)])
    # Queries whose rows are not 16-byte aligned take the matrix product whatever their number.
    odd = torch.empty(5 * 16 + 1, device="cuda", dtype=dtype)[1:].view(5, 16)
    odd.copy_(queries[:5])
    unaligned = grnnd.diagnostics.nearest_hubs(data, odd, 70, metric=metric)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for ids, rows in ((large, 600), (small, 600), (unaligned, 5)):
        check_nearest_hubs(ids, hubs, score[:rows], 70, tolerance)
    # Both sum the same products in float32 in other orders: only near ties may be ordered otherwise.
    agree = (small == large).all(dim=1).double().mean().item()
    assert agree >= 0.95, f"{agree:.4f} of the queries got the hubs the matrix product chose"


@pytest.mark.parametrize("device", DEVICES)
def test_every_vertex_is_reachable_from_the_hubs(device):
    data = islands(100_000, 16, count=40, size=4).to(device)
    graph = grnnd.build(data, degree=16, pool_size=32, initial_degree=8)
    hubs = grnnd.diagnostics.hubs(data)
    assert hubs.numel() == 100
    reached = grnnd.diagnostics.reachable(graph, hubs)
    assert reached.all(), f"{int((~reached).sum())} vertices unreachable"
    # The repairs keep each row ascending by distance, without repeats or the row itself, and
    # leave no row with fewer than 8 entries.
    ids = graph.long()
    dist = (data[ids.clamp_min(0)] - data[:, None]).pow(2).sum(2).masked_fill(ids < 0, float("inf"))
    assert (dist[:, 1:] >= dist[:, :-1] * (1 - 1e-4) - 1e-4).all()
    assert_rows_well_formed(graph)
    assert grnnd.diagnostics.degree_summary(graph)["min"] >= 8


@pytest.mark.parametrize("device", DEVICES)
def test_the_repair_takes_no_vertex_its_only_way_in(device):
    # Row 0 (the entry point without hubs) links to c and b; nothing links to a, whose nearest
    # vertex is row 0. Giving row 0's farthest place (b) to a would make b unreachable, and b's
    # nearest reachable vertex is row 0 again, which would then give up a: the repair must give
    # up c instead, which d links to as well (0 -> b -> d -> c).
    p, a, b, c, d = range(5)
    data = torch.tensor([[0.0, 0.0], [0.0, 2.0], [0.0, -3.0], [1.0, 0.0], [5.0, 0.0]], device=device)
    graph = torch.tensor([[c, b], [p, -1], [d, -1], [d, -1], [c, -1]], dtype=torch.int32, device=device)
    assert not grnnd.diagnostics.reachable(graph, torch.tensor([p]))[a]
    repaired = grnnd.diagnostics.connect(data, graph)
    assert repaired[p].tolist() == [a, b]  # ascending by distance
    assert torch.equal(repaired[1:], graph[1:])
    assert grnnd.diagnostics.reachable(repaired, torch.tensor([p])).all()
    # A graph whose vertices are all reachable comes back as it was.
    assert torch.equal(grnnd.diagnostics.connect(data, repaired), repaired)
    with pytest.raises(ValueError, match="graph: has 4 rows but data has 5"):
        grnnd.diagnostics.connect(data, graph[:4])


def assert_rows_well_formed(graph: torch.Tensor):
    ids = graph.long()
    padded = ids < 0
    assert not (padded[:, :-1] & ~padded[:, 1:]).any(), "padding before an entry"
    assert not (ids == torch.arange(ids.shape[0], device=ids.device)[:, None]).any(), "a row holds itself"
    sorted_ids = ids.sort(1).values
    assert not ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)).any(), "a repeated entry"


def fill_by_recipe(data: torch.Tensor, graph: torch.Tensor, passes: int = 3) -> torch.Tensor:
    """csrc/build/fill.h's recipe, row by row in float64: the fill's oracle."""
    x = data.double()
    n, degree = graph.shape
    rows = graph.tolist()
    for _ in range(passes):
        before, rows = rows, [list(r) for r in rows]
        for v in range(n):
            own = [u for u in before[v] if 0 <= u < n]
            if not 0 < len(own) < degree:
                continue
            budget = 128 if degree <= 48 else 128 * degree // 48  # fill.h, fill_candidates
            per = min(degree, max(1, budget // len(own)))
            kind = {u: "own" for u in own}
            for u in own:
                for w in before[u][:per]:
                    if 0 <= w < n and w != v:
                        kind.setdefault(w, "other")
            ids = torch.tensor(list(kind))
            dist = (x[ids] - x[v]).pow(2).sum(1).tolist()
            taken, others = [], 0
            for _, u in sorted(zip(dist, ids.tolist())):
                if kind[u] == "other":
                    if others == degree - len(own):
                        continue
                    others += 1
                taken.append(u)
            rows[v] = taken + [-1] * (degree - len(taken))
    return torch.tensor(rows, dtype=torch.int32)


def short_rows(n: int, degree: int, seed: int) -> torch.Tensor:
    """Rows of random lengths (some empty, some full) of distinct random ids other than the row's
    own, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.rand(n, n - 1, generator=g).argsort(1)[:, :degree] + 1
    ids = ((torch.arange(n)[:, None] + offsets) % n).int()
    lengths = torch.randint(0, degree + 1, (n, 1), generator=g)
    return torch.where(torch.arange(degree)[None] < lengths, ids, torch.full_like(ids, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("degree", [6, 24, 256])
def test_the_fill_follows_its_recipe(device, dtype, degree):
    # Integer coordinates: every distance is exact in float32 on both devices, and ties are broken
    # by id, so the fill must match the recipe row for row. Rows of 6 look at 21 two-hop entries a
    # neighbour (the most), rows of 256 at two or more (682 candidates a row, fill.h).
    g = torch.Generator().manual_seed(degree)
    n = 1500 if degree < 256 else 600
    data = torch.randint(-4, 5, (n, 12), generator=g).to(dtype)
    graph = short_rows(n, degree, seed=degree)
    filled = grnnd.diagnostics.fill(data.to(device), graph.to(device))
    expected = fill_by_recipe(data, graph)
    assert filled.dtype == torch.int32 and filled.shape == graph.shape
    assert torch.equal(filled.cpu(), expected)
    assert_rows_well_formed(expected)
    entries, before = (expected >= 0).sum(1), (graph >= 0).sum(1)
    assert (entries >= before).all() and (entries[before == 0] == 0).all()
    assert (entries > before).float().mean() > 0.5  # most rows had room and took some


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_the_cuda_fill_is_the_cpu_fill(metric):
    data = torch.randn(4000, 40, generator=torch.Generator().manual_seed(1))
    graph = short_rows(4000, 32, seed=2)
    on_cpu = grnnd.diagnostics.fill(data, graph, metric=metric)
    on_cuda = grnnd.diagnostics.fill(data.cuda(), graph.cuda(), metric=metric).cpu()
    # The two sum distances in different orders: a near tie may rank the other way.
    assert (on_cpu == on_cuda).all(1).float().mean() > 0.99


def test_the_fill_checks_its_inputs():
    data = torch.randn(10, 4)
    with pytest.raises(ValueError, match="graph: has 9 rows but data has 10"):
        grnnd.diagnostics.fill(data, torch.zeros(9, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at most 256 columns"):
        grnnd.diagnostics.fill(data, torch.zeros(10, 257, dtype=torch.int32))
    with pytest.raises(ValueError):
        grnnd.diagnostics.fill(data, torch.full((10, 3), 10, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_filled_to_the_degree_from_two_hops(many_clusters, device):
    # The relative-neighbourhood rule leaves a row of clustered data about half its places
    # (csrc/build/fill.h): the build fills every row with the nearest of its two-hop neighbours.
    data = many_clusters[0].to(device)
    graph = grnnd.build(data)
    summary = grnnd.diagnostics.degree_summary(graph)
    assert summary["min"] == graph.shape[1], summary
    assert_rows_well_formed(graph)
    ids = graph.long()
    dist = (data[ids] - data[:, None]).float().pow(2).sum(2)
    assert (dist[:, 1:] >= dist[:, :-1] * (1 - 1e-4) - 1e-4).all()


def test_diagnostics_by_hand():
    graph = torch.tensor([[1, 2], [2, -1], [-1, -1], [0, -1]], dtype=torch.int32)
    assert grnnd.diagnostics.reachable(graph, torch.tensor([0])).tolist() == [True, True, True, False]
    assert grnnd.diagnostics.out_degrees(graph).tolist() == [2, 1, 0, 1]
    summary = grnnd.diagnostics.degree_summary(graph, below=2)
    assert summary["min"] == 0 and summary["max"] == 2 and summary["mean"] == 1.0
    assert summary["share_below_2"] == 0.75


@pytest.fixture(scope="module")
def many_clusters():
    """400 clusters of 100 rows: a random start holds almost no neighbour from a row's cluster."""
    x = clustered(40_400, 64, 400, seed=5)
    data, queries = x[:40_000].contiguous(), x[40_000:].contiguous()
    return data, queries, grnnd.knn(data, queries, 10)[1]


def test_a_start_from_hubs_is_already_local(many_clusters):
    data, queries, truth = many_clusters
    short = dict(outer_iters=1, inner_iters=2, delta=0)  # two rounds: the start shows
    recall = {start: grnnd.recall(grnnd.search(data, grnnd.build(data, start=start, **short), queries, 10,
                                               list_size=32)[1], truth, 10)
              for start in ("random", "hubs")}
    assert recall["hubs"] > recall["random"] + 0.2, recall  # measured 0.62 against 0.23


def test_convergence_stops_early_at_the_quality_of_every_round(many_clusters):
    data, queries, truth = many_clusters
    rounds = []
    converged = grnnd.build(data, outer_iters=8, inner_iters=8, progress=lambda d, t: rounds.append(d))
    every = grnnd.build(data, outer_iters=8, inner_iters=8, delta=0)
    assert 8 < rounds[-1] < 40, rounds[-1]
    at = {name: grnnd.recall(grnnd.search(data, g, queries, 10, list_size=32)[1], truth, 10)
          for name, g in (("converged", converged), ("every", every))}
    assert at["converged"] >= at["every"] - 0.01, at


def test_a_build_ends_only_after_rounds_that_follow_reverse_edges(many_clusters):
    # A delta just loose enough that the very first round of the build would count as settled
    # (10 delta N R above its changes) yet far from ending a round of the first outer iteration:
    # the build still samples reverse edges after it and tests the round that follows them.
    data = many_clusters[0]
    pool = data.shape[0] * 48
    first = []
    grnnd.build(data, outer_iters=1, inner_iters=1, delta=0, progress=lambda d, t, c: first.append(c))
    delta = 1.2 * first[0] / (10 * pool)
    rounds = []
    grnnd.build(data, outer_iters=8, inner_iters=3, delta=delta, progress=lambda d, t, c: rounds.append((d, c)))
    assert rounds[0][1] <= 10 * delta * pool, (rounds, delta)  # the first round alone would have ended it
    assert rounds[-1][0] > 3, (rounds, delta)


def test_hub_entries_are_ignored_without_hubs():
    data = clustered(3000, 8, 10, seed=2)
    graph = grnnd.build(data)
    a = grnnd.search(data, graph, data[:50], 5, hub_entries=-1)
    b = grnnd.search(data, graph, data[:50], 5, hub_entries=0)
    assert torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="hub_entries: expected -1"):
        grnnd.search(data, graph, data[:5], 5, hub_entries=-2)


@pytest.mark.parametrize("device", DEVICES)
def test_unfound_share_counts_the_rows_a_search_for_themselves_misses(device):
    data = clustered(3000, 16, 20, seed=41).to(device)
    graph = grnnd.build(data)
    assert grnnd.diagnostics.unfound_share(data, graph) < 0.01
    # Every edge into 300 rows removed: a search reaches them only where it starts on one.
    cut = torch.arange(0, 3000, 10, device=device)
    severed = torch.where(torch.isin(graph.long(), cut), -1, graph)
    severed = severed.gather(1, torch.argsort((severed < 0).to(torch.int8), dim=1, stable=True))  # -1 last
    share = grnnd.diagnostics.unfound_share(data, severed)
    assert 0.09 <= share <= 0.1 + 0.01
    # A sample of 500 rows estimates the same share (binomial spread about 0.013).
    assert abs(grnnd.diagnostics.unfound_share(data, severed, sample=500) - share) < 0.05
