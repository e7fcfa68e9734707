"""GPU build and search benchmark on one CUDA device, with plain-PyTorch baselines in the same run.

    python -m benchmarks.bench_gpu --data clustered:n=1000000,d=128,clusters=1000,queries=10000 --out DIR
    python -m benchmarks.bench_gpu --data .data/text/embeddings.pt --ablation --out DIR
    python -m benchmarks.bench_gpu --data .data/text/embeddings.pt:pca=128 --small-batches --out DIR
    python -m benchmarks.bench_gpu --data zipf:2000000x128 --out DIR

--data: clustered blobs (``clustered:n=,d=,clusters=,queries=``), one of bench_scale.py's families
made on the GPU with 10 000 queries (``blobs:NxD``, ``zipf:NxD``, ``aniso:NxD``), or a file of
embeddings (``path[:pca=D]``).

Measures (CUDA events, after a warm-up; extension compile excluded):
  - plain PyTorch brute force (x_norm - 2 q @ X.T + topk) at float32 / float16: QPS and recall@10;
  - torch_grnnd build time, peak extra GPU memory, out-degree;
  - torch_grnnd search QPS-recall@10 curve at batch --batch, sweeping list_size (and search_width),
    with the distances computed per query (search_distance_counts), the row bytes they read and
    that traffic's share of the GPU's peak memory bandwidth;
  - with --codes int8: the same curve searching by 8-bit codes (grnnd.encode) on the same graph;
  - with --ablation: update order (the three of the paper, and descending_then_random) and
    reverse_ratio sweeps (build time, recall at list 64);
  - with --sweep CFG ...: the same for any build configurations (e.g. "update_order=descending,
    inner_iters=4"), plus search QPS and distances per query at list 64;
  - with --exact-graph: plain-PyTorch exact k-NN graph (k = degree) of all points, float16;
  - with --small-batches: wall-clock latency of batches of 1, 10, 100 and 1000 queries, for each
    list size and number of searches per query (--split-searches; 0 = the automatic choice), by
    the rows and by each of --codes.
With --compare PREVIOUS.json (a run of the same data on the same GPU model), every point more
than 5% slower at equal recall is listed (a table of the report, REGRESSION lines) and the run
exits with status 3: run it before and after a change to the build or the search. --compare
latest takes the newest result under --out of the same data, GPU model and build settings (by
the commit that last changed it), the previous committed run of this benchmark.
A data path may end in ``:pca=D``: base and queries projected on the base's top D principal
directions (fitted on a 100k-row sample) and normalised again, a lower-dimensional real set.
Writes gpu_<data>.{json,md,png} under --out.
"""
import argparse
import json
import sys

import torch

import torch_grnnd as grnnd
from benchmarks.common import back_to_back_ms, brute_force, cuda_time, exact_knn_graph, parse_settings
from benchmarks.datasets import load_data
from benchmarks.report import latest_result, machine, regression_table, regressions, write


def bytes_per_query(base, dists_per_query: float, list_size: int, codes=None) -> float:
    """Row bytes a query reads: each distance's row (its code row with codes, whose final list
    is then re-ranked by the full rows). Adjacency rows and the query itself not counted."""
    row = base.shape[1] * base.element_size()
    if codes is None:
        return dists_per_query * row
    return dists_per_query * codes.rows.shape[1] + list_size * row


def memory_bandwidth() -> float:
    """The GPU's peak memory bandwidth in bytes/s (from its clock and bus width; 0 if unknown)."""
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8


def code_spec(spec: str):
    """(kind, cells, coded_dims) of a --codes entry: "int8", "int4" (cells and coordinates None:
    the defaults), "int4@C" (C cells), "int4/K" (K coordinates, K = D rounded up to 32: every
    one) or "int4@C/K"."""
    spec, _, coded = spec.partition("/")
    kind, _, cells = spec.partition("@")
    return kind, int(cells) if cells else None, int(coded) if coded else None


def code_label(codes) -> str:
    """The kind; for int4 codes about C > 1 cells "int4@C" (about one centre: "int4", the codes
    of earlier versions), and "/K" where they keep K coordinates, fewer than the rows have."""
    if codes.kind != "int4":
        return codes.kind
    label = codes.kind if codes.cells == 1 else f"{codes.kind}@{codes.cells}"
    every = grnnd.codes.code_dims(codes.grid.shape[1], "int4")
    return label if codes.coded_dims == every else f"{label}/{codes.coded_dims}"


