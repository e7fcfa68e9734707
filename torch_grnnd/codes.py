"""Compact codes of the data rows, which the search walks the graph by (``csrc/core/codes.h``).

A graph search reads a few thousand rows per query, and those bytes bound it. With codes the
traversal reads one byte (``"int8"``) or half a byte (``"int4"``) per dimension instead of two or
four, and the final list is re-ranked by exact distances to the full rows, so the returned
distances are exact. The trade: the traversal ranks by approximate distances, so a list of the
same length finds somewhat fewer true neighbours (more so with int4), and the codes take memory
beside the rows: ``D`` bytes per row for int8 (plus 16 under l2), at most ``D / 2 + 16`` for
int4 (fewer where the codes leave the rows' last principal axes out, below).
``benchmarks/README.md`` has the measured curves.

``"int8"``: per dimension an offset and a step, the rows' minimum and range / 255 (cosine rows
once normalised); a row's code is ``round((x - offset) / step)`` in [0, 255]. Rows added later
are encoded on the same grid, clamped where they fall outside it.

``"int4"``: each row less the centre of its cell (k-means cells of the rows, about sqrt(N) of
them and at most 1 024, where they take at least half the rows' spread; else one), turned by a
random rotation (so that every coordinate carries a similar share), then 4 bits per coordinate
on a grid of 16 levels with a step chosen per row, and two floats per row for the inner-product
estimate of RaBitQ (Gao and Long 2024, extended to several bits): exact for the row itself, and
unbiased over random rotations in that paper's analysis. Where the residuals (rows less their
cells' centres) leave almost nothing on their last principal axes (real embeddings do), the codes
keep fewer coordinates: the leading principal axes, in whole groups of 32, turned by a random
rotation among themselves; the axes left out hold at most half a percent of the residuals'
variance (:func:`int4_coded_dims`; fitted on at least 16 rows a dimension). So 384-d sentence
embeddings take 192 bytes a row, a quarter of their float16 rows, where every coordinate would take
208. Rows added later are coded on the axes kept: what they hold elsewhere is lost to the walk
(not to the re-rank), and ``Index.encode`` fits a new grid.
Coding about a cell's centre rather than one global centre (as IVF-RaBitQ does) keeps rows of one
tight cluster apart: their differences are not drowned by the code's error on the cluster's
offset. The grid holds the rotation and the centres; rows added later use both.
"""
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

CODE_KINDS = ("int8", "int4")

# The format of a codes state: 2 for int4 rows coded about their cell's centre, the cell in the
# tail (csrc/core/codes.h); a state of format 1 (or none) holds codes about one centre, whose ip and
# cosine rows are coded again on loading (index.check_codes_state).
CODES_FORMAT = 2

# int4 cells: about sqrt(N) of them (a cell of about sqrt(N) rows), at most this many by
# default (a query computes a dot with every cell, csrc/core/codes.h) and at most kMaxInt4Cells asked.
# By default the rows are coded about cells only where the cells leave at most this share of the
# rows' spread about their mean (squared distances, on the k-means sample): the code's error
# scales with a row's distance from its centre, and each distance then costs a lookup of the
# query's dot with the row's cell (7-25% of a batch of 10 000's queries/s at 1 000 cells, H200). Real
# sentence embeddings keep 0.62 of it at 1 000 cells and gain no recall from them; 1 000
# synthetic clusters keep 0.19 and gain up to 0.13 of recall@10 at a short list
# (benchmarks/README.md, "int4 codes about cells"). Deciding costs the k-means: int4 encoding of
# 1M x 384 rows took 0.8 s against 0.4 s before (H200).
_DEFAULT_MAX_CELLS = 1024
_CELLS_MAX_SPREAD_KEPT = 0.5
MAX_CELLS = 4096
# k-means of the cells: on at most this many rows per cell (and at least this many rows), over
# this many Lloyd rounds.
_CELL_SAMPLE_PER_CELL = 64
_CELL_SAMPLE_MIN = 1 << 16
_CELL_ROUNDS = 8

# Rows encoded per step: bounds the float32 copy an encoding makes (about 64 MB at D = 1024).
_CHUNK_ROWS = 1 << 14


