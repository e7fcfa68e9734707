"""Builds whose update rounds take pair distances from one-byte codes (BuildParams.pair_codes),
on the CPU and CUDA against faiss-cpu's exact neighbours, and the codes themselves."""
import logging
import sys

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered, cuda_peak_bytes, exact_neighbours, one_thread
from torch_grnnd.codes import pair_codes, pair_codes_scratch_bytes
from torch_grnnd import memory
from torch_grnnd.params import CODES_DELTA, PAIR_CODES_MIN_DIM, ROWS_DELTA

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_codes_give_squared_distances_on_one_step():
    x = clustered(2_000, 40, 10, seed=1)
    codes, scale = pair_codes(x)
    assert codes.dtype == torch.uint8 and codes.shape == (2_000, 48)  # 40 rounded up to 16s
    assert int(codes[:, 40:].abs().sum()) == 0
    lo, step = x.min(0).values, float((x.max(0).values - x.min(0).values).max()) / 255
    assert scale == pytest.approx(step * step)
    assert torch.equal(codes[:, :40], ((x - lo) / step).round().clamp(0, 255).to(torch.uint8))
    # scale * sum of squared code differences is the squared distance up to the rounding: each
    # coordinate moves by at most half a step, so each difference by at most one step s, and
    # |d' - d| <= sum over coordinates of 2 |x_a - x_b| s + s^2.
    a, b = codes[:500].long(), codes[500:1000].long()
    approx = scale * (a - b).pow(2).sum(1).double()
    difference = (x[:500] - x[500:1000]).double()
    bound = (2 * difference.abs() * step + step * step).sum(1)
    assert bool(((approx - difference.pow(2).sum(1)).abs() <= bound * (1 + 1e-6)).all())
    assert float(((approx - difference.pow(2).sum(1)).abs() / difference.pow(2).sum(1)).median()) < 0.01


def test_codes_of_unit_rows_give_cosine_distances():
    x = clustered(2_000, 40, 10, seed=1) + 0.5  # off the origin, so that directions differ in spread
    codes, scale = pair_codes(x, "cosine")
    unit = x / x.norm(dim=1, keepdim=True)
    step = float((unit.max(0).values - unit.min(0).values).max()) / 255
    assert scale == pytest.approx(step * step / 2)
    a, b = codes[:500].long(), codes[500:1000].long()
    approx = scale * (a - b).pow(2).sum(1).double()
    cosine = 1 - (unit[:500] * unit[500:1000]).sum(1).double()
    # as for l2, half of each squared distance's bound: |d' - d| <= sum of (2 |u_a - u_b| s + s^2) / 2
    bound = (2 * (unit[:500] - unit[500:1000]).double().abs() * step + step * step).sum(1) / 2
    assert bool(((approx - cosine).abs() <= bound * (1 + 1e-5) + 1e-6).all())
    with pytest.raises(ValueError, match="l2 and cosine"):
        pair_codes(x, "ip")


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_build_on_codes_recalls_as_the_rows_do(device, metric):
    x = clustered(20_000, 64, 40, seed=2)
    queries = x[:500] + 0.3 * torch.randn(500, 64, generator=torch.Generator().manual_seed(5))
    truth = exact_neighbours(x, queries, 10, metric=metric)[1]
    found = {}
    for codes in (False, True):
        graph = grnnd.build(x.to(device), metric=metric, pair_codes=codes)
        ids = grnnd.search(x.to(device), graph, queries.to(device), 10, list_size=32, metric=metric)[1].cpu()
        found[codes] = grnnd.recall(ids, truth, 10)
    assert found[False] >= 0.9 and found[True] >= found[False] - 0.01


def test_the_codes_decide_the_pairs():
    # On one thread a build depends on its seed alone: the same build on the rows and on their
    # codes differ only where a code distance orders a pair otherwise than the rows'.
    x = clustered(3_000, 16, 12, seed=3, noise=2.0)
    with one_thread():
        rows = grnnd.build(x, degree=16, seed=4)
        coded = grnnd.build(x, degree=16, seed=4, pair_codes=True)
        again = grnnd.build(x, degree=16, seed=4, pair_codes=True)
    assert torch.equal(coded, again) and not torch.equal(coded, rows)


def test_pair_codes_are_checked():
    x = clustered(500, 16, 5, seed=6)
    with pytest.raises(ValueError, match="l2 and cosine"):
        grnnd.build(x, metric="ip", pair_codes=True)
    with pytest.raises(TypeError, match="True, False or None"):
        grnnd.build(x, pair_codes="False")
    codes, scale = pair_codes(x)
    op = torch.ops.grnnd.build.default
    for bad, message in ((codes.int(), "expected uint8"), (codes[:, :8], "stride a multiple of 16"),
                         (codes[:400], "expected shape")):
        with pytest.raises((ValueError, TypeError), match=message):
            op(x, pair_code_rows=bad, pair_code_scale=scale)
    with pytest.raises(ValueError, match="positive finite"):
        op(x, pair_code_rows=codes, pair_code_scale=0.0)
    with pytest.raises(ValueError, match="l2 and cosine only"):
        op(x, metric="ip", pair_code_rows=codes, pair_code_scale=scale)
    with one_thread():  # a graph that depends on the seed alone, the same in every mode opcheck runs
        torch.library.opcheck(op, (x,), dict(degree=8, pool_size=16, initial_degree=8, pair_code_rows=codes,
                                             pair_code_scale=scale))


