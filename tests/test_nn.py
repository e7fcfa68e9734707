"""torch_grnnd.nn: the KNNGraph layer and the Retriever module, and knn_graph's batch vector."""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours, one_thread

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def examples(sizes, dim=16, seed=0):
    """(x, batch) of len(sizes) clustered examples, each drawn around its own centres."""
    parts = [clustered(size, dim, 5, seed=seed + i) for i, size in enumerate(sizes)]
    return torch.cat(parts), torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))


def test_batch_graphs_stay_inside_examples_and_reach_recall():
    sizes = [700, 120, 1500, 400]
    x, batch = examples(sizes)
    edge_index = grnnd.knn_graph(x, 10, batch)
    assert edge_index.shape == (2, 10 * sum(sizes))
    assert torch.equal(batch[edge_index[0]], batch[edge_index[1]]), "an edge joins two examples"
    ids = edge_index[0].view(-1, 10)
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        _, truth = exact_neighbours(x[rows], x[rows], 11)
        recall = grnnd.recall(ids[rows] - start, truth[:, 1:])
        assert recall >= 0.95, (size, recall)
        start += size


def test_batch_equals_separate_graphs_and_skips_missing_examples():
    x, _ = examples([50, 80])
    batch = torch.tensor([2] * 50 + [5] * 80)  # example ids need not be consecutive
    edge_index = grnnd.knn_graph(x, 4, batch, exact=True)
    first, second = grnnd.knn_graph(x[:50], 4, exact=True), grnnd.knn_graph(x[50:], 4, exact=True)
    assert torch.equal(edge_index, torch.cat([first, second + 50], dim=1))


@pytest.mark.parametrize(
    "batch, k, error, match",
    [
        (torch.tensor([0] * 30 + [1] * 5 + [2] * 25), 0, ValueError, r"k: expected >= 1, got 0"),
        (torch.tensor([1] * 30 + [0] * 30), 3, ValueError, "batch: expected examples in ascending order"),
        (torch.tensor([0] * 30 + [1] * 20 + [0] * 10), 3, ValueError, "batch: expected examples in ascending order"),
        (torch.zeros(59, dtype=torch.long), 3, ValueError, r"batch: expected shape \[60\]"),
        (torch.zeros(60), 3, TypeError, "batch: expected an integer tensor"),
    ],
)
def test_batch_errors_name_the_problem(batch, k, error, match):
    with pytest.raises(error, match=match):
        grnnd.knn_graph(torch.randn(60, 4), k, batch)


@pytest.mark.parametrize("loop", [False, True])
def test_knn_graph_layer_returns_edge_distances(loop):
    x, batch = examples([200, 300], dim=8)
    layer = grnnd.nn.KNNGraph(k=6, metric="ip", loop=loop)
    with one_thread():  # both build a graph: equal only where the build is reproducible
        edge_index, dists = layer(x, batch)
        assert torch.equal(edge_index, grnnd.knn_graph(x, 6, batch, metric="ip", loop=loop))
    recomputed = -(x[edge_index[0]] * x[edge_index[1]]).sum(1)
    torch.testing.assert_close(dists, recomputed, rtol=1e-5, atol=1e-4)
    assert "k=6, metric='ip'" in repr(layer)