# int4 codes keep fewer coordinates than the rows have where the principal axes left out hold at
# most this share of the residuals' variance (about their cells, on the cells' sample). The 4-bit
# levels themselves leave about 1% of a Gaussian coordinate's variance as error, so the axes left
# out add at most half of that. On 60 000 real 384-d sentence embeddings the last 32 axes hold
# 0.26% (the next 32 another 0.50%), and codes of the leading 352 axes found 0.940 / 0.999 of the
# true 10 among the 10 / 16 rows they ranked first, against 0.944 / 0.999 for every rotated
# coordinate (a CPU proxy, 300 queries, benchmarks/README.md). The axes are fitted only on at least
# _INT4_AXES_ROWS_PER_DIM x D rows: on fewer, the residuals' last axes hold nothing because the
# sample spans too few directions, not because the data does, and rows added later would lose
# what lies outside the sample's span. Above _INT4_MAX_AXES_DIM dimensions they are not fitted
# either (a float64 eigendecomposition of D x D on the CPU: about 1 s at 2 048, far more at 4 096).
# In both cases every coordinate is coded.
_INT4_DROPPED_VARIANCE = 0.005
_INT4_AXES_ROWS_PER_DIM = 16
_INT4_MAX_AXES_DIM = 2048

# int4: the rotation's seed (one random rotation for every index of D dimensions whose codes keep
# every coordinate: codes of two such indexes with the same centre are comparable), the steps the
# encoder tries as multiples of a row's RMS (a coarse pass over 0.16-0.56, then +-0.02 and +-0.04
# around the best: 10 tries for a resolution of 0.02), and the levels' half range (codes.h:
# v = u - 7.5).
_ROTATION_SEED = 0x5EED
_INT4_COARSE_STEPS = (0.16, 0.24, 0.32, 0.40, 0.48, 0.56)
_INT4_FINE_OFFSETS = (-0.04, -0.02, 0.02, 0.04)
_INT4_HALF_RANGE = 7.5


def code_dims(dim: int, kind: str = "int8") -> int:
    """Codes per row, padded to a multiple of 16 (int8) or 32 (int4) (``code_dims`` in csrc/core/codes.h)."""
    return (dim + 15) // 16 * 16 if kind == "int8" else (dim + 31) // 32 * 32


PAIR_CODE_METRICS = ("l2", "cosine")  # the metrics a build's pair codes measure


def pair_codes_scratch_bytes(dim: int) -> int:
    """The most :func:`pair_codes` holds beside its output: a step's float32 rows and the few
    temporaries of its arithmetic (at most four copies of a step: 256 MB at D = 1024)."""
    return 4 * _CHUNK_ROWS * dim * 4


def pair_codes(rows: Tensor, metric: str = "l2") -> Tuple[Tensor, float]:
    """One-byte codes of ``rows`` [N, D] for a build's pair distances (``BuildParams.pair_codes``):
    uint8 [N, stride] on the rows' device, stride D rounded up to a multiple of 16 (zeros past
    D), each code round((x - o) / s) with o the dimension's minimum over the rows and one step s
    for every dimension (the widest range / 255); and the scale that turns a sum of squared code
    differences into the metric's distance (csrc/core/checks.h, check_pair_codes): s^2 under l2.
    Under cosine the codes are those of the rows divided by their norms, and the scale s^2 / 2:
    half the squared distance of unit rows is 1 - their cosine (a zero row, which has no
    direction, stays zero, half a unit from every unit row instead of 1). One step keeps that sum
    four dimensions an instruction pair on the GPU; a dimension of a small range then gets few
    levels, which costs little where the dimensions' spreads are alike."""
    if metric not in PAIR_CODE_METRICS:
        raise ValueError(f"pair_codes: codes measure l2 and cosine distances, not {metric!r}")
    n, dim = rows.shape

    def chunk(start: int) -> Tensor:
        return _prepared(rows[start:start + _CHUNK_ROWS], metric, rows.device)

    lo = torch.full((dim,), math.inf, device=rows.device)
    hi = torch.full((dim,), -math.inf, device=rows.device)
    for start in range(0, n, _CHUNK_ROWS):
        part = chunk(start)
        lo = torch.minimum(lo, part.amin(0))
        hi = torch.maximum(hi, part.amax(0))
    widest = float((hi - lo).max()) if n > 0 else 0.0
    step = widest / 255 if widest > 0 else 1.0  # all rows alike: every code 0
    out = torch.zeros(n, code_dims(dim), dtype=torch.uint8, device=rows.device)
    for start in range(0, n, _CHUNK_ROWS):
        part = chunk(start)
        out[start:start + part.shape[0], :dim] = ((part - lo) / step).round_().clamp_(0, 255).to(torch.uint8)
    return out, step * step / (2 if metric == "cosine" else 1)


