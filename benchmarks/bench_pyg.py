"""k-NN graphs of batched point clouds: torch_grnnd.pyg against plain batched torch.cdist + topk.

    python benchmarks/bench_pyg.py --out DIR

The workloads of PyTorch Geometric's k-NN-graph layers (DGCNN's DynamicEdgeConv and friends):
many small clouds in one batch. For each: the median of 10 timed calls after a warm-up (CUDA
events), of
  - torch: cdist + topk on the clouds stacked as [B, n, d] (what PyG users write without
    torch_cluster; every cloud has n points here so the stacking is free);
  - grnnd exact: torch_grnnd.pyg.knn_graph(x, k, batch, batch_size=B), one knn_segments call for
    the batch (a CPU kernel so far: the time includes the copies to the host and back);
  - grnnd approximate: the same with approximate=True (a GRNND graph per cloud), recall against
    the exact edges;
and checks that the exact edges equal torch's. torch_cluster is timed too where it is installed.
Writes pyg_<gpu>.json and .md under --out.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import machine  # noqa: E402
from torch_grnnd.pyg import knn_graph  # noqa: E402

WORKLOADS = [  # clouds, points per cloud, dim, k
    (32, 1024, 3, 20),
    (32, 1024, 64, 20),
    (8, 16384, 3, 16),
]


def median_ms(fn, repeat: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def torch_knn_graph(x: torch.Tensor, clouds: int, k: int) -> torch.Tensor:
    """Edges (neighbour, point) of each cloud's k nearest other points, by cdist + topk."""
    n = x.shape[0] // clouds
    pts = x.view(clouds, n, -1)
    d = torch.cdist(pts, pts)
    idx = d.topk(k + 1, dim=-1, largest=False).indices[..., 1:]  # drop the point itself
    idx = idx + (torch.arange(clouds, device=x.device) * n).view(-1, 1, 1)
    center = torch.arange(x.shape[0], device=x.device).view(clouds, n, 1).expand_as(idx)
    return torch.stack([idx.reshape(-1), center.reshape(-1)])


def edge_recall(found: torch.Tensor, truth: torch.Tensor, nodes: int) -> float:
    key = lambda e: e[0] * nodes + e[1]  # noqa: E731
    return torch.isin(key(truth), key(found)).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    try:
        import torch_cluster
    except ImportError:
        torch_cluster = None
    rows = []
    for clouds, n, dim, k in WORKLOADS:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(clouds * n, dim, generator=g, device="cuda")
        batch = torch.arange(clouds, device="cuda").repeat_interleave(n)
        row = {"clouds": clouds, "points": n, "dim": dim, "k": k}
        row["torch_ms"] = median_ms(lambda: torch_knn_graph(x, clouds, k))
        row["exact_ms"] = median_ms(lambda: knn_graph(x, k, batch, batch_size=clouds))
        exact = knn_graph(x, k, batch, batch_size=clouds)
        reference = torch_knn_graph(x, clouds, k)
        # cdist's rounding can swap near-ties, so compare as sets and report the overlap.
        row["exact_vs_torch_overlap"] = edge_recall(exact, reference, x.shape[0])
        row["approximate_ms"] = median_ms(lambda: knn_graph(x, k, batch, batch_size=clouds, approximate=True), 3)
        row["approximate_recall"] = edge_recall(knn_graph(x, k, batch, approximate=True), exact, x.shape[0])
        if torch_cluster is not None:
            row["torch_cluster_ms"] = median_ms(lambda: torch_cluster.knn_graph(x, k, batch))
        row["speedup_exact_vs_torch"] = row["torch_ms"] / row["exact_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine(threads=torch.get_num_threads(), cuda=True), "workloads": rows}
    os.makedirs(args.out, exist_ok=True)
    name = "pyg_" + torch.cuda.get_device_name().split()[1].lower()
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# k-NN graphs of batched point clouds, {torch.cuda.get_device_name()}", "",
             "Median of 10 calls (3 for approximate), CUDA events; `python benchmarks/bench_pyg.py`.", "",
             "| clouds x points, d, k | torch cdist + topk ms | grnnd exact ms | speed-up | exact = torch edges "
             "| grnnd approximate ms (recall) | torch_cluster ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['clouds']} x {r['points']}, {r['dim']}, {r['k']} | {r['torch_ms']:.3f} | "
                     f"{r['exact_ms']:.3f} | {r['speedup_exact_vs_torch']:.1f}x | {r['exact_vs_torch_overlap']:.4f} | "
                     f"{r['approximate_ms']:.1f} ({r['approximate_recall']:.3f}) | "
                     f"{r.get('torch_cluster_ms', float('nan')):.3f} |")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
