"""Metric learning on a k-NN graph of the embeddings, rebuilt every epoch.

Each point's class lives in a few directions of its features; loud nuisance directions hide it,
so at first a point's nearest neighbours are of any class. Every epoch the encoder embeds all
points, grnnd.nn.KNNGraph rebuilds the k-NN graph of the embeddings, and the graph is mined:
neighbours of another class are hard negatives, pushed out beyond a margin, while each point is
pulled towards a random point of its own class. The negatives' distances come straight from the
graph op and carry gradients into the encoder. A grnnd.nn.Retriever, rebuilt on the training
embeddings, then classifies held-out points by their nearest neighbours.

The run checks its own outcome (loss falls, neighbour purity rises, held-out accuracy) and
exits non-zero if it falls short.

    python examples/train_loop.py                        # 20 000 points, CUDA if available
    python examples/train_loop.py --smoke --device cpu   # a few seconds on a laptop CPU
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import torch_grnnd as grnnd


def hidden_classes(n: int, classes: int, signal_dim: int, noise_dim: int, generator: torch.Generator):
    """Points whose class shows in `signal_dim` directions under `noise_dim` louder ones, mixed
    by a random rotation so that no single feature gives the class away."""
    centres = torch.randn(classes, signal_dim, generator=generator) * 2
    labels = torch.randint(classes, (n,), generator=generator)
    signal = centres[labels] + 0.5 * torch.randn(n, signal_dim, generator=generator)
    nuisance = 3 * torch.randn(n, noise_dim, generator=generator)
    rotation = torch.linalg.qr(torch.randn(signal_dim + noise_dim, signal_dim + noise_dim, generator=generator))[0]
    return torch.cat([signal, nuisance], dim=1) @ rotation, labels


def same_class_partners(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For every point, a random other point of its class (itself in a class of one)."""
    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels)
    first = torch.cumsum(counts, 0) - counts  # where each class starts in `order`
    size = counts[labels]
    offset = torch.randint(1 << 30, labels.shape, generator=generator, device=labels.device) % size
    return order[first[labels] + offset]


def neighbour_purity(edge_index: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of k-NN edges that join two points of the same class."""
    return (labels[edge_index[0]] == labels[edge_index[1]]).float().mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a quick check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, epochs = (800, 40) if args.smoke else (20_000, 60)
    classes, k, margin = 10, 10, 1.0
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    x, labels = hidden_classes(n + n // 4, classes, signal_dim=8, noise_dim=24, generator=generator)
    x, labels = x.to(device), labels.to(device)
    x_train, y_train, x_test, y_test = x[:n], labels[:n], x[n:], labels[n:]

    encoder = nn.Sequential(nn.Linear(x.shape[1], 128), nn.ReLU(), nn.Linear(128, 32)).to(device)
    optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-2)
    knn = grnnd.nn.KNNGraph(k=k)  # l2 on unit-norm embeddings: distances in [0, 4]
    partner_generator = torch.Generator(device=device).manual_seed(args.seed)

    losses, purities = [], []
    for epoch in range(epochs):
        emb = F.normalize(encoder(x_train), dim=1)
        edge_index, dists = knn(emb)  # the graph of this epoch's embeddings
        negative = y_train[edge_index[0]] != y_train[edge_index[1]]
        # Hinge on the mined hard negatives, averaged over all edges: it fades as they leave.
        push = torch.where(negative, F.relu(margin - dists), torch.zeros_like(dists)).mean()
        partners = same_class_partners(y_train, partner_generator)
        pull = (emb - emb[partners]).pow(2).sum(1).mean()
        loss = pull + push
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        purities.append(neighbour_purity(edge_index, y_train))
        if epoch % 10 == 0 or epoch == epochs - 1:
            print(f"epoch {epoch:3d}  loss {losses[-1]:.4f}  neighbour purity {purities[-1]:.3f}")

    with torch.no_grad():
        retriever = grnnd.nn.Retriever(k=k).to(device)
        retriever.rebuild(F.normalize(encoder(x_train), dim=1))
        _, ids = retriever(F.normalize(encoder(x_test), dim=1))
        predicted = torch.mode(y_train[ids], dim=1).values
        accuracy = (predicted == y_test).float().mean().item()
    print(f"held-out k-NN accuracy {accuracy:.3f} ({len(y_test)} points, {retriever})")

    failures = []
    if not losses[-1] < 0.5 * losses[0]:
        failures.append(f"loss fell only from {losses[0]:.4f} to {losses[-1]:.4f}")
    if not (purities[-1] >= 0.9 and purities[-1] > purities[0] + 0.3):
        failures.append(f"neighbour purity went from {purities[0]:.3f} to {purities[-1]:.3f}")
    if not accuracy >= 0.9:
        failures.append(f"held-out accuracy {accuracy:.3f} < 0.9")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if not failures:
        print(f"OK: loss {losses[0]:.4f} -> {losses[-1]:.4f}, purity {purities[0]:.3f} -> {purities[-1]:.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
