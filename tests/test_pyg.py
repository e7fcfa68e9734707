"""torch_grnnd.pyg: torch_cluster's knn / knn_graph / radius / radius_graph semantics, exact,
on hand-made clouds with known answers and against a brute-force reference per example."""
import pytest
import torch

from torch_grnnd.pyg import knn, knn_graph, radius, radius_graph

from conftest import DEVICES



def edge_set(edge_index: torch.Tensor) -> set:
    return set(map(tuple, edge_index.t().tolist()))


def reference_knn(x, y, k, batch_x, batch_y, cosine=False):
    """torch_cluster's knn by brute force, one example at a time: (y index, x index) pairs, each
    query's nearest first, ties to the lower index."""
    edges = []
    for i in range(y.shape[0]):
        rows = (batch_x == batch_y[i]).nonzero().flatten()
        if rows.numel() == 0:
            continue
        a, b = y[i].double(), x[rows].double()
        d = 1 - torch.nn.functional.cosine_similarity(a.unsqueeze(0), b) if cosine else (b - a).pow(2).sum(1)
        order = sorted(range(rows.numel()), key=lambda j: (d[j].item(), rows[j].item()))[:k]
        edges += [(i, rows[j].item()) for j in order]
    return edges


# Points on a line: 0, 1, 3 | 10, 11 | (example 2 empty) | 20
LINE = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0], [20.0]])
LINE_BATCH = torch.tensor([0, 0, 0, 1, 1, 3])


@pytest.mark.parametrize("device", DEVICES)
def test_knn_graph_known_answers(device):
    x, batch = LINE.to(device), LINE_BATCH.to(device)
    # k = 1: each point's nearest other point of its example; the lone point of example 3 has none.
    assert knn_graph(x, 1, batch).tolist() == [[1, 0, 1, 4, 3], [0, 1, 2, 3, 4]]
    assert knn_graph(x, 1, batch, flow="target_to_source").tolist() == [[0, 1, 2, 3, 4], [1, 0, 1, 4, 3]]
    # loop=True: the point is one of its own k nearest (k edges, not k + 1).
    assert knn_graph(x, 1, batch, True).tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    # Examples smaller than k + 1 give what they have: 2, 2, 2 in the first, 1, 1 in the second.
    assert edge_set(knn_graph(x, 5, batch)) == {(1, 0), (2, 0), (0, 1), (2, 1), (0, 2), (1, 2), (4, 3), (3, 4)}
    # Positional arguments in torch_cluster's order, batch_size given (no host synchronisation).
    assert knn_graph(x, 2, batch, False, "source_to_target", False, 1, 4).shape == (2, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_knn_two_sets_known_answers(device):
    x, batch_x = LINE.to(device), LINE_BATCH.to(device)
    y = torch.tensor([[2.9], [10.4], [19.0], [5.0]], device=device)
    batch_y = torch.tensor([0, 1, 2, 3], device=device)  # example 2 has no rows of x
    assert knn(x, y, 2, batch_x, batch_y).tolist() == [[0, 0, 1, 1, 3], [2, 1, 3, 4, 5]]
    edge_index, dists = knn(x, y, 1, batch_x, batch_y, return_distances=True)
    assert edge_index.tolist() == [[0, 1, 3], [2, 3, 5]]
    assert torch.allclose(dists.cpu(), torch.tensor([0.01, 0.16, 225.0]))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs_give_empty_edges(device):
    empty = torch.empty(0, 3, device=device)
    some = torch.randn(5, 3, device=device)
    for edge_index in (knn(empty, some, 2), knn(some, empty, 2), knn_graph(empty, 3), radius_graph(empty, 1.0)):
        assert edge_index.shape == (2, 0) and edge_index.dtype == torch.long and edge_index.device == some.device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cosine", [False, True])
def test_knn_matches_brute_force_per_example(device, dtype, cosine):
    g = torch.Generator().manual_seed(3)
    sizes = [7, 1, 40, 0, 25, 3]  # smaller than k, empty, larger than k
    batch_x = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    x = torch.randn(int(sum(sizes)), 6, generator=g).to(dtype)
    batch_y = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 5])
    y = torch.randn(batch_y.numel(), 6, generator=g).to(dtype)
    got = knn(x.to(device), y.to(device), 5, batch_x.to(device), batch_y.to(device), cosine)
    want = reference_knn(x.float(), y.float(), 5, batch_x, batch_y, cosine)
    assert got.cpu().t().tolist() == [list(e) for e in want]


