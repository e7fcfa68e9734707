"""A training job over several processes: a k-NN graph of the whole data set rebuilt across ranks
every epoch, and retrieval from a memory bank sharded over the ranks.

Each rank makes its own rows (points whose class shows in a few directions under louder noise)
and trains one encoder with the others (DistributedDataParallel). Every epoch:
  1. each rank embeds its rows;
  2. grnnd.distributed.knn_graph finds each row's nearest rows among every rank's embeddings
     (exact, global ids): the k-NN graph of the whole data set;
  3. the graph is mined: neighbours of another class are pushed out beyond a margin, and each row
     is pulled towards a random row of its own class (on any rank).
Then the training embeddings become a grnnd.distributed.ShardedIndex, each rank's shard its own
rows (the memory bank), and every rank's held-out points retrieve their neighbours from all
shards and vote on their class (retrieval-augmented classification).

The run checks its outcome (loss falls, the graph's neighbours become same-class, held-out
accuracy) and every rank exits non-zero if it falls short.

One host with GPUs (NCCL), or CPUs only (gloo):
    torchrun --standalone --nproc_per_node=4 examples/distributed_training.py
    torchrun --standalone --nproc_per_node=2 examples/distributed_training.py --smoke --device cpu
Several hosts (run on each; host 0's address as the endpoint):
    torchrun --nnodes=2 --node_rank=<0 or 1> --nproc_per_node=<GPUs per host> \\
        --rdzv_backend=c10d --rdzv_endpoint=<host 0>:29500 examples/distributed_training.py
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_grnnd as grnnd


def own_rows(n: int, classes: int, dim: int, seed: int, rank: int, device: torch.device):
    """This rank's (points, labels): class centres shared by every rank (same seed), points drawn
    per rank. A class lives in the first 8 directions; the other dim - 8 carry 3x louder noise."""
    shared = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, 8, generator=shared) * 2
    mine = torch.Generator().manual_seed(seed + 1 + rank)
    labels = torch.randint(classes, (n,), generator=mine)
    signal = centres[labels] + 0.5 * torch.randn(n, 8, generator=mine)
    points = torch.cat([signal, 3 * torch.randn(n, dim - 8, generator=mine)], dim=1)
    return points.to(device), labels.to(device)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape on every rank), in rank order: global row ids index it."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="small sizes: a minute on two CPU processes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = grnnd.distributed.init_process_group(args.device)  # NCCL on GPUs, gloo on CPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    n, epochs = (600, 30) if args.smoke else (50_000, 60)  # rows per rank
    classes, k, margin = 10, 10, 1.0
    x, y = own_rows(n + n // 4, classes, 32, args.seed, rank, device)
    x_train, y_train, x_test, y_test = x[:n], y[:n], x[n:], y[n:]
    all_labels = gathered(y_train)  # global row id -> class
    # Each class's global rows, for the random same-class partners.
    order = torch.argsort(all_labels, stable=True)
    counts = torch.bincount(all_labels, minlength=classes)
    starts = torch.cumsum(counts, 0) - counts
    partner_generator = torch.Generator(device=device).manual_seed(args.seed + rank)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    encoder = nn.Sequential(nn.Linear(x.shape[1], 128), nn.ReLU(), nn.Linear(128, 32)).to(device)
    model = DistributedDataParallel(encoder, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    losses, purities = [], []
    for epoch in range(epochs):
        emb = F.normalize(model(x_train), dim=1)
        # The k-NN graph of all ranks' embeddings; the other ranks' rows enter as constants.
        _, neighbours = grnnd.distributed.knn_graph(emb.detach(), k)
        everyone = gathered(emb.detach())
        offset = rank * n
        local = (neighbours >= offset) & (neighbours < offset + n)  # a neighbour on this rank keeps its gradient
        other = torch.where(local[..., None], emb[(neighbours - offset).clamp(0, n - 1)], everyone[neighbours])
        dists = (emb[:, None] - other).pow(2).sum(-1)
        negative = all_labels[neighbours] != y_train[:, None]
        push = torch.where(negative, F.relu(margin - dists), torch.zeros_like(dists)).mean()
        pick = torch.randint(1 << 30, (n,), generator=partner_generator, device=device) % counts[y_train]
        partners = order[starts[y_train] + pick]
        pull = (emb - everyone[partners]).pow(2).sum(1).mean()
        loss = pull + push
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks
        optimizer.step()
        losses.append(mean_over_ranks(loss.item(), device))
        purities.append(mean_over_ranks(1 - negative.float().mean().item(), device))
        if rank == 0 and (epoch % 10 == 0 or epoch == epochs - 1):
            print(f"epoch {epoch:3d}  loss {losses[-1]:.4f}  neighbour purity {purities[-1]:.3f}", flush=True)

    with torch.no_grad():
        bank = grnnd.distributed.ShardedIndex.build(F.normalize(encoder(x_train), dim=1))  # each rank its shard
        _, ids = bank.search(F.normalize(encoder(x_test), dim=1), k)  # global ids over all shards
        predicted = torch.mode(all_labels[ids], dim=1).values
        accuracy = mean_over_ranks((predicted == y_test).float().mean().item(), device)
    if rank == 0:
        print(f"held-out accuracy by retrieval from {world} shards of {n} rows: {accuracy:.3f}", flush=True)

    checks = {f"loss fell only from {losses[0]:.4f} to {losses[-1]:.4f}": losses[-1] < 0.5 * losses[0],
              f"neighbour purity went from {purities[0]:.3f} to {purities[-1]:.3f}":
                  purities[-1] >= 0.9 and purities[-1] > purities[0] + 0.3,
              f"held-out accuracy {accuracy:.3f} < 0.9": accuracy >= 0.9}
    failures = [what for what, passed in checks.items() if not passed]
    # Shut down in order: the DDP model and the index hold the process group's work and buffers,
    # so they go first, and every rank has finished its collectives before any rank destroys the
    # group (a rank that leaves first can close the connection a slower one still tears down).
    del model, bank
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        for failure in failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        if not failures:
            print(f"OK: {world} ranks, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"purity {purities[0]:.3f} -> {purities[-1]:.3f}, accuracy {accuracy:.3f}")
    return 1 if failures else 0  # the same verdict on every rank: its inputs were all-reduced


if __name__ == "__main__":
    verdict = main()
    # Leave without the interpreter's shutdown, once the output is flushed. DistributedDataParallel
    # keeps its process group alive after destroy_process_group (torch 2.13: the group outlives it
    # even when the model is deleted first), so gloo's worker threads are still running when the
    # interpreter shuts down; one that frees a finished collective's tensors then needs the
    # interpreter's lock, and the process aborts after its work is done ("terminate called without
    # an active exception"; 2 runs of 25 on a 2-core CPU, in gloo's run loop under gdb).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(verdict)
