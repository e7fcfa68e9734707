"""Manifold learning: the k-NN graph of a point cloud -> a spectral embedding (Laplacian eigenmaps).

Points on a Swiss roll (a rolled-up rectangle in 3-D, randomly rotated into --dim dimensions)
are linked to their k nearest neighbours by grnnd.nn.KNNGraph; heat-kernel weights on the edges
make an affinity matrix whose leading eigenvectors unroll the sheet. The first coordinate of the
embedding should follow the position along the roll (t): the run checks the rank correlation
and exits non-zero if the roll did not unroll. With matplotlib installed it writes a PNG of the
roll and its embedding, coloured by t.

    python examples/manifold.py                                  # 4 000 points, CUDA if available
    python examples/manifold.py --smoke --device cpu --out /tmp/roll.png
"""
import argparse
import math
import sys

import torch

import torch_grnnd as grnnd


def swiss_roll(n: int, dim: int, noise: float, generator: torch.Generator):
    """(points [n, dim], t [n]): the roll (t cos t, h, t sin t) with t in [1.5 pi, 4.5 pi], h in
    [0, 21], plus noise, rotated into `dim` dimensions."""
    t = 1.5 * math.pi * (1 + 2 * torch.rand(n, generator=generator, dtype=torch.float64))
    h = 21 * torch.rand(n, generator=generator, dtype=torch.float64)
    roll = torch.stack([t * torch.cos(t), h, t * torch.sin(t)], dim=1)
    roll = roll + noise * torch.randn(n, 3, generator=generator, dtype=torch.float64)
    rotation = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))[0]
    return (torch.nn.functional.pad(roll, (0, dim - 3)) @ rotation).float(), t


def spectral_embedding(edge_index: torch.Tensor, dists: torch.Tensor, n: int, components: int) -> torch.Tensor:
    """Laplacian eigenmaps from a k-NN graph with squared distances on its edges."""
    scale = dists.median()
    affinity = torch.zeros(n, n, dtype=torch.float64, device=dists.device)
    affinity[edge_index[0], edge_index[1]] = torch.exp(-dists.double() / scale)
    affinity = torch.maximum(affinity, affinity.T)  # k-NN is not symmetric; the graph must be
    inv_sqrt_degree = affinity.sum(1).rsqrt()
    normalised = inv_sqrt_degree[:, None] * affinity * inv_sqrt_degree[None, :]
    # Dense and exact: fine up to some thousands of points (O(n^3)); for more, use a sparse
    # solver such as torch.lobpcg on the same matrix.
    _, vectors = torch.linalg.eigh(normalised)
    # The largest eigenvalue's vector is the trivial sqrt(degree) one; the next ones unroll.
    leading = vectors[:, -1 - components:-1].flip(1)
    return (leading * inv_sqrt_degree[:, None]).float()


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho of two 1-D tensors (no ties expected)."""
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()


def save_png(path: str, points: torch.Tensor, t: torch.Tensor, embedding: torch.Tensor) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return
    colour = t.cpu().numpy()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    projected = points.cpu() @ torch.linalg.svd(points.cpu() - points.cpu().mean(0), full_matrices=False)[2][:2].T
    left.scatter(projected[:, 0], projected[:, 1], c=colour, s=4, cmap="viridis")
    left.set_title("input (first two principal components)")
    e = embedding.cpu()
    right.scatter(e[:, 0], e[:, 1], c=colour, s=4, cmap="viridis")
    right.set_title("spectral embedding of the k-NN graph")
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a quick check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=16, help="ambient dimension the roll is rotated into")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out", default="manifold.png", help="PNG path (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = 1_000 if args.smoke else 4_000

    points, t = swiss_roll(n, args.dim, noise=0.3, generator=torch.Generator().manual_seed(args.seed))
    points = points.to(args.device)
    edge_index, dists = grnnd.nn.KNNGraph(k=args.k)(points)
    embedding = spectral_embedding(edge_index, dists, n, components=2)
    rho = rank_correlation(embedding[:, 0].cpu(), t.float())
    print(f"{n} points in {args.dim}-D, {edge_index.shape[1]} k-NN edges; "
          f"rank correlation of the first coordinate with the position along the roll: {rho:+.3f}")
    save_png(args.out, points, t, embedding)

    if abs(rho) < 0.95:
        print(f"FAILED: |rank correlation| {abs(rho):.3f} < 0.95: the roll did not unroll", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
