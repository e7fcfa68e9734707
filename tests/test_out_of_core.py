"""Builds within a memory budget (torch_grnnd/out_of_core.py): overlapping shards built one at a
time and joined, on the CPU (as CI runs them) and from host rows onto a GPU."""
import concurrent.futures

import numpy as np
import pytest
import torch

import torch_grnnd as grnnd
from torch_grnnd import memory, out_of_core

from conftest import clustered, cuda_peak_bytes, exact_neighbours, one_thread


def budget_for(rows: int, data: torch.Tensor, metric: str = "l2", **settings) -> int:
    """The budget in which a build of these settings holds `rows` rows of `data`."""
    return rows * memory.shard_bytes_per_row(data.shape[1], data.element_size(), grnnd.BuildParams(**settings), metric)


def recall(data, graph, queries, truth, metric="l2"):
    # At list 16 these clusters still tell graphs apart (at 64 every build here recalls ~1.0).
    return grnnd.recall(grnnd.search(data, graph, queries, 10, list_size=16, metric=metric)[1], truth)


def check_graph(graph: torch.Tensor, n: int, degree: int = grnnd.BuildParams().degree):
    assert graph.shape == (n, degree) and graph.dtype == torch.int32
    assert int(graph.min()) >= -1 and int(graph.max()) < n
    assert not bool((graph == torch.arange(n, dtype=torch.int32, device=graph.device).unsqueeze(1)).any())
    filled = graph >= 0
    # ids are distinct within each row
    ordered = graph.sort(1).values
    assert not bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())
    assert int(filled.sum(1).min()) >= 8



