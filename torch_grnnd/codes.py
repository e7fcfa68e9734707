"""Compact codes of the data rows, which the search walks the graph by (``csrc/codes.h``).

A graph search reads a few thousand rows per query, and those bytes bound it. With codes the
traversal reads one byte (``"int8"``) or half a byte (``"int4"``) per dimension instead of two or
four, and the final list is re-ranked by exact distances to the full rows, so the returned
distances are exact. The trade: the traversal ranks by approximate distances, so a list of the
same length finds somewhat fewer true neighbours (more so with int4), and the codes take memory
beside the rows: ``D`` bytes per row for int8 (plus 16 under l2), ``D / 2 + 16`` for int4.
``benchmarks/README.md`` has the measured curves.

``"int8"``: per dimension an offset and a step, the rows' minimum and range / 255 (cosine rows
once normalised); a row's code is ``round((x - offset) / step)`` in [0, 255]. Rows added later
are encoded on the same grid, clamped where they fall outside it.

``"int4"``: the rows less their centre, turned by a random rotation (so that every coordinate
carries a similar share), then 4 bits per coordinate on a grid of 16 levels with a step chosen
per row, and two floats per row for the inner-product estimate of RaBitQ (Gao and Long 2024,
extended to several bits): exact for the row itself, and unbiased over random rotations in that
paper's analysis. The grid holds the rotation and the centre; rows added later use both.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

CODE_KINDS = ("int8", "int4")

# Rows encoded per step: bounds the float32 copy an encoding makes (about 64 MB at D = 1024).
_CHUNK_ROWS = 1 << 14


# int4: the rotation's seed (one rotation for every index: codes of two indexes with the same
# centre are comparable), the steps the encoder tries as multiples of a row's RMS (a coarse pass
# over 0.16-0.56, then +-0.02 and +-0.04 around the best: 10 tries for a resolution of 0.02), and
# the levels' half range (codes.h: v = u - 7.5).
_ROTATION_SEED = 0x5EED
_INT4_COARSE_STEPS = (0.16, 0.24, 0.32, 0.40, 0.48, 0.56)
_INT4_FINE_OFFSETS = (-0.04, -0.02, 0.02, 0.04)
_INT4_HALF_RANGE = 7.5


def code_dims(dim: int, kind: str = "int8") -> int:
    """Codes per row, padded to a multiple of 16 (int8) or 32 (int4) (``code_dims`` in csrc/codes.h)."""
    return (dim + 15) // 16 * 16 if kind == "int8" else (dim + 31) // 32 * 32


def code_row_bytes(dim: int, metric: str, kind: str = "int8") -> int:
    """Bytes of one code row: the codes, then a 16-byte tail: under l2 the row's norm term for
    int8, the row's scale and norm term for int4 (csrc/codes.h)."""
    if kind == "int8":
        return code_dims(dim) + (16 if metric == "l2" else 0)
    return code_dims(dim, kind) // 2 + 16


def grid_kind(grid: Tensor) -> str:
    """The kind of codes a grid makes: int8's are [2, D], int4's [D + 1, D] (D >= 2)."""
    return "int8" if grid.shape[0] == 2 else "int4"


