"""What the content checks of the CUDA search cost, next to the search itself (same run, one GPU).

    python -m benchmarks.bench_checks --n 1000000 --dim 384 --out DIR

The search checks its inputs' values (csrc/core/checks.cpp, csrc/cuda/search_cuda.cu):
  - on every call, that the queries are finite: a fill of one int64, one kernel over the queries
    queued before the search, and one host synchronisation after it to read the answer;
  - once per graph and version, that every graph id lies in [-1, N): aminmax over the graph and a
    synchronisation.
Timed here:
  - search: back-to-back calls on an already checked graph (checks included), host wall clock;
  - the query check's upper bound: a one-element fill, isfinite over the queries, all() and a
    synchronisation, run alone from Python (one kernel more than the search runs, plus Python's
    per-op overhead, which the C++ path has not);
  - the graph scan alone, and the first search of a fresh copy of the graph against a checked one.
Writes checks_<n>k-d<dim>.json and .md under --out.
"""
import argparse
import json
import os
import time

import torch

import torch_grnnd as grnnd
from benchmarks.report import machine


def wall_ms(fn, repeat: int) -> float:
    """Milliseconds per call, host wall clock around `repeat` calls that each end synchronised."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / repeat


def query_check(queries: torch.Tensor) -> bool:
    # At least the work the search adds for its query check (see the module docstring).
    torch.full((1,), queries.shape[0], dtype=torch.int64, device=queries.device)
    return bool(torch.isfinite(queries).all().item())


def graph_scan(graph: torch.Tensor) -> tuple:
    lo, hi = torch.aminmax(graph)
    return int(lo.item()), int(hi.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--batches", default="1,100,10000")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    g = torch.Generator(device="cuda").manual_seed(0)
    clusters = max(args.n // 1000, 1)
    centres = torch.randn(clusters, args.dim, generator=g, device="cuda") * 3
    rows = centres[torch.randint(clusters, (args.n + 10_000,), generator=g, device="cuda")]
    x = (rows + torch.randn(rows.shape, generator=g, device="cuda")).half()
    data, all_queries = x[: args.n].contiguous(), x[args.n:].contiguous()
    graph = grnnd.build(data)
    torch.cuda.synchronize()

    rows_out = []
    for batch in (int(b) for b in args.batches.split(",")):
        queries = all_queries[:batch]
        repeat = 200 if batch <= 100 else 20
        search = wall_ms(lambda: grnnd.search(data, graph, queries, 10, list_size=64), repeat)
        check = wall_ms(lambda: query_check(queries), repeat)
        rows_out.append({"batch": batch, "search_ms": search, "query_check_ms": check,
                         "query_check_share": check / search})
        print(f"batch {batch}: search {search:.4f} ms per call, query check bound {check:.4f} ms "
              f"({100 * check / search:.2f}% of the search)", flush=True)

    queries = all_queries
    scan = wall_ms(lambda: graph_scan(graph), 20)
    copies = [graph.clone() for _ in range(5)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for copy in copies:
        grnnd.search(data, copy, queries, 10, list_size=64)
    torch.cuda.synchronize()
    first = (time.perf_counter() - start) * 1000 / len(copies)
    steady = next(r["search_ms"] for r in rows_out if r["batch"] == 10_000) if any(
        r["batch"] == 10_000 for r in rows_out) else wall_ms(lambda: grnnd.search(data, graph, queries, 10), 20)
    print(f"graph scan alone {scan:.4f} ms; first search of a graph {first:.4f} ms against {steady:.4f} ms "
          f"for a checked graph (batch {queries.shape[0]})", flush=True)

    result = {"machine": machine(threads=1, cuda=True), "n": args.n, "dim": args.dim, "dtype": "float16",
              "degree": graph.shape[1], "batches": rows_out, "graph_scan_ms": scan,
              "first_search_ms": first, "checked_search_ms": steady}
    os.makedirs(args.out, exist_ok=True)
    name = f"checks_{args.n // 1000}k-d{args.dim}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    gpu = result["machine"].get("gpu", "GPU")
    lines = [f"# Cost of the search's input checks, {args.n} x {args.dim} float16, degree {graph.shape[1]}", "",
             f"GPU {gpu}, torch {torch.__version__}; list 64, k 10; host wall clock per call, synchronised.", "",
             "| batch | search ms (checks included) | query check bound ms | share |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['search_ms']:.4f} | {r['query_check_ms']:.4f} | "
              f"{100 * r['query_check_share']:.2f}% |" for r in rows_out]
    lines += ["", f"Graph id scan alone: {scan:.4f} ms, once per graph and version. First search of a fresh "
              f"graph at batch {queries.shape[0]}: {first:.4f} ms; of a checked one: {steady:.4f} ms.", ""]
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
