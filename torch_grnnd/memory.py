"""A build's device memory: the bytes it needs a row, what a device has free, budgets in bytes.

A build on a device needs its rows, the pools (2 x N x pool_size x 8 bytes) and a little more
at once (``bytes_per_row``); the builds within a budget (:mod:`torch_grnnd.out_of_core`,
:class:`~torch_grnnd.SwappingIndex`) plan their shards by it, and a default build asks it
whether its pair codes fit (:func:`torch_grnnd.ops.build`).
"""
import re
from typing import Union

import torch

from .codes import code_dims
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


def bytes_per_row(dim: int, element_size: int, p: BuildParams) -> int:
    """Device bytes a build needs per row: the row (and a prepared copy for cosine or a wider
    dtype), the pools, their counts and locks, the start's cells, the graph with its fill, and
    with ``pair_codes`` the row's codes (one byte a dimension, in 16s)."""
    codes = code_dims(dim) if p.pair_codes else 0
    return 2 * dim * max(element_size, 2) + 2 * p.pool_size * 8 + 16 + 12 + 2 * p.degree * 4 + codes


def within_budget(p: BuildParams) -> BuildParams:
    """``p`` for a build within a memory budget: the rows, not pair codes, unless ``pair_codes``
    asks for them (the codes' bytes would take rows from every shard)."""
    return p.replace(pair_codes=bool(p.pair_codes))


def free_bytes(device: torch.device) -> int:
    """What a build on ``device`` may take: the GPU's free memory and what the caching allocator
    holds but does not use. A CPU has no such figure: a budget must be given there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    raise ValueError("max_gpu_memory: needed when the build runs on the CPU (there is no free memory to ask for)")