@dataclass(frozen=True, eq=False)  # tensors have no truth value to compare by
class Codes:
    """The codes of an index's rows and the grid they were made on.

    Attributes:
        kind: ``"int8"`` or ``"int4"``.
        metric: the metric they were made for (cosine codes are of normalised rows).
        rows: uint8 [N, code_row_bytes(D, metric, kind)], the search's ``codes``.
        grid: float32, the search's ``code_grid``: int8 [2, D], each dimension's offset and
            step; int4 [D + 1, D], the rotation (transposed) and then the rows' centre.
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


def fit_grid(data: Tensor, metric: str = "l2", device: Optional[Union[str, torch.device]] = None,
             kind: str = "int8") -> Tensor:
    """The grid codes of ``kind`` are made on, fitted to ``data``, on ``device`` (data's by
    default). int8: float32 [2, D], each dimension's minimum over the rows and its step, the
    range over 255 (1 where the range is 0: every row then codes to 0). int4: float32
    [D + 1, D], a random rotation (the same for every index of D dimensions) transposed, then
    the mean of the rows."""
    device = torch.device(device) if device is not None else data.device
    dim = data.shape[1]
    if kind == "int4":
        total = torch.zeros(dim, dtype=torch.float64, device=device)
        for start in range(0, data.shape[0], _CHUNK_ROWS):
            total += _prepared(data[start:start + _CHUNK_ROWS], metric, device).sum(0, dtype=torch.float64)
        centre = (total / max(data.shape[0], 1)).float()
        return torch.cat([_rotation(dim).to(device), centre[None]])
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


def _rotation(dim: int) -> Tensor:
    """float32 [D, D]: a random orthogonal matrix (QR of a Gaussian one, signs fixed so that it
    is uniformly distributed), from a fixed seed on the CPU, so every machine makes the same."""
    generator = torch.Generator().manual_seed(_ROTATION_SEED)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def encode_rows(rows: Tensor, grid: Tensor, metric: str) -> Tensor:
    """uint8 [N, code_row_bytes(D, metric, kind)] on grid's device: the rows coded on ``grid``
    (its shape says the kind, :func:`grid_kind`)."""
    kind = grid_kind(grid)
    n, dim = rows.shape
    device = grid.device
    out = torch.zeros(n, code_row_bytes(dim, metric, kind), dtype=torch.uint8, device=device)
    for start in range(0, n, _CHUNK_ROWS):
        x = _prepared(rows[start:start + _CHUNK_ROWS], metric, device)
        part = out[start:start + x.shape[0]]
        if kind == "int8":
            _encode_int8(x, grid, metric, part)
        else:
            _encode_int4(x, grid, part)
    return out


def _encode_int8(x: Tensor, grid: Tensor, metric: str, out: Tensor) -> None:
    dim = x.shape[1]
    offset, step = grid[0], grid[1]
    levels = ((x - offset) / step).round_().clamp_(0, 255)
    out[:, :dim] = levels.to(torch.uint8)
    if metric == "l2":
        norm = (levels * step).square().sum(1, dtype=torch.float32)
        out[:, code_dims(dim):code_dims(dim) + 4] = norm.view(torch.uint8).view(-1, 4)


def _encode_int4(x: Tensor, grid: Tensor, out: Tensor) -> None:
    """Codes of the rows x (prepared) on an int4 grid (csrc/codes.h): r = P (x - c); of the steps
    tried (multiples of r's RMS), the one whose levels v point closest to r's direction; then
    alpha = |r|^2 / <v, r> and |r|^2 in the tail."""
    n, dim = x.shape
    # In float64, so that a row's codes do not depend on the batch it is coded in (a float32
    # product's rounding may follow the matrix's shape).
    r = ((x - grid[dim]).double() @ grid[:dim].double()).float()
    norm = r.square().sum(1)
    rms = (norm / dim).sqrt().clamp_min(1e-30)

    def levels_at(multiple: Tensor) -> Tensor:  # multiple: [n], per row
        return (r / (rms * multiple)[:, None] + _INT4_HALF_RANGE).round_().clamp_(0, 15)

    best_cos = torch.full((n,), -2.0, device=x.device)
    best_multiple = torch.full((n,), _INT4_COARSE_STEPS[0], device=x.device)

    def try_steps(multiple: Tensor) -> None:
        nonlocal best_cos, best_multiple
        v = levels_at(multiple) - _INT4_HALF_RANGE
        cos = (v * r).sum(1) / (v.norm(dim=1) * norm.sqrt()).clamp_min(1e-30)
        better = cos > best_cos
        best_cos = torch.where(better, cos, best_cos)
        best_multiple = torch.where(better, multiple, best_multiple)

    for multiple in _INT4_COARSE_STEPS:
        try_steps(torch.full((n,), multiple, device=x.device))
    coarse = best_multiple
    for offset in _INT4_FINE_OFFSETS:
        try_steps(coarse + offset)
    best = levels_at(best_multiple).to(torch.uint8)
    v = best.float() - _INT4_HALF_RANGE
    inner = (v * r).sum(1)
    # A row at the centre (r = 0) has no direction: alpha 0 makes its estimate the exact 0.
    alpha = torch.where(norm > 0, norm / inner.where(inner != 0, torch.ones_like(inner)), torch.zeros_like(norm))
    padded = torch.zeros(n, code_dims(dim, "int4"), dtype=torch.uint8, device=x.device)
    padded[:, :dim] = best
    packed = padded[:, 0::2] | (padded[:, 1::2] << 4)
    width = packed.shape[1]
    out[:, :width] = packed
    out[:, width:width + 8] = torch.stack([alpha, norm], 1).contiguous().view(torch.uint8)


def encode(data: Tensor, kind: str = "int8", *, metric: str = "l2", grid: Optional[Tensor] = None,
           device: Optional[Union[str, torch.device]] = None) -> Codes:
    """Codes of the rows of ``data`` for a search under ``metric``: ``kind`` ``"int8"`` (8-bit
    scalar codes, one byte per dimension) or ``"int4"`` (4-bit codes of the rotated rows, half a
    byte per dimension and 16 bytes per row; needs D >= 2). ``grid``: code on this grid (another
    index's, of the same kind) instead of one fitted to ``data``. ``device``: where the codes go
    (data's by default), e.g. the GPU for rows kept in pinned host memory.

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
    if not _all_finite(data):
        raise ValueError("data: holds NaN or infinity; codes need finite rows")
    if kind == "int4" and data.shape[1] < 2:
        raise ValueError(f"codes: int4 codes need at least 2 dimensions, got {data.shape[1]}")
    if grid is None:
        grid = fit_grid(data, metric, device, kind)
    else:
        check_grid(grid, data.shape[1], kind)
        grid = grid.to(device if device is not None else grid.device)
    return Codes(kind, metric, encode_rows(data, grid, metric), grid)


def _all_finite(data: Tensor) -> bool:
    """Whether every value of ``data`` is finite, a run of rows at a time (a bool copy of all of a
    GPU's 25M x 1024 rows would take 24 GiB beside them), with one wait for the device."""
    rows = max(1, (1 << 28) // max(1, data.shape[1]))
    bad = torch.zeros((), dtype=torch.bool, device=data.device)
    for start in range(0, data.shape[0], rows):
        bad |= ~torch.isfinite(data[start:start + rows]).all()
    return not bool(bad)


def check_grid(grid: Tensor, dim: int, kind: str = "int8") -> None:
    shape = (2, dim) if kind == "int8" else (dim + 1, dim)
    what = "offsets and steps" if kind == "int8" else "rotation and centre"
    if not isinstance(grid, Tensor) or grid.dtype != torch.float32 or tuple(grid.shape) != shape:
        raise ValueError(f"grid: expected float32 [{shape[0]}, {dim}] ({what}), got "
                         f"{tuple(grid.shape) if isinstance(grid, Tensor) else type(grid).__name__}")