def code_row_bytes(dim: int, metric: str, kind: str = "int8", coded_dims: Optional[int] = None) -> int:
    """Bytes of one code row: the codes, then a 16-byte tail: under l2 the row's norm term for
    int8, the row's scale and norm term for int4 (csrc/core/codes.h). ``coded_dims`` (int4): the
    coordinates the codes keep (:func:`int4_coded_dims`), every one by default."""
    if kind == "int8":
        return code_dims(dim) + (16 if metric == "l2" else 0)
    return (coded_dims if coded_dims is not None else code_dims(dim, kind)) // 2 + 16


def int4_coded_dims(grid: Tensor) -> int:
    """The coordinates int4 codes on ``grid`` keep: the rotation's columns up to its last nonzero
    one, padded to 32. code_dims(D) for the random rotation of every coordinate; fewer where the
    grid turns the rows to their leading principal axes (its other columns are zero)."""
    dim = grid.shape[1]
    used = grid[:dim].ne(0).any(0).nonzero()
    return code_dims(int(used.max()) + 1 if used.numel() > 0 else dim, "int4")


def grid_kind(grid: Tensor) -> str:
    """The kind of codes a grid makes: int8's are [2, D], int4's [D + C, D] (D >= 2, C cells)."""
    return "int8" if grid.shape[0] == 2 else "int4"


def default_cells(rows: int) -> int:
    """The int4 cells of ``rows`` rows by default: about sqrt(rows), from 1 to 1 024."""
    return max(1, min(_DEFAULT_MAX_CELLS, round(math.sqrt(rows))))


@dataclass(frozen=True, eq=False)  # tensors have no truth value to compare by
class Codes:
    """The codes of an index's rows and the grid they were made on.

    Attributes:
        kind: ``"int8"`` or ``"int4"``.
        metric: the metric they were made for (cosine codes are of normalised rows).
        rows: uint8 [N, code_row_bytes(D, metric, kind, coded_dims)], the search's ``codes``.
        grid: float32, the search's ``code_grid``: int8 [2, D], each dimension's offset and
            step; int4 [D + C, D], the rotation (transposed; zero columns past the coordinates
            kept) and then the C cells' centres.
    """

    kind: str
    metric: str
    rows: Tensor
    grid: Tensor

    def __post_init__(self):
        # The search reads int4's coordinates from the rows' width, so rows of another grid's
        # width would be read wrongly rather than refused (csrc/core/codes.h, int4_row_bytes_fit).
        if self.kind == "int4" and self.rows.dim() == 2 and self.grid.dim() == 2 and self.grid.device.type != "meta":
            width = code_row_bytes(self.grid.shape[1], self.metric, "int4", int4_coded_dims(self.grid))
            if self.rows.shape[1] != width:
                raise ValueError(f"codes: int4 rows of {self.rows.shape[1]} bytes do not fit their grid, which keeps "
                                 f"{int4_coded_dims(self.grid)} coordinates ({width} bytes a row)")

    @property
    def nbytes(self) -> int:
        """Bytes the codes take (the grid not counted)."""
        return self.rows.numel()

    def to(self, device: Union[str, torch.device]) -> "Codes":
        return Codes(self.kind, self.metric, self.rows.to(device), self.grid.to(device))

    def select(self, rows: Tensor) -> "Codes":
        """The codes of these rows (an index's rows kept by a compaction, say)."""
        return Codes(self.kind, self.metric, self.rows[rows.to(self.rows.device)], self.grid)

    @property
    def coded_dims(self) -> int:
        """Codes a row holds: int8 one per dimension (padded to 16); int4 one per coordinate kept
        (padded to 32), fewer than the dimensions where the rows' last principal axes are left out."""
        return (self.rows.shape[1] - 16) * 2 if self.kind == "int4" else code_dims(self.grid.shape[1])

    @property
    def cells(self) -> int:
        """int4: the cells whose centres the rows are coded about; int8: 0."""
        return self.grid.shape[0] - self.grid.shape[1] if self.kind == "int4" else 0

    def state(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "grid": self.grid, "format": CODES_FORMAT}


