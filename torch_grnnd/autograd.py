"""Gradients of the distances that ``search``, ``knn`` and ``knn_graph`` return.

The ops pick neighbours (``ids``, integers, not differentiable); the distances to the picked
rows are smooth functions of the query and the row, so a loss on retrieved distances trains
whatever produced the queries and the data. The backward recomputes each distance's gradient
from the gathered rows (nothing is saved from the kernels but the ids)::

    l2      d = |q - x|^2               dd/dq = 2 (q - x)              dd/dx = -2 (q - x)
    ip      d = -<q, x>                 dd/dq = -x                     dd/dx = -q
    cosine  d = 1 - <q^, x^>, c = 1 - d dd/dq = -(x^ - c q^) / |q|     dd/dx = -(q^ - c x^) / |x|

with ``q^ = q / |q|``. A zero row has no direction and gets a zero cosine gradient. Entries with
id -1 (fewer than k results) contribute nothing. Gradients are computed in float32 for
float16/bfloat16 inputs (float64 stays float64) and returned in each input's dtype.

Example:
    >>> import torch, torch_grnnd as grnnd
    >>> data = torch.randn(50, 4, requires_grad=True)
    >>> queries = torch.randn(3, 4, requires_grad=True)
    >>> dists, ids = grnnd.knn(data, queries, k=2)
    >>> dists.sum().backward()
    >>> torch.allclose(queries.grad, 2 * (queries.unsqueeze(1) - data[ids]).sum(1))
    True
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


def _inverse_norm(x: Tensor) -> Tensor:
    norm = x.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, 1 / norm, torch.zeros_like(norm))


def pair_gradients(q: Tensor, x: Tensor, grad: Tensor, metric: str) -> Tuple[Tensor, Tensor]:
    """``grad * dd/dq`` and ``grad * dd/dx`` of ``d(q, x)`` for broadcastable rows ``q``, ``x``
    ([..., D]) and the incoming gradient ``grad`` ([...]) of each distance."""
    g = grad.unsqueeze(-1)
    if metric == "l2":
        dq = 2 * (q - x) * g
        return dq, -dq
    if metric == "ip":
        return -g * x, -g * q
    if metric == "cosine":
        q_inv, x_inv = _inverse_norm(q), _inverse_norm(x)
        q_unit, x_unit = q * q_inv, x * x_inv
        cos = (q_unit * x_unit).sum(-1, keepdim=True)
        return -g * (x_unit - cos * q_unit) * q_inv, -g * (q_unit - cos * x_unit) * x_inv
    raise ValueError(f'metric: expected one of "l2", "ip", "cosine", got {metric!r}')


def distance_backward(data: Tensor, queries: Tensor, ids: Tensor, grad_dists: Tensor, metric: str,
                      need_data: bool, need_queries: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients for ``data`` [N, D] and ``queries`` [Q, D] of ``dists[i, j] = d(queries[i],
    data[ids[i, j]])``, given the gradient of ``dists`` [Q, k]; None where not needed."""
    compute = torch.promote_types(torch.promote_types(data.dtype, queries.dtype), torch.float32)
    valid = ids >= 0
    # torch.where, not a product: the gradient at a padded entry may be inf or nan.
    grad = torch.where(valid, grad_dists, torch.zeros_like(grad_dists)).to(compute)
    rows = torch.where(valid, ids, torch.zeros_like(ids)).reshape(-1)
    # Data rows in pinned host memory (a GPU search of them) are gathered by the GPU.
    picked = data.index_select(0, rows) if data.device == rows.device else torch.ops.grnnd.gather_rows(data, rows)
    x = picked.view(*ids.shape, data.shape[1]).to(compute)
    q = queries.to(compute).unsqueeze(1)
    dq, dx = pair_gradients(q, x, grad, metric)
    grad_queries = dq.sum(1).to(queries.dtype) if need_queries else None
    grad_data = None
    if need_data:
        grad_data = torch.zeros(data.shape, dtype=compute, device=data.device)
        grad_data = grad_data.index_add(0, rows.to(data.device), dx.reshape(-1, data.shape[1]).to(data.device))
        grad_data = grad_data.to(data.dtype)
    return grad_data, grad_queries


def _save(ctx, data: Tensor, queries: Tensor, ids: Tensor, metric: str) -> None:
    ctx.save_for_backward(data, queries, ids)
    ctx.metric = metric


_SEARCH_ARGS = [a.name for a in torch.ops.grnnd.search.default._schema.arguments]


def _search_setup(ctx, inputs, output):
    # search has no keyword-only arguments (csrc/grnnd.cpp says why): all arrive in `inputs`.
    data, queries = inputs[0], inputs[2]
    _save(ctx, data, queries, output[1], inputs[_SEARCH_ARGS.index("metric")])


def _search_backward(ctx, grad_dists, _grad_ids):
    data, queries, ids = ctx.saved_tensors
    grads = [None] * len(_SEARCH_ARGS)
    if grad_dists is not None:
        grads[0], grads[2] = distance_backward(data, queries, ids, grad_dists, ctx.metric,
                                               ctx.needs_input_grad[0], ctx.needs_input_grad[2])
    return tuple(grads)


def _knn_setup(ctx, inputs, keyword_only_inputs, output):
    data, queries, _ = inputs
    _save(ctx, data, queries, output[1], keyword_only_inputs["metric"])


def _knn_backward(ctx, grad_dists, _grad_ids):
    data, queries, ids = ctx.saved_tensors
    need_data, need_queries, _ = ctx.needs_input_grad
    if grad_dists is None:
        return None, None, None
    grad_data, grad_queries = distance_backward(data, queries, ids, grad_dists, ctx.metric, need_data, need_queries)
    return grad_data, grad_queries, None


def _knn_graph_setup(ctx, inputs, keyword_only_inputs, output):
    data, _ = inputs
    _save(ctx, data, data, output[1], keyword_only_inputs["metric"])


def _knn_graph_backward(ctx, grad_dists, _grad_ids):
    data, _, ids = ctx.saved_tensors
    if grad_dists is None or not ctx.needs_input_grad[0]:
        return None, None
    # Every row is a query and a neighbour: both gradients land in data, row i's query part
    # at row i.
    as_neighbour, as_query = distance_backward(data, data, ids, grad_dists, ctx.metric, True, True)
    return as_neighbour + as_query, None


torch.library.register_autograd("grnnd::search", _search_backward, setup_context=_search_setup)
torch.library.register_autograd("grnnd::knn", _knn_backward, setup_context=_knn_setup)
torch.library.register_autograd("grnnd::knn_graph", _knn_graph_backward, setup_context=_knn_graph_setup)
