"""Op registration: opcheck, torch.compile, schema defaults, the Index API."""
import inspect

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered

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
        (torch.ops.grnnd.knn.default, (DATA, QUERIES, 5), dict(metric="ip")),
        (torch.ops.grnnd.knn_graph.default, (DATA, 4), dict()),
        (torch.ops.grnnd.knn_graph.default, (DATA, 4), dict(exact=True)),
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


@pytest.mark.parametrize("wrapper, op", [(grnnd.build, torch.ops.grnnd.build), (grnnd.search, torch.ops.grnnd.search),
                                         (grnnd.knn, torch.ops.grnnd.knn)])
def test_python_defaults_equal_schema_defaults(wrapper, op):
    schema = {a.name: a.default_value for a in op.default._schema.arguments if a.has_default_value()}
    params = {name: p.default for name, p in inspect.signature(wrapper).parameters.items()
              if p.default is not inspect.Parameter.empty}
    assert params == schema


def test_index_round_trip(tmp_path):
    data = clustered(3000, 16, 20, seed=13)
    queries = clustered(50, 16, 20, seed=14)
    index = grnnd.Index.build(data, metric="cosine", degree=24)
    dists, ids = index.search(queries, k=5)
    torch.save(index.state_dict(), tmp_path / "index.pt")
    restored = grnnd.Index.from_state_dict(torch.load(tmp_path / "index.pt", weights_only=True))
    assert restored.metric == "cosine" and restored.build_params == {"degree": 24} and len(restored) == 3000
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
