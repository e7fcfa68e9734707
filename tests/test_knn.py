"""Exact knn equals faiss-cpu's exact search."""
import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered, exact_neighbours


def assert_same_neighbours(dists, ids, ref_dists, ref_ids, rtol=1e-4, atol=1e-5):
    """Distances equal to rtol; ids equal except where the reference has a tie at that rank."""
    torch.testing.assert_close(dists, ref_dists, rtol=rtol, atol=atol)
    tol = atol + rtol * ref_dists.abs()
    differs = ids != ref_ids
    # A position may hold another id only if that id is an equally near neighbour.
    tied = ((ref_dists.unsqueeze(2) - ref_dists.unsqueeze(1)).abs() <= tol.unsqueeze(2)).sum(2) > 1
    assert not (differs & ~tied).any(), f"{int((differs & ~tied).sum())} ids differ without a tie"


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_knn_matches_faiss(metric, dtype):
    data = clustered(3000, 40, 20, seed=1).to(dtype)
    queries = clustered(200, 40, 20, seed=2).to(dtype)
    dists, ids = grnnd.knn(data, queries, 10, metric=metric)
    assert dists.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (200, 10)
    # The reference sees the very values stored (rounded to dtype), in float32.
    ref_dists, ref_ids = exact_neighbours(data.float(), queries.float(), 10, metric)
    assert_same_neighbours(dists, ids, ref_dists, ref_ids)


def test_knn_rows_sorted_and_self_first():
    data = clustered(1000, 16, 10, seed=3)
    dists, ids = grnnd.knn(data, data, 5)
    assert torch.equal(ids[:, 0], torch.arange(1000))
    assert (dists[:, 1:] >= dists[:, :-1]).all()


def test_knn_k_equals_n_returns_everything():
    data = torch.randn(50, 8)
    _, ids = grnnd.knn(data, data[:3], 50)
    assert torch.equal(ids.sort(1).values, torch.arange(50).expand(3, 50))


def test_knn_float64_accepted():
    data = torch.randn(500, 12, dtype=torch.float64)
    dists, ids = grnnd.knn(data, data[:20], 3)
    ref_dists, ref_ids = exact_neighbours(data.float(), data[:20].float(), 3)
    assert_same_neighbours(dists, ids, ref_dists, ref_ids)