@pytest.mark.parametrize("device", DEVICES)
def test_knn_graph_matches_torch_cluster_definition(device):
    # torch_cluster: knn(x, x, k + 1), then row and column swapped for source_to_target, self edges dropped.
    g = torch.Generator().manual_seed(5)
    batch = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 2, 50, 9]))
    x = torch.randn(batch.numel(), 3, generator=g)
    pairs = reference_knn(x, x, 7, batch, batch)
    want = [(j, i) for i, j in pairs if i != j]
    got = knn_graph(x.to(device), 6, batch.to(device))
    assert got.cpu().t().tolist() == [list(e) for e in want]


@pytest.mark.parametrize("device", DEVICES)
def test_radius_known_answers(device):
    x, batch = LINE.to(device), LINE_BATCH.to(device)
    # Within 1.5 on the line: 0-1 and 10-11; 1-3 is 2 apart.
    assert edge_set(radius_graph(x, 1.5, batch)) == {(1, 0), (0, 1), (4, 3), (3, 4)}
    assert edge_set(radius_graph(x, 1.5, batch, loop=True)) == {(1, 0), (0, 1), (4, 3), (3, 4)} | {
        (i, i) for i in range(6)}
    # At most max_num_neighbors, the nearest: from 2.5 within 3 are 3 (0.5), 1 (1.5) and 0 (2.5).
    y = torch.tensor([[2.5]], device=device)
    assert radius(x, y, 3.0, batch, torch.tensor([0], device=device), max_num_neighbors=2).tolist() == [[0, 0], [2, 1]]


