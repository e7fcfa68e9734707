"""Build progress: one report per outer iteration, through a callback, tqdm or logging."""
import dataclasses
import logging
import sys
import threading

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered

DATA = clustered(800, 8, 5, seed=30)
SMALL = dict(degree=8, pool_size=16, initial_degree=8)


def test_callback_gets_each_outer_iteration():
    calls = []
    grnnd.build(DATA, outer_iters=4, progress=lambda done, total: calls.append((done, total)), **SMALL)
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    grnnd.build(DATA, **SMALL)  # the hook is removed after the build
    assert len(calls) == 4


def test_index_and_knn_graph_report_but_do_not_keep_progress():
    calls = []
    index = grnnd.Index.build(DATA, progress=lambda d, t: calls.append(d), **SMALL)
    assert calls == [1, 2, 3] and "progress" not in dataclasses.asdict(index.build_params)
    calls.clear()
    grnnd.knn_graph(DATA, 5, torch.tensor([0] * 300 + [1] * 500), progress=lambda d, t: calls.append(d))
    assert calls == [1, 2, 3, 1, 2, 3]  # one build per example


def cancel(done, total):
    raise KeyboardInterrupt


def test_an_exception_in_the_callback_stops_the_build_and_propagates():
    with pytest.raises(KeyboardInterrupt):
        grnnd.build(DATA, progress=cancel, **SMALL)
    grnnd.build(DATA, **SMALL)  # no hook left behind: a later build runs normally
    grnnd._C._set_progress_callback(cancel)  # the raw hook: the kernel's own error
    try:
        with pytest.raises(RuntimeError, match="stopped by the progress callback, which raised KeyboardInterrupt"):
            torch.ops.grnnd.build(DATA, **SMALL)
    finally:
        grnnd._C._set_progress_callback(None)


def test_logging_when_tqdm_is_missing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm...` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with caplog.at_level(logging.DEBUG, logger="torch_grnnd"):
        grnnd.build(DATA, outer_iters=2, progress=True, **SMALL)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torch_grnnd")]
    assert messages[0].startswith("build: (800, 8) torch.float32 on cpu, metric=l2")
    assert [m.split(" done")[0] for m in messages[1:]] == ["build: outer iteration 1 of 2",
                                                           "build: outer iteration 2 of 2"]


def test_tqdm_bar(capsys):
    pytest.importorskip("tqdm")
    grnnd.build(DATA, outer_iters=2, progress=True, **SMALL)
    assert "torch_grnnd build" in capsys.readouterr().err


def test_callbacks_are_per_thread():
    seen = {}

    def build(name):
        seen[name] = []
        grnnd.build(DATA, outer_iters=2, progress=lambda d, t: seen[name].append(d), **SMALL)

    threads = [threading.Thread(target=build, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"a": [1, 2], "b": [1, 2]}


def test_progress_is_ignored_inside_compiled_code():
    calls = []

    def build(data):
        return grnnd.build(data, progress=lambda d, t: calls.append(d), **SMALL)

    graph = torch.compile(build, fullgraph=True, backend="aot_eager")(DATA)
    assert graph.shape == (800, 8) and calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_build_reports_finished_iterations():
    data = DATA.cuda()
    calls = []
    graph = grnnd.build(data, outer_iters=3, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(1, 3), (2, 3), (3, 3)] and graph.is_cuda
    with pytest.raises(KeyboardInterrupt):
        grnnd.build(data, progress=cancel)
