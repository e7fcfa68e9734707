"""GPU build and search benchmark on one CUDA device, with plain-PyTorch baselines in the same run.

    python benchmarks/bench_gpu.py --data clustered:n=1000000,d=128,clusters=1000,queries=10000 --out DIR
    python benchmarks/bench_gpu.py --data .data/text/embeddings.pt --ablation --out DIR

Measures (CUDA events, after a warm-up; extension compile excluded):
  - plain PyTorch brute force (x_norm - 2 q @ X.T + topk) at float32 / float16: QPS and recall@10;
  - torch_grnnd build time, peak extra GPU memory, out-degree;
  - torch_grnnd search QPS-recall@10 curve at batch --batch, sweeping list_size (and search_width);
  - with --ablation: update order and reverse_ratio sweeps (build time, recall at list 64);
  - with --exact-graph: plain-PyTorch exact k-NN graph (k = degree) of all points, float16;
  - with --small-batches: wall-clock latency of batches of 1, 100 and 1000 queries.
Writes gpu_<data>.{json,md,png} under --out.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_grnnd as grnnd  # noqa: E402
from benchmarks.report import machine, write  # noqa: E402


def cuda_time(fn, repeat: int = 1):
    """(result, seconds per call) by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) / 1000 / repeat


def load_data(spec: str, device: str):
    if spec.startswith("clustered"):
        kv = dict(item.split("=", 1) for item in spec.partition(":")[2].split(",") if item)
        n, d = int(kv.get("n", 1_000_000)), int(kv.get("d", 128))
        clusters, nq = int(kv.get("clusters", 1000)), int(kv.get("queries", 10_000))
        g = torch.Generator(device=device).manual_seed(int(kv.get("seed", 0)))
        centres = torch.randn(clusters, d, generator=g, device=device) * 3
        labels = torch.randint(clusters, (n + nq,), generator=g, device=device)
        x = centres[labels] + torch.randn(n + nq, d, generator=g, device=device)
        x = x.half()
        return f"clustered-{n // 1000}k-d{d}-c{clusters}", x[:n].contiguous(), x[n:].contiguous(), None
    blob = torch.load(spec, map_location=device)
    gt = blob.get("gt")
    return os.path.splitext(os.path.basename(spec))[0], blob["base"].contiguous(), blob["queries"].contiguous(), gt


def brute_force(base: torch.Tensor, queries: torch.Tensor, k: int, dtype: torch.dtype, chunk: int = 2048):
    """Plain PyTorch exact search: ||x||^2 - 2 q.X^T per query chunk, then topk."""
    x = base.to(dtype)
    x_norm = x.float().pow(2).sum(1)
    ids = []
    for q in queries.to(dtype).split(chunk):
        scores = x_norm - 2 * (q @ x.T).float()
        ids.append(scores.topk(k, dim=1, largest=False).indices)
    return torch.cat(ids)


def exact_knn_graph(base: torch.Tensor, k: int, chunk: int = 4096):
    """Plain PyTorch exact k-NN graph of all rows (self excluded), float16 matmul."""
    x_norm = base.float().pow(2).sum(1)
    out = []
    for s in range(0, base.shape[0], chunk):
        q = base[s:s + chunk]
        scores = x_norm - 2 * (q @ base.T).float()
        scores[torch.arange(q.shape[0], device=q.device), torch.arange(s, s + q.shape[0], device=q.device)] = float("inf")
        out.append(scores.topk(k, dim=1, largest=False).indices)
    return torch.cat(out)


