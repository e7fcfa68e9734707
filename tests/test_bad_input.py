"""Bad input, case by case, on every device: each call raises an exception of the right type that
names the argument, or (for inputs that are unusual but valid) returns a correct result.

Each case runs in a worker process, not in pytest's, so a case that kills its process (a
segmentation fault, an abort) fails that case alone and says so, instead of ending the suite. One
worker per device runs the cases in turn and is restarted after a death.

    python tests/test_bad_input.py --worker cuda     # the worker; reads case names on stdin
"""
import json
import os
import re
import subprocess
import sys
from typing import Callable, Dict, NamedTuple, Optional, Type

import pytest
import torch

import torch_grnnd as grnnd

OK = None  # expected outcome of a valid input: the case returns and its own assertions hold


class Case(NamedTuple):
    run: Callable[[str], object]  # run(device)
    raises: Optional[Type[BaseException]]
    match: str = ""
    needs_two_gpus: bool = False


def points(n: int, dim: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g).to(device)


def small_graph(device: str, n: int = 200, dim: int = 8):
    data = points(n, dim, device)
    return data, grnnd.build(data, degree=8, pool_size=16, initial_degree=8)


def with_value(t: torch.Tensor, row: int, col: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[row, col] = value
    return t


def graph_with_id(device: str, bad_id: int):
    data, graph = small_graph(device)
    graph = graph.clone()
    graph[5, 0] = bad_id
    return grnnd.search(data, graph, data[:2], 2)


def assert_valid_graph(graph: torch.Tensor, n: int, degree: int) -> None:
    assert graph.shape == (n, degree) and graph.dtype == torch.int32
    assert int(graph.min()) >= -1 and int(graph.max()) < n
    rows = torch.arange(n, device=graph.device).unsqueeze(1)
    assert not bool((graph == rows).any()), "a vertex lists itself"


def build_one_row(device: str):
    graph = grnnd.build(points(1, 4, device))
    assert graph.shape == (1, grnnd.BuildParams().degree) and bool((graph == -1).all())
    _, ids = grnnd.search(points(1, 4, device), graph, points(3, 4, device, seed=1), 1)
    assert ids.flatten().tolist() == [0, 0, 0]


def build_fewer_rows_than_degree(device: str):
    data = points(10, 4, device)
    graph = grnnd.build(data, degree=32)
    assert_valid_graph(graph, 10, 32)
    assert bool((graph[:, 9:] == -1).all()), "a row of 10 points has at most 9 neighbours"


def build_non_contiguous(device: str):
    wide = points(400, 16, device)
    data = wide[:, ::2]  # every other column: a strided view
    assert not data.is_contiguous()
    graph = grnnd.build(data, degree=8)
    assert_valid_graph(graph, 400, 8)
    _, ids = grnnd.search(data, graph, data[:50], 1)
    assert bool((ids[:, 0].cpu() == torch.arange(50)).float().mean() >= 0.98)


def build_zero_stride(device: str):
    data = points(1, 8, device).expand(300, 8)  # 300 identical rows sharing one row of memory
    assert data.stride(0) == 0
    assert_valid_graph(grnnd.build(data, degree=8), 300, 8)


def search_non_contiguous_queries(device: str):
    data, graph = small_graph(device)
    queries = data.t().contiguous().t()[:20]  # column-major rows
    assert not queries.is_contiguous()
    d1, i1 = grnnd.search(data, graph, queries, 5, searches=1)
    d2, i2 = grnnd.search(data, graph, queries.contiguous(), 5, searches=1)
    assert torch.equal(i1, i2) and torch.equal(d1, d2)


def mixed_devices(device: str):
    data, graph = small_graph(device)
    other = "meta" if device == "cpu" else "cpu"
    return torch.ops.grnnd.search.default(data, graph, data[:2].to(other), 2)


def two_gpus(device: str):
    data, graph = small_graph("cuda:0")
    return grnnd.search(data, graph, data[:2].to("cuda:1"), 2)


def graph_on_other_device(device: str):
    data, graph = small_graph(device)
    other = "meta" if device == "cpu" else "cpu"
    return grnnd.search(data, graph.to(other), data[:2], 2)


def index_from_state(device: str, **changes):
    data, graph = small_graph(device)
    state = grnnd.Index(data, graph, "l2").state_dict()
    state.update(changes)
    for key in [key for key, value in changes.items() if value is None]:
        del state[key]
    return grnnd.Index.from_state_dict(state)


def index_corrupt_graph(device: str):
    data, graph = small_graph(device)
    return index_from_state(device, graph=with_value(graph.float(), 3, 3, 1e6).int())


def retriever_load_state(device: str):
    data = points(200, 8, device)
    state = grnnd.nn.Retriever(data, k=3).state_dict()
    state["graph"] = with_value(state["graph"], 7, 1, 500)
    grnnd.nn.Retriever(k=3).to(device).load_state_dict(state)


CASES: Dict[str, Case] = {
    # build
    "build: 1-D data": Case(lambda d: grnnd.build(points(100, 1, d).flatten()), ValueError, "data: expected a 2-D"),
    "build: 3-D data": Case(lambda d: grnnd.build(points(100, 8, d).view(2, 50, 8)), ValueError, "data: expected a 2-D"),
    "build: int dtype": Case(lambda d: grnnd.build(torch.zeros(10, 4, dtype=torch.int64, device=d)), TypeError,
                             "data: expected float32, float16, bfloat16 or float64"),
    "build: N = 0": Case(lambda d: grnnd.build(points(0, 8, d)), ValueError, "data: expected at least one row"),
    "build: D = 0": Case(lambda d: grnnd.build(torch.empty(10, 0, device=d)), ValueError,
                         "data: expected at least one column"),
    "build: NaN row": Case(lambda d: grnnd.build(with_value(points(50, 4, d), 17, 2, float("nan"))), ValueError,
                           "data: expected finite values, row 17"),
    "build: inf row": Case(lambda d: grnnd.build(with_value(points(50, 4, d), 3, 0, float("-inf"))), ValueError,
                           "data: expected finite values, row 3"),
    "build: degree 0": Case(lambda d: grnnd.build(points(50, 4, d), degree=0), ValueError,
                            "degree: expected 1 <= degree <= 256"),
    "build: degree > 256": Case(lambda d: grnnd.build(points(50, 4, d), degree=257), ValueError,
                                "degree: expected 1 <= degree <= 256"),
    "build: unknown metric": Case(lambda d: grnnd.build(points(50, 4, d), metric="hamming"), ValueError,
                                  "metric: expected one of"),
    "build: N = 1": Case(build_one_row, OK),
    "build: degree >= N": Case(build_fewer_rows_than_degree, OK),
    "build: non-contiguous data": Case(build_non_contiguous, OK),
    "build: zero-stride data": Case(build_zero_stride, OK),
    # search
    "search: k > N": Case(lambda d: grnnd.search(*small_graph(d, n=2000), points(3, 8, d), 5000, list_size=1024),
                          ValueError, r"k: expected 1 <= k <= 2000 \(number of data rows\), got 5000"),
    "search: k = 0": Case(lambda d: grnnd.search(*small_graph(d), points(3, 8, d), 0), ValueError, "k: expected"),
    "search: k < 0": Case(lambda d: grnnd.search(*small_graph(d), points(3, 8, d), -4), ValueError, "k: expected"),
    "search: k > 1024": Case(lambda d: grnnd.search(*small_graph(d, n=2000), points(3, 8, d), 1025), ValueError,
                             "list_size: expected <= 1024, got 1025"),
    "search: list_size < k": Case(lambda d: grnnd.search(*small_graph(d), points(3, 8, d), 20, list_size=16),
                                  ValueError, r"k: expected <= list_size \(16\), got 20"),
    "search: queries of another width": Case(lambda d: grnnd.search(*small_graph(d), points(3, 5, d), 2), ValueError,
                                             "queries: expected dim 8 to match data, got 5"),
    "search: 1-D queries": Case(lambda d: grnnd.search(*small_graph(d), points(8, 1, d).flatten(), 2), ValueError,
                                "queries: expected a 2-D"),
    "search: NaN query": Case(lambda d: grnnd.search(*small_graph(d), with_value(points(5, 8, d), 3, 0, float("nan")),
                                                     2), ValueError, "queries: expected finite values, row 3"),
    "search: graph of other data": Case(lambda d: grnnd.search(points(300, 8, d), small_graph(d)[1],
                                                               points(2, 8, d), 2), ValueError,
                                        "graph: has 200 rows but data has 300; was it built on other data"),
    "search: graph id = N": Case(lambda d: graph_with_id(d, 200), ValueError,
                                 r"graph: ids must lie in \[0, 200\) with -1 as padding, found 200"),
    "search: graph id < -1": Case(lambda d: graph_with_id(d, -7), ValueError, "graph: ids must lie in .*found -7"),
    "search: int64 graph": Case(lambda d: grnnd.search(small_graph(d)[0], small_graph(d)[1].long(), points(2, 8, d),
                                                       2), TypeError, "graph: expected int32"),
    "search: unknown metric": Case(lambda d: grnnd.search(*small_graph(d), points(2, 8, d), 2, metric="manhattan"),
                                   ValueError, "metric: expected one of"),
    "search: filter of wrong length": Case(lambda d: grnnd.search(*small_graph(d), points(2, 8, d), 2,
                                                                  filter=torch.ones(99, dtype=torch.bool, device=d)),
                                           ValueError, r"filter: expected shape \[200\]"),
    "search: filter of wrong dtype": Case(lambda d: grnnd.search(*small_graph(d), points(2, 8, d), 2,
                                                                 filter=torch.ones(200, device=d)),
                                          TypeError, "filter: expected a bool tensor"),
    "search: queries on another device": Case(mixed_devices, ValueError, "data is on .* but queries is on"),
    "search: graph on another device": Case(graph_on_other_device, ValueError, "queries is on .* but graph is on"),
    "search: data on cuda:0, queries on cuda:1": Case(two_gpus, ValueError,
                                                      "data is on cuda:0 but queries is on cuda:1",
                                                      needs_two_gpus=True),
    "search: non-contiguous queries": Case(search_non_contiguous_queries, OK),
    # knn and knn_graph
    "knn: k > N": Case(lambda d: grnnd.knn(points(2000, 4, d), points(3, 4, d), 5000), ValueError,
                       r"k: expected 1 <= k <= 2000 \(number of data rows\), got 5000"),
    "knn: k > 1024": Case(lambda d: grnnd.knn(points(2000, 4, d), points(3, 4, d), 1025), ValueError,
                          "k: expected at most 1024 for exact knn, got 1025"),
    "knn: NaN data row": Case(lambda d: grnnd.knn(with_value(points(50, 4, d), 17, 1, float("nan")), points(3, 4, d),
                                                  2), ValueError, "data: expected finite values, row 17"),
    "knn: bool queries": Case(lambda d: grnnd.knn(points(50, 4, d), torch.ones(3, 4, dtype=torch.bool, device=d), 2),
                              TypeError, "queries: expected float32"),
    "knn_graph: k < 1": Case(lambda d: grnnd.knn_graph(points(100, 8, d), 0), ValueError,
                             r"k: expected >= 1, got 0"),
    "knn_graph: bad flow": Case(lambda d: grnnd.knn_graph(points(100, 8, d), 3, flow="up"), ValueError,
                                'flow: expected "source_to_target"'),
    # Index and nn modules
    "Index: queries of another width": Case(lambda d: grnnd.Index(*small_graph(d)).search(points(3, 5, d), 2),
                                            ValueError, "queries: expected dim 8 to match data, got 5"),
    "Index: state without graph": Case(lambda d: index_from_state(d, graph=None), ValueError,
                                       r"state: missing keys \['graph'\]"),
    "Index: state with float graph": Case(lambda d: index_from_state(d, graph=torch.zeros(200, 8, device=d)),
                                          TypeError, "state: graph must be int32"),
    "Index: state with graph ids past the data": Case(index_corrupt_graph, ValueError,
                                                      r"state: graph ids must lie in \[0, 200\)"),
    "Index: state with unknown metric": Case(lambda d: index_from_state(d, metric="hamming"), ValueError,
                                             "state: metric must be"),
    "nn.KNNGraph: k < 1": Case(lambda d: grnnd.nn.KNNGraph(k=-1)(points(10, 4, d)), ValueError,
                               r"k: expected >= 1, got -1"),
    "nn.Retriever: empty": Case(lambda d: grnnd.nn.Retriever(k=3)(points(2, 4, d)), RuntimeError,
                                "Retriever is empty"),
    "nn.Retriever: state with graph ids past the data": Case(retriever_load_state, ValueError,
                                                             r"state: graph ids must lie in \[0, 200\).*found 500"),
}


# ---- the worker: runs cases by name and prints one JSON line per case ----

def run_case(name: str, device: str) -> dict:
    case = CASES[name]
    if case.needs_two_gpus and torch.cuda.device_count() < 2:
        return {"outcome": "skipped", "why": "needs two GPUs"}
    try:
        case.run(device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001  (reporting exactly what was raised is the point)
        return {"outcome": "raised", "type": type(error).__name__, "message": str(error)}
    return {"outcome": "returned"}


def worker(device: str) -> None:
    for line in sys.stdin:
        name = line.rstrip("\n")
        print(json.dumps(run_case(name, device)), flush=True)


# ---- the tests: one per case and device, each asked of a worker process ----

class Worker:
    def __init__(self, device: str):
        self.device = device
        self.process: Optional[subprocess.Popen] = None

    def ask(self, name: str) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", self.device], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            code = self.process.wait()
            self.process = None
            return {"outcome": "died", "code": code}
        return json.loads(reply)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module")
def workers():
    pool: Dict[str, Worker] = {}
    yield pool
    for w in pool.values():
        w.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(workers, device, name):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case = CASES[name]
    result = workers.setdefault(device, Worker(device)).ask(name)
    if result["outcome"] == "skipped":
        pytest.skip(result["why"])
    assert result["outcome"] != "died", f"{name} on {device} killed its process (exit status {result['code']})"
    if case.raises is OK:
        assert result["outcome"] == "returned", f"{name} on {device}: {result}"
        return
    assert result["outcome"] == "raised", f"{name} on {device} returned instead of raising {case.raises.__name__}"
    assert result["type"] == case.raises.__name__, f"{name} on {device}: {result['type']}: {result['message']}"
    assert re.search(case.match, result["message"]), f"{name} on {device}: {result['message']!r}"


def test_the_table_covers_enough_bad_input():
    assert sum(case.raises is not OK for case in CASES.values()) >= 25


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
