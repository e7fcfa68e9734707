#!/usr/bin/env python3
"""How many candidates codes of fewer bits than int4's need: recall@10 after an exact re-rank of
the R rows nearest by each code's l2 estimate, every row scored (no graph), for 4, 3, 2 and 1
bits a rotated coordinate.

    python -m benchmarks.code_bits_proxy [--data clustered|lowrank|FAMILY:NxD|FILE.pt] [--rows N] [--dim D]

The codes are int4's (csrc/core/codes.h) with other level counts: the rows less their cell's
centre, turned by the same rotation and cells (``codes.fit_grid(kind="int4")``), coded with a step
per row (the best of 60 multiples of the row's RMS by the cosine of levels and row; 1 bit: the
signs), the estimate |q - c_j|^2 + |r|^2 - 2 alpha <v, P (q - c_j)> in float32. A graph search
re-ranks its final list the same way, so a code that needs twice R here needs about twice the
list there. A proxy on the CPU: no search kernel runs. A last line scores int4 as ``grnnd.encode``
chooses its coordinates: where it keeps only the leading principal axes (``codes.int4_coded_dims``),
those axes coded with 4 bits and the rest left out, on the same cells.

``--transform`` adds codes that spend their bits where the residuals vary: the coordinates
turned to the principal axes of the residuals (about their cells), each axis given 0-4 bits
within a budget of bytes a row, by greedy reverse water-filling (the next bit to the axis whose
quantisation error, variance x 4^-bits, is largest) and, where the budget lies between 3 and 4
bits a coordinate, by two levels (the leading axes 4 bits, the rest 3), and truncated (the
leading axes 4 bits, the rest none: what int4 codes do where those axes hold little); then a random rotation
within each group of axes of equal bits (``--axes-only``: none), coded with a step per row times
a step per group (its spread over its levels); the same estimate. ``--data FILE.pt`` reads real
embeddings ({"base", "queries"}, benchmarks/embed_cpu.py).
"""
import argparse

import torch

from benchmarks.datasets import make_set
from torch_grnnd import codes


