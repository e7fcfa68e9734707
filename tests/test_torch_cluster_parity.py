"""torch_grnnd.pyg against torch_cluster itself, where torch_cluster is installed: the same
calls, positional arguments in torch_cluster's order, must give the same edge sets.

torch_cluster is not a dependency (it needs a build against the local torch and CUDA), so
this file is skipped where it is missing; tests/test_pyg.py checks the same semantics against
a brute-force reference everywhere. torch_cluster's CPU knn has no ``cosine``, and its radius
keeps the first ``max_num_neighbors`` rows in row order where torch_grnnd keeps the nearest,
so the radius cases use a cap no query reaches.
"""
import pytest
import torch

from torch_grnnd import pyg

from conftest import DEVICES

torch_cluster = pytest.importorskip("torch_cluster")

SIZES = [30, 2, 0, 50, 9, 1]  # an example smaller than k + 1, a skipped index, a lone point


def edge_set(edge_index: torch.Tensor) -> set:
    return set(map(tuple, edge_index.t().tolist()))


def clouds(dim: int, sizes=SIZES, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.randn(batch.numel(), dim, generator=g), batch


def same_edges(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype == torch.long and ours.device == theirs.device
    assert ours.shape == theirs.shape and edge_set(ours) == edge_set(theirs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [3, 16])
@pytest.mark.parametrize("k", [1, 6])
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_knn_graph_equals_torch_cluster(device, dim, k, loop, flow):
    x, batch = clouds(dim)
    x, batch = x.to(device), batch.to(device)
    same_edges(pyg.knn_graph(x, k, batch, loop, flow), torch_cluster.knn_graph(x, k, batch, loop, flow))
    # No batch: one example of every row.
    same_edges(pyg.knn_graph(x, k, None, loop, flow), torch_cluster.knn_graph(x, k, None, loop, flow))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 4, 40])
def test_knn_two_sets_equals_torch_cluster(device, k):
    x, batch_x = clouds(5, seed=1)
    # Queries in every example but the first; example 2 has no rows of x.
    y, batch_y = clouds(5, sizes=[0, 3, 4, 10, 1, 2], seed=2)
    args = (x.to(device), y.to(device), k, batch_x.to(device), batch_y.to(device))
    same_edges(pyg.knn(*args), torch_cluster.knn(*args))
    if device == "cuda":  # torch_cluster's CPU knn refuses cosine
        same_edges(pyg.knn(*args, True), torch_cluster.knn(*args, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_radius_graph_equals_torch_cluster(device, loop, flow):
    x, batch = clouds(3)
    x, batch = x.to(device), batch.to(device)
    cap = 64  # above every example's size: both libraries keep every row within r
    same_edges(pyg.radius_graph(x, 1.2, batch, loop, cap, flow),
               torch_cluster.radius_graph(x, 1.2, batch, loop, cap, flow))
    y, batch_y = clouds(3, sizes=[4, 0, 3, 5, 2, 1], seed=3)
    args = (x, y.to(device), 1.5, batch, batch_y.to(device), cap)
    same_edges(pyg.radius(*args), torch_cluster.radius(*args))


@pytest.mark.parametrize("device", DEVICES)
def test_point_cloud_batch_equals_torch_cluster(device):
    # DGCNN's shape, scaled down: equal-sized clouds, k = 20, batch_size given.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8 * 256, 3, generator=g).to(device)
    batch = torch.arange(8, device=device).repeat_interleave(256)
    same_edges(pyg.knn_graph(x, 20, batch, False, "source_to_target", False, 1, 8),
               torch_cluster.knn_graph(x, 20, batch, False, "source_to_target", False, 1, 8))