def _prepared(rows: Tensor, metric: str, device: torch.device) -> Tensor:
    """The rows as the codes describe them: float32 on ``device``, cosine rows normalised."""
    x = rows.to(device=device, dtype=torch.float32)
    if metric == "cosine":
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return x


def fit_grid(data: Tensor, metric: str = "l2", device: Optional[Union[str, torch.device]] = None,
             kind: str = "int8", cells: Optional[int] = None, coded_dims: Optional[int] = None) -> Tensor:
    """The grid codes of ``kind`` are made on, fitted to ``data``, on ``device`` (data's by
    default). int8: float32 [2, D], each dimension's minimum over the rows and its step, the
    range over 255 (1 where the range is 0: every row then codes to 0). int4: float32
    [D + C, D], the rotation transposed, then the centres of ``cells`` k-means cells of the rows
    (the mean of the rows for one cell). ``cells=None``: :func:`default_cells` of them where they
    take at least half the rows' spread about their mean (clustered rows), else one. The
    rotation: where the codes keep every coordinate, a random one (the same for every index of D
    dimensions); where they keep ``coded_dims`` (a multiple of 32 below code_dims(D); None: as
    few as leave out at most half a percent of the residuals' variance), the residuals' leading
    principal axes turned by a random rotation among themselves, zero columns after them. The
    same rows give the same grid."""
    device = torch.device(device) if device is not None else data.device
    dim = data.shape[1]
    if kind == "int4":
        check_coded_dims(coded_dims, dim)
        centres, kept = _cell_centres(data, metric, device, default_cells(data.shape[0]) if cells is None else cells)
        if cells is None and kept > _CELLS_MAX_SPREAD_KEPT:
            centres, _ = _cell_centres(data, metric, device, 1)
        return torch.cat([_int4_turn(data, metric, device, centres, coded_dims), centres])
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


def _cell_centres(data: Tensor, metric: str, device: torch.device, cells: int) -> Tuple[Tensor, float]:
    """(float32 [cells, D], the share of the rows' spread the cells keep): the mean of the rows
    for one cell (share 1); else Lloyd's k-means (squared l2, on the prepared rows) of a
    fixed-seed sample of them from k-means++ seeds, and the sample's squared distances to its
    nearest centres over those to its mean. Sums are one-hot products in a fixed order
    (index_add_ adds in whatever order the GPU's atomics land), so the same rows give the same
    centres."""
    n, dim = data.shape
    if cells == 1 or n <= 1:
        total = torch.zeros(dim, dtype=torch.float64, device=device)
        for start in range(0, n, _CHUNK_ROWS):
            total += _prepared(data[start:start + _CHUNK_ROWS], metric, device).sum(0, dtype=torch.float64)
        return (total / max(n, 1)).float().expand(cells, dim).contiguous(), 1.0
    generator = torch.Generator().manual_seed(_ROTATION_SEED)
    sample = min(n, max(_CELL_SAMPLE_PER_CELL * cells, _CELL_SAMPLE_MIN))
    picked = torch.randperm(n, generator=generator)[:sample].sort().values
    x = _prepared(data[picked.to(data.device)], metric, device)
    if sample >= cells:
        centres = _spread_seeds(x, cells, generator)
    else:  # fewer rows than cells: the surplus cells repeat the first row and stay empty
        centres = torch.cat([x, x[:1].expand(cells - sample, dim)])
    for _ in range(_CELL_ROUNDS):
        sums = torch.zeros(cells, dim, dtype=torch.float64, device=device)
        counts = torch.zeros(cells, dtype=torch.float64, device=device)
        for start in range(0, sample, _CHUNK_ROWS):
            part = x[start:start + _CHUNK_ROWS]
            one_hot = torch.nn.functional.one_hot(_nearest(part, centres), cells).double()
            sums += one_hot.T @ part.double()
            counts += one_hot.sum(0)
        centres = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres.double()).float()
    about_cells = about_mean = 0.0
    mean = x.double().mean(0)
    for start in range(0, sample, _CHUNK_ROWS):
        part = x[start:start + _CHUNK_ROWS].double()
        about_cells += float((part - centres.double()[_nearest(part, centres)]).square().sum())
        about_mean += float((part - mean).square().sum())
    return centres, about_cells / about_mean if about_mean > 0 else 1.0


