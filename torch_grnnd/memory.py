"""A build's device memory: the bytes it needs a row, what a device has free, budgets in bytes.

A build on a device needs its rows, the pools (2 x N x pool_size x 8 bytes) and a little more
at once (``bytes_per_row``); the builds within a budget (:mod:`torch_grnnd.out_of_core`,
:class:`~torch_grnnd.SwappingIndex`) plan their shards by it and one more row
(``shard_bytes_per_row``), and a default build asks it whether its pair codes fit
(:func:`torch_grnnd.ops.build`).
"""
import re
from typing import Union

import torch

from .codes import code_dims, pair_codes_scratch_bytes
from .params import BuildParams

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Union[int, float, str]) -> int:
    """``8_000_000_000``, ``"8GB"``, ``"7.5 GiB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"max_gpu_memory: expected a positive size, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_gpu_memory: expected bytes or a size like '8GB' or '512MiB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def row_bytes(dim: int, element_size: int, metric: str = "l2") -> int:
    """Device bytes of a row as the kernels hold it: the row, and the copy they read instead
    where they need one (``prepare_vectors`` in csrc/cuda/detail/vectors_cuda.cuh): float32 rows
    of float64 data, and unit rows under cosine (of the rows' type; float32 for float64 data).
    l2 and ip kernels read float16, bfloat16 and float32 rows themselves."""
    row = max(element_size, 2)
    prepared = (4 if element_size > 4 else 0) + (min(row, 4) if metric == "cosine" else 0)
    return dim * (row + prepared)


def bytes_per_row(dim: int, element_size: int, p: BuildParams, metric: str = "l2") -> int:
    """Device bytes a build needs per row: the row with its prepared copy (:func:`row_bytes`),
    the pools, their counts and locks, the start's cells, the graph with its fill, and with
    ``pair_codes`` the row's codes (one byte a dimension, in 16s). A copy counted under every
    metric asked 2.3-2.4x what l2 builds on pair codes of 1M and 4M x 1 024 float16 rows took
    (benchmarks/README.md, "Building on one-byte codes"). The pools and the graph are a widened
    build's where the build may widen (``BuildParams.widen``): its widest rows, and the pools it
    needs, a third larger (it grows them to twice the size only where the GPU has the memory free,
    ``BuildParams.wide_pool_size_for``)."""
    codes = code_dims(dim) if p.pair_codes else 0
    pool_size, degree = (p.wide_pool_size_for(1.0), p.wide_degree) if p.may_widen(metric) else (p.pool_size, p.degree)
    return row_bytes(dim, element_size, metric) + 2 * pool_size * 8 + 16 + 12 + 2 * degree * 4 + codes


def build_extra_bytes(n: int, dim: int, element_size: int, p: BuildParams, metric: str = "l2") -> int:
    """Device bytes a build of ``n`` rows needs beside the rows themselves: :func:`bytes_per_row`
    less the row, for every row, and with ``pair_codes`` the scratch of making the codes
    (:func:`torch_grnnd.codes.pair_codes_scratch_bytes`). A default build asks it whether its pair
    codes fit (:func:`torch_grnnd.ops.build`); ``benchmarks/bench_scale.py`` sets the builds' peak
    memory against it."""
    scratch = pair_codes_scratch_bytes(dim) if p.pair_codes else 0
    return n * (bytes_per_row(dim, element_size, p, metric) - dim * element_size) + scratch


def shard_bytes_per_row(dim: int, element_size: int, p: BuildParams, metric: str = "l2") -> int:
    """Device bytes a row of a shard takes in the plans of builds within a budget
    (:mod:`torch_grnnd.out_of_core`, :class:`~torch_grnnd.SwappingIndex`): its build's
    (:func:`bytes_per_row` of :func:`within_budget`'s settings, which the shards build with) and
    one more row. Shards of what the build alone fits were slower:
    10M x 1024 float16 rows in 8 GB on one H200 built in 8 shards of up to 2.48M rows in 26.8 s,
    against 24.5 s in 11 shards of up to 1.52M (recall@10 at list 64 0.9831 against 0.9812, one
    seed; benchmarks/README.md, "Within the budget"): fewer cells cut the rows, and more of them
    lay near a border and were built twice."""
    return bytes_per_row(dim, element_size, within_budget(p), metric) + dim * max(element_size, 2)


def within_budget(p: BuildParams) -> BuildParams:
    """``p`` for a build within a memory budget: the rows, not pair codes, unless ``pair_codes``
    asks for them (the codes' bytes would take rows from every shard), and no widening (``widen``:
    its wider pools, which a build checks against the device's free memory alone, would pass the
    budget, and the shards' rows would differ in width)."""
    return p.replace(pair_codes=bool(p.pair_codes), widen=False)


def free_bytes(device: torch.device) -> int:
    """What a build on ``device`` may take: the GPU's free memory and what the caching allocator
    holds but does not use. A CPU has no such figure: a budget must be given there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    raise ValueError("max_gpu_memory: needed when the build runs on the CPU (there is no free memory to ask for)")
