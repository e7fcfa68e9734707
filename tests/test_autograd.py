"""Gradients of the distances returned by search, knn and knn_graph.

The ops return float32 distances whatever the input dtype, so gradcheck's finite differences
(on float64 inputs) use a step of 1e-3 instead of 1e-6: a step of 1e-6 would measure float32
rounding, not the derivative. The analytic gradients are also compared, to float64 precision,
with autograd through a plain-PyTorch recomputation of the same distances.
"""
import itertools

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered

METRICS = ["l2", "ip", "cosine"]
STEP = 1e-3  # gradcheck's finite-difference step


def points(n, seed, dtype=torch.float64):
    return clustered(n, 6, 3, seed=seed, spread=1.0, noise=0.5).to(dtype)


def reference_distances(data, queries, ids, metric):
    """The distances of the chosen pairs, recomputed by differentiable PyTorch ops."""
    x, q = data[ids], queries.unsqueeze(1)
    if metric == "l2":
        return (q - x).pow(2).sum(-1)
    if metric == "ip":
        return -(q * x).sum(-1)
    return 1 - torch.nn.functional.cosine_similarity(q, x, dim=-1, eps=0)


def separated_points(n_data, n_queries, k, metric):
    """(data, queries) in 3-D whose k + 1 nearest rows per query, in order, are far enough
    apart that no finite-difference step reorders them (a reordering makes the sorted output
    jump, which no derivative describes). With n_queries = 0 the queries are the data."""
    for seed in itertools.count():
        x = torch.randn(n_data + n_queries, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        data, queries = x[:n_data], x[n_data:] if n_queries else x
        all_ids = torch.arange(n_data).expand(queries.shape[0], n_data)
        d = reference_distances(data, queries, all_ids, metric)
        if not n_queries:
            d.fill_diagonal_(float("inf"))
        nearest = d.topk(k + 1, dim=1, largest=False).values
        if (nearest.diff(dim=1) > 20 * STEP).all():
            return data.clone().requires_grad_(), queries.clone().requires_grad_()


def gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=STEP, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("metric", METRICS)
def test_gradcheck_knn(metric):
    data, queries = separated_points(15, 4, 3, metric)
    gradcheck(lambda d, q: grnnd.knn(d, q, 3, metric=metric)[0], data, queries)


@pytest.mark.parametrize("metric", METRICS)
def test_gradcheck_search(metric):
    data, queries = separated_points(15, 4, 3, metric)
    graph = grnnd.build(data.detach(), degree=8, pool_size=16, initial_degree=8, metric=metric)
    gradcheck(lambda d, q: grnnd.search(d, graph, q, 3, list_size=16, metric=metric)[0], data, queries)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "approximate"])
@pytest.mark.parametrize("metric", METRICS)
def test_gradcheck_knn_graph(metric, exact):
    data, _ = separated_points(12, 0, 3, metric)
    gradcheck(lambda d: torch.ops.grnnd.knn_graph(d, 3, metric=metric, exact=exact)[0], data)


@pytest.mark.parametrize("metric", METRICS)
def test_gradients_equal_autograd_of_the_recomputed_distances(metric):
    data = points(200, 6).requires_grad_()
    queries = points(20, 7).requires_grad_()
    weights = torch.rand(20, 5)  # float32, as the distances: the incoming gradient is exact
    dists, ids = grnnd.knn(data, queries, 5, metric=metric)
    got = torch.autograd.grad((dists * weights).sum(), [data, queries])
    want = torch.autograd.grad((reference_distances(data, queries, ids, metric) * weights.double()).sum(),
                               [data, queries])
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision_gradients_keep_the_input_dtype(dtype):
    data = points(200, 8, dtype).requires_grad_()
    queries = points(20, 9, dtype).requires_grad_()
    dists, ids = grnnd.knn(data, queries, 5)
    dists.sum().backward()
    want = torch.autograd.grad(reference_distances(data.double(), queries.double(), ids, "l2").sum(),
                               [data, queries])
    for got, ref in zip([data.grad, queries.grad], want):
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is rounded to dtype
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)


