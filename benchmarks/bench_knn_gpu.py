"""Exact knn and all-points knn_graph on one CUDA device, against plain PyTorch in the same run.

    python -m benchmarks.bench_knn_gpu --data .data/text/embeddings.pt --out DIR
    python -m benchmarks.bench_knn_gpu --data clustered:n=1000000,d=384,clusters=1000,queries=10000

Measures (CUDA events, after a warm-up; extension compile excluded):
  - knn, k = 10, all queries in one call, float32 and float16 storage, against plain-PyTorch brute
    force (x_norm - 2 q @ X.T + topk in query chunks) of the same dtype: QPS and recall@10
    against float32 exact truth;
  - knn_graph, k = --graph-k, approximate (defaults) and exact, against the plain-PyTorch exact
    k-NN graph (float16 matmul + topk): seconds and recall@10 of each row's first 10 neighbours
    against the exact path (whose own recall is checked by float32 brute force on sampled rows).
Writes gpu_knn_<data>.{json,md,png} under --out.
"""
import argparse

import torch

import torch_grnnd as grnnd
from benchmarks.common import brute_force, cuda_time, exact_knn_graph
from benchmarks.datasets import load_data
from benchmarks.report import machine, write


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=384,clusters=1000,queries=10000")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--graph-k", type=int, default=32)
    p.add_argument("--skip-graph", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the CUDA kernels of one knn call")
    args = p.parse_args()
    name, base, queries, gt = load_data(args.data, "cuda")
    print(f"{name}: base {tuple(base.shape)} {base.dtype}, queries {tuple(queries.shape)} on "
          f"{torch.cuda.get_device_name()}", flush=True)
    nq = queries.shape[0]

    methods = []
    for dtype in (torch.float32, torch.float16):
        x, q = base.to(dtype), queries.to(dtype)
        brute_force(x, q[:1000], 10, dtype)
        ref_ids, ref_s = cuda_time(lambda: brute_force(x, q, 10, dtype))
        if gt is None and dtype == torch.float32:
            gt = ref_ids
        grnnd.knn(x, q[:1000], 10)
        (_, ids), secs = cuda_time(lambda: grnnd.knn(x, q, 10))
        for label, found, s in ((f"PyTorch brute force {str(dtype)[6:]}", ref_ids, ref_s),
                                (f"torch_grnnd knn {str(dtype)[6:]}", ids, secs)):
            r = grnnd.recall(found, gt, 10)
            methods.append({"name": label, "build_s": 0.0, "curve": [{"param": "exact", "recall": r, "qps": nq / s}]})
            print(f"{label}: recall@10 {r:.4f} {nq / s:12,.0f} q/s", flush=True)
        print(f"  knn speed-up over PyTorch at {dtype}: {ref_s / secs:.2f}x", flush=True)
        del x, q

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for dtype in (torch.float32, torch.float16):
            x, q = base.to(dtype), queries.to(dtype)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                grnnd.knn(x, q, 10)
                torch.cuda.synchronize()
            print(f"knn {dtype} kernels:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=8),
                  flush=True)
            del x, q

    tables = []
    if not args.skip_graph:
        k = args.graph_k
        n = base.shape[0]
        grnnd.knn_graph(base[:50_000], k, exact=True)
        ei, exact_s = cuda_time(lambda: grnnd.knn_graph(base, k, exact=True))
        truth = ei[0].view(n, k)
        # The exact path checked against float32 brute force on sampled rows (self dropped).
        sample = torch.randperm(n, device=base.device)[:10_000]
        brute = brute_force(base, base[sample], k + 1, torch.float32)
        brute = torch.stack([row[row != s][:k] for row, s in zip(brute, sample)])
        exact_recall = grnnd.recall(truth[sample], brute, 10)
        exact_knn_graph(base[:50_000], k)
        torch_graph, torch_s = cuda_time(lambda: exact_knn_graph(base, k))
        grnnd.knn_graph(base[:50_000], k)
        ei, approx_s = cuda_time(lambda: grnnd.knn_graph(base, k))
        rows = [["PyTorch exact (float16 matmul + topk)", torch_s, grnnd.recall(torch_graph, truth, 10), 1.0],
                ["torch_grnnd exact=True", exact_s, exact_recall, torch_s / exact_s],
                ["torch_grnnd approximate (defaults)", approx_s, grnnd.recall(ei[0].view(n, k), truth, 10),
                 torch_s / approx_s]]
        for row in rows:
            print(f"knn_graph {row[0]}: {row[1]:.3f} s, recall@10 {row[2]:.4f}, {row[3]:.2f}x PyTorch", flush=True)
        tables.append({"title": f"knn_graph of all {n:,} points, k = {k}. recall@10 of each row's first 10 against "
                                "the exact graph (exact=True, itself checked against float32 brute force on 10,000 "
                                "sampled rows):",
                       "columns": ["method", "seconds", "recall@10", "speed-up"], "rows": rows})

    results = {"title": f"GPU exact knn and knn_graph, {name}", "data": f"{name} {tuple(base.shape)} {base.dtype}",
               "machine": machine(threads=torch.get_num_threads(), cuda=True), "methods": methods, "tables": tables}
    for path in write(args.out, f"gpu_knn_{name}", results):
        print("wrote", path)


if __name__ == "__main__":
    main()