def rounds_and_graph(x, **settings):
    done = []
    graph = grnnd.build(x, progress=lambda rounds, total, changes, unfound: done.append(rounds), **settings)
    return done[-1], graph


def test_a_build_on_codes_converges_at_half_the_rows_delta():
    x = clustered(20_000, 32, 40, seed=7)
    with one_thread():
        default = rounds_and_graph(x, pair_codes=True)
        halved = rounds_and_graph(x, pair_codes=True, delta=CODES_DELTA)
        at_rows_delta = rounds_and_graph(x, pair_codes=True, delta=ROWS_DELTA)
        rows = rounds_and_graph(x)
        rows_at_their_delta = rounds_and_graph(x, delta=ROWS_DELTA)
    assert CODES_DELTA == ROWS_DELTA / 2
    assert default[0] == halved[0] > at_rows_delta[0] and torch.equal(default[1], halved[1])
    assert rows[0] == rows_at_their_delta[0] and torch.equal(rows[1], rows_at_their_delta[1])


@pytest.mark.parametrize("dim, metric, on_codes", [(PAIR_CODES_MIN_DIM, "l2", True),
                                                   (PAIR_CODES_MIN_DIM, "cosine", True),
                                                   (PAIR_CODES_MIN_DIM, "ip", False),
                                                   (PAIR_CODES_MIN_DIM - 16, "l2", False)])
def test_the_default_builds_wide_rows_on_codes(dim, metric, on_codes):
    # BuildParams.pair_codes=None: the codes from PAIR_CODES_MIN_DIM dimensions on, under the
    # metrics they measure. On one thread a graph depends on its seed and its distances alone, so
    # the default's graph is the one of the setting it chose, and not the other's.
    x = clustered(1_200, dim, 12, seed=8)
    with one_thread():
        default = grnnd.build(x, degree=16, seed=5, metric=metric)
        chosen = grnnd.build(x, degree=16, seed=5, metric=metric, pair_codes=on_codes)
        other = grnnd.build(x, degree=16, seed=5, metric=metric, pair_codes=not on_codes) if metric != "ip" else None
    assert grnnd.BuildParams().pair_codes is None
    assert torch.equal(default, chosen)
    if other is not None:
        assert not torch.equal(default, other)


def compared_on(caplog) -> list:
    """What each build logged since caplog was last cleared: "rows" or "pair codes"."""
    lines = [r.getMessage() for r in caplog.records if "pairs compared on the" in r.getMessage()]
    return [line.split("pairs compared on the ")[1].split(",")[0] for line in lines]


def test_host_rows_built_on_a_device_keep_the_rows(caplog):
    # Builds within a budget plan their shards without the codes' bytes, so the default keeps the
    # rows there: out_of_core's builds and SwappingIndex's shards (with or without a budget).
    x = clustered(1_200, PAIR_CODES_MIN_DIM, 12, seed=12)
    small = dict(degree=8, pool_size=16, initial_degree=8, outer_iters=1, inner_iters=1)
    with caplog.at_level(logging.DEBUG, logger="torch_grnnd"):
        grnnd.build(x, device="cpu", max_gpu_memory="10GB", **small)
        grnnd.SwappingIndex.build(x, device="cpu", shard_rows=600, **small)
        grnnd.SwappingIndex.build(x, device="cpu", max_gpu_memory="10GB", **small)
        assert compared_on(caplog) == ["rows"] * 4  # one build, two shards, one shard
        caplog.clear()
        grnnd.build(x, device="cpu", max_gpu_memory="10GB", pair_codes=True, **small)  # asked for
        index = grnnd.SwappingIndex.build(x, device="cpu", shard_rows=600, pair_codes=True, **small)
        assert compared_on(caplog) == ["pair codes"] * 3
    assert index.build_params.pair_codes is True
    assert grnnd.SwappingIndex.build(x, device="cpu", shard_rows=600, **small).build_params.pair_codes is None