def test_padded_results_get_no_gradient():
    data = points(50, 10).requires_grad_()
    graph = grnnd.build(data.detach(), degree=8, pool_size=16, initial_degree=8)
    allowed = torch.arange(50) < 3  # three rows may be returned, k = 5: two pads per query
    dists, ids = grnnd.search(data, graph, data[:4].detach(), 5, filter=allowed)
    assert (ids[:, 3:] == -1).all() and torch.isinf(dists[:, 3:]).all()
    (dists[:, :3].sum() + 0 * dists[:, 3:].nan_to_num(posinf=0).sum()).backward()
    assert torch.isfinite(data.grad).all()
    assert (data.grad[3:] == 0).all(), "only the returned rows get a gradient"


def test_knn_graph_gradient_reaches_queries_and_neighbours():
    data = points(40, 11).requires_grad_()
    dists, ids = torch.ops.grnnd.knn_graph(data, 3, exact=True)
    grad = torch.autograd.grad(dists.sum(), data)[0]
    want = torch.autograd.grad(reference_distances(data, data, ids, "l2").sum(), data)[0]
    torch.testing.assert_close(grad, want)


def test_ids_are_not_differentiable():
    data = points(40, 12).requires_grad_()
    dists, ids = grnnd.knn(data, data[:3], 2)
    assert dists.requires_grad and not ids.requires_grad


def test_training_step_on_retrieved_distances_lowers_the_loss():
    """An encoder trained to pull queries towards what they retrieve: the loss falls."""
    torch.manual_seed(0)
    corpus = clustered(500, 16, 5, seed=13)
    queries = clustered(64, 16, 5, seed=14)
    encoder = torch.nn.Linear(16, 8)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.01)
    losses = []
    for _ in range(5):
        data = encoder(corpus)
        graph = grnnd.build(data.detach(), degree=16)
        dists, _ = grnnd.search(data, graph, encoder(queries), 5)
        loss = dists.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_opcheck_with_gradients():
    data = points(60, 15, torch.float32).requires_grad_()
    queries = points(7, 16, torch.float32).requires_grad_()
    graph = grnnd.build(data.detach(), degree=8, pool_size=16, initial_degree=8)
    torch.library.opcheck(torch.ops.grnnd.search.default, (data, graph, queries, 5), dict(metric="cosine"))
    torch.library.opcheck(torch.ops.grnnd.knn.default, (data, queries, 5), dict(metric="ip"))
    torch.library.opcheck(torch.ops.grnnd.knn_graph.default, (data, 4), dict(exact=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("metric", METRICS)
def test_cuda_gradients_equal_autograd_of_the_recomputed_distances(metric, dtype):
    data = clustered(3000, 32, 20, seed=17).to("cuda", dtype).requires_grad_()
    queries = clustered(100, 32, 20, seed=18).to("cuda", dtype).requires_grad_()
    graph = grnnd.build(data.detach(), metric=metric)
    dists, ids = grnnd.search(data, graph, queries, 5, metric=metric)
    got = torch.autograd.grad(dists.sum(), [data, queries])
    want = torch.autograd.grad(reference_distances(data.double(), queries.double(), ids, metric).sum(),
                               [data, queries])
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.is_cuda
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gradients_of_a_search_over_pinned_host_rows():
    # The GPU reads the rows where they lie, forward and backward; the data's gradient is on the host.
    rows = clustered(3000, 32, 20, seed=19)
    on_gpu = rows.cuda().requires_grad_()
    on_host = rows.pin_memory().requires_grad_()
    queries = clustered(100, 32, 20, seed=20).cuda().requires_grad_()
    graph = grnnd.build(rows).cuda()
    grads = []
    for data in (on_gpu, on_host):
        dists, ids = grnnd.search(data, graph, queries, 5)
        grads.append(torch.autograd.grad(dists.sum(), [data, queries]))
    assert grads[1][0].device.type == "cpu" and grads[1][1].is_cuda
    torch.testing.assert_close(grads[1][0], grads[0][0].cpu())
    torch.testing.assert_close(grads[1][1], grads[0][1])