def test_argument_errors():
    x = torch.randn(10, 3)
    with pytest.raises(ValueError, match="flow: expected"):
        knn_graph(x, 2, flow="up")
    with pytest.raises(ValueError, match=r"batch_x: expected shape \[10\]"):
        knn(x, x, 2, torch.zeros(9, dtype=torch.long), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="both are needed"):
        knn(x, x, 2, torch.tensor([0] * 5 + [1] * 5), None)
    with pytest.raises(ValueError, match="y: expected dim 3 to match x, got 2"):
        knn(x, torch.randn(4, 2), 2)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        knn_graph(torch.zeros(10, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="k: expected >= 1"):
        knn(x, x, 0)
    # x's examples must come sorted, as torch_cluster requires (its rows are found by binary search).
    unsorted = torch.tensor([0, 1] * 5)
    with pytest.raises(ValueError, match="batch: expected examples in ascending order .* 4 descents"):
        knn_graph(x, 2, unsorted)
    with pytest.raises(ValueError, match="batch_x: expected examples in ascending order"):
        knn(x, x, 2, unsorted, torch.zeros(10, dtype=torch.long))


def test_queries_of_any_order_find_their_own_examples():
    x, y = torch.randn(10, 3), torch.randn(6, 3)
    batch_x, batch_y = torch.tensor([0] * 4 + [1] * 6), torch.tensor([1, 0, 1, 0, 0, 1])
    query, found = knn(x, y, 2, batch_x, batch_y)
    assert bool((batch_x[found] == batch_y[query]).all()) and query.numel() == 12
    for q in range(6):
        mine = (batch_x == batch_y[q]).nonzero().flatten()
        want = mine[(x[mine] - y[q]).square().sum(1).argsort()[:2]]
        assert found[query == q].tolist() == want.tolist()


def test_approximate_finds_the_exact_neighbours_on_easy_data(monkeypatch):
    from torch_grnnd import segments
    g = torch.Generator().manual_seed(8)
    batch = torch.repeat_interleave(torch.arange(2), torch.tensor([600, 400]))
    x = torch.randn(1000, 8, generator=g)
    exact = knn_graph(x, 5, batch)
    # Examples this small are searched exactly: an exact scan costs less than their builds.
    assert torch.equal(knn_graph(x, 5, batch, approximate=True), exact)
    monkeypatch.setattr(segments, "EXACT_EXAMPLE_ROWS", 500)  # the example of 600 gets a GRNND graph
    approximate = edge_set(knn_graph(x, 5, batch, approximate=True))
    assert len(edge_set(exact) & approximate) >= 0.95 * len(edge_set(exact))


@pytest.mark.parametrize("device", DEVICES)
def test_every_batched_entry_refuses_an_unsorted_batch(device):
    # Each example's rows are found by binary search in the batch vector: unsorted, the edges
    # would be wrong. Read with the number of examples (one synchronisation), and without one on
    # the CPU when batch_size is given; a GPU trusts a batch vector given with batch_size.
    import types

    import torch_grnnd as grnnd
    from torch_grnnd.pyg import KNNGraph
    x = torch.randn(10, 3, device=device)
    unsorted, queries = torch.tensor([0, 1] * 5, device=device), torch.zeros(10, dtype=torch.long, device=device)
    calls = {
        "pyg.knn": lambda **kw: knn(x, x, 2, unsorted, queries, **kw),
        "pyg.knn_graph": lambda **kw: knn_graph(x, 2, unsorted, **kw),
        "pyg.knn_graph approximate": lambda **kw: knn_graph(x, 2, unsorted, approximate=True, **kw),
        "pyg.radius": lambda **kw: radius(x, x, 1.0, unsorted, queries, **kw),
        "pyg.radius_graph": lambda **kw: radius_graph(x, 1.0, unsorted, **kw),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="expected examples in ascending order .* 4 descents"):
            call()
        if device == "cpu":
            with pytest.raises(ValueError, match="expected examples in ascending order"):
                call(batch_size=2)
    data = types.SimpleNamespace(pos=x, batch=unsorted, edge_attr=None)
    for call in (lambda: grnnd.knn_graph(x, 2, unsorted), lambda: grnnd.knn_graph(x, 2, unsorted, exact=True),
                 lambda: grnnd.knn_graph(x, 2, unsorted, metric="ip"), lambda: grnnd.nn.KNNGraph(2)(x, unsorted),
                 lambda: KNNGraph(2)(data)):
        with pytest.raises(ValueError, match="batch: expected examples in ascending order .* 4 descents"):
            call()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dim, k", [(3, 20), (64, 20)])
def test_cuda_equals_cpu_on_point_cloud_batches(dim, k):
    # A DGCNN-sized batch: 32 clouds of varying size around 1024 points.
    g = torch.Generator().manual_seed(dim)
    sizes = torch.randint(900, 1100, (32,), generator=g)
    batch = torch.repeat_interleave(torch.arange(32), sizes)
    x = torch.randn(batch.numel(), dim, generator=g)
    cpu = knn_graph(x, k, batch, batch_size=32)
    gpu = knn_graph(x.cuda(), k, batch.cuda(), batch_size=32)
    assert torch.equal(cpu, gpu.cpu())


SEGMENT_SIZES = [0, 1, 5, 40, 150, 64, 3, 0]  # empty, smaller and larger than k, a multiple of the tile


def segment_problem(dim: int, seed: int, sorted_queries: bool):
    """x in examples of SEGMENT_SIZES, with ptr_x; queries of every example (and of none: index
    -1 and one past the last) in batch order or shuffled."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(SEGMENT_SIZES)
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    x = torch.randn(int(sizes.sum()), dim, generator=g)
    batch_y = torch.randint(-1, len(SEGMENT_SIZES) + 1, (300,), generator=g)
    batch_y = batch_y.sort().values if sorted_queries else batch_y
    y = torch.randn(batch_y.numel(), dim, generator=g)
    return x, y, ptr_x, batch_y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [3, 64])
def test_knn_segments_matches_faiss_per_example(device, dim):
    faiss = pytest.importorskip("faiss")
    k = 10
    x, y, ptr_x, batch_y = segment_problem(dim, seed=dim, sorted_queries=True)
    dists, ids = torch.ops.grnnd.knn_segments(x.to(device), y.to(device), ptr_x.to(device), batch_y.to(device), k)
    dists, ids = dists.cpu(), ids.cpu()
    for b in range(len(SEGMENT_SIZES)):
        queries = (batch_y == b).nonzero().flatten()
        begin, end = int(ptr_x[b]), int(ptr_x[b + 1])
        take = min(k, end - begin)
        if queries.numel() == 0:
            continue
        assert (ids[queries, take:] == -1).all() and torch.isinf(dists[queries, take:]).all()
        if take == 0:
            continue
        index = faiss.IndexFlatL2(dim)
        index.add(x[begin:end].numpy())
        want_d, want_i = index.search(y[queries].numpy(), take)
        assert torch.equal(ids[queries, :take], torch.from_numpy(want_i) + begin)
        assert torch.allclose(dists[queries, :take], torch.from_numpy(want_d), rtol=1e-4, atol=1e-4)
    outside = (batch_y < 0) | (batch_y >= len(SEGMENT_SIZES))
    assert outside.any() and (ids[outside] == -1).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dim", [3, 6, 17, 64, 130])
@pytest.mark.parametrize("k", [1, 9, 20, 33, 200])
@pytest.mark.parametrize("sorted_queries", [True, False])
def test_knn_segments_cuda_equals_cpu_bit_for_bit(dim, k, sorted_queries):
    # Every kernel variant (dimension passes of 4, 16 and 64; best k in registers or in the
    # output row), queries in batch order or shuffled: the same neighbours and distances.
    x, y, ptr_x, batch_y = segment_problem(dim, seed=dim + k, sorted_queries=sorted_queries)
    x[7] = x[6]  # an exact tie: the lower row comes first on both
    cpu = torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k)
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), y.cuda(), ptr_x.cuda(), batch_y.cuda(), k)
    assert torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(cpu[0], gpu[0].cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dim", [6, 17, 64, 130])
@pytest.mark.parametrize("k", [9, 20, 40])
def test_knn_segments_cuda_equals_cpu_with_many_ties(dim, k):
    # Small integer coordinates: many rows at equal distances, the lower row first on both, and
    # many candidates queued at the k-th best's distance (csrc/cuda/knn_segments_cuda.cu).
    x, y, ptr_x, batch_y = segment_problem(dim, seed=dim * k, sorted_queries=False)
    x, y = x.round().clamp(-1, 1), y.round().clamp(-1, 1)
    cpu = torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k)
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), y.cuda(), ptr_x.cuda(), batch_y.cuda(), k)
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [5, 40])
def test_knn_segments_cuda_equals_cpu_on_large_batches(k):
    # A batch of many small examples, some smaller than k: 700 examples of 1 to 199 rows.
    g = torch.Generator().manual_seed(k)
    sizes = torch.randint(1, 200, (700,), generator=g)
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    batch = torch.repeat_interleave(torch.arange(700), sizes)
    x = torch.randn(batch.numel(), 6, generator=g)
    cpu = torch.ops.grnnd.knn_segments(x, x, ptr_x, batch, k)
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), x.cuda(), ptr_x.cuda(), batch.cuda(), k)
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim, method", [(3, "auto"), (3, "scan"), (3, "grid"), (17, "auto"), (64, "auto")])
def test_knn_segments_batch_x_form_equals_ptr_form(device, dim, method):
    # x's examples as a sorted batch vector (PyG's form; the CUDA scan searches it per query)
    # give what ptr gives, empty examples and queries of no example included; examples=-1
    # reads the count from batch_x.
    x, y, ptr_x, batch_y = segment_problem(dim, seed=dim + 1, sorted_queries=device == "cpu")
    batch_x = torch.repeat_interleave(torch.arange(len(SEGMENT_SIZES)), torch.tensor(SEGMENT_SIZES))
    x, y, ptr_x, batch_x, batch_y = (t.to(device) for t in (x, y, ptr_x, batch_x, batch_y))
    want = torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, 9, method)
    given = torch.ops.grnnd.knn_segments(x, y, None, batch_y, 9, method, batch_x=batch_x,
                                         examples=len(SEGMENT_SIZES))
    assert torch.equal(want[1], given[1]) and torch.equal(want[0], given[0])
    # The last example is empty, so batch_x's largest value is one short of the count: queries of
    # that example and beyond find nothing either way.
    read = torch.ops.grnnd.knn_segments(x, y, None, batch_y, 9, method, batch_x=batch_x)
    assert torch.equal(want[1], read[1])
    # Fewer examples than batch_x holds: rows of the examples beyond are nobody's.
    cut = torch.ops.grnnd.knn_segments(x, y, None, batch_y, 9, method, batch_x=batch_x, examples=4)
    beyond = batch_y >= 4
    assert beyond.any() and (cut[1][beyond] == -1).all() and torch.equal(cut[1][~beyond], want[1][~beyond])


@pytest.mark.parametrize("device", DEVICES)
def test_knn_segments_examples_form_errors(device):
    x = torch.randn(10, 3, device=device)
    batch = torch.zeros(10, dtype=torch.long, device=device)
    ptr = torch.tensor([0, 10], device=device)
    op = torch.ops.grnnd.knn_segments
    with pytest.raises(ValueError, match="exactly one of ptr_x and batch_x, got both"):
        op(x, x, ptr, batch, 2, batch_x=batch)
    with pytest.raises(ValueError, match="exactly one of ptr_x and batch_x, got neither"):
        op(x, x, None, batch, 2)
    with pytest.raises(ValueError, match=r"batch_x: expected shape \[10\]"):
        op(x, x, None, batch, 2, batch_x=batch[:5])
    with pytest.raises(TypeError, match="batch_x: expected int64"):
        op(x, x, None, batch, 2, batch_x=batch.int())
    with pytest.raises(ValueError, match="examples: expected >= 0"):
        op(x, x, None, batch, 2, batch_x=batch, examples=-2)
    with pytest.raises(ValueError, match="examples: expected -1 or 1"):
        op(x, x, ptr, batch, 2, examples=3)


def test_knn_graph_transform_sets_edges_and_drops_edge_attr():
    from types import SimpleNamespace

    from torch_grnnd.pyg import KNNGraph
    pos, batch = LINE, LINE_BATCH
    data = SimpleNamespace(pos=pos, batch=batch, edge_attr=torch.ones(3, 2))
    out = KNNGraph(k=1)(data)
    assert out.edge_index.tolist() == knn_graph(pos, 1, batch).tolist() and out.edge_attr is None
    assert not hasattr(data, "edge_index") and data.edge_attr is not None  # the input is untouched
    undirected = KNNGraph(k=1, force_undirected=True)(data).edge_index
    assert undirected.tolist() == [[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]]
    assert KNNGraph(k=2, loop=True)(data).edge_index.shape == (2, 11)  # 2 per point, 1 for the lone one
    with pytest.raises(ValueError, match="flow: expected"):
        KNNGraph(flow="up")


def test_knn_graph_transform_on_a_pyg_data_object():
    torch_geometric = pytest.importorskip("torch_geometric")
    from torch_geometric.utils import to_undirected

    from torch_grnnd.pyg import KNNGraph
    g = torch.Generator().manual_seed(4)
    data = torch_geometric.data.Data(pos=torch.randn(50, 3, generator=g))
    out = KNNGraph(k=4, force_undirected=True)(data)
    assert isinstance(out, torch_geometric.data.Data) and out.num_nodes == 50
    assert torch.equal(out.edge_index, to_undirected(knn_graph(data.pos, 4), num_nodes=50))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [1, 16, 21, 32])
def test_knn_segments_point_clouds_equal_cpu_bit_for_bit(k):
    # Point clouds of 512 to 4096 points an example, the sizes of PyG's batches: an empty
    # example, one smaller than k, ties and queries of no example are among them.
    g = torch.Generator().manual_seed(k)
    sizes = torch.tensor([1500, 0, 7, 2048, 900, 1200])
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    x = torch.randint(0, 6, (int(sizes.sum()), 3), generator=g).float()  # many exact ties
    y = torch.randn(3000, 3, generator=g) * 2 + 2
    batch_y = torch.randint(-1, 7, (3000,), generator=g)
    cpu = torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k, method="scan")
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), y.cuda(), ptr_x.cuda(), batch_y.cuda(), k, method="scan")
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())


def reference_edges(dists, ids, max_distance=None, drop_self=False, neighbour_first=False, most=-1):
    """segment_edges composed from torch ops: mask, nonzero, gather."""
    keep = ids >= 0
    if max_distance is not None:
        keep &= dists < max_distance
    if drop_self:
        keep &= ids != torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    if most >= 0:  # each row's first `most` kept entries
        keep &= keep.cumsum(1) <= most
    at = keep.nonzero()
    edges = torch.stack([at[:, 0], ids[at[:, 0], at[:, 1]]])
    return edges.flip(0) if neighbour_first else edges


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_distance", [None, 0.5, 0.0])
@pytest.mark.parametrize("drop_self", [False, True])
@pytest.mark.parametrize("neighbour_first", [False, True])
@pytest.mark.parametrize("most", [-1, 0, 3, 40])
def test_segment_edges_equals_mask_and_nonzero(device, max_distance, drop_self, neighbour_first, most):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 40, (3000, 40), generator=g)  # rows longer than a warp
    ids[::7, 0] = torch.arange(0, 3000, 7)  # queries whose own row is among their ids
    dists = torch.rand(3000, 40, generator=g)
    dists[ids < 0] = float("inf")
    got = torch.ops.grnnd.segment_edges(dists.to(device), ids.to(device), max_distance=max_distance,
                                        drop_self=drop_self, neighbour_first=neighbour_first, most=most)
    want = reference_edges(dists, ids, max_distance, drop_self, neighbour_first, most)
    assert got.dtype == torch.long and got.device.type == device
    assert torch.equal(got.cpu(), want) and (want.shape[1] > 0) == (max_distance != 0.0 and most != 0)
    if most > 0 and max_distance is None:  # rows with more kept entries than that are cut
        assert torch.bincount(want[1 if neighbour_first else 0], minlength=3000).max() == most
    empty = torch.ops.grnnd.segment_edges(dists[:0].to(device), ids[:0].to(device))
    assert empty.shape == (2, 0)


def test_segment_edges_bad_input():
    dists, ids = torch.rand(4, 3), torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="expected float32 and int64"):
        torch.ops.grnnd.segment_edges(dists, ids.int())
    with pytest.raises(ValueError, match="one shape"):
        torch.ops.grnnd.segment_edges(dists[:3], ids)
    with pytest.raises(ValueError, match="max_distance: expected a number"):
        torch.ops.grnnd.segment_edges(dists, ids, max_distance=float("nan"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("k", [1, 7, 21, 32])
@pytest.mark.parametrize("queries", [3000, 300_000])
def test_knn_segments_queued_candidates_keep_the_tie_rule(dim, k, queries):
    # Candidates wait in a queue before they are inserted (knn_segments_cuda.cu), checked against
    # a k-th best that may have improved since. Integer coordinates make many exact ties, which
    # must still go to the lower row, as the CPU breaks them; few and many queries per block.
    g = torch.Generator().manual_seed(dim + k)
    sizes = torch.tensor([300, 0, 5, 1000, 77, 512]) // (1 if queries < 100_000 else 10)  # CPU time
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    x = torch.randint(0, 3, (int(sizes.sum()), dim), generator=g).float()
    y = torch.randint(0, 3, (queries, dim), generator=g).float()
    batch_y = torch.randint(-1, 7, (queries,), generator=g).sort().values
    cpu = torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k, method="scan")
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), y.cuda(), ptr_x.cuda(), batch_y.cuda(), k, method="scan")
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())


def test_segment_edges_refuses_a_negative_cap():
    ids = torch.randint(0, 5, (5, 3))
    with pytest.raises(ValueError, match="most: expected -1"):
        torch.ops.grnnd.segment_edges(torch.rand(5, 3), ids, most=-2)
