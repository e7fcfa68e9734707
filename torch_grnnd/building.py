"""The build as callers use it: on the data's device, or on another device within a memory
budget, in shards when the rows do not fit (:mod:`torch_grnnd.out_of_core`). It sits above both
the raw op (:func:`torch_grnnd.ops.build`) and the shards, which build each shard with the op."""
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import ops
from .ops import Metric
from .out_of_core import build_in_shards
from .params import BuildParams
from .progress import Progress


def build(data: Tensor, params: Optional[BuildParams] = None, *, metric: Metric = "l2", progress: Progress = False,
          init: Optional[Tensor] = None, init_split: int = 0, init_mode: str = "merge",
          device: Optional[Union[str, torch.device]] = None,
          max_gpu_memory: Optional[Union[int, str]] = None, **settings: Any) -> Tensor:
    """Build a GRNND graph (GPU-parallel Relative NN-Descent) over the rows of ``data``.

    Starting from ``S`` neighbours per vertex (most from the cells of its nearest hubs), outer
    iterations each run up to ``T2`` rounds in which every vertex applies the
    relative-neighbourhood rule to its pool in random order (of two neighbours closer to each
    other than the farther is to the vertex, the farther is handed to the closer), then give a
    reverse edge to the closest ``rho`` share of each pool. Rounds stop when they change little
    (``delta``), at most ``T1`` outer iterations.

    Args:
        data: [N, D] float32/float16/bfloat16 (float64 accepted), CPU or CUDA.
        params: the build settings, :class:`~torch_grnnd.BuildParams` (defaults when omitted).
        metric: ``"l2"``, ``"ip"`` or ``"cosine"``.
        progress: report each round: ``True`` for a tqdm bar (or log records), or a callable
            ``progress(done, total)`` or ``progress(done, total, changes)``; see
            :mod:`torch_grnnd.progress`. Ignored inside ``torch.compile``; on CUDA each report
            costs a stream synchronisation.
        init: optional int32 [N, c] neighbours each row starts with (a graph over the same rows,
            -1 padded). Of each row's entries those the relative-neighbourhood rule keeps among
            themselves are taken as already compared (a built row's fill entries go): the rounds
            then spend their distances on the pairs the S draws bring in.
            :func:`torch_grnnd.merge` starts from the two graphs it merges. At most
            ``pool_size - S`` columns are used.
        init_split: with ``init`` holding two graphs, rows ``[0, init_split)`` and
            ``[init_split, N)`` (a merge), each row draws its S from the other graph's rows:
            its own were compared by its own build. 0 (the default): draws from all rows.
        init_mode: what rows ``[init_split, N)`` are: ``"merge"`` (the default), a second
            graph; ``"grow"``, new rows without one (their ``init`` rows are not read), as
            :meth:`Index.add <torch_grnnd.Index.add>` adds a large batch: they draw their S from
            all rows, each row of the graph draws the new rows' share of S among them, pairs of
            two rows of the graph are not compared, and the rounds stop when the new rows settle.
        device: build on this device rather than data's; the graph is returned where ``data``
            is. Rows on the CPU (pinned, or a memory-mapped file) that do not fit the device
            are built there in overlapping shards, copied in while the previous one builds,
            and joined (:mod:`torch_grnnd.out_of_core`).
        max_gpu_memory: the device memory such a build may use, bytes or a size like
            ``"8GB"``; default: what is free on ``device``. Giving it without ``device`` builds
            on data's device within it.
        **settings: any field of :class:`~torch_grnnd.BuildParams` (``degree=16``, ...),
            overriding ``params``.

    Returns:
        int32 [N, degree]: neighbour ids of each row, ascending by distance, -1 padded.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> x = torch.randn(1000, 16)
        >>> graph = grnnd.build(x, degree=16)
        >>> graph.shape, graph.dtype
        (torch.Size([1000, 16]), torch.int32)
    """
    p = BuildParams.merge(params, **settings)
    if device is not None or max_gpu_memory is not None:
        if init is not None or init_split or init_mode != "merge":
            raise ValueError("build: init is not supported with device or max_gpu_memory (shards have no common rows)")
        return build_in_shards(data, p, metric, data.device if device is None else device, max_gpu_memory, progress)
    return ops.build(data, p, metric=metric, progress=progress, init=init, init_split=init_split, init_mode=init_mode)