def _spread_seeds(x: Tensor, cells: int, generator: torch.Generator) -> Tensor:
    """float32 [cells, D]: k-means++ seeds among the rows x, each next one drawn with probability
    proportional to its squared distance from the seeds so far, so that every cluster of rows
    gets a seed of its own (Lloyd rounds from random rows leave some cells across two clusters,
    whose rows are then coded about a centre between them)."""
    n = x.shape[0]
    draws = torch.rand(cells, generator=generator, dtype=torch.float64).to(x.device)
    seeds = torch.empty(cells, x.shape[1], dtype=x.dtype, device=x.device)
    seeds[0] = x[int(draws[0] * n)]
    # |x - s|^2 = |x|^2 + |s|^2 - 2 <x, s>: one pass over the rows a draw (a matrix-vector
    # product) where the difference, its square and their sum took three, each writing or reading
    # a copy of the sample (158 of the 0.24-0.30 s that 1 000 draws took at 65 536 x 384, H200).
    # The product's float32 rounding (about 1e-7 of |x|^2) only matters for rows next to a seed,
    # whose draw weights are about 0 either way.
    norms = x.square().sum(1, dtype=torch.float64)  # no float64 copy of the sample

    def distances(seed: Tensor) -> Tensor:
        return (norms + seed.double().square().sum() - 2 * torch.mv(x, seed).double()).clamp_min_(0)

    nearest = distances(seeds[0])
    for j in range(1, cells):  # no host synchronisation: the pick stays a tensor
        total = nearest.cumsum(0)
        pick = torch.searchsorted(total, (draws[j] * total[-1])[None]).clamp_max_(n - 1)
        seeds[j] = x.index_select(0, pick)[0]
        nearest = torch.minimum(nearest, distances(seeds[j]))
    return seeds


def _nearest(x: Tensor, centres: Tensor) -> Tensor:
    """int64 [n]: each row's nearest centre by squared l2, in float64 (so that a row's cell does
    not depend on the rows coded beside it)."""
    xd, cd = x.double(), centres.double()
    return ((cd.square().sum(1))[None] - 2 * xd @ cd.T).argmin(1)


def check_coded_dims(coded_dims: Any, dim: int) -> None:
    """``coded_dims`` of int4 codes of rows of ``dim``: None or a multiple of 32 in [32, code_dims(dim)]."""
    every = code_dims(dim, "int4")
    if coded_dims is not None and (not isinstance(coded_dims, int) or isinstance(coded_dims, bool)
                                   or not 32 <= coded_dims <= every or coded_dims % 32 != 0):
        raise ValueError(f"coded_dims: expected a multiple of 32 in [32, {every}] for int4 codes, got {coded_dims!r}")


def _int4_turn(data: Tensor, metric: str, device: torch.device, centres: Tensor,
               coded_dims: Optional[int]) -> Tensor:
    """float32 [D, D], an int4 grid's rotation (fit_grid): y = u @ it."""
    n, dim = data.shape
    every = code_dims(dim, "int4")
    if coded_dims is None and (dim > _INT4_MAX_AXES_DIM or n < _INT4_AXES_ROWS_PER_DIM * dim):
        coded_dims = every  # too wide to fit the axes, or too few rows to tell the data's directions
    if coded_dims is not None and coded_dims >= every:
        return _rotation(dim).to(device)
    variance, axes = _residual_axes(data, metric, device, centres)
    if coded_dims is None:
        # The fewest coordinates, in groups of 32, whose axes leave out at most the allowed share.
        left_out = variance.flip(0).cumsum(0).flip(0)  # left_out[i]: the variance on axes i, i + 1, ...
        coded_dims = next((kept for kept in range(32, every, 32)
                           if left_out[0] > 0 and left_out[kept] <= _INT4_DROPPED_VARIANCE * left_out[0]), every)
        if coded_dims >= every:
            return _rotation(dim).to(device)
    turn = torch.zeros(dim, dim, dtype=torch.float64)
    turn[:, :coded_dims] = axes[:, :coded_dims] @ _rotation(coded_dims).double()
    return turn.float().to(device)


