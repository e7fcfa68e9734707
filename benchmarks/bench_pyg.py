"""k-NN graphs of batched point clouds: torch_grnnd.pyg against plain batched torch.cdist + topk.

    python -m benchmarks.bench_pyg --out DIR [--device cpu] [--workloads 32x1024x3x20 ...]

The workloads of PyTorch Geometric's k-NN-graph layers (DGCNN's DynamicEdgeConv and friends):
many small clouds in one batch. For each: the median of 10 timed calls after a warm-up (CUDA
events; the wall clock on the CPU), of
  - torch: cdist + topk on the clouds stacked as [B, n, d] (what PyG users write without
    torch_cluster; every cloud has n points here so the stacking is free);
  - grnnd exact: torch_grnnd.pyg.knn_graph(x, k, batch, batch_size=B), one knn_segments launch
    for the batch;
  - grnnd approximate: the same with approximate=True (a GRNND graph per cloud where clouds
    have more than segments.EXACT_EXAMPLE_ROWS points, else the exact search), recall against
    the exact edges;
  - torch_grnnd.knn_graph(x, k, batch, batch_size=B), exact=True and approximate (its default), which search
    the batch by the same path;
and checks that the exact edges equal torch's (torch is skipped where its [B, n, n] distance
matrix would not fit: 1 x 1M) and torch_grnnd.knn_graph's exact ones. torch_cluster is timed too
where it is installed. Then, on a GPU, a DGCNN forward pass (three PyG EdgeConv layers,
3 -> 64 -> 64 -> 128, k = 20, the graph rebuilt from each layer's features as DynamicEdgeConv
does) with each k-NN source, where torch_geometric is installed. Writes pyg_<gpu>.json and .md
(pyg_cpu_t<threads> on the CPU) under --out.
"""
import argparse
import json
import os

import torch

import torch_grnnd as grnnd
from benchmarks.common import median_ms
from benchmarks.report import machine
from torch_grnnd.pyg import knn_graph

WORKLOADS = [  # clouds, points per cloud, dim, k
    (32, 1024, 3, 20),
    (32, 1024, 64, 20),
    (256, 128, 3, 16),  # these three: where the grid starts to beat the scan
    (128, 256, 3, 16),
    (64, 512, 3, 16),
    (8, 16384, 3, 16),
    (1, 1_000_000, 3, 16),
]
TORCH_MAX_SCORES = 1 << 31  # [B, n, n] float32 distances torch may materialise (8 GiB)


def torch_knn_graph(x: torch.Tensor, clouds: int, k: int) -> torch.Tensor:
    """Edges (neighbour, point) of each cloud's k nearest other points, by cdist + topk."""
    n = x.shape[0] // clouds
    pts = x.view(clouds, n, -1)
    d = torch.cdist(pts, pts)
    idx = d.topk(k + 1, dim=-1, largest=False).indices[..., 1:]  # drop the point itself
    idx = idx + (torch.arange(clouds, device=x.device) * n).view(-1, 1, 1)
    center = torch.arange(x.shape[0], device=x.device).view(clouds, n, 1).expand_as(idx)
    return torch.stack([idx.reshape(-1), center.reshape(-1)])


def edge_keys(edge_index: torch.Tensor, nodes: int) -> torch.Tensor:
    """One int64 per edge (row 0 major), for comparing edge indexes as sets."""
    return edge_index[0] * nodes + edge_index[1]


def same_edges(a: torch.Tensor, b: torch.Tensor, nodes: int) -> bool:
    """Whether two edge indexes hold the same edges, in any order."""
    return a.shape == b.shape and torch.equal(edge_keys(a, nodes).sort().values, edge_keys(b, nodes).sort().values)


def edge_recall(found: torch.Tensor, truth: torch.Tensor, nodes: int) -> float:
    return torch.isin(edge_keys(truth, nodes), edge_keys(found, nodes)).float().mean().item()