def search_curve(base, graph, queries, gt, batch, lists, widths, codes=None):
    curve = []
    q = queries[:batch]
    peak = memory_bandwidth()
    for width in widths:
        for lst in lists:
            run = lambda: grnnd.search(base, graph, q, 10, list_size=lst, search_width=width, codes=codes)  # noqa: E731
            run()
            (_, ids), secs = cuda_time(run, repeat=3)
            counts = grnnd.search_distance_counts(base, graph, q, 10, list_size=lst, search_width=width, codes=codes)
            dists = counts.float().mean().item()
            qps = q.shape[0] / secs
            read = bytes_per_query(base, dists, lst, codes)
            shown = width if width > 0 else "auto"
            curve.append({"param": f"list={lst},width={shown}", "recall": grnnd.recall(ids, gt[:batch], 10),
                          "qps": qps, "dists_per_query": dists, "bytes_per_query": read,
                          "bandwidth_share": read * qps / peak if peak else 0.0})
            label = f" {code_label(codes)}" if codes is not None else ""
            print(f"  search{label} list={lst:4d} width={shown}: recall@10 "
                  f"{curve[-1]['recall']:.4f} {qps:12,.0f} q/s, {dists:,.0f} distances/query, "
                  f"{read / 1e6:.2f} MB/query, {curve[-1]['bandwidth_share']:.0%} of peak bandwidth", flush=True)
    return curve


def build_sweep(base, queries, gt, configs, batch):
    """Build time, recall@10, QPS and distances per query at list 64 for each configuration."""
    rows = []
    q, truth = queries[:batch], gt[:batch]
    for text in configs:
        cfg = parse_settings(text)
        graph, secs = cuda_time(lambda: grnnd.build(base, **cfg))
        run = lambda: grnnd.search(base, graph, q, 10, list_size=64)  # noqa: E731
        run()
        (_, ids), search_s = cuda_time(run, repeat=3)
        counts = grnnd.search_distance_counts(base, graph, q, 10, list_size=64)
        rows.append([text or "defaults", secs, grnnd.recall(ids, truth, 10), q.shape[0] / search_s,
                     counts.float().mean().item()])
        print(f"  sweep {rows[-1][0]}: build {secs:.3f} s, recall@10 (list 64) {rows[-1][2]:.4f}, "
              f"{rows[-1][3]:,.0f} q/s, {rows[-1][4]:,.0f} distances/query", flush=True)
        del graph
    return {"title": f"Build configurations: build time, and the search at list 64, batch {batch}:",
            "columns": ["build parameters", "build s", "recall@10", "queries/s", "distances/query"], "rows": rows}


