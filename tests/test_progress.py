"""Build progress: one report per update round, through a callback, tqdm or logging."""
import dataclasses
import logging
import sys
import threading

import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered

DATA = clustered(800, 8, 5, seed=30)
SMALL = dict(degree=8, pool_size=16, initial_degree=8)
# A fixed schedule of 2 x 2 rounds: every round runs and reports.
FIXED = dict(SMALL, outer_iters=2, inner_iters=2, delta=0)


def test_callback_gets_each_round():
    calls = []
    grnnd.build(DATA, progress=lambda done, total: calls.append((done, total)), **FIXED)
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    grnnd.build(DATA, **FIXED)  # the hook is removed after the build
    assert len(calls) == 4


def test_reports_show_convergence_and_end_with_done_equal_to_total():
    calls = []
    grnnd.build(DATA, outer_iters=10, inner_iters=10, delta=0.01,
                progress=lambda done, total, changes: calls.append((done, total, changes)), **SMALL)
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and done[0] == 1
    # Converged long before the cap of 100 rounds: the last report says so.
    assert calls[-1][0] == calls[-1][1] < 100 and all(t == 100 for _, t, _ in calls[:-1])
    changes = [c for _, _, c in calls]
    assert changes[0] > 10 * changes[-2] and min(changes) >= 0
    # Without convergence, every round of the cap runs.
    calls.clear()
    grnnd.build(DATA, outer_iters=3, inner_iters=4, delta=0,
                progress=lambda done, total, changes: calls.append((done, total)), **SMALL)
    assert calls == [(d, 12) for d in range(1, 13)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_build_from_scratch_may_end_from_its_third_outer_iteration(device):
    # With delta = 0.9 every round counts as converged, so each outer iteration runs one round and
    # the build ends at the first outer iteration whose first round is tested
    # (csrc/build/build_schedule.h, first_tested_outer_iteration): the third from scratch, the
    # second for a build that starts from a graph. (A build that widens goes on past its widening:
    # test_widen.py.)
    data = DATA.to(device)
    settings = dict(SMALL, outer_iters=8, inner_iters=4, delta=0.9, widen=False)
    rounds = []
    graph = grnnd.build(data, progress=lambda done, total: rounds.append(done), **settings)
    assert rounds[-1] == 3
    rounds.clear()
    grnnd.build(data, init=graph, progress=lambda done, total: rounds.append(done), **settings)
    assert rounds[-1] == 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_build_goes_on_while_its_outer_iterations_make_rows_findable(device):
    # One round per outer iteration and a delta whose change test every round passes (a round
    # changes at most N x pool_size entries, under 10 x delta x N x pool_size): what ends the
    # build is the share of sampled rows that a search of the pools' graph misses, measured after
    # each outer iteration from the second on (csrc/build/build_schedule.h, unfound_share). The
    # build ends after the first outer iteration from the third on that lowered it by at most
    # delta / 2. Few initial neighbours and a random start leave the graph of the first outer
    # iterations hard to search, so here it goes on past the third.
    data = clustered(3000, 16, 3, seed=30).to(device)
    delta = 0.2
    calls = []
    grnnd.build(data, degree=8, pool_size=12, initial_degree=4, outer_iters=12, inner_iters=1, delta=delta,
                start="random", progress=lambda done, total, changes, unfound: calls.append((done, unfound)))
    rounds = calls[-1][0]
    assert rounds > 3 and calls[-1] != calls[-2]  # the last report: the build converged
    assert [u for _, u in calls[:2]] == [None, None]  # nothing measured before the second outer iteration
    # The report of round r carries the share measured after round r - 1; the last report the
    # share after the last round.
    shares = [u for _, u in calls[2:]]
    assert len(shares) == rounds - 1 and all(0 <= u <= 1 for u in shares)
    falls = [before - after for before, after in zip(shares, shares[1:])]
    assert all(f > delta / 2 for f in falls[:-1]) and falls[-1] <= delta / 2
    # Without convergence (delta = 0) or from a graph nothing is measured.
    calls.clear()
    graph = grnnd.build(data, progress=lambda done, total, changes, unfound: calls.append(unfound), **FIXED)
    assert calls == [None] * 4
    calls.clear()
    grnnd.build(data, init=graph, delta=0.02, progress=lambda done, total, changes, unfound: calls.append(unfound),
                **SMALL)
    assert calls and all(u is None for u in calls)


def test_index_and_knn_graph_report_but_do_not_keep_progress(monkeypatch):
    calls = []
    index = grnnd.Index.build(DATA, progress=lambda d, t: calls.append(d), **FIXED)
    assert calls == [1, 2, 3, 4] and "progress" not in dataclasses.asdict(index.build_params)
    calls.clear()
    batch = torch.tensor([0] * 300 + [1] * 500)
    # Examples this small are searched exactly in one segment-kernel call: no build to report.
    grnnd.knn_graph(DATA, 5, batch, progress=lambda d, t: calls.append(d))
    assert calls == []
    # Larger ones are built one after another, each reporting its rounds.
    monkeypatch.setattr(grnnd.segments, "EXACT_EXAMPLE_ROWS", 100)
    grnnd.knn_graph(DATA, 5, batch, progress=lambda d, t: calls.append(d))
    assert calls[0] == 1 and calls.count(1) == 2  # one build per example


def cancel(done, total, changes=0, unfound=None):
    raise KeyboardInterrupt


def test_a_large_add_reports_its_build_and_a_small_one_nothing(monkeypatch):
    index = grnnd.Index.build(DATA[:500], **FIXED)
    calls = []
    index.add(DATA[600:], progress=lambda done, total: calls.append((done, total)))
    # One build of the union from the index's graph, with the index's 2 x 2 rounds.
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)] and len(index) == 700
    calls.clear()
    index.add(DATA[500:510], progress=lambda done, total: calls.append((done, total)))
    assert calls == [] and len(index) == 710
    # A batch searched for but above EXACT_BATCH_ROWS: the build of the batch reports.
    monkeypatch.setattr(grnnd.index, "EXACT_BATCH_ROWS", 50)
    index.add(DATA[510:600], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)] and len(index) == 800


