"""How the CUDA build's time and memory grow with N and D, on one GPU.

    python -m benchmarks.bench_build_scaling --out DIR
    python -m benchmarks.bench_build_scaling --sizes 100000x384,1000000x384 --out DIR

For each N x D: clustered float16 rows (N / 1000 clusters, benchmarks/bench_gpu.py's generator,
made on the GPU), a warm-up build on the first 100k rows, then the build timed with CUDA events;
its peak extra GPU memory against the issue's bound (data + 2 * N * pool_size * 8 bytes, + 10%),
and the recall@10 of 1000 held-out queries searched at list 64, against exact results from
torch_grnnd.knn (exact; checked against faiss-cpu in tests/test_knn.py). Writes
gpu_build_scaling.{json,md} under --out.
"""

import torch

import torch_grnnd as grnnd
from benchmarks.common import cuda_time
from benchmarks.datasets import load_data
from benchmarks.report import sized_gpu_run

POOL_SIZE = 48  # the build's default R, for the memory bound


def measure(n: int, d: int) -> dict:
    name, base, queries, _ = load_data(f"clustered:n={n},d={d},clusters={max(n // 1000, 10)},queries=1000", "cuda")
    truth = grnnd.knn(base, queries, 10)[1]
    grnnd.build(base[:100_000])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph, secs = cuda_time(lambda: grnnd.build(base))
    peak = torch.cuda.max_memory_allocated() - before
    data_bytes = base.numel() * base.element_size()
    bound = 1.1 * (data_bytes + 2 * n * POOL_SIZE * 8)
    _, ids = grnnd.search(base, graph, queries, 10, list_size=64)
    row = {"n": n, "d": d, "data": name, "build_s": secs, "peak_extra_bytes": peak, "bound_bytes": bound,
           "recall_list64": grnnd.recall(ids, truth, 10)}
    print(f"N={n:>9,} D={d:>5}: build {secs:.3f} s, peak extra {peak / 2**20:,.0f} MiB "
          f"(bound {bound / 2**20:,.0f} MiB), recall@10 at list 64 {row['recall_list64']:.4f}", flush=True)
    del base, queries, graph
    torch.cuda.empty_cache()
    return row


def main():
    results, base, lines = sized_gpu_run(
        __doc__, "100000x384,1000000x384,4000000x384,1000000x96,1000000x128,1000000x1024", measure,
        "CUDA build scaling", "gpu_build_scaling")
    rows = results["rows"]
    lines += ["Clustered float16 rows (N / 1000 clusters), default build parameters, L2; recall@10 of 1000 "
              "held-out queries at list 64 against exact results.", "",
              "| N | D | build s | peak extra GPU MiB | bound MiB | recall@10 |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['n']:,} | {r['d']} | {r['build_s']:.3f} | {r['peak_extra_bytes'] / 2**20:,.0f} | "
              f"{r['bound_bytes'] / 2**20:,.0f} | {r['recall_list64']:.4f} |" for r in rows]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", base + ".json", base + ".md")


if __name__ == "__main__":
    main()
