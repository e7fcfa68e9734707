"""Nearest hubs, as the build's cells need them, on one GPU: the fused product against the
score matrix.

    python -m benchmarks.bench_hubs --out DIR
    python -m benchmarks.bench_hubs --sizes 10000000x128,4000000x384 --out DIR

For each N x D: N random float16 rows, and for every row its nearest hubs among the N / 1000 of
the build (torch_grnnd.diagnostics.nearest_hubs with the rows as queries). Two hubs, as the
build's cells take them, go through the fused product where csrc/build/hubs.h allows it (D <= 512);
three go through grnnd's score matrix and one-pass selection (the path the build took for two
before the fused product, whose selection of three costs a little more); the baseline is plain
PyTorch: float32 scores by torch.mm in chunks of 2^26 and topk. Each is timed with CUDA events
after a first untimed call; "agree" is the share of rows whose two nearest hubs the fused product
and the baseline choose alike. Writes gpu_hubs.{json,md} under --out.
"""

import torch

import torch_grnnd as grnnd
from benchmarks.common import cuda_time
from benchmarks.report import sized_gpu_run


def plain_torch(x: torch.Tensor, hubs: torch.Tensor, k: int) -> torch.Tensor:
    """The k nearest hubs of each row, as plain PyTorch computes them: chunks of float32 scores."""
    bias = hubs.float().pow(2).sum(1)
    chunk = max(1, (1 << 26) // hubs.shape[0])
    return torch.cat([torch.topk(bias - 2 * torch.mm(x[i:i + chunk], hubs.T, out_dtype=torch.float32), k, dim=1,
                                 largest=False).indices for i in range(0, x.shape[0], chunk)])


def measure(n: int, d: int) -> dict:
    x = torch.randn(n, d, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).half()
    hub_ids = grnnd.diagnostics.hubs(x)
    row = {"n": n, "d": d, "hubs": int(hub_ids.numel())}
    runs = {"two_s": lambda: grnnd.diagnostics.nearest_hubs(x, x, 2),
            "three_s": lambda: grnnd.diagnostics.nearest_hubs(x, x, 3),
            "torch_s": lambda: hub_ids[plain_torch(x, x[hub_ids], 2)]}
    out = {}
    for key, run in runs.items():
        run()
        out[key], row[key] = cuda_time(run)
    row["agree"] = (out["two_s"] == out["torch_s"]).all(dim=1).double().mean().item()
    print(f"N={n:>10,} D={d:>5} hubs={row['hubs']:>6,}: two {row['two_s']:.3f} s, three {row['three_s']:.3f} s, "
          f"plain PyTorch {row['torch_s']:.3f} s, agree {row['agree']:.5f}", flush=True)
    return row


def main():
    results, base, lines = sized_gpu_run(__doc__, "10000000x128,4000000x384,4000000x512,4000000x1024", measure,
                                         "Nearest hubs on the GPU", "gpu_hubs")
    rows = results["rows"]
    lines += ["Random float16 rows, each row's nearest of the N / 1000 hubs: two through the fused product "
              "(D <= 512), three through grnnd's score matrix, two by plain PyTorch (torch.mm, topk); "
              "`python -m benchmarks.bench_hubs`.", "",
              "| N | D | hubs | grnnd, two nearest s | grnnd, three nearest s | plain PyTorch, two s | same two hubs |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['n']:,} | {r['d']} | {r['hubs']:,} | {r['two_s']:.3f} | {r['three_s']:.3f} | "
              f"{r['torch_s']:.3f} | {r['agree']:.5f} |" for r in rows]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", base + ".json", base + ".md")


if __name__ == "__main__":
    main()