def test_a_budget_keeps_the_rows_unless_asked():
    # Builds within a memory budget (max_gpu_memory, SwappingIndex) plan their shards without the
    # codes, so the default must not add them there.
    assert memory.within_budget(grnnd.BuildParams()).pair_codes is False
    assert memory.within_budget(grnnd.BuildParams(pair_codes=True)).pair_codes is True
    dim = PAIR_CODES_MIN_DIM
    default = memory.bytes_per_row(dim, 2, memory.within_budget(grnnd.BuildParams()))
    assert default == memory.bytes_per_row(dim, 2, grnnd.BuildParams(pair_codes=False, widen=False))
    assert memory.bytes_per_row(dim, 2, grnnd.BuildParams(pair_codes=True, widen=False)) == default + dim


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the free-memory rule is the GPU's")
def test_the_default_keeps_the_rows_where_the_gpu_cannot_hold_the_codes(monkeypatch, caplog):
    from torch_grnnd import ops

    x = torch.randn(4_000, PAIR_CODES_MIN_DIM, device="cuda", dtype=torch.float16)
    params = grnnd.BuildParams()
    coded = params.replace(pair_codes=True)
    needed = memory.build_extra_bytes(*x.shape, 2, coded)  # the build's extra beside the rows, the coding's steps
    assert ops._builds_on_pair_codes(params, x, "l2")
    monkeypatch.setattr(ops, "free_bytes", lambda device: needed)
    assert ops._builds_on_pair_codes(params, x, "l2")
    monkeypatch.setattr(ops, "free_bytes", lambda device: needed - 1)
    assert not ops._builds_on_pair_codes(params, x, "l2")
    assert ops._builds_on_pair_codes(params.replace(pair_codes=True), x, "l2")  # asked for: no rule
    with caplog.at_level(logging.DEBUG, logger="torch_grnnd"):
        graph = grnnd.build(x)
    assert compared_on(caplog) == ["rows"]
    # One Gaussian's rows: the build may widen (BuildParams.widen).
    assert graph.shape[0] == 4_000
    assert graph.shape[1] in (params.degree, params.wide_degree_for(0.0), params.wide_degree), graph.shape
    assert int(graph.min()) >= 0


def test_a_compiled_default_build_keeps_the_rows():
    # The codes' step is a host value read off the rows, which a full graph cannot hold: inside
    # torch.compile the default builds wide rows on the rows, the graph an eager build on them makes.
    x = clustered(800, PAIR_CODES_MIN_DIM, 8, seed=9)

    def build(data):
        return grnnd.build(data, degree=8, pool_size=16, initial_degree=8, outer_iters=2, inner_iters=1, seed=3)

    with one_thread():
        compiled = torch.compile(build, fullgraph=True, backend="aot_eager")(x)
        on_rows = grnnd.build(x, degree=8, pool_size=16, initial_degree=8, outer_iters=2, inner_iters=1, seed=3,
                              pair_codes=False)
    assert torch.equal(compiled, on_rows)


def test_adds_keep_the_rows_by_default():
    # A build from init (an add) would encode every row for rounds over a few new ones: the
    # default keeps the rows there, so an add makes the graph an add on the rows makes.
    x = clustered(1_300, PAIR_CODES_MIN_DIM, 12, seed=10)
    with one_thread():
        graph = grnnd.build(x[:1_000], degree=16, seed=5, pair_codes=False)
        graphs = []
        for params in (grnnd.BuildParams(degree=16, seed=5), grnnd.BuildParams(degree=16, seed=5, pair_codes=False)):
            index = grnnd.Index(x[:1_000].clone(), graph.clone(), "l2", params)
            index.add(x[1_000:])
            graphs.append(index.graph)
    assert torch.equal(graphs[0], graphs[1])


def test_a_build_says_what_it_compares_pairs_on(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # progress as log records
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    for dim, on in ((PAIR_CODES_MIN_DIM, "pair codes"), (PAIR_CODES_MIN_DIM - 16, "rows")):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="torch_grnnd"):
            grnnd.build(clustered(300, dim, 3, seed=11), degree=8, pool_size=16, initial_degree=8, outer_iters=1,
                        inner_iters=1, progress=True)
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("torch_grnnd")]
        assert f"pairs compared on the {on}," in messages[0]
        assert messages[1].startswith("build on pair codes: round 1" if on == "pair codes" else "build: round 1")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory is the GPU's")
def test_a_build_on_codes_takes_the_memory_the_default_rule_counts():
    # The default takes the codes where the GPU holds what memory.bytes_per_row counts beside the
    # rows, plus pair_codes_scratch_bytes: a build on codes must peak within that, and above a
    # build on the rows by the codes (N x D bytes) and the coding's steps at most, as the docs say.
    n, dim = 1_000_000, PAIR_CODES_MIN_DIM
    data = torch.randn(n, dim, device="cuda", dtype=torch.float16)
    grnnd.build(data[:20_000], pair_codes=False)  # cuBLAS's workspace, kept by the process (test_build_cuda)
    peaks = {}
    for on_codes in (False, True):
        graph, peaks[on_codes] = cuda_peak_bytes(lambda: grnnd.build(data, pair_codes=on_codes))
        assert graph.shape[0] == n and int(graph.min()) >= 0
        del graph
    p = grnnd.BuildParams(pair_codes=True)
    counted = memory.build_extra_bytes(n, dim, 2, p)
    codes_bytes = n * grnnd.codes.code_dims(dim)
    mib = {key: f"{value / 2**20:.0f} MiB" for key, value in peaks.items()}
    assert peaks[True] <= counted, (mib, f"counted {counted / 2**20:.0f} MiB")
    assert peaks[True] - peaks[False] <= 1.05 * codes_bytes + pair_codes_scratch_bytes(dim), mib
