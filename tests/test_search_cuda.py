"""The CUDA search (csrc/cuda/search_cuda.cu, its kernels in search_walk_cuda.cuh) against exact results and
its CPU twin.

The graphs are built on the CPU, so these tests measure the search alone. The CUDA kernel walks
the same graph from the same random entry points as the CPU kernel; only float summation order
differs, so its recall must match the CPU's at the same settings (within 0.01).
"""
import functools

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered as _clustered, exact_neighbours

# Gaussian clusters whose centres sit close together relative to their spread, so that graph
# search is far from trivial (CPU recall@10 about 0.67 at list 32, 0.97 at list 256).
clustered = functools.partial(_clustered, spread=0.25, noise=0.5)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, DIM, NQ, K = 20_000, 64, 1_000, 10
METRICS = ["l2", "ip", "cosine"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def points():
    x = clustered(N + NQ, DIM, 100)
    return x[:N].contiguous(), x[N:].contiguous()


_graphs = {}


@pytest.fixture(scope="module")
def graph_for(points):
    # Graphs of the degree asked for: these rows widen a default build's graph (BuildParams.widen),
    # and on rows of 64 the GPU's visited hash, which forgets, recomputed 1.25x the CPU's distances
    # in split searches (test_split_search_matches_cpu) where it takes 1.0-1.15x on rows of 32.
    def get(metric, degree=32):
        if (metric, degree) not in _graphs:
            _graphs[metric, degree] = grnnd.build(points[0], metric=metric, degree=degree, widen=False)
        return _graphs[metric, degree]

    return get


def exact(data, queries, k, metric):
    """Exact k-NN ids (int64 [Q, k]) of float32 copies of the (possibly rounded) rows."""
    return exact_neighbours(data, queries, k, metric)[1]


def reference_distances(data, queries, ids, metric):
    """Distances of the returned ids, recomputed in float64 on the CPU (-1 ids give +inf)."""
    x, q = data.double().cpu(), queries.double().cpu()
    safe = ids.cpu().clamp_min(0)
    rows = x[safe]  # [Q, k, D]
    if metric == "l2":
        d = ((rows - q[:, None, :]) ** 2).sum(-1)
    elif metric == "ip":
        d = -(rows * q[:, None, :]).sum(-1)
    else:
        d = 1 - torch.nn.functional.cosine_similarity(rows, q[:, None, :].expand_as(rows), dim=-1)
    return torch.where(ids.cpu() >= 0, d, torch.full_like(d, float("inf")))


def check_rows(dists, ids, n):
    """Output invariants: shapes/dtypes, ids in range, -1 exactly where dist is +inf and only at
    the end of a row, rows ascending, no id twice in a row."""
    assert dists.dtype == torch.float32 and ids.dtype == torch.int64 and dists.shape == ids.shape
    d, i = dists.cpu(), ids.cpu()
    assert ((i >= -1) & (i < n)).all()
    assert torch.equal(i == -1, torch.isinf(d) & (d > 0)), "padding must be -1 with +inf"
    assert (d[:, 1:] >= d[:, :-1]).all(), "rows must be ascending"
    padded = i == -1
    assert (padded[:, :-1] <= padded[:, 1:]).all(), "padding only at the end of a row"
    for row in i.tolist():
        found = [v for v in row if v >= 0]
        assert len(found) == len(set(found)), "duplicate id in a row"


@pytest.mark.parametrize("search_width", [1, 2])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recall_matches_cpu(points, graph_for, dtype, metric, search_width):
    data, queries = (t.to(dtype) for t in points)
    graph = graph_for(metric)
    truth = exact(data, queries, K, metric)
    data_c, graph_c, queries_c = data.cuda(), graph.cuda(), queries.cuda()
    for list_size in (32, 64, 128, 256):
        kw = dict(list_size=list_size, search_width=search_width, metric=metric)
        _, cpu_ids = grnnd.search(data, graph, queries, K, **kw)
        dists, ids = grnnd.search(data_c, graph_c, queries_c, K, **kw)
        assert dists.device == data_c.device and ids.device == data_c.device
        check_rows(dists, ids, N)
        # Distances are those of the returned rows (the cosine query is normalised in its storage
        # type on the GPU, hence the looser tolerance for 16-bit storage).
        atol = 1e-3 if dtype == torch.float32 else 2e-2
        ref = reference_distances(data, queries, ids, metric).float()
        torch.testing.assert_close(dists.cpu(), ref, rtol=1e-3, atol=atol)
        gpu, cpu = grnnd.recall(ids, truth), grnnd.recall(cpu_ids, truth)
        assert gpu >= cpu - 0.01, f"list_size={list_size}: CUDA recall {gpu:.4f} < CPU recall {cpu:.4f} - 0.01"


@pytest.mark.parametrize("list_size,search_width", [(512, 1), (1024, 4)])
def test_large_lists(points, graph_for, list_size, search_width):
    data, queries = points[0], points[1][:200]
    graph = graph_for("l2")
    truth = exact(data, queries, K, "l2")
    # One search per query on both sides: the GPU would split a batch of 200, and at lists this
    # long a split trades some recall for latency (ops.search).
    kw = dict(list_size=list_size, search_width=search_width, searches=1)
    _, cpu_ids = grnnd.search(data, graph, queries, K, **kw)
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), K, **kw)
    check_rows(dists, ids, N)
    assert grnnd.recall(ids, truth) >= grnnd.recall(cpu_ids, truth) - 0.01