def rows_and_queries(kind: str, n: int, d: int, nq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "clustered":  # 300 Gaussian blobs, centres spread by 3
        centres = torch.randn(300, d, generator=g) * 3
        x = centres[torch.randint(300, (n + nq,), generator=g)] + torch.randn(n + nq, d, generator=g)
    else:  # rank-48 signal plus noise, normalised: a stand-in for sentence embeddings
        z = torch.randn(n + nq, 48, generator=g) @ torch.randn(48, d, generator=g)
        z += 0.6 * torch.randn(n + nq, d, generator=g)
        x = z / z.norm(dim=1, keepdim=True)
    return x[:n].contiguous(), x[n:].contiguous()


def levels(r: torch.Tensor, bits, spread=None) -> torch.Tensor:
    """v (levels less their half range) of each row of r, the step chosen per row; ``bits`` one
    count for every coordinate, or a [D] tensor of counts (0: the coordinate is dropped) with
    ``spread`` [D] the coordinates' standard deviations: an axis's step is then its spread over
    its levels, times the row's multiple. Returned in units of the row's step (times the axis's
    step where steps differ), which the estimate's alpha rescales."""
    if isinstance(bits, int) and bits == 1:
        return torch.sign(r) * 0.5
    top = (2.0 ** torch.as_tensor(bits, dtype=torch.float32) - 1) * torch.ones(r.shape[1])
    norm = r.norm(dim=1)
    if spread is None:
        step, row = torch.ones(r.shape[1]), (norm / r.shape[1] ** 0.5).clamp_min(1e-30)
    else:
        # A spread-less axis (rows of lower rank) keeps a finite step: its levels are 0.
        step = (spread / top.clamp_min(1)).clamp_min(1e-6 * float(spread.max()))
        row = (norm / float(spread.square().sum()) ** 0.5).clamp_min(1e-30) * 4  # about +-2 spreads at 1x
    best_cos, best = torch.full((r.shape[0],), -2.0), torch.zeros_like(r)
    for multiple in torch.linspace(0.05, 3.0, 60):
        v = (r / (row * multiple)[:, None] / step + top / 2).round().clamp_min(0)
        v = (torch.minimum(v, top) - top / 2) * step
        cos = (v * r).sum(1) / (v.norm(dim=1) * norm).clamp_min(1e-30)
        better = cos > best_cos
        best_cos, best[better] = torch.where(better, cos, best_cos), v[better]
    return best


def water_filling(variance: torch.Tensor, budget_bits: int, most: int = 4) -> torch.Tensor:
    """Bits per axis, 0 to ``most``, summing to ``budget_bits``: each next bit to the axis whose
    quantisation error (variance x 4^-bits) is largest."""
    bits = torch.zeros(variance.shape[0], dtype=torch.long)
    error = variance.clone().double()
    for _ in range(min(budget_bits, most * variance.shape[0])):
        axis = int(error.argmax())
        bits[axis] += 1
        error[axis] = -1.0 if bits[axis] == most else error[axis] / 4
    return bits


def group_rotation(bits: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A random rotation within each group of axes that share a bit count (block-diagonal in
    the axes' order): inside a group the coordinates become alike and near Gaussian, as int4's
    rotation makes all of them, while the groups keep the bits the allocation gave them."""
    g = torch.Generator().manual_seed(seed)
    turn = torch.zeros(bits.shape[0], bits.shape[0])
    for count in bits.unique():
        idx = (bits == count).nonzero().flatten()
        q, _ = torch.linalg.qr(torch.randn(len(idx), len(idx), generator=g, dtype=torch.float64))
        turn[idx[:, None], idx[None, :]] = q.float()
    return turn


def group_spread(variance: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Each axis's spread after group_rotation: the root of its group's mean variance."""
    spread = torch.empty_like(variance)
    for count in bits.unique():
        idx = bits == count
        spread[idx] = variance[idx].mean().sqrt()
    return spread


def recall_by_candidates(estimate, exact, truth, lists) -> list:
    found = []
    for size in lists:
        candidates = estimate.topk(size, largest=False).indices
        best = candidates.gather(1, exact.gather(1, candidates).topk(10, largest=False).indices)
        found.append((best[:, :, None] == truth[:, None, :]).any(-1).float().mean().item())
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered",
                   help="clustered, lowrank, a scale family as FAMILY:NxD (benchmarks/datasets.py, made on the CPU), "
                   "or a .pt file of embeddings")
    p.add_argument("--bits", default="4,3,2,1", help="the bit counts of the int4-style lines")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--transform", default="", help="comma-separated budgets in bytes of codes a row, e.g. 176,144")
    p.add_argument("--axes-only", action="store_true", help="--transform without the rotation within bit groups")
    args = p.parse_args()
    if args.data.endswith(".pt"):
        blob = torch.load(args.data)
        base = blob["base"][:args.rows].float().contiguous()
        queries = blob["queries"][:args.queries].float().contiguous()
    elif ":" in args.data:
        family, shape = args.data.split(":")
        rows, dim = (int(v) for v in shape.split("x"))
        base, queries = (part.float().contiguous() for part in
                         make_set(family, rows, dim, queries=args.queries, device="cpu"))
    else:
        base, queries = rows_and_queries(args.data, args.rows, args.dim, args.queries)
    # Every coordinate coded, on the random rotation: the int4 codes the transforms are set against.
    every = codes.code_dims(base.shape[1], "int4")
    cells = codes._Int4Cells(codes.fit_grid(base, "l2", kind="int4", coded_dims=every), "l2")
    cell = codes._nearest(base, cells.centres)
    r = ((base.double() - cells.centres[cell]) @ cells.rotation).float()
    exact = torch.cdist(queries, base).square()
    truth = exact.topk(10, largest=False).indices
    about = (queries.double()[:, None, :] - cells.centres[None]).float()  # q - c_j, every cell
    turned = about @ cells.rotation.float()
    dim = base.shape[1]
    print(f"{args.data} {base.shape[0]} x {dim}, {cells.centres.shape[0]} cells, {queries.shape[0]} queries")
    lists = (10, 16, 32, 64, 128, 256)

    def estimate_of(res, v, turned_queries, whole=None):
        """The l2 estimate with alpha from the coded coordinates res and the row's squared norm
        ``whole`` (res's own where every coordinate is coded)."""
        alpha = res.square().sum(1) / (v * res).sum(1)
        norm = res.square().sum(1) if whole is None else whole
        return torch.stack([about[i, cell].square().sum(1) + norm
                            - 2 * alpha * (v * turned_queries[i, cell]).sum(1) for i in range(len(queries))])

    for bits in (int(b) for b in args.bits.split(",")):
        found = recall_by_candidates(estimate_of(r, levels(r, bits), turned), exact, truth, lists)
        print(f"{bits} bits ({bits * dim // 8} B of codes a row): "
              + " ".join(f"R {size} {rec:.3f}" for size, rec in zip(lists, found)), flush=True)
    # int4 as grnnd.encode chooses its coordinates (codes.int4_coded_dims): where it keeps fewer
    # than every one, the leading principal axes on the same cells, the rest left out.
    chosen = codes._Int4Cells(codes.fit_grid(base, "l2", kind="int4", cells=cells.centres.shape[0]), "l2")
    if chosen.kept == dim:
        print("int4 as encode chooses: every coordinate (the 4-bit line)", flush=True)
    else:
        kept = ((base.double() - chosen.centres[cell]) @ chosen.rotation).float()
        found = recall_by_candidates(estimate_of(kept, levels(kept, 4), (about.double() @ chosen.rotation).float(),
                                                 whole=r.square().sum(1)), exact, truth, lists)
        print(f"int4 as encode chooses, {chosen.kept} of {dim} coordinates ({chosen.coded // 2} B of codes a row): "
              + " ".join(f"R {size} {rec:.3f}" for size, rec in zip(lists, found)), flush=True)
    if args.transform:
        variance, axes = torch.linalg.eigh(r.double().T @ r.double() / r.shape[0])
        variance, axes = variance.flip(0).clamp_min(0).float(), axes.flip(1).float()  # largest first
        share = variance.cumsum(0) / variance.sum()
        print(f"residual variance on the first 10% / 25% / 50% of the axes: {share[dim // 10 - 1]:.2f} / "
              f"{share[dim // 4 - 1]:.2f} / {share[dim // 2 - 1]:.2f}; on the last 32 / 64 axes: "
              f"{1 - share[dim - 33]:.4f} / {1 - share[dim - 65]:.4f}")
        for budget in (int(b) for b in args.transform.split(",")):
            allocations = [("water-filling", water_filling(variance, 8 * budget))]
            if 3 * dim <= 8 * budget <= 4 * dim:  # the leading axes 4 bits, the rest 3
                allocations.append(("two levels", (torch.arange(dim) < 8 * budget - 3 * dim).long() + 3))
            if 8 * budget <= 4 * dim:  # 4 bits on the leading axes, none on the rest (int4_coded_dims)
                allocations.append(("truncated", (torch.arange(dim) < 2 * budget).long() * 4))
            for name, bits in allocations:
                turn = axes if args.axes_only else axes @ group_rotation(bits).T
                spread = variance.sqrt() if args.axes_only else group_spread(variance, bits)
                r_turned, q_turned = r @ turn, turned @ turn
                v = levels(r_turned, bits, spread)
                found = recall_by_candidates(estimate_of(r_turned, v, q_turned), exact, truth, lists)
                counts = " ".join(f"{int((bits == b).sum())} x {b}" for b in range(4, -1, -1) if (bits == b).any())
                print(f"transform, {budget} B of codes a row, {name} ({counts} bits): "
                      + " ".join(f"R {size} {rec:.3f}" for size, rec in zip(lists, found)), flush=True)

if __name__ == "__main__":
    main()
