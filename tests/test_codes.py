"""Searches that walk the graph by compact codes (8-bit, and 4-bit of the rotated rows) and re-rank
by exact distances (csrc/core/codes.h): recall against faiss-cpu, exact returned distances, the CPU and
CUDA twins, filters, bad input."""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
METRICS = ["l2", "ip", "cosine"]
KINDS = ["int8", "int4"]


@pytest.fixture(scope="module")
def sets():
    """Per metric: 12k x 48 clustered rows (a dimension not a multiple of 16), queries, graph."""
    data = clustered(12_300, 48, 60, seed=3)
    base, queries = data[:12_000].contiguous(), data[12_000:].contiguous()
    return {m: (base, queries, grnnd.build(base, metric=m)) for m in METRICS}


def test_encode_layout_and_decoding():
    x = clustered(500, 20, 5, seed=1)
    codes = grnnd.encode(x, metric="l2")
    assert codes.rows.dtype == torch.uint8 and codes.rows.shape == (500, 32 + 16)  # 20 codes padded to 32, norm tail
    assert codes.grid.shape == (2, 20) and codes.grid.dtype == torch.float32
    offset, step = codes.grid
    levels = codes.rows[:, :20].float()
    decoded = offset + step * levels
    # Every coordinate decodes to within half a step of the row's own.
    assert bool(((decoded - x).abs() <= step / 2 + 1e-5).all())
    assert bool((codes.rows[:, 20:32] == 0).all())  # padding codes are zero
    norm = codes.rows[:, 32:36].contiguous().view(torch.float32).flatten()
    torch.testing.assert_close(norm, (levels * step).square().sum(1), rtol=1e-5, atol=1e-5)
    assert grnnd.encode(x, metric="cosine").rows.shape == (500, 32)  # no norm tail without l2


def _int4_parts(codes, dim):
    """(levels v [N, coded], alpha, K, cell) of int4 code rows (csrc/core/codes.h)."""
    width = codes.coded_dims // 2
    packed = codes.rows[:, :width]
    levels = torch.stack([packed & 0xF, packed >> 4], 2).flatten(1)
    tail = codes.rows[:, width:width + 16].contiguous()
    alpha, k = tail[:, :8].view(torch.float32).unbind(1)
    return levels, alpha, k, tail[:, 8:12].view(torch.int32).flatten().long()


def _int4_estimates(codes, queries, dim):
    """[Q, N]: the distances the search walks by (csrc/core/codes.h), in float64 and without the
    query's quantisation: -t_j + K - alpha <v, y> (x2 under l2, plus |q - c_0|^2; 1 + under cosine)."""
    levels, alpha, k, cell = _int4_parts(codes, dim)
    kept = min(dim, codes.coded_dims)  # every coordinate, or the leading principal axes
    v = levels[:, :kept].double() - 7.5
    rotation, centres = codes.grid[:dim, :kept].double(), codes.grid[dim:].double()
    q = queries.double()
    if codes.metric == "cosine":
        q = torch.nn.functional.normalize(q, dim=1)
    if codes.metric == "l2":
        u, offsets = q - centres[0], centres - centres[0]
    else:
        u, offsets = q, centres
    inner = alpha.double()[None] * ((u @ rotation) @ v.T)
    t = (u @ offsets.T)[:, cell]
    if codes.metric == "l2":
        return u.square().sum(1, keepdim=True) - 2 * t + k.double()[None] - 2 * inner
    return (1 if codes.metric == "cosine" else 0) - t + k.double()[None] - inner


