"""Compact codes of the data rows, which the search walks the graph by (``csrc/codes.h``).

A graph search reads a few thousand rows per query, and those bytes bound it. With codes the
traversal reads one byte per dimension (8-bit scalar codes, ``"int8"``) instead of two or four,
and the final list is re-ranked by exact distances to the full rows, so the returned distances
are exact. The trade: the traversal ranks by approximate distances, so a list of the same length
finds slightly fewer true neighbours, and the codes take ``D`` bytes per row (plus 16 under l2)
beside the rows. ``benchmarks/README.md`` has the measured curves.

Encoding: per dimension an offset and a step, the rows' minimum and range / 255 (cosine rows
once normalised); a row's code is ``round((x - offset) / step)`` in [0, 255]. Rows added later
are encoded on the same grid, clamped where they fall outside it.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

CODE_KINDS = ("int8",)

# Rows encoded per step: bounds the float32 copy an encoding makes (about 64 MB at D = 1024).
_CHUNK_ROWS = 1 << 14


def code_dims(dim: int) -> int:
    """Codes per row, padded to a multiple of 16 (``code_dims`` in csrc/codes.h)."""
    return (dim + 15) // 16 * 16


def code_row_bytes(dim: int, metric: str) -> int:
    """Bytes of one code row: the codes, then under l2 a 16-byte tail with the row's norm term."""
    return code_dims(dim) + (16 if metric == "l2" else 0)


@dataclass(frozen=True, eq=False)  # tensors have no truth value to compare by
class Codes:
    """The codes of an index's rows and the grid they were made on.

    Attributes:
        kind: ``"int8"``.
        metric: the metric they were made for (cosine codes are of normalised rows; l2 codes
            carry each row's norm term).
        rows: uint8 [N, code_row_bytes(D, metric)], the search's ``codes``.
        grid: float32 [2, D], each dimension's offset and step, the search's ``code_grid``.
    """

    kind: str
    metric: str
    rows: Tensor
    grid: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes the codes take (the grid not counted)."""
        return self.rows.numel()

    def to(self, device: Union[str, torch.device]) -> "Codes":
        return Codes(self.kind, self.metric, self.rows.to(device), self.grid.to(device))

    def select(self, rows: Tensor) -> "Codes":
        """The codes of these rows (an index's rows kept by a compaction, say)."""
        return Codes(self.kind, self.metric, self.rows[rows.to(self.rows.device)], self.grid)

    def state(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "grid": self.grid}


def _prepared(rows: Tensor, metric: str, device: torch.device) -> Tensor:
    """The rows as the codes describe them: float32 on ``device``, cosine rows normalised."""
    x = rows.to(device=device, dtype=torch.float32)
    if metric == "cosine":
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return x


def fit_grid(data: Tensor, metric: str = "l2", device: Optional[Union[str, torch.device]] = None) -> Tensor:
    """float32 [2, D] on ``device`` (data's by default): each dimension's minimum over the rows
    and its step, the range over 255 (1 where the range is 0: every row then codes to 0)."""
    device = torch.device(device) if device is not None else data.device
    dim = data.shape[1]
    low = torch.full((dim,), float("inf"), device=device)
    high = torch.full((dim,), float("-inf"), device=device)
    for start in range(0, data.shape[0], _CHUNK_ROWS):
        x = _prepared(data[start:start + _CHUNK_ROWS], metric, device)
        low = torch.minimum(low, x.amin(0))
        high = torch.maximum(high, x.amax(0))
    if data.shape[0] == 0:
        low, high = torch.zeros(dim, device=device), torch.zeros(dim, device=device)
    step = (high - low) / 255
    return torch.stack([low, torch.where(step > 0, step, torch.ones_like(step))])


def encode_rows(rows: Tensor, grid: Tensor, metric: str) -> Tensor:
    """uint8 [N, code_row_bytes(D, metric)] on grid's device: the rows coded on ``grid``."""
    n, dim = rows.shape
    device = grid.device
    width = code_row_bytes(dim, metric)
    out = torch.zeros(n, width, dtype=torch.uint8, device=device)
    offset, step = grid[0], grid[1]
    for start in range(0, n, _CHUNK_ROWS):
        x = _prepared(rows[start:start + _CHUNK_ROWS], metric, device)
        levels = ((x - offset) / step).round_().clamp_(0, 255)
        part = out[start:start + x.shape[0]]
        part[:, :dim] = levels.to(torch.uint8)
        if metric == "l2":
            norm = (levels * step).square().sum(1, dtype=torch.float32)
            part[:, code_dims(dim):code_dims(dim) + 4] = norm.view(torch.uint8).view(-1, 4)
    return out


def encode(data: Tensor, kind: str = "int8", *, metric: str = "l2", grid: Optional[Tensor] = None,
           device: Optional[Union[str, torch.device]] = None) -> Codes:
    """Codes of the rows of ``data`` for a search under ``metric``: ``kind`` ``"int8"`` (8-bit
    scalar codes, one byte per dimension). ``grid``: code on this grid (another index's) instead
    of one fitted to ``data``. ``device``: where the codes go (data's by default), e.g. the GPU
    for rows kept in pinned host memory.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> x = torch.randn(1000, 16)
        >>> codes = grnnd.encode(x, metric="l2")
        >>> codes.rows.shape, codes.rows.dtype
        (torch.Size([1000, 32]), torch.uint8)
        >>> d, i = grnnd.search(x, grnnd.build(x), x[:3], k=1, codes=codes)
        >>> i.flatten().tolist()
        [0, 1, 2]
    """
    if kind not in CODE_KINDS:
        raise ValueError(f"codes: expected one of {CODE_KINDS}, got {kind!r}")
    if metric not in ("l2", "ip", "cosine"):
        raise ValueError(f'metric: expected "l2", "ip" or "cosine", got {metric!r}')
    if not isinstance(data, Tensor) or data.dim() != 2 or not data.is_floating_point():
        raise ValueError(f"data: expected a floating-point [N, D] tensor, got "
                         f"{tuple(data.shape) if isinstance(data, Tensor) else type(data).__name__}")
    if data.shape[0] > 0 and not bool(torch.isfinite(data).all()):
        raise ValueError("data: holds NaN or infinity; codes need finite rows")
    if grid is None:
        grid = fit_grid(data, metric, device)
    else:
        check_grid(grid, data.shape[1])
        grid = grid.to(device if device is not None else grid.device)
    return Codes(kind, metric, encode_rows(data, grid, metric), grid)


def check_grid(grid: Tensor, dim: int) -> None:
    if not isinstance(grid, Tensor) or grid.dtype != torch.float32 or tuple(grid.shape) != (2, dim):
        raise ValueError(f"grid: expected float32 [2, {dim}] (offsets and steps), got "
                         f"{tuple(grid.shape) if isinstance(grid, Tensor) else type(grid).__name__}")
