"""Bad input raises a clear exception that names the argument; nothing crashes or hangs."""
import pytest
import torch

import torch_grnnd as grnnd

X = torch.randn(100, 8)
G = grnnd.build(X, degree=8, pool_size=16, initial_degree=8)


@pytest.mark.parametrize(
    "data, match",
    [
        (torch.randn(100), "data: expected a 2-D tensor"),
        (torch.randn(2, 50, 8), "data: expected a 2-D tensor"),
        (torch.empty(0, 8), "data: expected at least one row"),
        (torch.empty(10, 0), "data: expected at least one column"),
    ],
)
def test_build_rejects_bad_shapes(data, match):
    with pytest.raises(ValueError, match=match):
        grnnd.build(data)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_build_rejects_non_float_dtypes(dtype):
    with pytest.raises(TypeError, match="data: expected float32, float16, bfloat16 or float64"):
        grnnd.build(torch.zeros(10, 4, dtype=dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rows_are_named(bad):
    data = torch.randn(50, 4)
    data[17, 2] = bad
    with pytest.raises(ValueError, match="data: expected finite values, row 17"):
        grnnd.build(data)
    with pytest.raises(ValueError, match="data: expected finite values, row 17"):
        grnnd.knn(data, torch.randn(3, 4), 2)
    queries = torch.randn(5, 8)
    queries[3, 0] = bad
    with pytest.raises(ValueError, match="queries: expected finite values, row 3"):
        grnnd.search(X, G, queries, 2)


def test_large_finite_values_are_accepted():
    # Row sums of these overflow float32; the values themselves are finite.
    huge = torch.full((20, 3), 3e38).to(torch.bfloat16)
    assert grnnd.build(huge, degree=4, pool_size=8, initial_degree=4).shape == (20, 4)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(degree=0), "degree: expected 1 <= degree <= 256"),
        (dict(degree=257), "degree: expected 1 <= degree <= 256"),
        (dict(pool_size=1), "pool_size: expected 2 <= R"),
        (dict(pool_size=100_000), "pool_size: expected 2 <= R"),
        (dict(initial_degree=0), "initial_degree: expected 1 <= S"),
        (dict(outer_iters=0), "outer_iters: expected >= 1"),
        (dict(inner_iters=-1), "inner_iters: expected >= 0"),
        (dict(reverse_ratio=1.5), "reverse_ratio: expected 0 <= rho <= 1"),
        (dict(update_order="sideways"), "update_order: expected one of"),
        (dict(metric="hamming"), "metric: expected one of"),
    ],
)
def test_build_rejects_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        grnnd.build(X, **params)


def test_k_out_of_range():
    for k in (0, -1, 101):
        with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 100"):
            grnnd.knn(X, X[:2], k)
        with pytest.raises(ValueError, match=r"k: expected"):
            grnnd.search(X, G, X[:2], k, list_size=128)
    with pytest.raises(ValueError, match=r"k: expected <= list_size \(16\)"):
        grnnd.search(X, G, X[:2], 20, list_size=16)
    with pytest.raises(ValueError, match=r"k: expected >= 1, got 0"):
        grnnd.knn_graph(X, 0)
    # As in torch_cluster, k past the other points gives each point all of them.
    assert grnnd.knn_graph(X, 100, exact=True).shape == (2, 100 * 99)
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 99"):
        torch.ops.grnnd.knn_graph(X, 100)  # the op itself has a fixed shape
    with pytest.raises(ValueError, match=r"k: expected at most 1024 for exact knn, got 1025"):
        grnnd.knn(torch.randn(2000, 4), torch.randn(2, 4), 1025)


def test_dimension_mismatch():
    with pytest.raises(ValueError, match="queries: expected dim 8 to match data, got 5"):
        grnnd.search(X, G, torch.randn(3, 5), 2)
    with pytest.raises(ValueError, match="queries: expected dim 8 to match data, got 5"):
        grnnd.knn(X, torch.randn(3, 5), 2)


def test_graph_checks():
    with pytest.raises(ValueError, match="graph: has 50 rows but data has 100; was it built on other data"):
        grnnd.search(X, G[:50], X[:2], 2)
    with pytest.raises(TypeError, match="graph: expected int32"):
        grnnd.search(X, G.long(), X[:2], 2)
    bad = G.clone()
    bad[5, 0] = 100
    with pytest.raises(ValueError, match=r"graph: ids must lie in \[0, 100\).*found 100"):
        grnnd.search(X, bad, X[:2], 2)
    bad[5, 0] = -7
    with pytest.raises(ValueError, match="found -7"):
        grnnd.search(X, bad, X[:2], 2)
    with pytest.raises(ValueError, match="graph: expected a 2-D tensor"):
        grnnd.search(X, G.flatten(), X[:2], 2)


def test_filter_checks():
    with pytest.raises(TypeError, match="filter: expected a bool tensor"):
        grnnd.search(X, G, X[:2], 2, filter=torch.ones(100))
    with pytest.raises(ValueError, match=r"filter: expected shape \[100\]"):
        grnnd.search(X, G, X[:2], 2, filter=torch.ones(99, dtype=torch.bool))


def test_search_parameter_checks():
    with pytest.raises(ValueError, match=r"search_width: expected 0 \(automatic\) .. 32"):
        grnnd.search(X, G, X[:2], 2, search_width=-1)
    with pytest.raises(ValueError, match=r"search_width: expected 0 \(automatic\) .. 32"):
        grnnd.search(X, G, X[:2], 2, search_width=33)
    with pytest.raises(ValueError, match="list_size: expected <= 1024"):
        grnnd.search(X, G, X[:2], 2, list_size=5000)
    with pytest.raises(ValueError, match="max_iters: expected >= 0"):
        grnnd.search(X, G, X[:2], 2, max_iters=-3)
    with pytest.raises(ValueError, match=r"searches: expected 0 \(automatic\) .. 32, got 33"):
        grnnd.search(X, G, X[:2], 2, searches=33)
    with pytest.raises(ValueError, match="searches: expected 0"):
        grnnd.search_distance_counts(X, G, X[:2], 2, searches=-1)
    rows = torch.randn(200, 8)
    with pytest.raises(ValueError, match=r"searches \* k: expected <= 4096"):
        grnnd.search(rows, grnnd.build(rows, degree=8, pool_size=16), rows[:2], 130, list_size=256, searches=32)
    with pytest.raises(ValueError, match='flow: expected "source_to_target"'):
        grnnd.knn_graph(X, 3, flow="up")


def test_device_mix_is_named():
    meta = torch.randn(10, 8, device="meta")
    with pytest.raises(ValueError, match="data is on cpu but queries is on meta"):
        torch.ops.grnnd.knn.default(X, meta, 2)


def test_too_many_rows_is_rejected_before_any_work():
    # 2^31 rows of one byte-sized column would need 4 GiB as float16; an expanded view costs nothing.
    huge = torch.zeros(1, 1, dtype=torch.float16).expand(2**31, 1)
    with pytest.raises(ValueError, match="data: expected fewer than 2\\^31 - 1 rows"):
        grnnd.build(huge)


def test_cuda_kernel_is_registered_or_explains_itself():
    # On a CPU-only install the CUDA entries are stubs that say how to get real kernels.
    for op in ("build", "search", "knn"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"grnnd::{op}", "CUDA")