@pytest.mark.parametrize("metric", METRICS)
def test_int4_layout_and_estimates(metric):
    x = clustered(2_000, 40, 8, seed=2)
    codes = grnnd.encode(x, "int4", metric=metric)
    assert codes.rows.shape == (2_000, 32 + 16)  # 40 codes padded to 64 nibbles, alpha, K, cell, padding
    cells = grnnd.codes.default_cells(2_000)
    assert cells == 45 and codes.cells == cells and codes.grid.shape == (40 + cells, 40)
    rotation, centres = codes.grid[:40], codes.grid[40:]
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(40), atol=1e-5, rtol=0)  # orthogonal
    rows = torch.nn.functional.normalize(x, dim=1) if metric == "cosine" else x
    levels, alpha, k, cell = _int4_parts(codes, 40)
    assert bool((levels[:, 40:] == 0).all())  # padding codes are zero
    # Each row is coded about its nearest centre.
    assert torch.equal(cell, torch.cdist(rows.double(), centres.double()).argmin(1))
    v = levels[:, :40].float() - 7.5
    r = (rows - centres[cell]) @ rotation
    # A row's own inner product is estimated exactly, and the levels point close to its direction.
    torch.testing.assert_close(alpha * (v * r).sum(1), r.square().sum(1), rtol=1e-4, atol=1e-5)
    moved = r.norm(dim=1) > 1e-6  # a row alone in its cell is its centre: r = 0, no direction
    assert float(torch.nn.functional.cosine_similarity(v, r)[moved].min()) > 0.97
    # The estimated distances are close to the exact ones: within a small share of their spread.
    queries = clustered(2_100, 40, 8, seed=2)[2_000:]
    estimate = _int4_estimates(codes, queries, 40)
    q = torch.nn.functional.normalize(queries, dim=1) if metric == "cosine" else queries
    exact = (torch.cdist(q.double(), rows.double()).square() if metric == "l2"
             else (1 if metric == "cosine" else 0) - q.double() @ rows.double().T)
    assert float((estimate - exact).abs().mean() / exact.std()) < 0.02
    # The same rows on the same grid give the same codes; the rotation is the same for every index.
    assert torch.equal(grnnd.codes.encode_rows(x, codes.grid, metric), codes.rows)
    assert torch.equal(grnnd.encode(x[:100] * 2, "int4", metric=metric).grid[:40], rotation)


@pytest.mark.parametrize("metric", METRICS)
def test_int4_cells_code_tight_clusters_finely(metric):
    # Many tight clusters far apart: about one global centre, the code's error on a row's offset
    # drowns the differences inside its cluster; about its cell's centre it does not.
    x = clustered(4_100, 48, 40, seed=5, spread=10.0, noise=0.5)
    base, queries = x[:4_000], x[4_000:]
    q = torch.nn.functional.normalize(queries, dim=1) if metric == "cosine" else queries
    rows = torch.nn.functional.normalize(base, dim=1) if metric == "cosine" else base
    exact = (torch.cdist(q.double(), rows.double()).square() if metric == "l2"
             else (1 if metric == "cosine" else 0) - q.double() @ rows.double().T)
    near = exact.topk(50, largest=False).indices

    def error(codes):  # mean error of the estimate among each query's 50 nearest rows
        return float((_int4_estimates(codes, queries, 48) - exact).gather(1, near).abs().mean())

    one, cells = grnnd.encode(base, "int4", metric=metric, cells=1), grnnd.encode(base, "int4", metric=metric)
    assert one.cells == 1 and cells.cells == 63 == grnnd.codes.default_cells(4_000)
    # Rows without clusters keep most of their spread about any cells: coded about one centre.
    assert grnnd.encode(torch.randn(4_000, 48), "int4", metric=metric).cells == 1
    assert error(cells) < 0.5 * error(one), (error(cells), error(one))
    # And so the walk by codes ranks like the rows: the coded search keeps the rows' recall.
    graph = grnnd.build(base, metric=metric)
    truth = exact_neighbours(base, queries, 10, metric)[1]
    full = grnnd.recall(grnnd.search(base, graph, queries, 10, list_size=16, metric=metric)[1], truth)
    coded = grnnd.recall(grnnd.search(base, graph, queries, 10, list_size=16, metric=metric, codes=cells)[1], truth)
    assert coded >= full - 0.01, (coded, full)


