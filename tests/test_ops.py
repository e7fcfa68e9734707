"""Op registration: opcheck, torch.compile, schema defaults, the Index API."""
import dataclasses

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered, one_thread

# Small enough that every kernel runs on one thread, so repeated calls agree exactly.
DATA = clustered(60, 8, 4, seed=11)
QUERIES = clustered(7, 8, 4, seed=12)
GRAPH = grnnd.build(DATA, degree=8, pool_size=16, initial_degree=8)


@pytest.mark.parametrize(
    "op, args, kwargs",
    [
        (torch.ops.grnnd.build.default, (DATA,), dict(degree=8, pool_size=16, initial_degree=8)),
        (torch.ops.grnnd.build.default, (DATA.half(),), dict(degree=8, pool_size=16, initial_degree=8, metric="cosine")),
        (torch.ops.grnnd.search.default, (DATA, GRAPH, QUERIES, 5), dict(list_size=16)),
        (torch.ops.grnnd.search.default, (DATA, GRAPH, QUERIES, 5), dict(filter=torch.arange(60) % 2 == 0)),
        (torch.ops.grnnd.search.default, (DATA, GRAPH, QUERIES, 5), dict(list_size=16, searches=3)),
        (torch.ops.grnnd.search_distance_counts.default, (DATA, GRAPH, QUERIES, 5), dict(searches=2)),
        (torch.ops.grnnd.knn.default, (DATA, QUERIES, 5), dict(metric="ip")),
        (torch.ops.grnnd.nearest_hubs.default, (clustered(16_000, 4, 8, seed=13), QUERIES[:, :4], 3), dict()),
        (torch.ops.grnnd.connect.default, (DATA, GRAPH), dict()),
        (torch.ops.grnnd.fill.default, (DATA, GRAPH), dict()),
        (torch.ops.grnnd.gather_rows.default, (DATA, torch.tensor([3, 0, 59, 3])), dict()),
        (torch.ops.grnnd.knn_graph.default, (DATA, 4), dict()),
        (torch.ops.grnnd.knn_graph.default, (DATA, 4), dict(exact=True)),
        (torch.ops.grnnd.knn_segments.default, (DATA, QUERIES, torch.tensor([0, 25, 60]),
                                                torch.tensor([0, 0, 1, 1, 1, 0, 1]), 5), dict()),
        (torch.ops.grnnd.segment_edges.default, (torch.rand(7, 4), torch.randint(-1, 7, (7, 4))),
         dict(max_distance=0.5, drop_self=True, neighbour_first=True)),
    ],
)
def test_opcheck(op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


def test_compile_fullgraph_build_and_search():
    def retrieve(data, queries):
        graph = torch.ops.grnnd.build(data, degree=8, pool_size=16, initial_degree=8)
        dists, ids = torch.ops.grnnd.search(data, graph, queries, 3)
        return dists.sqrt(), ids

    compiled = torch.compile(retrieve, fullgraph=True, backend="aot_eager")
    dists, ids = compiled(DATA, QUERIES)
    eager_dists, eager_ids = retrieve(DATA, QUERIES)
    assert torch.equal(ids, eager_ids)
    torch.testing.assert_close(dists, eager_dists)


class EmbedAndRetrieve(torch.nn.Module):
    """Encodes, takes the k-NN graph of the batch, indexes it and searches it: every op, the
    Python wrappers, both nn layers and the backward, as a model would use them."""

    def __init__(self, dim):
        super().__init__()
        self.encoder = torch.nn.Linear(dim, dim)
        self.knn = grnnd.nn.KNNGraph(k=4)
        self.index = grnnd.nn.Retriever(k=3)

    def forward(self, data, queries):
        emb = self.encoder(data)
        _, edge_dists = self.knn(emb)
        graph = grnnd.build(emb.detach(), degree=8, pool_size=16, initial_degree=8, progress=True)
        dists, ids = grnnd.search(emb, graph, self.encoder(queries), 3)
        _, exact_ids = grnnd.knn(emb, self.encoder(queries), 3)
        stored_dists, stored_ids = self.index(self.encoder(queries))
        loss = dists.mean() + edge_dists.mean() + stored_dists.mean()
        return loss, ids, exact_ids, stored_ids


def run_model_step(model, data, queries):
    """Forward and backward; the loss, the ids and the encoder's gradient."""
    model.zero_grad()
    loss, *ids = model(data, queries)
    loss.backward()
    return loss.detach(), ids, model.encoder.weight.grad.clone()


def check_compiled_model_matches_eager(device, backend):
    torch.manual_seed(0)
    model = EmbedAndRetrieve(8).to(device)
    data, queries = DATA.to(device), QUERIES.to(device)
    model.index.rebuild(model.encoder(data))
    eager = run_model_step(model, data, queries)
    compiled = run_model_step(torch.compile(model, fullgraph=True, backend=backend), data, queries)
    torch.testing.assert_close(compiled[0], eager[0])
    for got, want in zip(compiled[1], eager[1]):
        assert torch.equal(got, want)
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_model_forward_and_backward():
    check_compiled_model_matches_eager("cpu", "aot_eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compile_fullgraph_model_on_cuda():
    check_compiled_model_matches_eager("cuda", "inductor")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_retriever_search_replays_in_a_cuda_graph():
    data, queries = clustered(5000, 32, 20, seed=15).cuda(), clustered(256, 32, 20, seed=16).cuda()
    retriever = grnnd.nn.Retriever(data, k=10, metric="cosine")
    static_queries = queries[:128].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch.cuda.graph asks
        retriever(static_queries)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_dists, captured_ids = retriever(static_queries)
    for batch in (queries[:128], queries[128:]):
        static_queries.copy_(batch)
        graph.replay()
        eager_dists, eager_ids = retriever(batch.clone())
        torch.cuda.synchronize()
        assert torch.equal(captured_ids, eager_ids) and torch.equal(captured_dists, eager_dists)


@pytest.mark.parametrize("settings, op", [(grnnd.BuildParams, torch.ops.grnnd.build),
                                          (grnnd.SearchParams, torch.ops.grnnd.search),
                                          (grnnd.SearchParams, torch.ops.grnnd.search_distance_counts)])
def test_settings_defaults_equal_schema_defaults(settings, op):
    # Every setting with a schema default has that default; metric belongs to the data, not the settings.
    schema = {a.name: a.default_value for a in op.default._schema.arguments if a.has_default_value()}
    schema.pop("metric")
    for start in ("init", "init_split", "init_mode"):  # what the call starts from (ops.build's init), not settings
        schema.pop(start, None)
    for state in ("codes", "code_grid", "pair_code_rows", "pair_code_scale"):  # codes of the rows, not settings
        schema.pop(state, None)
    defaults = {f.name: f.default for f in dataclasses.fields(settings) if f.name in schema}
    if settings is grnnd.BuildParams:  # None: chosen per build (pair codes or rows), the rows' the schema's
        assert defaults.pop("delta") is None and schema.pop("delta") == grnnd.params.ROWS_DELTA
    assert defaults == schema and set(schema) <= {f.name for f in dataclasses.fields(settings)}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_degree_above_the_pool_is_filled_from_two_hops(device):
    data = clustered(3000, 8, 6, seed=3).to(device)
    wide = grnnd.build(data, degree=40, pool_size=24)
    assert wide.shape == (3000, 40)
    assert int((wide >= 0).sum(1).min()) == 40  # every place filled
    ids = wide.long()
    dist = (data[ids] - data[:, None]).pow(2).sum(2)
    assert (dist[:, 1:] >= dist[:, :-1] * (1 - 1e-5)).all(), "rows ascending by distance"
    assert not (ids == torch.arange(3000, device=device)[:, None]).any()
    assert (ids.sort(1).values.diff(1) > 0).all(), "no repeats"


def test_settings_as_params_or_keywords():
    data, graph, queries = DATA, GRAPH, QUERIES
    params = grnnd.SearchParams(k=4, list_size=32, searches=2)
    by_params = grnnd.search(data, graph, queries, params=params)
    by_keywords = grnnd.search(data, graph, queries, 4, list_size=32, searches=2)
    assert torch.equal(by_params[1], by_keywords[1]) and by_params[1].shape == (QUERIES.shape[0], 4)
    # Keywords override the params; k overrides params.k.
    assert grnnd.search(data, graph, queries, 2, params=params)[1].shape[1] == 2
    counts = grnnd.search_distance_counts(data, graph, queries, params=params.replace(list_size=16))
    assert counts.shape == (QUERIES.shape[0],)
    with pytest.raises(TypeError, match=r"SearchParams: unknown setting\(s\) \['list_sise'\]"):
        grnnd.search(data, graph, queries, 4, list_sise=32)
    with pytest.raises(TypeError, match="params: expected BuildParams, got SearchParams"):
        grnnd.build(data, params)
    with one_thread():
        a = grnnd.build(data, grnnd.BuildParams(degree=8, pool_size=16, initial_degree=8))
        b = grnnd.build(data, degree=8, pool_size=16, initial_degree=8)
    assert torch.equal(a, b)
    index = grnnd.Index.build(data, grnnd.BuildParams(degree=8), pool_size=16)
    assert index.build_params == grnnd.BuildParams(degree=8, pool_size=16)
    assert grnnd.Index.from_state_dict(index.state_dict()).build_params == index.build_params



def test_merged_keyword_settings_are_reused_and_kept_apart():
    # Plain keywords are merged once and looked up after (every search merges its keywords);
    # values of other types, a tensor filter and explicit params are merged afresh every call.
    a = grnnd.SearchParams.merge(None, k=7, list_size=40)
    assert grnnd.SearchParams.merge(None, k=7, list_size=40) is a and (a.k, a.list_size) == (7, 40)
    assert type(grnnd.SearchParams.merge(None, k=7, list_size=40.0).list_size) is float
    assert grnnd.SearchParams.merge(None, k=7, list_size=True).list_size is True
    b = grnnd.SearchParams.merge(None, list_size=40, k=7)
    assert (b.k, b.list_size) == (7, 40)
    assert grnnd.BuildParams.merge(None, degree=8) is grnnd.BuildParams.merge(None, degree=8)
    assert grnnd.BuildParams.merge(None, degree=8) == grnnd.BuildParams(degree=8)
    allowed = torch.ones(DATA.shape[0], dtype=torch.bool)
    first, second = (grnnd.SearchParams.merge(None, filter=allowed.clone()) for _ in range(2))
    assert first is not second and first.filter is not second.filter
    base = grnnd.SearchParams(k=3)
    merged = grnnd.SearchParams.merge(base, list_size=40)
    assert (merged.k, merged.list_size) == (3, 40) and merged is not grnnd.SearchParams.merge(base, list_size=40)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"SearchParams: unknown setting\(s\) \['list_sise'\]"):
            grnnd.SearchParams.merge(None, list_sise=32)
    assert grnnd.search(DATA, GRAPH, QUERIES, 4, list_size=32)[1].shape == (QUERIES.shape[0], 4)


def test_index_round_trip(tmp_path):
    data = clustered(3000, 16, 20, seed=13)
    queries = clustered(50, 16, 20, seed=14)
    index = grnnd.Index.build(data, metric="cosine", degree=24)
    dists, ids = index.search(queries, k=5)
    torch.save(index.state_dict(), tmp_path / "index.pt")
    restored = grnnd.Index.from_state_dict(torch.load(tmp_path / "index.pt", weights_only=True))
    assert restored.metric == "cosine" and restored.build_params == grnnd.BuildParams(degree=24) and len(restored) == 3000
    again_dists, again_ids = restored.search(queries, k=5)
    assert torch.equal(ids, again_ids) and torch.equal(dists, again_dists)
    assert "Index(n=3000, dim=16, degree=24" in repr(restored)


def test_index_rejects_mismatched_state():
    with pytest.raises(ValueError, match="missing keys"):
        grnnd.Index.from_state_dict({"data": DATA})
    with pytest.raises(ValueError, match="does not fit data"):
        grnnd.Index.from_state_dict({"data": DATA, "graph": GRAPH[:10], "metric": "l2"})


def test_recall_helper():
    assert grnnd.recall(torch.tensor([[1, 2, -1]]), torch.tensor([[2, 5, 1]])) == pytest.approx(2 / 3)
    assert grnnd.recall(torch.tensor([[4, 3]]), torch.tensor([[3, 4, 9]]), k=2) == 1.0
    with pytest.raises(ValueError):
        grnnd.recall(torch.tensor([[1]]), torch.tensor([[1, 2]]), k=2)


def test_cpu_kernels_are_built_with_openmp():
    # at::parallel_for expands to `#pragma omp parallel` inside the extension: without -fopenmp
    # the CPU kernels would quietly run on one thread.
    import shutil
    import subprocess

    if not torch.backends.openmp.is_available():
        pytest.skip("this torch has no OpenMP")
    if shutil.which("readelf") is None:
        pytest.skip("readelf not available")
    dynamic = subprocess.run(["readelf", "-d", grnnd._C.__file__], capture_output=True, text=True).stdout
    assert "libgomp" in dynamic