def _residual_axes(data: Tensor, metric: str, device: torch.device, centres: Tensor) -> Tuple[Tensor, Tensor]:
    """(float64 [D] variances, largest first; float64 [D, D] the principal axes in columns) of the
    residuals x - c (each row less its nearest centre), on a fixed-seed sample of the rows (the
    cells' first 65 536). The scatter is summed in float64 (no TF32, and about the same sums on
    either device), the eigendecomposition runs on the CPU and each axis's largest entry is made
    positive: the same rows give the same axes on one device, and axes equal to rounding on
    another."""
    n, dim = data.shape
    generator = torch.Generator().manual_seed(_ROTATION_SEED)
    picked = torch.randperm(n, generator=generator)[:min(n, _CELL_SAMPLE_MIN)].sort().values
    scatter = torch.zeros(dim, dim, dtype=torch.float64, device=device)
    for start in range(0, picked.shape[0], _CHUNK_ROWS):
        x = _prepared(data[picked[start:start + _CHUNK_ROWS].to(data.device)], metric, device)
        e = x.double() - centres.double()[_nearest(x, centres)]
        scatter += e.T @ e
    variance, axes = torch.linalg.eigh(scatter.cpu() / max(1, picked.shape[0]))
    variance, axes = variance.flip(0).clamp_min(0), axes.flip(1)
    largest = axes.gather(0, axes.abs().argmax(0, keepdim=True))
    return variance, axes * torch.where(largest < 0, -1.0, 1.0)


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
    cells = _Int4Cells(grid, metric) if kind == "int4" else None
    coded = cells.coded if cells is not None else None
    out = torch.zeros(n, code_row_bytes(dim, metric, kind, coded), dtype=torch.uint8, device=device)
    for start in range(0, n, _CHUNK_ROWS):
        x = _prepared(rows[start:start + _CHUNK_ROWS], metric, device)
        part = out[start:start + x.shape[0]]
        if kind == "int8":
            _encode_int8(x, grid, metric, part)
        else:
            _encode_int4(x, cells, part)
    return out


def _encode_int8(x: Tensor, grid: Tensor, metric: str, out: Tensor) -> None:
    dim = x.shape[1]
    offset, step = grid[0], grid[1]
    levels = ((x - offset) / step).round_().clamp_(0, 255)
    out[:, :dim] = levels.to(torch.uint8)
    if metric == "l2":
        norm = (levels * step).square().sum(1, dtype=torch.float32)
        out[:, code_dims(dim):code_dims(dim) + 4] = norm.view(torch.uint8).view(-1, 4)


class _Int4Cells:
    """An int4 grid's parts in float64, as every chunk of rows coded on it needs them: the
    rotation, the centres, and the offsets W_j (c_j - c_0 under l2, c_j otherwise) with their
    rotations P W_j and squared norms (csrc/core/codes.h), and the coordinates coded: the
    rotation's first ``kept`` columns, ``coded`` codes a row with the padding."""

    def __init__(self, grid: Tensor, metric: str):
        dim = grid.shape[1]
        self.metric = metric
        self.coded = int4_coded_dims(grid)
        self.kept = min(self.coded, dim)
        self.rotation, self.centres = grid[:dim, :self.kept].double(), grid[dim:].double()
        self.offsets = self.centres - self.centres[0] if metric == "l2" else self.centres
        self.turned = self.offsets @ self.rotation
        self.offset_norms = self.offsets.square().sum(1)