def test_knn_graph_layer_is_differentiable():
    x = clustered(100, 8, 4, seed=3).requires_grad_()
    edge_index, dists = grnnd.nn.KNNGraph(k=4, loop=True)(x)
    dists.sum().backward()
    want = 2 * torch.zeros_like(x).index_add(0, edge_index[1], x[edge_index[1]] - x[edge_index[0]]).detach()
    want += 2 * torch.zeros_like(x).index_add(0, edge_index[0], x[edge_index[0]] - x[edge_index[1]]).detach()
    torch.testing.assert_close(x.grad, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def corpus():
    return clustered(3000, 16, 20, seed=20), clustered(50, 16, 20, seed=21)


def test_retriever_state_dict_round_trip(corpus, tmp_path):
    data, queries = corpus
    retriever = grnnd.nn.Retriever(data, k=5, metric="cosine", list_size=48, degree=24)
    dists, ids = retriever(queries)
    assert set(retriever.state_dict()) == {"data", "graph", "ids", "removed", "_extra_state"}
    torch.save(retriever.state_dict(), tmp_path / "retriever.pt")
    restored = grnnd.nn.Retriever()
    restored.load_state_dict(torch.load(tmp_path / "retriever.pt", weights_only=True))
    assert (restored.k, restored.metric, restored.list_size, restored.build_params) == (5, "cosine", 48,
                                                                                  grnnd.BuildParams(degree=24))
    again_dists, again_ids = restored(queries)
    assert torch.equal(ids, again_ids) and torch.equal(dists, again_dists)
    assert "n=3000, dim=16, k=5, metric='cosine'" in repr(restored)


def test_retriever_inside_a_model(corpus):
    data, queries = corpus

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(16, 16)
            self.index = grnnd.nn.Retriever(k=3)

        def forward(self, x):
            return self.index(self.encoder(x))

    model = Model()
    with torch.no_grad():
        model.index.rebuild(model.encoder(data))
    assert set(model.state_dict()) >= {"encoder.weight", "index.data", "index.graph", "index._extra_state"}
    copy = Model()
    copy.load_state_dict(model.state_dict())
    assert torch.equal(copy(queries)[1], model(queries)[1])
    dists, _ = model(queries)
    dists.sum().backward()  # gradients reach the query encoder; the index is a detached buffer
    assert model.encoder.weight.grad is not None and not model.index.data.requires_grad

    model.half()
    assert model.index.data.dtype == torch.float16 and model.index.graph.dtype == torch.int32
    _, ids = model.index(model.encoder(queries.half()))
    assert grnnd.recall(ids, copy(queries)[1]) >= 0.9


def test_retriever_rebuild_replaces_the_index(corpus):
    data, queries = corpus
    retriever = grnnd.nn.Retriever(data[:1000], k=4)
    assert len(retriever) == 1000
    assert retriever.rebuild(data) is retriever and len(retriever) == 3000
    _, truth = exact_neighbours(data, queries, 4)
    assert grnnd.recall(retriever(queries)[1], truth) >= 0.95
    assert retriever(queries, k=2)[1].shape == (50, 2)


def test_empty_retriever_says_what_to_do():
    with pytest.raises(RuntimeError, match="Retriever is empty: call rebuild"):
        grnnd.nn.Retriever()(torch.randn(2, 4))


@needs_cuda
@pytest.mark.cuda
def test_retriever_follows_the_module_to_cuda(corpus):
    data, queries = corpus
    retriever = grnnd.nn.Retriever(data, k=5)
    cpu_ids = retriever(queries)[1]
    retriever.cuda()
    assert retriever.data.is_cuda and retriever.graph.is_cuda
    dists, ids = retriever(queries.cuda())
    # A batch this small is split into several searches per query on the GPU (ops.search), so
    # the answers may differ from the CPU's; their quality may not.
    truth = grnnd.knn(data, queries, 5)[1]
    assert ids.is_cuda and grnnd.recall(ids, truth) >= grnnd.recall(cpu_ids, truth) - 0.01
    restored = grnnd.nn.Retriever().cuda()
    restored.load_state_dict(retriever.state_dict())
    assert restored.data.is_cuda and torch.equal(restored(queries.cuda())[1], ids)


@needs_cuda
@pytest.mark.cuda
def test_batch_graphs_on_cuda():
    x, batch = examples([300, 500])
    cpu = grnnd.knn_graph(x, 8, batch, exact=True)
    edge_index, dists = grnnd.nn.KNNGraph(k=8)(x.cuda(), batch.cuda())
    assert edge_index.is_cuda and dists.is_cuda
    assert torch.equal(batch[edge_index[0].cpu()], batch[edge_index[1].cpu()])
    assert grnnd.recall(edge_index[0].view(-1, 8).cpu(), cpu[0].view(-1, 8)) >= 0.95


def test_retriever_adds_removes_and_keeps_it_in_its_state():
    data = clustered(3000, 16, 20, seed=40)
    retriever = grnnd.nn.Retriever(k=3)
    retriever.add(data[:2000], ids=torch.arange(2000) + 100)      # empty: the first add builds
    retriever.add(data[2000:], ids=torch.arange(1000) + 5000)
    # One Index behind the buffers from call to call: room reserved through it stays, so an add
    # that fits copies none of the rows (the buffers stay views of one storage).
    index = retriever.index
    index.reserve(3100)
    assert retriever.index is index and index.capacity == 3100 and retriever.data.shape[0] == 3000
    storage = retriever.data.untyped_storage().data_ptr()
    retriever.add(data[:5], ids=torch.arange(5) + 9000)
    assert retriever.index is index and retriever.data.untyped_storage().data_ptr() == storage
    retriever.remove(torch.arange(5) + 9000)
    retriever.remove(torch.tensor([100, 5000]))
    assert len(retriever) == 2998
    found = retriever(data)[1]
    assert not torch.isin(found, torch.tensor([100, 5000])).any()
    assert (found[1:2000, 0] == torch.arange(101, 2100)).float().mean() >= 0.99
    restored = grnnd.nn.Retriever()
    restored.load_state_dict(retriever.state_dict())
    assert torch.equal(restored(data)[1], found) and len(restored) == 2998
    retriever.compact()
    assert retriever.data.shape[0] == 2998 and retriever.removed.numel() == 0
    assert not torch.isin(retriever(data)[1], torch.tensor([100, 5000])).any()
    # A state saved before ids and tombstones existed still loads.
    old = {key: value for key, value in grnnd.nn.Retriever(data[:500], k=3).state_dict().items()
           if not key.endswith(("ids", "removed"))}
    plain = grnnd.nn.Retriever()
    plain.load_state_dict(old)
    assert plain.ids.numel() == 0 and len(plain) == 500


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_a_batch_of_small_examples_is_one_segment_search(metric, monkeypatch):
    # Examples of at most segments.EXACT_EXAMPLE_ROWS rows: one knn_segments call for the whole batch,
    # exact neighbours even when an approximate graph is asked for, k per point with duplicates.
    from torch_grnnd import segments
    x, batch = examples([300, 5, 700], dim=6)
    x[10] = x[11]  # a duplicate: each must still get k others, never itself
    calls = []
    scan = segments._scan
    monkeypatch.setattr(segments, "_scan", lambda *args: calls.append(1) or scan(*args))
    edge_index, dists = grnnd.knn_graph(x, 8, batch, metric=metric, return_distances=True)
    assert len(calls) == 1
    neighbour, centre = edge_index
    assert not bool((neighbour == centre).any()) and torch.equal(batch[neighbour], batch[centre])
    assert torch.bincount(centre, minlength=1005).tolist() == [8] * 300 + [4] * 5 + [8] * 700
    start = 0
    for size in (300, 5, 700):  # the same neighbour distances as each example's exact graph
        mine = (centre >= start) & (centre < start + size)
        want = grnnd.knn_graph(x[start:start + size], min(8, size - 1), metric=metric, exact=True,
                               return_distances=True)[1]
        torch.testing.assert_close(dists[mine], want, rtol=1e-4, atol=1e-5)
        start += size
    # Larger examples are built one after another, as before.
    monkeypatch.setattr(segments, "EXACT_EXAMPLE_ROWS", 100)
    calls.clear()
    grnnd.knn_graph(x, 8, batch, metric=metric)
    assert not calls


def gapped_batch(device):
    """(x, batch) of examples 0 (40 points), 1 (3: fewer than k + 1), 3 (60; no example 2), 8-d."""
    g = torch.Generator().manual_seed(7)
    batch = torch.tensor([0] * 40 + [1] * 3 + [3] * 60)
    return torch.randn(103, 8, generator=g).to(device), batch.to(device)


def brute_force_others(x, batch, k, metric):
    """Each point's k nearest other points of its example by float64 brute force, ties to the
    lower id: one list per point."""
    x = x.double().cpu()
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    lists = []
    for i in range(x.shape[0]):
        mine = ((batch.cpu() == batch[i].item()).nonzero().flatten()).tolist()
        mine.remove(i)
        d = -(x[mine] @ x[i]) if metric == "ip" else (x[mine] - x[i]).square().sum(1)
        lists.append(sorted(mine, key=lambda j: (d[mine.index(j)].item(), j))[:k])
    return lists


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_batch_graph_is_the_pyg_graph_and_the_exact_one(device, metric, loop, flow):
    # grnnd.knn_graph searches a batch as torch_grnnd.pyg.knn_graph does: the same edges in the
    # same order and the same distances (no duplicate points here, where their rules differ),
    # exact, and so also where an approximate graph is asked of examples this small.
    from torch_grnnd import pyg
    x, batch = gapped_batch(device)
    k = 5
    edge_index, dists = grnnd.knn_graph(x, k, batch, metric=metric, exact=True, loop=loop, flow=flow,
                                        return_distances=True)
    want, want_dists = pyg.knn_graph(x, k, batch, loop, flow, cosine=metric == "cosine", return_distances=True)
    assert edge_index.device == x.device and torch.equal(edge_index, want)
    torch.testing.assert_close(dists, want_dists)
    assert torch.equal(grnnd.knn_graph(x, k, batch, metric=metric, loop=loop, flow=flow), want)
    neighbour, point = edge_index if flow == "source_to_target" else edge_index.flip(0)
    truth = brute_force_others(x, batch, k - 1 if loop else k, metric)
    found = [[] for _ in range(x.shape[0])]
    for n, p in zip(neighbour.tolist(), point.tolist()):
        found[p].append(n)
    assert found == [([p] if loop else []) + others for p, others in enumerate(truth)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_given_batch_size_gives_the_same_graph(device):
    # batch_size (torch_cluster's argument) spares reading the number of examples: the same edges
    # and distances, by the function and by the module, with an example id skipped (2 of 0..3).
    x, batch = gapped_batch(device)
    for exact in (True, False):
        want = grnnd.knn_graph(x, 5, batch, exact=exact, return_distances=True)
        got = grnnd.knn_graph(x, 5, batch, exact=exact, return_distances=True, batch_size=4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    layer = grnnd.nn.KNNGraph(5, exact=True)
    assert torch.equal(layer(x, batch, batch_size=4)[0], layer(x, batch)[0])
    if device == "cpu":  # a batch vector on the CPU is checked all the same
        with pytest.raises(ValueError, match="sorted"):
            grnnd.knn_graph(x, 5, batch.flip(0), batch_size=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exact", [True, False])
def test_ip_batch_graph_is_each_example_on_its_own(device, exact):
    # The segment kernel ranks by l2: under ip each example is searched on its own, exactly where
    # the examples are this small, with the edges and distances of each example's exact graph.
    x, batch = gapped_batch(device)
    edge_index, dists = grnnd.knn_graph(x, 4, batch, metric="ip", exact=exact, return_distances=True)
    parts = [(grnnd.knn_graph(x[a:b], min(4, b - a - 1), metric="ip", exact=True, return_distances=True), a)
             for a, b in ((0, 40), (40, 43), (43, 103))]
    assert torch.equal(edge_index, torch.cat([edges + a for (edges, _), a in parts], dim=1))
    torch.testing.assert_close(dists, torch.cat([d for (_, d), _ in parts]), rtol=1e-5, atol=1e-5)
    assert brute_force_others(x, batch, 4, "ip") == [edge_index[0, edge_index[1] == p].tolist() for p in range(103)]


@pytest.mark.parametrize("device", DEVICES)
def test_batch_graph_of_no_points_has_no_edges(device):
    x, batch = torch.empty(0, 3, device=device), torch.empty(0, dtype=torch.long, device=device)
    for exact in (True, False):
        edge_index, dists = grnnd.knn_graph(x, 2, batch, exact=exact, return_distances=True)
        assert edge_index.shape == (2, 0) and dists.shape == (0,) and edge_index.device == x.device


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_an_approximate_batch_builds_its_large_examples_only(metric, monkeypatch):
    # Past segments.EXACT_EXAMPLE_ROWS an example gets its own GRNND graph; the small ones of the
    # same batch (down to a lone point) are still searched exactly.
    from torch_grnnd import segments
    monkeypatch.setattr(segments, "EXACT_EXAMPLE_ROWS", 50)
    builds = []
    build = segments.ops.build
    monkeypatch.setattr(segments.ops, "build", lambda rows, **kw: builds.append(len(rows)) or build(rows, **kw))
    sizes = [1, 2, 5, 300]
    x, batch = examples(sizes, dim=8)
    edge_index = grnnd.knn_graph(x, 4, batch, metric=metric)
    exact = grnnd.knn_graph(x, 4, batch, metric=metric, exact=True)
    assert builds == [300] and edge_index.shape == exact.shape == (2, 0 + 2 + 20 + 1200)
    assert torch.equal(edge_index[:, :22], exact[:, :22])  # the small examples' edges come first
    assert grnnd.recall(edge_index[0, 22:].view(-1, 4), exact[0, 22:].view(-1, 4)) >= 0.9


def test_the_pyg_transform_is_the_module():
    from torch_grnnd import pyg
    transform = pyg.KNNGraph(k=3, cosine=True, approximate=True)
    assert isinstance(transform, grnnd.nn.KNNGraph)
    assert (transform.metric, transform.exact, transform.cosine, transform.approximate) == ("cosine", False, True, True)
    transform.cosine, transform.approximate = False, False
    assert (transform.metric, transform.exact) == ("l2", True) and repr(transform) == "KNNGraph(k=3)"
    for make in (grnnd.nn.KNNGraph, pyg.KNNGraph):
        with pytest.raises(ValueError, match="flow: expected"):
            make(3, flow="up")


def test_retriever_buffers_replaced_win_over_the_index_it_held():
    # An edit made through retriever.index and not yet seen by the buffers must not undo a
    # later load_state_dict or dtype change; and state_dict saves the edit.
    a, b = clustered(2000, 16, 10, seed=41), clustered(3000, 16, 10, seed=42)
    retriever = grnnd.nn.Retriever(a, k=3)
    retriever.index.reserve(2500)
    retriever.load_state_dict(grnnd.nn.Retriever(b, k=3).state_dict())
    retriever(b[:2])
    assert retriever.data.shape[0] == 3000 and len(retriever) == 3000
    retriever.index.reserve(3500)
    retriever.double()
    retriever(b[:2].double())
    assert retriever.data.dtype == torch.float64
    edited = grnnd.nn.Retriever(a, k=3)
    edited.index.remove(torch.tensor([0, 1]))
    restored = grnnd.nn.Retriever()
    restored.load_state_dict(edited.state_dict())
    assert len(restored) == 1998 and not torch.isin(restored(a[:5])[1], torch.tensor([0, 1])).any()


def test_retriever_search_takes_the_settings_of_the_call():
    data = clustered(3000, 16, 10, seed=43)
    retriever = grnnd.nn.Retriever(data, k=3, list_size=16)
    allowed = torch.arange(3000) % 2 == 1
    dists, ids = retriever.search(data[:20], 5, list_size=64, filter=allowed)
    assert ids.shape == (20, 5) and bool((ids % 2 == 1).all())
    assert torch.equal(retriever.search(data[:20])[1], retriever(data[:20])[1])  # its own settings otherwise