def small_batches(base, graph, queries, gt, lists, searches, batches=(1, 10, 100, 1000), spread=1000, codes=None):
    """Latency as a caller sees it: back-to-back calls from Python, wall clock, synchronised (the
    median of five timings).

    Consecutive calls take consecutive slices of the first ``spread`` queries (at least one
    batch), so the recall of a batch of 1 is measured over many queries, not one."""
    rows = []
    for batch in batches:
        slices = [queries[s:s + batch] for s in range(0, max(spread, batch), batch)]
        truth = gt[:len(slices) * batch]
        for lst in lists:
            for split in searches:
                run = lambda q: grnnd.search(base, graph, q, 10, list_size=lst, searches=split,  # noqa: E731
                                             codes=codes)
                ids = [run(q)[1] for q in slices]  # warm-up, and the answers recall is measured on
                ms = back_to_back_ms(run, slices, max(1, 200 // len(slices)) * len(slices), torch.device("cuda"))
                counts = torch.cat([grnnd.search_distance_counts(base, graph, q, 10, list_size=lst, searches=split,
                                                                 codes=codes) for q in slices])
                rows.append([code_label(codes) if codes is not None else "none", batch, lst, split or "auto", ms,
                             batch / ms * 1000,
                             grnnd.recall(torch.cat(ids), truth, 10), counts.float().mean().item()])
                print(f"  small batch codes={rows[-1][0]} batch={batch} list={lst} searches={split or 'auto'}: "
                      f"{ms:.3f} ms/call, {rows[-1][5]:,.0f} q/s, recall@10 {rows[-1][6]:.4f}, "
                      f"{rows[-1][7]:,.0f} distances/query", flush=True)
    return {"title": "Small batches, back-to-back calls of torch.ops.grnnd.search from Python (wall clock); "
                     "recall over the first 1000 queries, taken a batch per call:",
            "columns": ["codes", "batch", "list", "searches", "ms per call", "queries/s", "recall@10",
                        "distances/query"],
            "rows": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=1000000,d=128,clusters=1000,queries=10000")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--lists", default="16,24,32,48,64,96,128,192,256")
    p.add_argument("--widths", default="0", help="search widths of the curves (0 = automatic, the default)")
    p.add_argument("--ablation", action="store_true")
    p.add_argument("--exact-graph", action="store_true")
    p.add_argument("--small-batches", action="store_true", help="latency of batches of 1, 10, 100 and 1000")
    p.add_argument("--small-lists", default="10,16,24,32,64", help="list sizes of --small-batches")
    p.add_argument("--split-searches", default="0,1", help="searches per query of --small-batches (0 = auto)")
    p.add_argument("--build", default="", help="build params, e.g. pool_size=64,inner_iters=8")
    p.add_argument("--codes", default="", help="comma-separated code kinds to search by as well, same graph: "
                   "int8, int4, int4@C for int4 codes about C cells, int4/K for K coordinates (int4: as grnnd.encode "
                   "chooses)")
    p.add_argument("--compare", default="", help="a previous run's JSON (same data, same GPU model), or 'latest': "
                   "the newest result under --out of this data, GPU model and build settings (report.latest_result); "
                   "flag every point more than 5%% slower at equal recall, and exit with status 3 if there is one")
    p.add_argument("--sweep", nargs="*", default=[], help="build configurations to compare, each like --build")
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

    params = parse_settings(args.build)
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
                    "bytes_per_vector": graph.shape[1] * 4 + base.shape[1] * base.element_size(),
                    "curve": search_curve(base, graph, queries, gt, args.batch, lists, widths)})
    code_sets = [None]
    for spec in filter(None, args.codes.split(",")):
        kind, cells, coded = code_spec(spec)
        codes, encode_s = cuda_time(lambda: grnnd.encode(base, kind, cells=cells, coded_dims=coded))
        code_sets.append(codes)
        print(f"grnnd encode {spec}: {encode_s:.3f} s, {codes.rows.shape[1]} bytes per row"
              f"{f', {codes.cells} cells' if kind == 'int4' else ''}", flush=True)
        methods.append({"name": f"torch_grnnd, {code_label(codes)} codes + exact re-rank",
                        "build_s": build_s + encode_s,
                        "params": {**params, "codes": kind, "cells": codes.cells}, "encode_s": encode_s,
                        "bytes_per_vector": graph.shape[1] * 4 + codes.rows.shape[1],
                        "curve": search_curve(base, graph, queries, gt, args.batch, lists, widths, codes)})

    if args.small_batches:
        for codes in code_sets:
            extra.setdefault("tables", []).append(small_batches(
                base, graph, queries, gt, [int(v) for v in args.small_lists.split(",")],
                [int(v) for v in args.split_searches.split(",")], codes=codes))

    if args.sweep:
        extra.setdefault("tables", []).append(build_sweep(base, queries, gt, args.sweep, args.batch))

    if args.ablation:
        rows = []
        for order in ("random", "ascending", "descending", "descending_then_random"):
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
    found = []
    previous = latest_result(args.out, results) if args.compare == "latest" else args.compare
    if args.compare and previous is None:
        print(f"--compare latest: no result in {args.out} of this data, GPU model and build settings", flush=True)
    elif previous:
        with open(previous) as f:
            found = regressions(results, json.load(f))
        results.setdefault("tables", []).append(regression_table(found, previous))
        for row in found:
            print(f"REGRESSION {row[0]}: recall@10 {row[1]:.4f}, {row[2]:,.0f} -> {row[3]:,.0f} ({row[4]:.2f}x)")
        print(f"against {previous}: {len(found)} points more than 5% slower at equal recall", flush=True)
    for path in write(args.out, f"gpu_{name}", results):
        print("wrote", path)
    if found:
        sys.exit(3)


if __name__ == "__main__":
    main()