def test_k_equals_list_size_256(points, graph_for):
    data, queries = points[0], points[1][:200]
    graph = graph_for("l2")
    truth = exact(data, queries, 256, "l2")
    _, cpu_ids = grnnd.search(data, graph, queries, 256, list_size=256)
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), 256, list_size=256)
    assert ids.shape == (200, 256)
    check_rows(dists, ids, N)
    assert (ids >= 0).all(), "a connected 20k graph has 256 reachable nodes for every query"
    assert grnnd.recall(ids, truth) >= grnnd.recall(cpu_ids, truth) - 0.01


def test_filter(points, graph_for):
    data, queries = points
    graph = graph_for("l2")
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(1)) < 0.5
    # Exact truth over the allowed rows only, mapped back to data ids.
    allowed_ids = allowed.nonzero().squeeze(1)
    truth = allowed_ids[exact(data[allowed], queries, K, "l2")]
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), K, list_size=256, filter=allowed.cuda())
    check_rows(dists, ids, N)
    assert (ids >= 0).all()
    assert allowed[ids.cpu()].all(), "a filtered-out id was returned"
    _, cpu_ids = grnnd.search(data, graph, queries, K, list_size=256, filter=allowed)
    gpu, cpu = grnnd.recall(ids, truth), grnnd.recall(cpu_ids, truth)
    assert gpu >= 0.9, f"filtered recall {gpu:.4f}"
    assert gpu >= cpu - 0.01


@pytest.mark.parametrize("share", [0.01, 0.0])
def test_sparse_filter_pads(points, graph_for, share):
    data, queries = points[0], points[1][:200]
    graph = graph_for("l2")
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(2)) < share
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), K, list_size=64, filter=allowed.cuda())
    check_rows(dists, ids, N)
    found = ids[ids >= 0].cpu()
    assert allowed[found].all(), "a filtered-out id was returned"
    if share == 0.0:
        assert (ids == -1).all() and torch.isinf(dists).all()


def test_filter_with_large_shared_memory(points, graph_for):
    """list_size = k = 1024 with a filter needs more than the default 48 KiB of shared memory."""
    data, queries = points[0], points[1][:64]
    graph = graph_for("l2")
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(3)) < 0.5
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), 1024, list_size=1024, filter=allowed.cuda())
    check_rows(dists, ids, N)
    assert allowed[ids[ids >= 0].cpu()].all()
    assert (ids[:, :K] >= 0).all()


@pytest.mark.parametrize("batch", [256, 4])  # 4: split into several searches per query
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_cuda_graph_capture(points, graph_for, metric, batch):
    data, graph = points[0].cuda(), graph_for(metric).cuda()
    queries = points[1].cuda()
    allowed = (torch.arange(N) % 3 != 0).cuda()
    kw = dict(list_size=64, search_width=2, metric=metric, filter=allowed)
    static_q = queries[:batch].clone()
    eager = grnnd.search(data, graph, static_q, K, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch.cuda.graph asks
        grnnd.search(data, graph, static_q, K, **kw)
    torch.cuda.current_stream().wait_stream(side)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = grnnd.search(data, graph, static_q, K, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])

    static_q.copy_(queries[batch:2 * batch])  # new inputs in the same buffer, replayed
    g.replay()
    fresh = grnnd.search(data, graph, queries[batch:2 * batch].clone(), K, **kw)
    torch.cuda.synchronize()
    assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[1], fresh[1])


