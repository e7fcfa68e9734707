"""GRNND build + graph search on the CPU: recall against faiss-cpu, graph invariants, ablations."""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered, exact_neighbours, one_thread


def check_graph_invariants(graph: torch.Tensor, data: torch.Tensor, degree: int, metric: str = "l2"):
    n = data.shape[0]
    assert graph.dtype == torch.int32 and graph.shape == (n, degree)
    valid = graph >= 0
    assert ((graph >= -1) & (graph < n)).all(), "ids out of range"
    # -1 only as a tail pad: once a row has a pad, everything after it is a pad
    assert not (valid[:, 1:] & ~valid[:, :-1]).any(), "-1 before a valid id"
    rows = torch.arange(n).unsqueeze(1).expand_as(graph)
    assert not (valid & (graph == rows)).any(), "self loop"
    ids = graph.long().where(valid, -torch.arange(1, degree + 1).expand_as(graph))  # pads made unique
    assert (ids.sort(1).values.diff(dim=1) != 0).all(), "duplicate id in a row"
    # rows ascending by distance
    x = data.float()
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    neigh = x[graph.long().clamp_min(0)]
    if metric == "ip":  # ip graphs are built on the lifted l2 distance (csrc/core/params.h)
        sq = x.pow(2).sum(1)
        lift = (sq.max() - sq).clamp_min(0).sqrt()
        d = (neigh - x.unsqueeze(1)).pow(2).sum(-1) + (lift[graph.long().clamp_min(0)] - lift.unsqueeze(1)).pow(2)
    elif metric == "l2":
        d = (neigh - x.unsqueeze(1)).pow(2).sum(-1)
    else:
        d = -(neigh * x.unsqueeze(1)).sum(-1)
    ascending = d[:, 1:] >= d[:, :-1] - 1e-4 * d[:, :-1].abs().clamp_min(1)
    assert (ascending | ~valid[:, 1:]).all(), "row not ascending by distance"
    return valid.sum(1)


def test_default_build_reaches_recall(blobs, blobs_truth, blobs_graph):
    data, queries = blobs
    _, ids = grnnd.search(data, blobs_graph, queries, 10)
    assert grnnd.recall(ids, blobs_truth) >= 0.95


def test_default_graph_invariants(blobs, blobs_graph):
    degrees = check_graph_invariants(blobs_graph, blobs[0], grnnd.BuildParams().degree)
    assert degrees.min() >= 1, "a vertex without neighbours cannot be reached through it"