DGCNN_CLOUDS, DGCNN_POINTS, DGCNN_K = 32, 1024, 20


def dgcnn_forward_ms() -> dict:
    """Forward time of a DGCNN feature extractor per k-NN source; empty without torch_geometric."""
    try:
        from torch_geometric.nn import EdgeConv
    except ImportError:
        return {}

    def mlp(a, b):
        return torch.nn.Sequential(torch.nn.Linear(2 * a, b), torch.nn.ReLU(), torch.nn.Linear(b, b))

    layers = torch.nn.ModuleList([EdgeConv(mlp(3, 64)), EdgeConv(mlp(64, 64)), EdgeConv(mlp(64, 128))]).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    pos = torch.randn(DGCNN_CLOUDS * DGCNN_POINTS, 3, generator=g, device="cuda")
    batch = torch.arange(DGCNN_CLOUDS, device="cuda").repeat_interleave(DGCNN_POINTS)
    sources = {
        "torch cdist + topk": lambda h: torch_knn_graph(h, DGCNN_CLOUDS, DGCNN_K),
        "torch_grnnd.pyg.knn_graph": lambda h: knn_graph(h, DGCNN_K, batch, batch_size=DGCNN_CLOUDS),
    }
    try:
        import torch_cluster
        sources["torch_cluster.knn_graph"] = lambda h: torch_cluster.knn_graph(h, DGCNN_K, batch, batch_size=DGCNN_CLOUDS)
    except ImportError:
        pass

    def forward(source):
        h = pos
        with torch.no_grad():
            for layer in layers:
                h = layer(h, source(h))
        return h

    return {name: median_ms(lambda: forward(source)) for name, source in sources.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--workloads", nargs="+", metavar="BxNxDxK",
                        help="clouds x points x dim x k of the workloads to run (default: all)")
    args = parser.parse_args()
    device = args.device
    try:
        import torch_cluster
    except ImportError:
        torch_cluster = None
    workloads = WORKLOADS
    if args.workloads:
        workloads = [tuple(int(v) for v in w.split("x")) for w in args.workloads]
    rows = []
    for clouds, n, dim, k in workloads:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(clouds * n, dim, generator=g, device=device)
        batch = torch.arange(clouds, device=device).repeat_interleave(n)
        row = {"clouds": clouds, "points": n, "dim": dim, "k": k}
        repeat = 10 if clouds * n * n <= TORCH_MAX_SCORES else 3

        def ms(fn, times=repeat):
            return median_ms(fn, times, device)

        row["exact_ms"] = ms(lambda: knn_graph(x, k, batch, batch_size=clouds))
        # The op's two exact paths (what "auto" chooses between), queries = points.
        ptr = torch.arange(clouds + 1, device=device) * n
        for method in ("scan", "grid"):
            if method == "grid" and (dim > 3 or k > 32):
                continue
            row[f"{method}_op_ms"] = ms(lambda: torch.ops.grnnd.knn_segments(x, x, ptr, batch, k + 1, method=method))
        exact = knn_graph(x, k, batch, batch_size=clouds)
        if clouds * n * n <= TORCH_MAX_SCORES:
            row["torch_ms"] = ms(lambda: torch_knn_graph(x, clouds, k), 10)
            reference = torch_knn_graph(x, clouds, k)
            # cdist's rounding can swap near-ties, so compare as sets and report the overlap.
            row["exact_vs_torch_overlap"] = edge_recall(exact, reference, x.shape[0])
            row["speedup_exact_vs_torch"] = row["torch_ms"] / row["exact_ms"]
        row["approximate_ms"] = ms(lambda: knn_graph(x, k, batch, batch_size=clouds, approximate=True), 3)
        row["approximate_recall"] = edge_recall(knn_graph(x, k, batch, approximate=True), exact, x.shape[0])
        # torch_grnnd.knn_graph: the same search of the batch, given the number of clouds as pyg's is.
        row["grnnd_exact_ms"] = ms(lambda: grnnd.knn_graph(x, k, batch, exact=True, batch_size=clouds))
        row["grnnd_exact_equals_pyg"] = same_edges(grnnd.knn_graph(x, k, batch, exact=True), exact, x.shape[0])
        row["grnnd_approximate_ms"] = ms(lambda: grnnd.knn_graph(x, k, batch, batch_size=clouds), 3)
        row["grnnd_approximate_recall"] = edge_recall(grnnd.knn_graph(x, k, batch), exact, x.shape[0])
        # torch_cluster's CUDA kernel scans every row of an example for every query: 1 x 1M would
        # take minutes, so it runs where torch's distance matrix would fit too.
        if torch_cluster is not None and clouds * n * n <= TORCH_MAX_SCORES:
            row["torch_cluster_ms"] = ms(lambda: torch_cluster.knn_graph(x, k, batch, batch_size=clouds))
            row["exact_equals_torch_cluster"] = same_edges(exact, torch_cluster.knn_graph(x, k, batch), x.shape[0])
            row["speedup_exact_vs_torch_cluster"] = row["torch_cluster_ms"] / row["exact_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    dgcnn = dgcnn_forward_ms() if device == "cuda" else {}
    result = {"machine": machine(threads=torch.get_num_threads(), cuda=device == "cuda"), "workloads": rows,
              "dgcnn": dgcnn}
    os.makedirs(args.out, exist_ok=True)
    if device == "cuda":
        where, timing = torch.cuda.get_device_name(), "CUDA events"
        name = "pyg_" + where.split()[1].lower()
    else:
        where, timing = f"CPU, {torch.get_num_threads()} threads", "wall clock"
        name = f"pyg_cpu_t{torch.get_num_threads()}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# k-NN graphs of batched point clouds, {where}", "",
             f"Median of 10 calls (3 for approximate), {timing}; `python -m benchmarks.bench_pyg`.", "",
             "| clouds x points, d, k | torch cdist + topk ms | grnnd exact ms | speed-up | exact = torch edges "
             "| grnnd approximate ms (recall) | torch_cluster ms | vs torch_cluster | exact = torch_cluster edges "
             "| op: scan ms | op: grid ms | grnnd.knn_graph exact ms | = pyg edges "
             "| grnnd.knn_graph approximate ms (recall) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nan = float("nan")
    for r in rows:
        lines.append(f"| {r['clouds']} x {r['points']}, {r['dim']}, {r['k']} | {r.get('torch_ms', nan):.3f} | "
                     f"{r['exact_ms']:.3f} | {r.get('speedup_exact_vs_torch', nan):.1f}x | "
                     f"{r.get('exact_vs_torch_overlap', nan):.4f} | "
                     f"{r['approximate_ms']:.1f} ({r['approximate_recall']:.3f}) | "
                     f"{r.get('torch_cluster_ms', nan):.3f} | {r.get('speedup_exact_vs_torch_cluster', nan):.1f}x | "
                     f"{r.get('exact_equals_torch_cluster', '')} | {r.get('scan_op_ms', nan):.3f} | "
                     f"{r.get('grid_op_ms', nan):.3f} | {r['grnnd_exact_ms']:.3f} | {r['grnnd_exact_equals_pyg']} | "
                     f"{r['grnnd_approximate_ms']:.1f} ({r['grnnd_approximate_recall']:.3f}) |")
    if dgcnn:
        lines += ["", f"DGCNN forward pass ({DGCNN_CLOUDS} clouds x {DGCNN_POINTS} points, three EdgeConv layers, "
                      f"k = {DGCNN_K}, graph rebuilt per layer), median of 10, ms:", "",
                  "| k-NN source | forward ms |", "|---|---:|"]
        lines += [f"| {source} | {ms:.3f} |" for source, ms in dgcnn.items()]
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