@pytest.mark.parametrize("search_width", [1, 4])
@pytest.mark.parametrize("searches", [1, 8])
@pytest.mark.parametrize("list_size", [32, 128, 512])
def test_results_do_not_depend_on_the_batch_size(points, graph_for, list_size, searches, search_width):
    # The block size follows the batch (64 threads per query for batches that fill the GPU, up
    # to 512 for a few queries), and so does the loop of wide rounds (four parents of degree
    # 48: the block loop, which sorts only the candidates that can enter the list, below four
    # blocks per SM, the warp loop above); with the number of searches per query and the width
    # fixed (both follow the batch when left automatic), a query's search, and so its result, is
    # the same.
    data, queries = points
    graph = graph_for("l2").cuda()
    x = data.cuda()
    many = torch.cat([queries] * 20).cuda()  # 20 000 queries: more than 8 per SM on any GPU
    kw = dict(list_size=list_size, searches=searches, search_width=search_width)
    d_all, i_all = grnnd.search(x, graph, many, K, **kw)
    for batch in (1, 50, 500):
        d, i = grnnd.search(x, graph, many[:batch], K, **kw)
        assert torch.equal(i, i_all[:batch]) and torch.equal(d, d_all[:batch])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_coded_results_do_not_depend_on_the_batch_size(points, graph_for, kind):
    """By codes as by rows: a few queries take the block loop (the codes' teams, several chunks
    of a code row in flight, only entering candidates sorted), 20 000 the warp loop."""
    data, queries = points
    graph = graph_for("l2").cuda()
    x = data.cuda()
    codes = grnnd.encode(x, kind)
    many = torch.cat([queries] * 20).cuda()
    kw = dict(list_size=64, searches=1, search_width=4, codes=codes)
    d_all, i_all = grnnd.search(x, graph, many, K, **kw)
    for batch in (1, 50, 500):
        d, i = grnnd.search(x, graph, many[:batch], K, **kw)
        assert torch.equal(i, i_all[:batch]) and torch.equal(d, d_all[:batch])


@pytest.mark.parametrize("degree, search_width", [(32, 1), (32, 2), (48, 1), (48, 4), (64, 1), (64, 4)])
@pytest.mark.parametrize("list_size", [16, 24, 48, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_warp_iterations_match_the_general_loop(points, graph_for, metric, list_size, degree, search_width):
    """Without a filter, lists up to 256 and rounds of up to 256 neighbour slots (eight a lane;
    more than 64 only where the blocks fill the GPU, as 1 000 queries do) take the warp-level loop
    (two, four or eight register rows); an all-true filter takes block_iterations. Both walk the
    same graph in the same order."""
    data, graph, queries = points[0].cuda(), graph_for(metric, degree).cuda(), points[1].cuda()
    kw = dict(list_size=list_size, metric=metric, searches=1, search_width=search_width)
    warp = grnnd.search(data, graph, queries, K, **kw)
    general = grnnd.search(data, graph, queries, K, filter=torch.ones(N, dtype=torch.bool, device="cuda"), **kw)
    assert torch.equal(warp[1], general[1]) and torch.equal(warp[0], general[0])


@pytest.mark.parametrize("searches", [4, 16])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_split_search_matches_cpu(points, graph_for, metric, searches):
    """Several searches per query: same recall and about the same work as the CPU twin (at the
    CPU's width: left automatic, a GPU expands more parents in a batch this small)."""
    data, queries = points[0], points[1][:300]
    graph = graph_for(metric)
    truth = exact(data, queries, K, metric)
    for list_size in (32, 64):
        kw = dict(list_size=list_size, metric=metric, searches=searches, search_width=1)
        _, cpu_ids = grnnd.search(data, graph, queries, K, **kw)
        dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), K, **kw)
        check_rows(dists, ids, N)
        ref = reference_distances(data, queries, ids, metric).float()
        torch.testing.assert_close(dists.cpu(), ref, rtol=1e-3, atol=1e-3)
        gpu, cpu = grnnd.recall(ids, truth), grnnd.recall(cpu_ids, truth)
        assert gpu >= cpu - 0.01, f"list_size={list_size}: CUDA recall {gpu:.4f} < CPU recall {cpu:.4f} - 0.01"
        # The GPU's visited hash may forget and recompute; the CPU's never does.
        cpu_work = grnnd.search_distance_counts(data, graph, queries, K, **kw).double().mean()
        gpu_work = grnnd.search_distance_counts(data.cuda(), graph.cuda(), queries.cuda(), K, **kw).double().mean()
        assert 0.95 * cpu_work <= gpu_work <= 1.15 * cpu_work, f"distances/query: CUDA {gpu_work}, CPU {cpu_work}"


