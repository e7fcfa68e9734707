"""knn_segments' grid path (csrc/pyg/grid.h) against its scan of every row: the same neighbours and
bit for bit the same distances, on every shape of data the grid could get wrong (ties, points
on a plane or a line or all in one place, queries far outside the data, empty and small
examples, skipped and out-of-range example indices). The scan itself is checked against
faiss-cpu in test_pyg.py.
"""
import pytest
import torch

import torch_grnnd  # noqa: F401  (registers the ops)

from conftest import DEVICES



def segments(sizes, dim, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(sizes)
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    n = int(sizes.sum())
    x = torch.randint(0, 4, (n, dim), generator=g).float() if integer else torch.randn(n, dim, generator=g)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    return x, ptr, batch


def both(x, y, ptr, batch, k, device):
    args = [t.to(device) for t in (x, y, ptr, batch)]
    scan = torch.ops.grnnd.knn_segments(*args, k, method="scan")
    grid = torch.ops.grnnd.knn_segments(*args, k, method="grid")
    return [t.cpu() for t in scan], [t.cpu() for t in grid]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim,k", [(1, 4), (2, 8), (3, 16), (3, 20), (3, 32), (5, 10)])
def test_grid_returns_what_the_scan_returns(device, dim, k):
    x, ptr, batch = segments([900, 0, 5, 1, 2000, 40], dim, seed=dim * 100 + k)
    y = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    far = torch.full((3, dim), 50.0) * torch.tensor([1.0, -1.0, 0.0])[:, None]  # far outside the box
    y, batch_y = torch.cat([y, far]), torch.cat([batch, torch.tensor([0, 4, 5])])
    scan, grid = both(x, y, ptr, batch_y, k, device)
    assert torch.equal(scan[1], grid[1]) and torch.equal(scan[0], grid[0])
    assert (grid[1][batch_y == 2][:, 5:] == -1).all()  # an example of 5 rows pads the rest


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lower_row_as_in_the_scan(device):
    # Integer coordinates in a 4 x 4 x 4 lattice: every distance is tied many times over.
    x, ptr, batch = segments([700, 1300], 3, seed=5, integer=True)
    scan, grid = both(x, x, ptr, batch, 24, device)
    assert torch.equal(scan[1], grid[1]) and torch.equal(scan[0], grid[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["plane", "line", "point"])
def test_degenerate_clouds(device, shape):
    x, ptr, batch = segments([600, 600], 3, seed=6)
    if shape in ("plane", "line"):
        x[:, 2] = 1.5
    if shape == "line":
        x[:, 1] = -2.0
    if shape == "point":
        x[:] = 0.25
    scan, grid = both(x, x, ptr, batch, 12, device)
    assert torch.equal(scan[1], grid[1]) and torch.equal(scan[0], grid[0])


@pytest.mark.parametrize("device", DEVICES)
def test_unsorted_and_out_of_range_example_indices(device):
    x, ptr, batch = segments([300, 300, 300], 3, seed=7)
    g = torch.Generator().manual_seed(8)
    batch_y = torch.randint(-1, 5, (400,), generator=g)
    y = torch.randn(400, 3, generator=g)
    scan, grid = both(x, y, ptr, batch_y, 8, device)
    assert torch.equal(scan[1], grid[1]) and torch.equal(scan[0], grid[0])
    outside = (batch_y < 0) | (batch_y >= 3)
    assert (grid[1][outside] == -1).all() and grid[0][outside].isinf().all()


@pytest.mark.parametrize("device", DEVICES)
def test_auto_picks_a_path_that_gives_the_same_and_grid_refuses_what_it_cannot_do(device):
    x, ptr, batch = segments([1000, 1000], 3, seed=9)
    x, ptr, batch = x.to(device), ptr.to(device), batch.to(device)
    auto = torch.ops.grnnd.knn_segments(x, x, ptr, batch, 16)
    scan = torch.ops.grnnd.knn_segments(x, x, ptr, batch, 16, method="scan")
    assert torch.equal(auto[1], scan[1]) and torch.equal(auto[0], scan[0])
    with pytest.raises(ValueError, match="takes k <= 32"):
        torch.ops.grnnd.knn_segments(x, x, ptr, batch, 33, method="grid")
    with pytest.raises(ValueError, match='method: expected "auto", "grid" or "scan"'):
        torch.ops.grnnd.knn_segments(x, x, ptr, batch, 4, method="tree")
    descending = torch.tensor([0, 1500, 1000, 2000], device=device)
    with pytest.raises(ValueError, match="needs ascending ptr_x"):
        torch.ops.grnnd.knn_segments(x, x, descending, batch, 4, method="grid")
    # "auto" follows such ranges by the scan.
    assert torch.ops.grnnd.knn_segments(x, x, descending, batch, 4)[1].shape == (2000, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grid_equals_the_cpu_grid_on_a_large_cloud():
    x, ptr, batch = segments([200_000], 3, seed=10)
    cpu = torch.ops.grnnd.knn_segments(x, x, ptr, batch, 16, method="grid")
    gpu = torch.ops.grnnd.knn_segments(x.cuda(), x.cuda(), ptr.cuda(), batch.cuda(), 16, method="grid")
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[0], gpu[0].cpu())