@pytest.mark.parametrize("stop_at", [1, 4])  # the build's first round, its last
def test_an_interrupted_add_leaves_the_index_as_it_was(stop_at):
    index = grnnd.Index.build(DATA[:500], ids=torch.arange(1000, 1500), **FIXED)
    before = index.state_dict()
    seen = []

    def stop(done, total):
        seen.append(done)
        if len(seen) == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        index.add(DATA[500:], ids=torch.arange(300), progress=stop)
    after = index.state_dict()
    assert len(index) == 500 and after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) if isinstance(before[k], torch.Tensor) else after[k] == before[k]
               for k in before)
    index.add(DATA[500:], ids=torch.arange(300))  # and it still takes the batch
    assert len(index) == 800


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
        grnnd.build(DATA, progress=True, **FIXED)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torch_grnnd")]
    assert messages[0].startswith("build: (800, 8) torch.float32 on cpu, metric=l2")
    assert [m.split(" done")[0] for m in messages[1:]] == [f"build: round {d} of at most 4" for d in range(1, 5)]
    assert all("pool entries changed" in m for m in messages[1:])
    # A converging build from scratch logs the unfound share once it has measured it.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torch_grnnd"):
        grnnd.build(DATA, progress=True, **SMALL)
    rounds = [r.getMessage() for r in caplog.records if r.name.startswith("torch_grnnd")][1:]
    assert "unfound" not in rounds[0] and "of the sampled rows unfound" in rounds[-1]


def test_tqdm_bar(capsys):
    pytest.importorskip("tqdm")
    grnnd.build(DATA, progress=True, **FIXED)
    assert "torch_grnnd build" in capsys.readouterr().err


def test_callbacks_are_per_thread():
    seen = {}

    def build(name):
        seen[name] = []
        grnnd.build(DATA, progress=lambda d, t: seen[name].append(d), **FIXED)

    threads = [threading.Thread(target=build, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}


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
    graph = grnnd.build(data, outer_iters=3, inner_iters=1, delta=0, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(1, 3), (2, 3), (3, 3)] and graph.is_cuda
    calls.clear()
    grnnd.build(data, outer_iters=10, inner_iters=10, delta=0.01, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1] < 100
    with pytest.raises(KeyboardInterrupt):
        grnnd.build(data, progress=cancel)