def test_split_search_with_filter(points, graph_for):
    data, queries = points[0], points[1][:300]
    graph = graph_for("l2")
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(4)) < 0.5
    allowed_ids = allowed.nonzero().squeeze(1)
    truth = allowed_ids[exact(data[allowed], queries, K, "l2")]
    kw = dict(list_size=256, searches=4)
    dists, ids = grnnd.search(data.cuda(), graph.cuda(), queries.cuda(), K, filter=allowed.cuda(), **kw)
    check_rows(dists, ids, N)
    assert allowed[ids[ids >= 0].cpu()].all(), "a filtered-out id was returned"
    _, cpu_ids = grnnd.search(data, graph, queries, K, filter=allowed, **kw)
    assert grnnd.recall(ids, truth) >= max(0.9, grnnd.recall(cpu_ids, truth) - 0.01)


def test_small_batches_are_split_automatically(points, graph_for):
    """A batch too small to fill the GPU is split into several searches per query (more work
    per query, found by counting distances); one that fills it is not."""
    data, graph = points[0].cuda(), graph_for("l2").cuda()
    queries = points[1].cuda()
    small = queries[:4]
    auto = grnnd.search_distance_counts(data, graph, small, K, list_size=64)
    single = grnnd.search_distance_counts(data, graph, small, K, list_size=64, searches=1)
    assert auto.double().mean() > 2 * single.double().mean()
    many = torch.cat([queries] * 20)
    assert torch.equal(grnnd.search_distance_counts(data, graph, many, K, list_size=64),
                       grnnd.search_distance_counts(data, graph, many, K, list_size=64, searches=1))
    # Recall over the first 400 queries, asked 4 at a time, against one search per query.
    truth = exact(points[0], points[1][:400], K, "l2")
    split_ids = torch.cat([grnnd.search(data, graph, q, K, list_size=64)[1] for q in queries[:400].split(4)])
    _, single_ids = grnnd.search(data, graph, queries[:400], K, list_size=64, searches=1)
    assert grnnd.recall(split_ids, truth) >= grnnd.recall(single_ids, truth) - 0.01