def test_search_results_sorted_unique(blobs, blobs_graph):
    data, queries = blobs
    dists, ids = grnnd.search(data, blobs_graph, queries, 10, list_size=32)
    assert dists.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (500, 10)
    assert (dists.diff(dim=1) >= 0).all()
    assert (ids.sort(1).values.diff(dim=1) != 0).all()
    exact = (data[ids] - queries.unsqueeze(1)).pow(2).sum(-1)
    torch.testing.assert_close(dists, exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("searches", [2, 8])
def test_split_search_results(blobs, blobs_graph, searches):
    """A query answered by several independent searches (params.h): the merged results are
    ascending, distinct and exact, and the work (distances computed) grows with the searches."""
    data, queries = blobs
    dists, ids = grnnd.search(data, blobs_graph, queries, 10, list_size=32, searches=searches)
    assert (dists.diff(dim=1) >= 0).all()
    assert (ids.sort(1).values.diff(dim=1) != 0).all()
    torch.testing.assert_close(dists, (data[ids] - queries.unsqueeze(1)).pow(2).sum(-1), rtol=1e-4, atol=1e-4)
    single = grnnd.search_distance_counts(data, blobs_graph, queries, 10, list_size=32, searches=1)
    split = grnnd.search_distance_counts(data, blobs_graph, queries, 10, list_size=32, searches=searches)
    assert split.float().mean() > 1.5 * single.float().mean()


def test_split_search_recall(blobs, blobs_truth, blobs_graph):
    """Splitting buys recall where one search is short of it, and costs little where one search
    is already near 0.99 (the documented trade-off in params.h)."""
    data, queries = blobs

    def recall(list_size, searches):
        return grnnd.recall(grnnd.search(data, blobs_graph, queries, 10, list_size=list_size, searches=searches)[1],
                            blobs_truth)

    # With rows filled to the degree (csrc/build/fill.h) one search at list 16 already recalls 0.99 here;
    # at list 10 it missed 0.011 of the neighbours against 0.005 split in 8 (CPU, degree 48).
    assert 1 - recall(10, 8) <= (1 - recall(10, 1)) * 2 / 3
    assert recall(32, 8) >= recall(32, 1) - 0.015


def test_cpu_searches_once_unless_asked(blobs, blobs_graph):
    data, queries = blobs
    auto = grnnd.search(data, blobs_graph, queries[:3], 10)
    one = grnnd.search(data, blobs_graph, queries[:3], 10, searches=1)
    assert torch.equal(auto[1], one[1]) and torch.equal(auto[0], one[0])


def test_distance_counts(blobs, blobs_graph):
    data, queries = blobs
    counts = {lst: grnnd.search_distance_counts(data, blobs_graph, queries, 10, list_size=lst) for lst in (16, 64)}
    assert counts[16].dtype == torch.int32 and counts[16].shape == (queries.shape[0],)
    # Every search computes at least its entry points (one per list slot) and at most every row.
    assert (counts[16] >= 16).all() and (counts[64] >= 64).all() and (counts[64] <= data.shape[0]).all()
    assert counts[64].float().mean() > counts[16].float().mean()
    # One iteration: the hubs ranked for the entry points (one distance each), the entry points,
    # and the neighbours of one parent (a row of the graph).
    hubs = grnnd.diagnostics.hubs(data).numel()
    assert hubs == 20
    one_step = grnnd.search_distance_counts(data, blobs_graph, queries, 10, list_size=16, max_iters=1)
    assert (one_step <= hubs + 16 + blobs_graph.shape[1]).all() and (one_step > hubs + 16).any()


def test_larger_list_raises_recall(blobs, blobs_truth, blobs_graph):
    data, queries = blobs
    recalls = [grnnd.recall(grnnd.search(data, blobs_graph, queries, 10, list_size=s)[1], blobs_truth)
               for s in (10, 32, 128)]
    assert recalls[0] < recalls[1] <= recalls[2]
    assert recalls[2] >= 0.99


def test_search_width_two_also_reaches_recall(blobs, blobs_truth, blobs_graph):
    data, queries = blobs
    _, ids = grnnd.search(data, blobs_graph, queries, 10, search_width=2)
    assert grnnd.recall(ids, blobs_truth) >= 0.95


@pytest.mark.parametrize("metric", ["ip", "cosine"])
def test_other_metrics_reach_recall(metric):
    data = clustered(8000, 32, 40, seed=4)
    queries = clustered(300, 32, 40, seed=5)
    graph = grnnd.build(data, metric=metric)
    check_graph_invariants(graph, data, grnnd.BuildParams().degree, metric)
    _, truth = exact_neighbours(data, queries, 10, metric)
    # Maximum inner product is the harder search (this set's ip recall at list 128 is about 0.95,
    # at 192 about 0.98), so the list is larger than for l2.
    _, ids = grnnd.search(data, graph, queries, 10, metric=metric, list_size=192)
    assert grnnd.recall(ids, truth) >= 0.95


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_storage_dtypes(dtype):
    data = clustered(5000, 32, 30, seed=6)
    queries = clustered(200, 32, 30, seed=7)
    graph = grnnd.build(data.to(dtype))
    check_graph_invariants(graph, data.to(dtype), grnnd.BuildParams().degree)
    _, truth = exact_neighbours(data.to(dtype).float(), queries.to(dtype).float(), 10)
    _, ids = grnnd.search(data.to(dtype), graph, queries.to(dtype), 10, list_size=128)
    assert grnnd.recall(ids, truth) >= 0.95


def test_knn_graph_recall(blobs):
    data = blobs[0][:8000]
    dists, ids = torch.ops.grnnd.knn_graph(data, 10)
    assert ids.shape == (8000, 10) and dists.shape == (8000, 10)
    assert not (ids == torch.arange(8000).unsqueeze(1)).any(), "self in its own list"
    _, truth = exact_neighbours(data, data, 11)
    truth = truth[:, 1:]  # the exact list starts with the point itself (no duplicates in this data)
    assert grnnd.recall(ids, truth) >= 0.95
    _, exact_ids = torch.ops.grnnd.knn_graph(data, 10, exact=True)
    assert grnnd.recall(exact_ids, truth) >= 0.999  # not 1.0: faiss and knn may break distance ties differently


def test_knn_graph_edge_index_follows_pyg():
    data = clustered(600, 8, 6, seed=8)
    edge_index = grnnd.knn_graph(data, 5, exact=True)
    _, ids = torch.ops.grnnd.knn_graph(data, 5, exact=True)
    assert edge_index.shape == (2, 3000)
    assert torch.equal(edge_index[1], torch.arange(600).repeat_interleave(5))  # targets = centres
    assert torch.equal(edge_index[0], ids.reshape(-1))
    flipped = grnnd.knn_graph(data, 5, exact=True, flow="target_to_source")
    assert torch.equal(flipped, edge_index.flip(0))
    with_loops = grnnd.knn_graph(data, 5, exact=True, loop=True)  # the loop is one of the 5
    assert with_loops.shape == (2, 3000) and (with_loops[0] == with_loops[1]).sum() == 600
    assert torch.equal(with_loops[0].view(600, 5)[:, 1:], edge_index[0].view(600, 5)[:, :4])


@pytest.mark.parametrize("loop", [False, True])
def test_knn_graph_has_torch_clusters_loop_and_small_example_semantics(loop):
    # Examples of 1, 3 and 40 points with k = 5: the small ones give each point what they have.
    from torch_grnnd.pyg import knn_graph as cluster_style
    sizes = [1, 3, 40]
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    x = clustered(44, 4, 3, seed=9)
    edge_index, dists = grnnd.knn_graph(x, 5, batch, exact=True, loop=loop, return_distances=True)
    want = cluster_style(x, 5, batch, loop=loop)
    assert set(map(tuple, edge_index.t().tolist())) == set(map(tuple, want.t().tolist()))
    per_point = torch.bincount(edge_index[1], minlength=44)
    expected = [1 if loop else 0] + [3 if loop else 2] * 3 + [5] * 40
    assert per_point.tolist() == expected
    torch.testing.assert_close(dists, (x[edge_index[0]] - x[edge_index[1]]).pow(2).sum(1), rtol=1e-5, atol=1e-5)


def quality(data, queries, truth, **build_params):
    """Graph quality as recall@10 of the smallest search (list 10), averaged over seeds: filled rows
    (csrc/build/fill.h) recall 0.97 at list 16 here whatever the rounds made of them."""
    recalls = []
    for seed in (0, 1):
        graph = grnnd.build(data, seed=seed, **build_params)
        recalls.append(grnnd.recall(grnnd.search(data, graph, queries, 10, list_size=10)[1], truth))
    return sum(recalls) / len(recalls)


def test_random_order_beats_ascending_at_equal_iterations(blobs, blobs_truth):
    # Seed 000, Figure 7: parallel ascending updates fall into synchronised convergence traps.
    # Measured here at T1=2, T2=3 from the paper's random start: random ~0.85, ascending ~0.76.
    data, queries = blobs
    few = dict(outer_iters=2, inner_iters=3, start="random", delta=0)
    random = quality(data, queries, blobs_truth, update_order="random", **few)
    ascending = quality(data, queries, blobs_truth, update_order="ascending", **few)
    # The fill (csrc/build/fill.h) narrows the gap the rounds leave: 0.925 against 0.911 at list 10 (CPU).
    assert random > ascending + 0.005, (random, ascending)


def test_reverse_edges_improve_the_graph(blobs, blobs_truth):
    # Seed 000, Figure 8: without reverse edges the graph is less connected and recall drops.
    # Both run the same rounds (two outer iterations, each to its cap), so that the convergence
    # test, which stops the two at different rounds, does not decide the comparison. Narrowed by
    # the fill (csrc/build/fill.h): 0.9888 against 0.9875 at list 10 here (CPU); with the
    # default stop rule both end near 0.986, a third outer iteration taking back what the reverse
    # edges gave on these well-separated blobs.
    data, queries = blobs
    rounds = dict(delta=0.0, outer_iters=2)
    without = quality(data, queries, blobs_truth, reverse_ratio=0.0, **rounds)
    sampled = quality(data, queries, blobs_truth, reverse_ratio=0.6, **rounds)
    assert sampled > without, (sampled, without)


def test_same_seed_one_thread_is_reproducible():
    data = clustered(3000, 16, 20, seed=9)
    with one_thread():
        a = grnnd.build(data, seed=7)
        b = grnnd.build(data, seed=7)
        c = grnnd.build(data, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_descending_then_random_orders_each_outer_iteration():
    # Descending in every outer iteration but the last, random in the last: with one outer
    # iteration it is the random build, with two it is neither of the plain orders.
    data = clustered(3000, 16, 20, seed=9)
    with one_thread():
        build = lambda order, outer: grnnd.build(data, update_order=order, outer_iters=outer, inner_iters=3)  # noqa: E731
        assert torch.equal(build("descending_then_random", 1), build("random", 1))
        mixed = build("descending_then_random", 2)
        assert not torch.equal(mixed, build("random", 2))
        assert not torch.equal(mixed, build("descending", 2))


def test_tiny_inputs():
    data = torch.randn(2, 3)
    graph = grnnd.build(data, degree=4, pool_size=4, initial_degree=4)
    assert graph.tolist() == [[1, -1, -1, -1], [0, -1, -1, -1]]
    dists, ids = grnnd.search(data, graph, data, 2)
    assert ids.tolist() == [[0, 1], [1, 0]]
    one = grnnd.build(torch.randn(1, 3), degree=2, pool_size=2, initial_degree=1)
    assert one.tolist() == [[-1, -1]]


def test_filter_never_returns_excluded(blobs, blobs_graph):
    data, queries = blobs
    allowed = torch.rand(data.shape[0], generator=torch.Generator().manual_seed(0)) < 0.3
    _, ids = grnnd.search(data, blobs_graph, queries, 10, list_size=64, filter=allowed)
    assert allowed[ids[ids >= 0]].all()
    kept = allowed.nonzero().squeeze(1)
    _, truth = exact_neighbours(data[kept], queries, 10)
    assert grnnd.recall(ids, kept[truth]) >= 0.9
