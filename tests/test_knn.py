"""Exact knn equals faiss-cpu's exact search, on the CPU and (where present) on CUDA."""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def true_distances(data, queries, ids, metric):
    """float64 distances of each query to the rows `ids` [Q, k] it was given."""
    x, q = data.double().cpu()[ids.cpu()], queries.double().cpu().unsqueeze(1)
    if metric == "l2":
        return (q - x).pow(2).sum(-1)
    if metric == "ip":
        return -(q * x).sum(-1)
    return 1 - torch.nn.functional.cosine_similarity(q, x, dim=-1)


def assert_same_neighbours(dists, ids, ref_dists, ref_ids, data, queries, metric="l2", rtol=1e-4, atol=1e-5):
    """Distances equal to rtol; where an id differs from the reference's, it is an equally near
    neighbour (a tie): its own distance is the reference's distance at that rank."""
    dists, ids = dists.cpu(), ids.cpu()
    torch.testing.assert_close(dists, ref_dists, rtol=rtol, atol=atol)
    assert all(len(set(row)) == len(row) for row in ids.tolist()), "an id is returned twice for one query"
    differs = ids != ref_ids
    if differs.any():
        own = true_distances(data, queries, ids, metric).float()
        torch.testing.assert_close(own[differs], ref_dists[differs], rtol=rtol, atol=atol)


def assert_matches_faiss(data, queries, k, device):
    """knn on `device` against faiss-cpu's exact l2 search of the same float32 rows."""
    dists, ids = grnnd.knn(data.to(device), queries.to(device), k)
    ref_dists, ref_ids = exact_neighbours(data, queries, k)
    assert_same_neighbours(dists, ids, ref_dists, ref_ids, data, queries)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_knn_matches_faiss(device, metric, dtype):
    data = clustered(3000, 40, 20, seed=1).to(dtype)
    queries = clustered(200, 40, 20, seed=2).to(dtype)
    dists, ids = grnnd.knn(data.to(device), queries.to(device), 10, metric=metric)
    assert dists.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (200, 10)
    assert dists.device.type == device
    # The reference sees the very values stored (rounded to dtype), in float32.
    ref_dists, ref_ids = exact_neighbours(data.float(), queries.float(), 10, metric)
    assert_same_neighbours(dists, ids, ref_dists, ref_ids, data.float(), queries.float(), metric)


@pytest.mark.parametrize("device", DEVICES)
def test_knn_rows_sorted_and_self_first(device):
    data = clustered(1000, 16, 10, seed=3).to(device)
    dists, ids = grnnd.knn(data, data, 5)
    assert torch.equal(ids[:, 0].cpu(), torch.arange(1000))
    assert (dists[:, 1:] >= dists[:, :-1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_knn_k_equals_n_returns_everything(device):
    data = torch.randn(50, 8).to(device)
    _, ids = grnnd.knn(data, data[:3], 50)
    assert torch.equal(ids.cpu().sort(1).values, torch.arange(50).expand(3, 50))


@pytest.mark.parametrize("device", DEVICES)
def test_knn_float64_accepted(device):
    data = torch.randn(500, 12, dtype=torch.float64)
    dists, ids = grnnd.knn(data.to(device), data[:20].to(device), 3)
    ref_dists, ref_ids = exact_neighbours(data.float(), data[:20].float(), 3)
    assert_same_neighbours(dists, ids, ref_dists, ref_ids, data.float(), data[:20].float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, min_recall", [(torch.float16, 0.995), (torch.bfloat16, 0.99)])
def test_knn_half_storage_recall_against_float32_truth(device, dtype, min_recall):
    # What is lost here is lost in storing the values: the search is exact on the stored values
    # (test above). bfloat16 keeps 8 significant bits, so near-tied neighbours swap places; an
    # exact search on these bfloat16 values reaches 0.993, float16 0.999.
    data = clustered(20_000, 64, 100, seed=4)
    queries = clustered(500, 64, 100, seed=5)
    _, ids = grnnd.knn(data.to(device, dtype), queries.to(device, dtype), 10)
    truth = exact_neighbours(data, queries, 10)[1]
    assert grnnd.recall(ids.cpu(), truth) >= min_recall


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 100, 1024])
def test_knn_large_k(device, k):
    data = clustered(5000, 24, 30, seed=6)
    queries = clustered(64, 24, 30, seed=7)
    assert_matches_faiss(data, queries, k, device)


@pytest.mark.cuda
@requires_cuda
def test_knn_cuda_streams_over_many_tiles():
    # 20k queries make the CUDA kernel split the queries into blocks and the data into several
    # tiles, so running results must carry over between tiles and query blocks.
    data = clustered(40_000, 32, 200, seed=8)
    queries = clustered(20_000, 32, 200, seed=9)
    assert_matches_faiss(data, queries, 10, "cuda")


@pytest.mark.cuda
@requires_cuda
def test_knn_cuda_large_magnitudes():
    # Values far outside float16's range: the float32 path scales before rounding its operands.
    data = clustered(3000, 40, 20, seed=10) * 1e6
    queries = clustered(100, 40, 20, seed=11) * 1e6
    assert_matches_faiss(data, queries, 10, "cuda")


@pytest.mark.cuda
@requires_cuda
def test_knn_cuda_matches_cpu_on_current_stream():
    data = clustered(4000, 48, 40, seed=12)
    queries = clustered(300, 48, 40, seed=13)
    cpu = grnnd.knn(data, queries, 10)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dists, ids = grnnd.knn(data.cuda(), queries.cuda(), 10)
    stream.synchronize()
    assert_same_neighbours(dists, ids, *cpu, data, queries)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 60 * 2**30
                    or not __import__("os").environ.get("GRNND_LARGE_TESTS"),
                    reason="needs a CUDA device with 60 GiB and GRNND_LARGE_TESTS=1")
def test_knn_cuda_50m_rows():
    # 50M x 384 float16 (38 GB): the data is only ever read tile by tile.
    g = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randn(50_000_000, 384, generator=g, device="cuda", dtype=torch.float16)
    rows = torch.randint(50_000_000, (64,), generator=g, device="cuda")
    queries = data[rows] + 0.01 * torch.randn(64, 384, generator=g, device="cuda", dtype=torch.float16)
    dists, ids = grnnd.knn(data, queries, 10)
    assert torch.equal(ids[:, 0], rows)
    assert (dists[:, 1:] >= dists[:, :-1]).all()


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_cpu_distances_at_every_lane_tail(metric):
    """The CPU distance loops keep 32 partial sums and take the rest in blocks of 8 and then one
    by one (csrc/cpu/distances_cpu.cpp): widths around each boundary give float64's distances."""
    for dim in (1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 65, 100, 383, 384, 1030):
        g = torch.Generator().manual_seed(dim)
        data, queries = torch.randn(300, dim, generator=g), torch.randn(20, dim, generator=g)
        dists, ids = grnnd.knn(data, queries, 5, metric=metric)
        expected = true_distances(data, queries, ids, metric).float()
        torch.testing.assert_close(dists, expected, rtol=1e-5, atol=1e-4 * dim ** 0.5, msg=f"dim {dim}")