def test_a_budget_holds_the_pair_codes_too(blobs, blobs_truth, blobs_graph):
    data, queries = blobs
    n, dim = data.shape
    rows = out_of_core.bytes_per_row(dim, data.element_size(), grnnd.BuildParams())
    coded = out_of_core.bytes_per_row(dim, data.element_size(), grnnd.BuildParams(pair_codes=True))
    assert coded == rows + (dim + 15) // 16 * 16
    graph = grnnd.build(data, device="cpu", max_gpu_memory=budget_for(n // 3, data, pair_codes=True),
                        pair_codes=True)
    check_graph(graph, n)
    assert recall(data, graph, queries, blobs_truth) >= recall(data, blobs_graph, queries, blobs_truth) - 0.01

@pytest.mark.parametrize("shards_worth", [2.5, 6.0])
def test_sharded_build_recalls_as_the_whole_build(blobs, blobs_truth, blobs_graph, shards_worth):
    data, queries = blobs
    n = data.shape[0]
    reports = []
    budget = budget_for(int(n / shards_worth), data)
    graph = grnnd.build(data, device="cpu", max_gpu_memory=budget,
                        progress=lambda done, total: reports.append((done, total)))
    members, primary, secondary, centres, _ = out_of_core.plan_shards(data, int(n / shards_worth), "l2",
                                                                      torch.device("cpu"), 0, budget)
    assert len(members) >= 3  # the budget really split the build
    # each row in its own shard, a shared row in a second, the centres in every shard
    assert sum(m.numel() for m in members) == n + int((secondary >= 0).sum()) + (len(members) - 1) * centres.numel()
    assert bool(torch.isin(grnnd.diagnostics.hubs(data), centres).all())
    assert all(m.numel() <= int(n / shards_worth) for m in members)
    check_graph(graph, n)
    whole = recall(data, blobs_graph, queries, blobs_truth)
    sharded = recall(data, graph, queries, blobs_truth)
    # Measured: whole 0.989; sharded 0.983 (5 shards), 0.988 (13 shards); with no shared rows
    # (a row in one shard only) 0.860 and 0.849.
    assert sharded >= whole - 0.01, (sharded, whole, len(members))
    # progress counts rows: each shard's rows as it is built, then the shared rows as they are joined
    done = [d for d, _ in reports]
    assert done[-1] == reports[-1][1] == sum(m.numel() for m in members) + int((secondary >= 0).sum())
    assert done == sorted(set(done)) and len(done) > len(members)
    reached = grnnd.diagnostics.reachable(graph, grnnd.diagnostics.hubs(data))
    assert bool(reached.all())


def test_rows_of_two_shards_get_edges_into_both(blobs):
    data, _ = blobs
    n = data.shape[0]
    graph = grnnd.build(data, device="cpu", max_gpu_memory=budget_for(n // 3, data))
    members, primary, secondary, _, _ = out_of_core.plan_shards(data, n // 3, "l2", torch.device("cpu"), 0)
    shared = (secondary >= 0).nonzero().flatten()
    rows = graph[shared].long()
    into_secondary = ((primary[rows.clamp_min(0)] == secondary[shared].unsqueeze(1)) & (rows >= 0)).any(1)
    # Without the join a row holds only its own shard's rows; joined, most shared rows reach the other shard.
    assert float(into_secondary.float().mean()) > 0.5


def test_only_rows_near_a_border_are_shared(blobs):
    """Cells are k-means cells, and a row goes into a second shard only when it lies as near the
    border as rows whose neighbours cross it: clustered rows keep their neighbours together while
    sharing few rows; rows with no clusters to follow share many."""
    clustered_rows, _ = blobs
    generator = torch.Generator().manual_seed(0)
    unclustered_rows = torch.randn(20_000, 64, generator=generator) * torch.logspace(0, -1.5, 64)
    shared, together = [], []
    for data in (clustered_rows, unclustered_rows):
        n = data.shape[0]
        members, _, secondary, _, _ = out_of_core.plan_shards(data, int(n / 2.5), "l2", torch.device("cpu"), 0)
        in_shard = torch.zeros(n, len(members), dtype=torch.bool)
        for s, ids in enumerate(members):
            in_shard[ids, s] = True
        neighbours = exact_neighbours(data, data, 11)[1][:, 1:].long()
        shared.append(float((secondary >= 0).float().mean()))
        together.append(float((in_shard.unsqueeze(1) & in_shard[neighbours]).any(2).float().mean()))
    # Measured: clustered 2% shared, 0.99999 of the true 10-NN in a shard with their row (cells
    # around sampled rows shared 43% and kept 0.986); unclustered 58% shared, 0.85.
    assert shared[0] < 0.1 and together[0] > 0.995, (shared, together)
    assert shared[1] > 0.3, (shared, together)


def test_repeated_rows_keep_shards_within_the_budget(blobs):
    """Repeated rows make empty k-means cells (whose centroid would be every copy's second cell
    at no distance) and cells too dense for one shard: the copies stay in one shard, a dense cell
    is cut, and no shard holds more rows than the budget allows."""
    data, _ = blobs
    copies = torch.cat([data, data[:1].repeat(1000, 1)])
    plan = out_of_core.plan_shards(copies, 3333, "l2", torch.device("cpu"), 0)
    assert all(m.numel() <= 3333 for m in plan.members)
    # Measured: none of the copies shared (95% when empty cells were kept)
    assert float((plan.secondary[20_000:] >= 0).float().mean()) < 0.05
    dense = torch.cat([data[:12_000], data[:1].repeat(8000, 1)])  # 8000 copies: more than a shard holds
    plan = out_of_core.plan_shards(dense, 3000, "l2", torch.device("cpu"), 0)
    assert all(m.numel() <= 3000 for m in plan.members)
    assert sum(m.numel() for m in plan.members) == (20_000 + int((plan.secondary >= 0).sum())
                                                    + (len(plan.members) - 1) * plan.centres.numel())
    check_graph(grnnd.build(dense, device="cpu", max_gpu_memory=budget_for(3000, dense)), 20_000)


def test_planning_in_blocks_plans_the_same_cells(blobs, monkeypatch):
    """The k-means and nearest-cell passes go in blocks that keep their scores within
    ASSIGN_CHUNK_SCORES (so a plan of many cells stays within the budget): k-means blocks of 200
    and 650 rows, and passes of 77 and 252 rows, give the cells, margins and probe neighbours
    of one block of all rows."""
    data, _ = blobs
    train, probes = data[:4000], torch.arange(0, 20_000, 97)
    whole = out_of_core._centroids(train, 50)
    origin = torch.zeros(data.shape[1])
    nearness = out_of_core._nearness(data, whole, origin, probes, "l2", torch.device("cpu"))
    for scores in (20_000, 65_000):
        monkeypatch.setattr(out_of_core, "ASSIGN_CHUNK_SCORES", scores)
        centroids = out_of_core._centroids(train, 50)
        torch.testing.assert_close(centroids, whole, rtol=1e-4, atol=1e-4)
        blocked = out_of_core._nearness(data, whole, origin, probes, "l2", torch.device("cpu"))
        assert torch.equal(blocked.cells, nearness.cells) and torch.equal(blocked.neighbours, nearness.neighbours)
        torch.testing.assert_close(blocked.margin, nearness.margin)
    # the probes' neighbours are their exact nearest rows, themselves left out
    exact = exact_neighbours(data, data[probes], 11)[1][:, 1:]
    assert (nearness.neighbours == exact.long()).float().mean() > 0.99


def test_a_build_that_fits_is_the_plain_build(blobs):
    data, _ = blobs
    graph = grnnd.build(data[:3000], device="cpu", max_gpu_memory="1GB")
    check_graph(graph, 3000)
    assert grnnd.recall(graph, grnnd.build(data[:3000])) > 0.9


def test_a_row_counts_the_copy_the_kernels_make_of_it():
    # The kernels read l2 and ip rows of 16 and 32 bits as they are; they make a float32 copy of
    # float64 rows and a unit copy under cosine (csrc/cuda/detail/vectors_cuda.cuh).
    dim, params = 100, grnnd.BuildParams()
    assert [memory.row_bytes(dim, size, "l2") for size in (2, 4, 8)] == [200, 400, 1200]
    assert [memory.row_bytes(dim, size, "ip") for size in (2, 4, 8)] == [200, 400, 1200]
    assert [memory.row_bytes(dim, size, "cosine") for size in (2, 4, 8)] == [400, 800, 1600]
    rest = memory.bytes_per_row(dim, 2, params) - memory.row_bytes(dim, 2)
    # A build that may widen counts its widest rows and the pools it needs, a third larger (twice as
    # large only where the GPU has them free); under inner product it never widens.
    assert rest == 2 * params.wide_pool_size_for(1.0) * 8 + 28 + 2 * params.wide_degree * 4
    assert memory.bytes_per_row(dim, 2, params, "cosine") == 400 + rest
    assert memory.bytes_per_row(dim, 2, params, "ip") == 200 + 2 * params.pool_size * 8 + 28 + 2 * params.degree * 4
    # a shard's plan counts one more row (measured faster than shards of what the build fits), and
    # a shard never widens (memory.within_budget)
    narrow = memory.bytes_per_row(dim, 2, params.replace(widen=False)) - memory.row_bytes(dim, 2)
    assert narrow == 2 * params.pool_size * 8 + 28 + 2 * params.degree * 4
    assert memory.shard_bytes_per_row(dim, 2, params, "cosine") == 600 + narrow
    # A build's extra beside its rows: every row's share less the row itself (a float64 row's float32
    # copy stays counted), and the coding's steps where it builds on pair codes.
    assert memory.build_extra_bytes(1000, dim, 2, params) == 1000 * rest
    assert memory.build_extra_bytes(1000, dim, 8, params) == 1000 * (rest + 4 * dim)
    coded = params.replace(pair_codes=True)
    assert memory.build_extra_bytes(1000, dim, 2, coded) == 1000 * (rest + grnnd.codes.code_dims(dim)) \
        + grnnd.codes.pair_codes_scratch_bytes(dim)
    # a budget of the same bytes holds fewer cosine rows, and their joins read fewer rows
    budget, n = 10**10, 10**8
    assert budget // memory.bytes_per_row(dim, 2, params, "cosine") < budget // memory.bytes_per_row(dim, 2, params)
    cosine_rows = out_of_core.join_capacity(budget, n, dim, 2, params, "cosine")
    assert cosine_rows < out_of_core.join_capacity(budget, n, dim, 2, params)


def test_sizes_and_bad_budgets():
    assert out_of_core.parse_bytes("8GB") == 8 * 10**9
    assert out_of_core.parse_bytes("1.5 GiB") == 3 * 2**29
    assert out_of_core.parse_bytes(4096) == 4096
    for bad in ["8 parsecs", "-1GB", 0, "GB"]:
        with pytest.raises(ValueError, match="max_gpu_memory"):
            out_of_core.parse_bytes(bad)
    data = torch.randn(5000, 16)
    with pytest.raises(ValueError, match="max_gpu_memory: .* hold only"):
        grnnd.build(data, device="cpu", max_gpu_memory="10kB")
    with pytest.raises(ValueError, match="max_gpu_memory: needed"):
        grnnd.build(data, device="cpu")
    with pytest.raises(ValueError, match="init is not supported"):
        grnnd.build(data, max_gpu_memory="1GB", init=torch.zeros(5000, 4, dtype=torch.int32))


def test_an_interrupted_build_raises_and_leaves_no_worker():
    data = clustered(12_000, 16, 24, seed=3)

    class Stop(Exception):
        pass

    def stop(done, total):
        if done >= total // 4:  # after a shard or two
            raise Stop

    with pytest.raises(Stop):
        grnnd.build(data, device="cpu", max_gpu_memory=budget_for(3000, data), progress=stop)
    # the process goes on: the same build without the interruption completes
    check_graph(grnnd.build(data, device="cpu", max_gpu_memory=budget_for(3000, data)), 12_000)


def memory_mapped(data: torch.Tensor, directory, how: str) -> torch.Tensor:
    """``data``'s rows read from a file: an .npy file through numpy's memory map (copy-on-write,
    so the tensor is writable and nothing goes back to the file) or a raw one through torch's."""
    if how == "npy":
        path = str(directory / "rows.npy")
        np.save(path, data.numpy())
        return torch.from_numpy(np.load(path, mmap_mode="c"))
    path = str(directory / "rows.bin")
    data.numpy().tofile(path)
    return torch.from_file(path, shared=False, size=data.numel(), dtype=data.dtype).view(data.shape)


@pytest.mark.parametrize("how", ["npy", "from_file"])
def test_rows_in_a_memory_mapped_file_build_as_rows_in_memory(tmp_path, how):
    data = clustered(12_000, 16, 24, seed=3)
    mapped = memory_mapped(data, tmp_path, how)
    budget = budget_for(3000, data)
    with one_thread():  # the CPU build is then deterministic
        assert torch.equal(grnnd.build(mapped, device="cpu", max_gpu_memory=budget),
                           grnnd.build(data, device="cpu", max_gpu_memory=budget))


def test_an_index_built_within_a_budget(blobs):
    data, queries = blobs
    n = data.shape[0]
    budget = budget_for(n // 3, data)
    ids = torch.arange(n) * 7 + 3
    reports = []
    with one_thread():
        index = grnnd.Index.build(data, ids=ids, device="cpu", max_gpu_memory=budget, degree=24,
                                  progress=lambda done, total: reports.append(done))
        assert torch.equal(index.graph, grnnd.build(data, device="cpu", max_gpu_memory=budget, degree=24))
    assert index.graph.shape == (n, 24) and len(reports) > 3  # built in shards, with progress
    assert index.build_params.degree == 24 and "max_gpu_memory" not in index.state_dict()
    found = index.search(queries, 10)[1]
    assert bool(torch.isin(found, ids).all())  # user ids come back


def test_joins_read_rows_up_to_the_budget():
    params = grnnd.BuildParams()
    n, dim = 10_000_000, 1024
    budget = 8 * 10**9
    rows_per_shard = budget // out_of_core.bytes_per_row(dim, 2, params)
    for budget in (8 * 10**9, 2 * 10**8):
        rows_per_shard = budget // memory.shard_bytes_per_row(dim, 2, params)
        capacity = out_of_core.join_capacity(budget, n, dim, 2, params)
        chunk_rows = out_of_core.join_chunk_rows(budget, params)
        candidates = chunk_rows * 2 * params.degree * out_of_core.JOIN_BYTES_PER_CANDIDATE
        # the rows, the largest chunk's candidates and the marks fit, one row more would not
        assert capacity * dim * 2 + candidates + n + 1 <= budget < (capacity + 1) * dim * 2 + candidates + n + 1
        assert candidates <= budget // 2 and capacity >= 0.5 * rows_per_shard
    assert out_of_core.join_chunk_rows(8 * 10**9, params) == out_of_core.JOIN_CHUNK_ROWS
    assert out_of_core.join_capacity(budget, 1000, dim, 2, params) == 1000  # never more than all rows
    # a budget too small for the marks: still the rows of one row's join
    assert out_of_core.join_capacity(10**6, n, dim, 2, params) == 2 * params.degree + 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_rows_arrive_whole_through_the_buffer_halves():
    data = torch.randn(5000, 33)  # unpinned: gathered on the host, copied block by block
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        loader = out_of_core._RowLoader(data, 40, torch.device("cuda"), worker)
        assert loader.staged and loader.capacity == 40
        for ids in [torch.randint(0, 5000, (1234,)), torch.arange(19), torch.arange(0)]:
            # blocks of 20 rows: more rows than the buffer holds, an odd number of blocks, none
            assert torch.equal(loader.rows(ids).cpu(), data[ids])
        # a stream after them waits for their copies before it gathers into the buffer
        batches = [(torch.arange(s, s + 40).flip(0), s) for s in range(0, 200, 40)]
        streamed = [(rows.cpu(), ids, start) for rows, ids, start in loader.stream(iter(batches))]
        assert [start for _, _, start in streamed] == list(range(0, 200, 40))
        assert all(torch.equal(rows, data[ids]) for rows, ids, _ in streamed)
        assert torch.equal(loader.rows(torch.arange(4999, -1, -1)).cpu(), data.flip(0))  # and after one


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("source", ["pinned", "unpinned", "npy"])
def test_host_rows_built_on_the_gpu_in_shards(metric, source, tmp_path):
    # Pinned rows are read by the GPU where they lie; others (a memory-mapped file among them)
    # go through the pinned staging buffer.
    data = clustered(40_500, 48, 80, seed=1).half()
    data, queries = data[:40_000].contiguous(), data[40_000:].contiguous()
    truth = exact_neighbours(data, queries, 10, metric)[1]
    whole = grnnd.build(data.cuda(), metric=metric).cpu()
    host = {"pinned": data.pin_memory, "unpinned": lambda: data,
            "npy": lambda: memory_mapped(data, tmp_path, "npy")}[source]()
    graph = grnnd.build(host, metric=metric, device="cuda", max_gpu_memory=budget_for(12_000, data))
    assert graph.device.type == "cpu"
    check_graph(graph, 40_000)
    r_whole = recall(data, whole, queries, truth, metric)
    r_sharded = recall(data, graph, queries, truth, metric)
    assert r_sharded >= r_whole - 0.01, (r_sharded, r_whole)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("metric, source", [("l2", "pinned"), ("l2", "unpinned"), ("cosine", "pinned")])
def test_a_build_in_shards_stays_within_its_budget(metric, source):
    # Wide rows, where a shard's rows outweigh the rest of its build: a shard's rows must leave
    # the device before the next shard's come in, and the joins must count the copy a cosine
    # prune makes of the rows they read. Under the budget: the shards' builds and the joins.
    n, dim = 300_000, 1024
    data = clustered(n, dim, 300, seed=5).half()
    host = data.pin_memory() if source == "pinned" else data
    budget = budget_for(60_000, data, metric)
    grnnd.build(data[:20_000].cuda(), metric=metric)  # cuBLAS's workspace, kept by the process (test_build_cuda)
    graph, peak = cuda_peak_bytes(lambda: grnnd.build(host, metric=metric, device="cuda", max_gpu_memory=budget))
    check_graph(graph, n)
    assert peak <= budget, f"peak {peak / 2**20:.0f} MiB against a budget of {budget / 2**20:.0f} MiB"


def test_join_chunks_copy_in_only_the_rows_they_read_within_the_buffer():
    n, degree = 5000, 6
    generator = torch.Generator().manual_seed(0)
    graph = torch.randint(-1, n, (n, degree), generator=generator, dtype=torch.int32)
    shared = torch.randperm(n, generator=generator)[:1200]
    slot = torch.full((n,), -1, dtype=torch.int64)
    slot[shared] = torch.arange(shared.numel())
    second = torch.randint(-1, n, (shared.numel(), degree), generator=generator, dtype=torch.int32)
    capacity = 200  # a chunk of capacity // 4 rows reads more than this: the chunks shrink
    chunks = list(out_of_core._join_chunks(shared, graph, second, slot, capacity, torch.device("cpu")))
    parts = torch.cat([part for part, _, _ in chunks])
    assert torch.equal(parts, shared)  # every shared row once, in the given order
    for part, candidates, needed in chunks:
        assert needed.numel() <= capacity and bool((needed[1:] > needed[:-1]).all())
        assert torch.equal(candidates, torch.cat([graph[part], second[slot[part]]], 1))
        read = torch.cat([part, candidates[candidates >= 0].long()]).unique()
        assert torch.equal(needed, read)
    assert max(part.numel() for part, _, _ in chunks) < capacity // 4


def test_gather_rows_on_the_cpu_and_its_errors():
    data = torch.randn(50, 7)
    ids = torch.tensor([4, 0, 49, 4])
    assert torch.equal(torch.ops.grnnd.gather_rows(data, ids), data[ids])
    assert torch.ops.grnnd.gather_rows(data, ids[:0]).shape == (0, 7)
    with pytest.raises(IndexError, match=r"ids: expected ids in \[0, 50\), got 50"):
        torch.ops.grnnd.gather_rows(data, torch.tensor([1, 50]))
    with pytest.raises(IndexError, match="got -1"):
        torch.ops.grnnd.gather_rows(data, torch.tensor([-1]))
    with pytest.raises(ValueError, match="ids: expected int64"):
        torch.ops.grnnd.gather_rows(data, ids.int())
    with pytest.raises(ValueError, match="data: expected a matrix"):
        torch.ops.grnnd.gather_rows(data[0], ids)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, dim", [(torch.float16, 1024), (torch.float16, 4), (torch.float32, 3),
                                        (torch.float16, 3), (torch.int8, 5), (torch.float32, 0)])
def test_gather_rows_reads_pinned_host_rows_from_the_gpu(dtype, dim):
    # row widths of 2048, 8, 12, 6 and 5 bytes: 16-, 8-, 4-, 2- and 1-byte words
    data = (torch.randn(3000, dim) * 50).to(dtype).pin_memory()
    ids = torch.randint(0, 3000, (10_000,), device="cuda")
    rows = torch.ops.grnnd.gather_rows(data, ids)
    assert rows.device == ids.device and rows.dtype == dtype
    assert torch.equal(rows.cpu(), data[ids.cpu()])
    assert torch.equal(torch.ops.grnnd.gather_rows(data[1:], ids[:5]).cpu(), data[1:][ids[:5].cpu()])  # offset rows
    assert torch.ops.grnnd.gather_rows(data, ids[:0]).shape == (0, dim)
    assert torch.equal(torch.ops.grnnd.gather_rows(data.cuda(), ids), data.cuda()[ids])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gather_rows_from_the_gpu_needs_pinned_rows():
    ids = torch.tensor([0, 2], device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        torch.ops.grnnd.gather_rows(torch.randn(10, 4), ids)
    with pytest.raises(IndexError, match="got 10"):
        torch.ops.grnnd.gather_rows(torch.randn(10, 4).pin_memory(), torch.tensor([10], device="cuda"))