def _low_rank(n, dim, rank, seed):
    """Clustered rows on a random rank-``rank`` subspace plus faint noise: their residuals about
    any centres lie almost wholly on ``rank`` principal axes, as real embeddings' mostly do."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, rank, generator=g))[0].T
    return clustered(n, rank, 40, seed=seed) @ basis + 1e-3 * torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("metric", METRICS)
def test_int4_codes_keep_the_leading_principal_axes_where_the_rest_hold_little(metric):
    x = _low_rank(3_000, 96, 24, seed=4)
    codes = grnnd.encode(x, "int4", metric=metric)
    # 24 axes hold the residuals: one group of 32 coordinates keeps them, 32 bytes a row (16 of
    # codes and the tail) where every coordinate would take 64; a sixth of the float16 rows.
    assert codes.coded_dims == 32 and codes.rows.shape == (3_000, 16 + 16)
    rotation = codes.grid[:96]
    assert bool((rotation[:, 32:] == 0).all())
    torch.testing.assert_close(rotation[:, :32].T @ rotation[:, :32], torch.eye(32), atol=1e-5, rtol=0)
    queries = _low_rank(3_100, 96, 24, seed=4)[3_000:]
    rows = torch.nn.functional.normalize(x, dim=1) if metric == "cosine" else x
    q = torch.nn.functional.normalize(queries, dim=1) if metric == "cosine" else queries
    exact = (torch.cdist(q.double(), rows.double()).square() if metric == "l2"
             else (1 if metric == "cosine" else 0) - q.double() @ rows.double().T)
    estimate = _int4_estimates(codes, queries, 96)
    every = grnnd.encode(x, "int4", metric=metric, coded_dims=96)
    assert every.coded_dims == 96 and every.rows.shape == (3_000, 48 + 16)
    # The estimated distances stay close to the exact ones: within a small share of their spread,
    # as with every coordinate coded (which spends three times the bits on the same 24 axes).
    error, error_every = ((float((e - exact).abs().mean() / exact.std()))
                          for e in (estimate, _int4_estimates(every, queries, 96)))
    assert error < 0.03 and error_every < 0.03, (error, error_every)
    # The same rows give the same grid and codes; added rows are coded on it the same way.
    assert torch.equal(grnnd.encode(x, "int4", metric=metric).grid, codes.grid)
    assert torch.equal(grnnd.codes.encode_rows(x[:500], codes.grid, metric), codes.rows[:500])
    # Rows whose residuals spread over every axis keep every coordinate, on the fixed rotation; so
    # do rows too few (under 16 a dimension) to tell the data's directions from the sample's.
    assert grnnd.encode(torch.randn(3_000, 96), "int4", metric=metric).coded_dims == 96
    assert grnnd.encode(x[:1_000], "int4", metric=metric).coded_dims == 96
    assert grnnd.encode(x, "int4", metric=metric, coded_dims=64).coded_dims == 64
    # Rows of one grid's width with another grid are refused, not read wrongly.
    with pytest.raises(ValueError, match="int4 rows of 64 bytes do not fit their grid, which keeps 32"):
        grnnd.codes.Codes("int4", metric, every.rows, codes.grid)


@pytest.mark.parametrize("device", DEVICES)
def test_int4_codes_of_fewer_coordinates_search_and_edit_like_every_coordinate(device, tmp_path):
    data = _low_rank(9_300, 96, 24, seed=6).to(device)
    base, extra, queries = data[:8_000], data[8_000:9_000], data[9_000:]
    index = grnnd.Index.build(base, codes="int4")
    assert index.codes.coded_dims == 32
    truth = exact_neighbours(base, queries, 10)[1]
    every = grnnd.encode(base, "int4", coded_dims=96)
    for list_size in (16, 64):
        fewer = grnnd.recall(index.search(queries, 10, list_size=list_size)[1].cpu(), truth)
        full = grnnd.recall(grnnd.search(base, index.graph, queries, 10, list_size=list_size, codes=every)[1].cpu(),
                            truth)
        assert fewer >= full - 0.01 and fewer >= 0.9, (list_size, fewer, full)
    if device == "cuda":  # the twins walk by the same code distances
        kw = dict(list_size=64, searches=1, search_width=1, codes=index.codes)
        d_gpu, i_gpu = grnnd.search(base, index.graph, queries, 10, **kw)
        d_cpu, i_cpu = grnnd.search(base.cpu(), index.graph.cpu(), queries.cpu(), 10,
                                    **{**kw, "codes": index.codes.to("cpu")})
        assert (i_cpu == i_gpu.cpu()).float().mean().item() >= 0.99
        torch.testing.assert_close(d_gpu.cpu(), d_cpu, rtol=1e-4, atol=1e-4)
    index.add(extra)
    assert index.codes.rows.shape == (9_000, 32)
    index.encode("int4", coded_dims=96)  # every coordinate, asked for
    assert index.codes.coded_dims == 96 and index.codes.rows.shape == (9_000, 64)
    index.encode("int4")
    assert torch.equal(index.codes.rows, grnnd.codes.encode_rows(index.data, index.codes.grid, "l2"))
    torch.save(index.state_dict(), tmp_path / "index.pt")
    restored = grnnd.Index.from_state_dict(torch.load(tmp_path / "index.pt", weights_only=True))
    assert torch.equal(restored.codes.rows, index.codes.rows)
    assert torch.equal(restored.search(queries, 10)[1], index.search(queries, 10)[1])


def test_int4_codes_of_earlier_versions_load():
    # Codes of earlier versions: one centre, and a tail of alpha, |r|^2 and zeros, with no format
    # in the state.
    data = clustered(3_000, 24, 10, seed=4)
    width = grnnd.codes.code_dims(24, "int4") // 2
    for metric in METRICS:
        state = grnnd.Index.build(data, metric=metric).state_dict()
        now = grnnd.encode(data, "int4", metric=metric, cells=1)
        rows = torch.nn.functional.normalize(data, dim=1) if metric == "cosine" else data
        r = ((rows - now.grid[24]).double() @ now.grid[:24].double()).float()  # as the old encoder made it
        old = now.rows.clone()
        old[:, width + 4:width + 8] = r.square().sum(1).view(torch.uint8).view(-1, 4)
        old[:, width + 8:] = 0
        state["codes"] = {"kind": "int4", "rows": old, "grid": now.grid}
        restored = grnnd.Index.from_state_dict(state)
        # l2: kept as they are (about one centre K = |r|^2 and the cell is 0); else coded again.
        assert torch.equal(restored.codes.rows, old if metric == "l2" else now.rows), metric
        queries = data[:50] + 0.1
        truth = exact_neighbours(data, queries, 10, metric)[1]
        assert grnnd.recall(restored.search(queries, 10)[1], truth) >= 0.95


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("metric", METRICS)
def test_coded_search_recall_and_exact_distances(sets, metric, kind):
    base, queries, graph = sets[metric]
    codes = grnnd.encode(base, kind, metric=metric)
    truth = exact_neighbours(base, queries, 10, metric)[1]
    full = grnnd.search(base, graph, queries, 10, list_size=64, metric=metric)[1]
    dists, ids = grnnd.search(base, graph, queries, 10, list_size=64, metric=metric, codes=codes)
    recall, full_recall = grnnd.recall(ids, truth), grnnd.recall(full, truth)
    assert recall >= 0.95 and recall >= full_recall - 0.02, (recall, full_recall)
    # The returned distances are the exact ones of the returned rows, ascending.
    x, q = base[ids].double(), queries.double().unsqueeze(1)
    if metric == "cosine":
        x, q = torch.nn.functional.normalize(x, dim=2), torch.nn.functional.normalize(q, dim=2)
    want = (x - q).square().sum(2) if metric == "l2" else -(x * q).sum(2) + (1 if metric == "cosine" else 0)
    torch.testing.assert_close(dists.double(), want, rtol=1e-4, atol=1e-4)
    assert bool((dists[:, 1:] >= dists[:, :-1]).all())


@pytest.mark.parametrize("kind", KINDS)
def test_coded_search_with_split_searches_and_filter(sets, kind):
    base, queries, graph = sets["l2"]
    codes = grnnd.encode(base, kind)
    truth = exact_neighbours(base, queries, 10)[1]
    _, ids = grnnd.search(base, graph, queries, 10, list_size=64, searches=4, codes=codes)
    assert grnnd.recall(ids, truth) >= 0.95
    allowed = torch.arange(base.shape[0]) % 3 != 0
    _, ids = grnnd.search(base, graph, queries, 10, list_size=64, filter=allowed, codes=codes)
    assert bool(allowed[ids[ids >= 0]].all())
    allowed_rows = allowed.nonzero().flatten()
    truth_allowed = allowed_rows[exact_neighbours(base[allowed_rows], queries, 10)[1]]
    assert grnnd.recall(ids, truth_allowed) >= 0.9


def test_coded_distance_counts_are_the_walks(sets):
    base, queries, graph = sets["l2"]
    codes = grnnd.encode(base)
    counts = grnnd.search_distance_counts(base, graph, queries, 10, list_size=64, codes=codes)
    full = grnnd.search_distance_counts(base, graph, queries, 10, list_size=64)
    assert counts.shape == full.shape and counts.dtype == torch.int32
    # The codes walk the same graph with the same budget: the same order of work, not the same count.
    assert 0.7 < counts.float().mean() / full.float().mean() < 1.3


def test_coded_search_refuses_bad_codes(sets):
    base, queries, graph = sets["l2"]
    codes = grnnd.encode(base)
    with pytest.raises(ValueError, match="made for metric 'l2'"):
        grnnd.search(base, graph, queries, 10, metric="ip", codes=codes)
    with pytest.raises(TypeError, match="codes: expected torch_grnnd.Codes"):
        grnnd.search(base, graph, queries, 10, codes=codes.rows)
    with pytest.raises(ValueError, match="codes and code_grid: expected both or neither"):
        torch.ops.grnnd.search(base, graph, queries, 10, codes=codes.rows)
    with pytest.raises(ValueError, match=r"codes: expected shape \[12000, 64\]"):
        torch.ops.grnnd.search(base, graph, queries, 10, codes=codes.rows[:, :48], code_grid=codes.grid)
    with pytest.raises(TypeError, match="codes: expected uint8"):
        torch.ops.grnnd.search(base, graph, queries, 10, codes=codes.rows.float(), code_grid=codes.grid)
    with pytest.raises(ValueError,
                       match=r"code_grid: expected shape \[2, 48\] .* or \[48 \+ C, 48\] with 1 <= C <= 4096"):
        torch.ops.grnnd.search(base, graph, queries, 10, codes=codes.rows, code_grid=codes.grid[:, :8])
    int4 = grnnd.encode(base, "int4")
    with pytest.raises(ValueError, match=r"codes: expected shape \[12000, 48\] \(the int4 codes"):
        torch.ops.grnnd.search(base, graph, queries, 10, codes=codes.rows, code_grid=int4.grid)
    with pytest.raises(ValueError, match="int4 codes need at least 2 dimensions"):
        grnnd.encode(base[:, :1], "int4")
    with pytest.raises(ValueError, match="codes: expected one of"):
        grnnd.encode(base, "int3")
    for kind, cells in (("int4", 0), ("int4", 4097), ("int8", 4), ("int4", 2.0)):
        with pytest.raises(ValueError, match=r"cells: expected an int in \[1, 4096\]"):
            grnnd.encode(base, kind, cells=cells)
    for width in (16 + 8, 16 + 48):  # int4 code rows: a tail and 1 to 2 whole chunks at D = 48
        with pytest.raises(ValueError, match=r"codes: expected shape \[12000, 48\] \(the int4 codes"):
            torch.ops.grnnd.search(base, graph, queries, 10, codes=int4.rows.new_zeros(12_000, width),
                                   code_grid=int4.grid)
    for coded in (48, 0, 96, True, 32.0):
        with pytest.raises(ValueError, match=r"coded_dims: expected a multiple of 32 in \[32, 64\]"):
            grnnd.encode(base, "int4", coded_dims=coded)
    with pytest.raises(ValueError, match=r"coded_dims: expected a multiple of 32 in \[32, 64\]"):
        grnnd.codes.fit_grid(base, kind="int4", coded_dims=40)
    with pytest.raises(ValueError, match="coded_dims: applies to int4 codes on a grid fitted here"):
        grnnd.encode(base, "int8", coded_dims=32)
    with pytest.raises(ValueError, match=r"grid: expected float32 \[48 \+ C, 48\]"):
        grnnd.encode(base, "int4", grid=torch.zeros(48 + 4097, 48))
    with pytest.raises(ValueError, match="NaN or infinity"):
        grnnd.encode(torch.tensor([[0.0, float("nan")]]))


@pytest.mark.parametrize("kind", KINDS)
def test_coded_search_opcheck(sets, kind):
    base, queries, graph = sets["l2"]
    codes = grnnd.encode(base, kind)
    torch.library.opcheck(torch.ops.grnnd.search.default, (base, graph, queries[:4], 5),
                          {"codes": codes.rows, "code_grid": codes.grid})


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("metric", METRICS)
def test_cuda_twin_walks_like_the_cpu(sets, metric, kind):
    # Both devices compute the code distances in integers and the same float steps (codes.h),
    # start from the same entry points and re-rank exactly: the results agree up to ties. The
    # width is fixed: left automatic, a GPU expands more parents in a batch this small.
    base, queries, graph = sets[metric]
    codes = grnnd.encode(base, kind, metric=metric)
    kw = dict(list_size=64, searches=1, search_width=1, metric=metric)
    d_cpu, i_cpu = grnnd.search(base, graph, queries, 10, codes=codes, **kw)
    d_gpu, i_gpu = grnnd.search(base.cuda(), graph.cuda(), queries.cuda(), 10, codes=codes.to("cuda"), **kw)
    same = (i_cpu == i_gpu.cpu()).float().mean().item()
    assert same >= 0.99, same
    torch.testing.assert_close(d_gpu.cpu(), d_cpu, rtol=1e-4, atol=1e-4)
    truth = exact_neighbours(base, queries, 10, metric)[1]
    assert grnnd.recall(i_gpu.cpu(), truth) >= 0.95


@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_coded_search_small_batches_filter_and_host_rows(sets, kind):
    base, queries, graph = sets["l2"]
    half = base.half()
    codes = grnnd.encode(half, kind, device="cuda")
    g, q = graph.cuda(), queries.half().cuda()
    truth = exact_neighbours(half, queries.half(), 10)[1]
    for batch in (1, 10, 300):  # split searches below a full GPU, one block per query above
        ids = torch.cat([grnnd.search(half.cuda(), g, q[s:s + batch], 10, list_size=64, codes=codes)[1]
                         for s in range(0, 300, batch)])
        assert grnnd.recall(ids.cpu(), truth) >= 0.95, batch
    allowed = (torch.arange(base.shape[0]) % 2 == 0).cuda()
    _, ids = grnnd.search(half.cuda(), g, q, 10, list_size=64, filter=allowed, codes=codes)
    assert bool(allowed[ids[ids >= 0]].all())
    # Codes on the GPU, rows in pinned host memory: only the final lists' rows cross the bus.
    pinned = half.pin_memory()
    d_host, i_host = grnnd.search(pinned, g, q, 10, list_size=64, codes=codes)
    d_dev, i_dev = grnnd.search(half.cuda(), g, q, 10, list_size=64, codes=codes)
    assert torch.equal(i_host, i_dev) and torch.equal(d_host, d_dev)


@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_coded_search_is_capturable(kind):
    base = clustered(20_000, 64, 40, seed=5).cuda()
    graph = grnnd.build(base)
    codes = grnnd.encode(base, kind)
    q = base[:1].clone()
    eager = grnnd.search(base, graph, q, 10, codes=codes)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        grnnd.search(base, graph, q, 10, codes=codes)  # warm-up outside the capture
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, stream=stream):
            captured = grnnd.search(base, graph, q, 10, codes=codes)
    cuda_graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[1], eager[1]) and torch.equal(captured[0], eager[0])




def _found_at_zero(index, vectors, ids):
    """Whether each of ``vectors`` is found first, at distance 0, under its id."""
    d, i = index.search(vectors, 1, list_size=64)
    return bool((i[:, 0] == ids).all()) and bool((d[:, 0].abs() < 1e-3).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_index_keeps_its_codes_through_edits_and_saves(device, kind, tmp_path):
    data = clustered(9_000, 40, 30, seed=7).to(device)
    base, extra, queries = data[:6_000], data[6_000:8_800], data[8_800:]
    index = grnnd.Index.build(base, codes=kind)
    width = 48 + 16 if kind == "int8" else 32 + 16
    assert index.codes is not None and index.codes.rows.shape == (6_000, width) and f"codes='{kind}'" in repr(index)
    truth = exact_neighbours(base, queries, 10)[1]
    d, i = index.search(queries, 10)
    assert grnnd.recall(i.cpu(), truth) >= 0.95
    # Small add (linked by search), then a large one (grown in one build): new rows are coded too.
    index.add(extra[:200])
    assert index.codes.rows.shape[0] == 6_200 and _found_at_zero(index, extra[:50], torch.arange(6_000, 6_050,
                                                                                               device=device))
    index.add(extra[200:])
    assert index.codes.rows.shape[0] == 8_800
    assert torch.equal(index.codes.rows, grnnd.codes.encode_rows(index.data, index.codes.grid, "l2"))
    # Removed rows are never returned; compaction keeps the codes of the rows it keeps.
    gone = torch.arange(0, 8_800, 3, device=device)
    index.remove(gone)
    _, i = index.search(queries, 10)
    assert not bool(torch.isin(i, gone).any())
    index.compact()
    assert index.codes.rows.shape[0] == index.data.shape[0] == len(index)
    assert torch.equal(index.codes.rows, grnnd.codes.encode_rows(index.data, index.codes.grid, "l2"))
    kept = data[:8_800][torch.arange(8_800, device=device) % 3 != 0]
    assert grnnd.recall(index.search(queries, 10)[1].cpu(),
                        index.ids[torch.as_tensor(exact_neighbours(index.data, queries, 10)[1]).to(device)].cpu()) \
        >= 0.95
    assert kept.shape[0] == len(index)
    # Saved and restored: the same codes, the same answers.
    torch.save(index.state_dict(), tmp_path / "index.pt")
    restored = grnnd.Index.from_state_dict(torch.load(tmp_path / "index.pt", weights_only=True))
    assert torch.equal(restored.codes.rows, index.codes.rows) and torch.equal(restored.codes.grid, index.codes.grid)
    assert torch.equal(restored.search(queries, 10)[1], index.search(queries, 10)[1])
    # Codes dropped and made again.
    index.encode(None)
    assert index.codes is None
    index.encode(kind)
    assert index.codes.rows.shape[0] == len(index) and index.codes.kind == kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_merged_indexes_are_coded_on_one_grid(device, kind):
    data = clustered(8_200, 32, 20, seed=8).to(device)
    a = grnnd.Index.build(data[:4_000], codes=kind)
    b = grnnd.Index.build(data[4_000:8_000] * 1.5, codes=kind)  # another range: a's grid would clamp it
    union = grnnd.merge(a, b)
    assert union.codes is not None and union.codes.rows.shape[0] == 8_000 and union.codes.kind == kind
    rows = union.data
    assert torch.equal(union.codes.grid, grnnd.codes.fit_grid(rows, "l2", kind=kind))
    queries = data[8_000:]
    truth = exact_neighbours(rows, queries, 10)[1]
    assert grnnd.recall(union.search(queries, 10)[1].cpu(), truth) >= 0.95


def test_index_refuses_bad_codes():
    data = clustered(2_000, 16, 5, seed=9)
    with pytest.raises(ValueError, match="codes: expected None or one of"):
        grnnd.Index.build(data, codes="int2")
    index = grnnd.Index.build(data)
    with pytest.raises(ValueError, match="codes: expected torch_grnnd.Codes"):
        grnnd.Index(data, index.graph, "ip", codes=grnnd.encode(data, metric="l2"))
    state = grnnd.Index.build(data, codes="int8").state_dict()
    state["codes"]["rows"] = state["codes"]["rows"][:, :8]
    with pytest.raises(ValueError, match="state: code rows must be uint8"):
        grnnd.Index.from_state_dict(state)


def test_coded_search_compiles_fullgraph(sets):
    # The codes are plain tensors to the op: the fake kernel gives the shapes, the search's
    # backward recomputes the (exact, re-ranked) distances from the rows.
    base, queries, graph = sets["l2"]
    codes = grnnd.encode(base)

    def retrieve(q):
        dists, ids = grnnd.search(base, graph, q, 5, list_size=32, codes=codes)
        return dists.sum(), ids

    q = queries[:8].clone().requires_grad_(True)
    total, ids = torch.compile(retrieve, fullgraph=True, backend="aot_eager")(q)
    eager_total, eager_ids = retrieve(q)
    assert torch.equal(ids, eager_ids)
    torch.testing.assert_close(total, eager_total)
    total.backward()
    want = 2 * (q.detach().unsqueeze(1) - base[ids]).sum(1)  # d/dq of the summed squared distances
    torch.testing.assert_close(q.grad, want, rtol=1e-4, atol=1e-4)
