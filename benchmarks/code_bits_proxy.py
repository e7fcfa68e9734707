#!/usr/bin/env python3
"""How many candidates codes of fewer bits than int4's need: recall@10 after an exact re-rank of
the R rows nearest by each code's l2 estimate, every row scored (no graph), for 4, 3, 2 and 1
bits a rotated coordinate.

    python -m benchmarks.code_bits_proxy [--data clustered|lowrank] [--rows N] [--dim D]

The codes are int4's (csrc/core/codes.h) with other level counts: the rows less their cell's
centre, turned by the same rotation and cells (``codes.fit_grid(kind="int4")``), coded with a step
per row (the best of 60 multiples of the row's RMS by the cosine of levels and row; 1 bit: the
signs), the estimate |q - c_j|^2 + |r|^2 - 2 alpha <v, P (q - c_j)> in float32. A graph search
re-ranks its final list the same way, so a code that needs twice R here needs about twice the
list there. A proxy on the CPU: no search kernel runs.
"""
import argparse

import torch

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


def levels(r: torch.Tensor, bits: int) -> torch.Tensor:
    """v (levels less their half range) of each row of r, the step chosen per row."""
    if bits == 1:
        return torch.sign(r) * 0.5
    top = 2 ** bits - 1
    norm = r.norm(dim=1)
    rms = (norm / r.shape[1] ** 0.5).clamp_min(1e-30)
    best_cos, best = torch.full((r.shape[0],), -2.0), torch.zeros_like(r)
    for multiple in torch.linspace(0.05, 3.0, 60):
        v = (r / (rms * multiple)[:, None] + top / 2).round().clamp(0, top) - top / 2
        cos = (v * r).sum(1) / (v.norm(dim=1) * norm).clamp_min(1e-30)
        better = cos > best_cos
        best_cos, best[better] = torch.where(better, cos, best_cos), v[better]
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered", choices=["clustered", "lowrank"])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=300)
    args = p.parse_args()
    base, queries = rows_and_queries(args.data, args.rows, args.dim, args.queries)
    cells = codes._Int4Cells(codes.fit_grid(base, "l2", kind="int4"), "l2")
    cell = codes._nearest(base, cells.centres)
    r = ((base.double() - cells.centres[cell]) @ cells.rotation).float()
    exact = torch.cdist(queries, base).square()
    truth = exact.topk(10, largest=False).indices
    about = (queries.double()[:, None, :] - cells.centres[None]).float()  # q - c_j, every cell
    turned = about @ cells.rotation.float()
    print(f"{args.data} {args.rows} x {args.dim}, {cells.centres.shape[0]} cells, {args.queries} queries")
    lists = (10, 16, 32, 64, 128, 256)
    for bits in (4, 3, 2, 1):
        v = levels(r, bits)
        alpha = r.square().sum(1) / (v * r).sum(1)
        estimate = torch.stack([about[i, cell].square().sum(1) + r.square().sum(1)
                                - 2 * alpha * (v * turned[i, cell]).sum(1) for i in range(len(queries))])
        found = []
        for size in lists:
            candidates = estimate.topk(size, largest=False).indices
            best = candidates.gather(1, exact.gather(1, candidates).topk(10, largest=False).indices)
            found.append((best[:, :, None] == truth[:, None, :]).any(-1).float().mean().item())
        print(f"{bits} bits ({bits * args.dim // 8} B of codes a row): "
              + " ".join(f"R {size} {rec:.3f}" for size, rec in zip(lists, found)), flush=True)


if __name__ == "__main__":
    main()