def _encode_int4(x: Tensor, cells: _Int4Cells, out: Tensor) -> None:
    """Codes of the rows x (prepared) on an int4 grid (csrc/core/codes.h): the row's cell j (nearest
    centre) and r = P (x - c_j), its coordinates kept; of the steps tried (multiples of r's RMS),
    the one whose levels v point closest to r's direction; then alpha = |r|^2 / <v, r>, the row's
    constant K and j in the tail. Where the codes leave principal axes out, their part of
    <x - c_j, q - c_j> is taken as 0 and K holds the whole |x - c_j|^2."""
    n = x.shape[0]
    cell = _nearest(x, cells.centres)
    # In float64, so that a row's codes do not depend on the batch it is coded in (a float32
    # product's rounding may follow the matrix's shape).
    e = x.double() - cells.centres[cell]
    r = (e @ cells.rotation).float()
    norm = r.square().sum(1)
    whole = norm if cells.kept == x.shape[1] else e.square().sum(1).float()
    rms = (norm / cells.kept).sqrt().clamp_min(1e-30)

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
    # K (codes.h): l2 |W_j|^2 + |r|^2 + 2 alpha <v, P W_j> with W_j = c_j - c_0; ip and cosine
    # alpha <v, P c_j> - <c_j, e>.
    estimate = alpha.double() * (v.double() * cells.turned[cell]).sum(1)
    if cells.metric == "l2":
        k = cells.offset_norms[cell] + whole.double() + 2 * estimate
    else:
        k = estimate - (cells.centres[cell] * e).sum(1)
    padded = torch.zeros(n, cells.coded, dtype=torch.uint8, device=x.device)
    padded[:, :cells.kept] = best
    packed = padded[:, 0::2] | (padded[:, 1::2] << 4)
    width = packed.shape[1]
    out[:, :width] = packed
    out[:, width:width + 8] = torch.stack([alpha, k.float()], 1).contiguous().view(torch.uint8)
    out[:, width + 8:width + 12] = cell.to(torch.int32)[:, None].view(torch.uint8)


def encode(data: Tensor, kind: str = "int8", *, metric: str = "l2", grid: Optional[Tensor] = None,
           device: Optional[Union[str, torch.device]] = None, cells: Optional[int] = None,
           coded_dims: Optional[int] = None) -> Codes:
    """Codes of the rows of ``data`` for a search under ``metric``: ``kind`` ``"int8"`` (8-bit
    scalar codes, one byte per dimension) or ``"int4"`` (4-bit codes of the rotated rows, half a
    byte per coordinate and 16 bytes per row; needs D >= 2). ``coded_dims`` (int4): the
    coordinates kept, a multiple of 32 (the rows' leading principal axes where it is below the
    dimensions); None (the default): every one, or fewer where the residuals' last principal axes
    hold at most half a percent of their variance (``Codes.coded_dims`` says how many). ``grid``:
    code on this grid (another index's, of the same kind) instead of one fitted to ``data``.
    ``device``: where the codes go
    (data's by default), e.g. the GPU for rows kept in pinned host memory. ``cells`` (int4): the
    cells the rows are coded about, 1 to 4 096: more cells code clustered rows more finely, and
    each query computes one dot product per cell and looks one up per distance. None (the
    default): :func:`default_cells` of them where they take at least half the rows' spread
    (:func:`fit_grid`), else one.

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
    if cells is not None and (kind != "int4" or grid is not None or not isinstance(cells, int)
                              or not 1 <= cells <= MAX_CELLS):
        raise ValueError(f"cells: expected an int in [1, {MAX_CELLS}] for int4 codes on a grid fitted here, got "
                         f"{cells!r} ({kind} codes{', a grid given' if grid is not None else ''})")
    if coded_dims is not None and (kind != "int4" or grid is not None):
        raise ValueError(f"coded_dims: applies to int4 codes on a grid fitted here, got {coded_dims!r} with "
                         f"{kind} codes{', a grid given' if grid is not None else ''}")
    check_coded_dims(coded_dims, data.shape[1])
    if grid is None:
        grid = fit_grid(data, metric, device, kind, cells, coded_dims)
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
    if kind == "int8":
        fits, shape = lambda rows: rows == 2, f"[2, {dim}] (offsets and steps)"
    else:
        fits = lambda rows: dim < rows <= dim + MAX_CELLS  # noqa: E731
        shape = f"[{dim} + C, {dim}] with 1 <= C <= {MAX_CELLS} (rotation and cell centres)"
    if (not isinstance(grid, Tensor) or grid.dtype != torch.float32 or grid.dim() != 2 or grid.shape[1] != dim
            or not fits(grid.shape[0])):
        raise ValueError(f"grid: expected float32 {shape}, got "
                         f"{tuple(grid.shape) if isinstance(grid, Tensor) else type(grid).__name__}")