def search_curve(base, graph, queries, gt, batch, lists, widths):
    curve = []
    q = queries[:batch]
    for width in widths:
        for lst in lists:
            run = lambda: grnnd.search(base, graph, q, 10, list_size=lst, search_width=width)  # noqa: E731
            run()
            (_, ids), secs = cuda_time(run, repeat=3)
            curve.append({"param": f"list={lst},width={width}", "recall": grnnd.recall(ids, gt[:batch], 10),
                          "qps": q.shape[0] / secs})
            print(f"  search list={lst:4d} width={width}: recall@10 {curve[-1]['recall']:.4f} "
                  f"{curve[-1]['qps']:12,.0f} q/s", flush=True)
    return curve


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=128,clusters=1000,queries=10000")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--lists", default="16,24,32,48,64,96,128,192,256")
    p.add_argument("--widths", default="1")
    p.add_argument("--ablation", action="store_true")
    p.add_argument("--exact-graph", action="store_true")
    p.add_argument("--small-batches", action="store_true", help="latency of batches of 1, 100 and 1000")
    p.add_argument("--build", default="", help="build params, e.g. pool_size=64,inner_iters=8")
    args = p.parse_args()
    device = "cuda"
    name, base, queries, gt = load_data(args.data, device)
    print(f"{name}: base {tuple(base.shape)} {base.dtype}, queries {tuple(queries.shape)} on "
          f"{torch.cuda.get_device_name()}", flush=True)

    methods, extra = [], {}
    # Baselines: plain PyTorch brute force; float32 is also the ground truth when none was given.
    for dtype in (torch.float32, torch.float16):
        brute_force(base, queries[:1000], 10, dtype)
        ids, secs = cuda_time(lambda: brute_force(base, queries, 10, dtype))
        if gt is None and dtype == torch.float32:
            gt = ids
        r = grnnd.recall(ids, gt, 10)
        methods.append({"name": f"PyTorch brute force {str(dtype)[6:]}", "build_s": 0.0,
                        "curve": [{"param": "exact", "recall": r, "qps": queries.shape[0] / secs}]})
        print(f"brute force {dtype}: recall {r:.4f} {queries.shape[0] / secs:,.0f} q/s", flush=True)
    gt = gt.to(device)

    params = {k: (float(v) if "." in v else int(v) if v.lstrip("-").isdigit() else v)
              for k, v in (kv.split("=") for kv in args.build.split(",") if kv)}
    grnnd.build(base[:100_000], **params)  # warm-up: kernel load, allocator
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph, build_s = cuda_time(lambda: grnnd.build(base, **params))
    peak = torch.cuda.max_memory_allocated() - before
    degree = (graph >= 0).sum(1).float()
    print(f"grnnd build: {build_s:.3f} s, peak extra {peak / 2**20:.0f} MiB, degree mean {degree.mean():.1f} "
          f"min {degree.min():.0f}", flush=True)
    extra["build"] = {"seconds": build_s, "peak_extra_bytes": peak, "degree_mean": degree.mean().item(),
                      "params": params, "data_bytes": base.numel() * base.element_size()}
    lists = [int(s) for s in args.lists.split(",")]
    widths = [int(s) for s in args.widths.split(",")]
    methods.append({"name": "torch_grnnd (GRNND graph + CUDA search)", "build_s": build_s, "params": params,
                    "curve": search_curve(base, graph, queries, gt, args.batch, lists, widths)})

    if args.small_batches:
        # Latency as a caller sees it: back-to-back calls from Python, wall clock, synchronised.
        rows = []
        for lst in (64, 96, 128):
            for batch in (1, 100, 1000):
                q = queries[:batch]
                run = lambda: grnnd.search(base, graph, q, 10, list_size=lst)  # noqa: E731
                run()
                torch.cuda.synchronize()
                calls = 200 if batch < 1000 else 50
                start = time.perf_counter()
                for _ in range(calls):
                    _, ids = run()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) / calls * 1000
                rows.append([lst, batch, ms, batch / ms * 1000, grnnd.recall(ids, gt[:batch], 10)])
                print(f"  small batch list={lst} batch={batch}: {ms:.3f} ms/call, {rows[-1][3]:,.0f} q/s, "
                      f"recall@10 {rows[-1][4]:.4f}", flush=True)
        extra.setdefault("tables", []).append({
            "title": "Small batches, back-to-back calls of torch.ops.grnnd.search from Python (wall clock):",
            "columns": ["list", "batch", "ms per call", "queries/s", "recall@10"], "rows": rows})

    if args.ablation:
        rows = []
        for order in ("random", "ascending", "descending"):
            for rho in ((0.2, 0.4, 0.6, 0.8, 1.0) if order == "random" else (0.6,)):
                g, secs = cuda_time(lambda: grnnd.build(base, **{**params, "update_order": order, "reverse_ratio": rho}))
                _, ids = grnnd.search(base, g, queries[:args.batch], 10, list_size=64)
                rows.append({"update_order": order, "reverse_ratio": rho, "build_s": secs,
                             "recall_list64": grnnd.recall(ids, gt[:args.batch], 10)})
                print(f"  ablation {order:10s} rho={rho}: {secs:.3f} s recall@10(list 64) "
                      f"{rows[-1]['recall_list64']:.4f}", flush=True)
        extra["ablation"] = rows

    if args.exact_graph:
        k = int(params.get("degree", 32))
        exact_knn_graph(base[:50_000], k)
        _, secs = cuda_time(lambda: exact_knn_graph(base, k))
        extra["exact_knn_graph_s"] = secs
        print(f"plain PyTorch exact k-NN graph (k={k}, float16): {secs:.2f} s", flush=True)

    results = {"title": f"GPU build + search, {name}", "data": f"{name} {tuple(base.shape)} {base.dtype}",
               "machine": machine(threads=torch.get_num_threads(), cuda=True), "methods": methods, **extra}
    for path in write(args.out, f"gpu_{name}", results):
        print("wrote", path)


if __name__ == "__main__":
    main()