def test_gpu_searches_expand_four_parents_by_default(points, graph_for):
    """search_width=0 (the default) is 4 on the GPU at every batch size for lists up to 128
    (params.h, resolve_search_width): the same results as width 4 given, and more found than with
    width 1."""
    data, graph = points[0].cuda(), graph_for("l2").cuda()
    queries = points[1].cuda()
    sms = torch.cuda.get_device_properties(queries.device).multi_processor_count
    for batch in (1, 5, 8 * sms + 1, 24 * sms + 1):
        q = torch.cat([queries] * (batch // NQ + 1))[:batch]
        auto = grnnd.search(data, graph, q, K, list_size=64)
        given = grnnd.search(data, graph, q, K, list_size=64, search_width=4)
        assert torch.equal(auto[1], given[1]) and torch.equal(auto[0], given[0]), batch
        assert torch.equal(grnnd.search_distance_counts(data, graph, q, K, list_size=64),
                           grnnd.search_distance_counts(data, graph, q, K, list_size=64, search_width=4))
    truth = exact(points[0], points[1], K, "l2")
    for batch in (4, NQ):  # split and not split
        wide = torch.cat([grnnd.search(data, graph, q, K, list_size=32)[1] for q in queries.split(batch)])
        narrow = torch.cat([grnnd.search(data, graph, q, K, list_size=32, search_width=1)[1]
                            for q in queries.split(batch)])
        assert grnnd.recall(wide, truth) >= grnnd.recall(narrow, truth), batch


@pytest.mark.parametrize("degree, wide", [(32, 6), (48, 6), (96, 5)])
def test_long_lists_expand_six_parents_by_default(points, graph_for, degree, wide):
    """A list longer than 128 (per search) takes 6 parents an iteration, fewer where 6 rounds of
    the degree would pass 512 candidates (params.h, resolve_search_width): the same results and
    distances as that width given, at a large batch and a small one; a list of 128 keeps 4."""
    data, graph = points[0].cuda(), graph_for("l2", degree).cuda()
    queries = points[1].cuda()
    sms = torch.cuda.get_device_properties(queries.device).multi_processor_count
    for batch in (3, 8 * sms + 1):
        q = torch.cat([queries] * (batch // NQ + 1))[:batch]
        for list_size, width in ((128, 4 if degree <= 64 else 2), (129, wide), (256, wide)):
            searches = 1 if batch > 3 else 4  # a small batch is split; each search then keeps the list
            auto = grnnd.search(data, graph, q, K, list_size=list_size, searches=searches)
            given = grnnd.search(data, graph, q, K, list_size=list_size, searches=searches, search_width=width)
            assert torch.equal(auto[1], given[1]) and torch.equal(auto[0], given[0]), (batch, list_size)
            assert torch.equal(
                grnnd.search_distance_counts(data, graph, q, K, list_size=list_size, searches=searches),
                grnnd.search_distance_counts(data, graph, q, K, list_size=list_size, searches=searches,
                                             search_width=width)), (batch, list_size)


def test_small_batches_split_more_the_longer_the_list(points, graph_for):
    """A split batch runs 4 searches per query at list_size = k and twice as many for each further
    k/3 of list, up to 32 (searches_for_batch): a batch of 2 by automatic searches gives what the
    explicit counts give, and the longer lists find more."""
    data, graph = points[0].cuda(), graph_for("l2").cuda()
    queries = points[1][:400].cuda()
    truth = exact(points[0], points[1][:400], K, "l2")
    recalls = []
    for list_size, searches in ((K, 4), (K + 4, 9), (2 * K, 32), (64, 32)):  # 4 * 2^(3 * 4 / K) = 9.2
        auto = [grnnd.search(data, graph, q, K, list_size=list_size) for q in queries.split(2)]
        given = [grnnd.search(data, graph, q, K, list_size=list_size, searches=searches) for q in queries.split(2)]
        for (ad, ai), (gd, gi) in zip(auto, given):
            assert torch.equal(ai, gi) and torch.equal(ad, gd), (list_size, searches)
        recalls.append(grnnd.recall(torch.cat([ids for _, ids in auto]), truth))
    assert all(b >= a - 0.005 for a, b in zip(recalls, recalls[1:])) and recalls[-1] > recalls[0], recalls


def test_non_default_stream_and_repeatability(points, graph_for):
    data, graph, queries = points[0].cuda(), graph_for("l2").cuda(), points[1].cuda()
    ref = grnnd.search(data, graph, queries, K, list_size=64)
    again = grnnd.search(data, graph, queries, K, list_size=64)
    assert torch.equal(ref[1], again[1]) and torch.equal(ref[0], again[0]), "same inputs, same results"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dists, ids = grnnd.search(data, graph, queries, K, list_size=64)
    stream.synchronize()
    assert torch.equal(ids, ref[1]) and torch.equal(dists, ref[0])


@pytest.mark.parametrize("batch", [3, 700, 40_000])
def test_non_finite_queries_name_their_first_row(points, graph_for, batch):
    # The check's kernel writes one answer a block (at most 1 024 blocks of 256 values, which
    # then step through the rest): 3 queries of 64 values take one block, 700 take 175 (the bad
    # rows in blocks 87, 116 and 174) and 40 000 all 1 024 (blocks 904, 522 and 778: later rows
    # in lower blocks).
    data, graph = points[0].cuda(), graph_for("l2").cuda()
    queries = points[1].cuda().repeat(batch // NQ + 1, 1)[:batch].clone()
    bad = sorted({batch - 1, batch // 2, (2 * batch) // 3})
    for row, value in zip(bad, (float("inf"), float("nan"), float("-inf"))):
        queries[row, row % DIM] = value
    with pytest.raises(ValueError, match=f"queries: expected finite values, row {bad[0]} holds"):
        grnnd.search(data, graph, queries, K, list_size=32)
    queries[bad] = points[1][:len(bad)].cuda()
    grnnd.search(data, graph, queries, K, list_size=32)  # finite again: no stale answer raises


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device(points, graph_for):
    data, graph, queries = points[0], graph_for("l2"), points[1][:256]
    ref = grnnd.search(data.cuda(0), graph.cuda(0), queries.cuda(0), K, list_size=64)
    with torch.cuda.device(0):  # the current device stays cuda:0; the op must follow its inputs
        dists, ids = grnnd.search(data.cuda(1), graph.cuda(1), queries.cuda(1), K, list_size=64)
    assert ids.device == torch.device("cuda", 1) and dists.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    assert torch.equal(ids.cpu(), ref[1].cpu()) and torch.equal(dists.cpu(), ref[0].cpu())


def test_out_of_range_graph_ids(points, graph_for):
    data, queries = points[0], points[1][:256]
    graph = graph_for("l2").clone()
    g = torch.Generator().manual_seed(4)
    corrupt = torch.rand(graph.shape, generator=g) < 0.2
    junk = torch.randint(N, 4 * N, graph.shape, generator=g, dtype=torch.int32)
    junk[torch.rand(graph.shape, generator=g) < 0.5] *= -1
    graph[corrupt] = junk[corrupt]
    graph[0, 0], graph[1, 0] = torch.iinfo(torch.int32).max, torch.iinfo(torch.int32).min
    data, graph, queries = data.cuda(), graph.cuda(), queries.cuda()
    with pytest.raises(ValueError, match=r"graph: ids must lie in \[0, %d\)" % N):
        grnnd.search(data, graph, queries, K, list_size=64)
    # Under CUDA-graph capture the host cannot scan the ids: the kernels must skip them themselves.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, on the intact graph
        grnnd.search(data, graph_for("l2").cuda(), queries, K, list_size=64)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        dists, ids = grnnd.search(data, graph, queries, K, list_size=64)
    cuda_graph.replay()
    torch.cuda.synchronize()
    check_rows(dists, ids, N)
    assert (ids >= 0).all()


@pytest.mark.parametrize("batch", [1000, 4])  # 4: split into several searches per query
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pinned_host_rows_are_searched_as_rows_on_the_gpu(points, graph_for, dtype, metric, batch):
    """Data rows in pinned host memory are read by the kernel where they lie (unified
    addressing): the same walk as over a device copy of the rows, so the same answers, bit for bit."""
    data, graph, queries = points[0].to(dtype), graph_for(metric).cuda(), points[1][:batch].to(dtype).cuda()
    host = data.pin_memory()
    ref = grnnd.search(data.cuda(), graph, queries, K, list_size=64, metric=metric)
    got = grnnd.search(host, graph, queries, K, list_size=64, metric=metric)
    assert got[1].is_cuda and torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0])
    assert torch.equal(grnnd.search_distance_counts(host, graph, queries, K, list_size=64, metric=metric),
                       grnnd.search_distance_counts(data.cuda(), graph, queries, K, list_size=64, metric=metric))


def test_pinned_host_rows_in_an_index_with_removed_rows_and_ids(points, graph_for):
    data, graph, queries = points[0], graph_for("l2").cuda(), points[1][:300].cuda()
    removed = torch.rand(N, generator=torch.Generator().manual_seed(7)) < 0.3
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(8)) * 3 + 11
    on_gpu = grnnd.Index(data.cuda(), graph, removed=removed.cuda(), ids=ids)
    on_host = grnnd.Index(data.pin_memory(), graph, removed=removed, ids=ids)  # ids stay on the host
    ref, got = on_gpu.search(queries, K, list_size=64), on_host.search(queries, K, list_size=64)
    assert got[1].is_cuda and torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0])
    rows = on_gpu.rows_of(got[1][got[1] >= 0])
    assert not removed[rows.cpu()].any(), "a removed row was returned"


def test_host_rows_that_cannot_be_read_where_they_lie_raise(points, graph_for):
    data, graph, queries = points[0], graph_for("l2").cuda(), points[1][:8].cuda()
    with pytest.raises(ValueError, match=r"pinned memory; pass data.pin_memory\(\)"):
        grnnd.search(data, graph, queries, K)
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16, contiguous"):
        grnnd.search(data.double().pin_memory(), graph, queries.double(), K)
    wide = torch.cat([data, data], dim=1).pin_memory()
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16, contiguous"):
        grnnd.search(wide[:, ::2], graph, queries, K)
    with pytest.raises(ValueError, match="queries is on cuda:0 but graph is on cpu"):
        grnnd.search(data.pin_memory(), graph.cpu(), queries, K)
    with pytest.raises(ValueError, match="queries is on cuda:0 but filter is on cpu"):
        grnnd.search(data.pin_memory(), graph, queries, K, filter=torch.ones(N, dtype=torch.bool))
    with pytest.raises(ValueError, match="data is on cuda:0 but queries is on cpu"):
        grnnd.search(data.cuda(), graph, queries.cpu(), K)


def test_misaligned_view(points, graph_for):
    """Rows that start 4 bytes past a 16-byte boundary (a view into a larger buffer) cannot take
    16-byte loads as they are; the op copies them and gives the same answers."""
    data, graph, queries = points[0].cuda(), graph_for("l2").cuda(), points[1][:256].cuda()
    buffer = torch.empty(N * DIM + 1, device="cuda")
    view = buffer[1:].view(N, DIM)
    view.copy_(data)
    assert view.data_ptr() % 16 != 0
    ref = grnnd.search(data, graph, queries, K, list_size=64)
    got = grnnd.search(view, graph, queries, K, list_size=64)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_odd_dim(dtype):
    """Rows that are not a multiple of 16 bytes take the element-wise load path."""
    x = clustered(5_000, 30, 20, seed=5).to(dtype)
    queries = clustered(200, 30, 20, seed=6).to(dtype)
    graph = grnnd.build(x.float(), degree=16)
    # One search per query on both sides: a batch of 200 would otherwise be split on the GPU.
    dists, ids = grnnd.search(x.cuda(), graph.cuda(), queries.cuda(), K, list_size=64, searches=1)
    check_rows(dists, ids, 5_000)
    torch.testing.assert_close(dists.cpu(), reference_distances(x, queries, ids, "l2").float(), rtol=1e-3, atol=1e-3)
    truth = exact(x, queries, K, "l2")
    _, cpu_ids = grnnd.search(x, graph, queries, K, list_size=64, searches=1)
    assert grnnd.recall(ids, truth) >= grnnd.recall(cpu_ids, truth) - 0.01


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_wide_rows_take_several_load_rounds(dtype, metric):
    """Rows of 4400 bytes: each lane of a 32-lane team loads 8-9 chunks of a row, more than the
    warp loop keeps in flight at once (team_visit), so a distance takes several rounds of loads,
    the last one partial. The warp loop and the general loop (one chunk at a time) must still
    return identical results, with the distances of the float64 reference."""
    n, dim = 3_000, 4400 // torch.tensor([], dtype=dtype).element_size()
    x = clustered(n, dim, 20, seed=9).to(dtype)
    queries = clustered(100, dim, 20, seed=9).to(dtype) + 0.01
    graph = grnnd.build(x.float(), degree=16, metric=metric)
    kw = dict(list_size=64, searches=1, metric=metric)
    warp = grnnd.search(x.cuda(), graph.cuda(), queries.cuda(), K, **kw)
    general = grnnd.search(x.cuda(), graph.cuda(), queries.cuda(), K, filter=torch.ones(n, dtype=torch.bool,
                                                                                        device="cuda"), **kw)
    assert torch.equal(warp[1], general[1]) and torch.equal(warp[0], general[0])
    check_rows(*warp, n)
    ref = reference_distances(x, queries, warp[1], metric).float()
    torch.testing.assert_close(warp[0].cpu(), ref, rtol=1e-3, atol=1e-3)
    truth = exact(x, queries, K, metric)
    assert grnnd.recall(warp[1], truth) >= 0.9


def test_tiny_complete_graph_is_exact():
    """With fewer rows than list_size and every edge present the search is exhaustive."""
    n = 50
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(7))
    others = torch.arange(n).repeat(n, 1)
    graph = others[others != torch.arange(n)[:, None]].view(n, n - 1).int()
    queries = torch.randn(20, 16, generator=torch.Generator().manual_seed(8))
    dists, ids = grnnd.search(x.cuda(), graph.cuda(), queries.cuda(), n, list_size=64)
    ref_d, ref_i = grnnd.knn(x, queries, n)
    assert torch.equal(ids.cpu(), ref_i)
    torch.testing.assert_close(dists.cpu(), ref_d, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise(points, graph_for):
    data, graph, queries = points[0][:1000].cuda(), graph_for("l2")[:1000].cuda(), points[1][:4].cuda()
    with pytest.raises(ValueError, match="list_size"):
        grnnd.search(data, graph, queries, K, list_size=2048)
    with pytest.raises(ValueError, match="k"):
        grnnd.search(data, graph, queries, 65, list_size=64)
    with pytest.raises(ValueError, match="device"):
        grnnd.search(data, graph.cpu(), queries, K)
