"""How far the build's graph is from the best graph the same rule could make, on data whose big
clusters are where recall is lost.

    python -m benchmarks.bench_graph_ceiling --dim 1024 --sizes 125000,1000000
    python -m benchmarks.bench_graph_ceiling --sets zipf_aniso:10000000x1024 --lists 64,256
    python -m benchmarks.bench_graph_ceiling --device cpu --dim 256 --sizes 20000 --lists 32,64

Two kinds of input. --sizes: one anisotropic Gaussian cluster of zipf_aniso's kind
(benchmarks/datasets.py: a scale per dimension, log-uniform over 10^-1 .. 10^0.25) of each size,
the shape of the big clusters where that family's in-distribution queries lose recall as N
grows, with --queries queries drawn the same way. --sets: a family of datasets.py with its two
query sets ("in" and "rare", as benchmarks/bench_scale.py), where each row's exact neighbours are
taken within its own cluster: exact for families whose clusters lie apart (zipf_aniso: by its
spreads, centres about 68 apart and a row about 24 from its own centre at 1024-d), an approximation where they overlap.
Graphs made of those have no edges between clusters but the repair's: their figures for the
in queries (mostly from big clusters, which hold hubs) are a ceiling, those for the rare ones
(from small clusters, reached through other clusters) are not.
For each input, these graphs:
  build            torch_grnnd.build with the defaults, then each of --builds;
  exact, pruned    the build's relative-neighbourhood rule applied to each row's exact
                   2 x width nearest neighbours (prune_rows), then the reachability repair:
                   the graph a fully converged build would start its pruning from;
  exact, unpruned  each row's exact `width` nearest neighbours, repaired the same way.
The width is --exact-degree, or else the first build's row width: a build that widens its rows
(BuildParams.widen, rows of twice the degree on the hard families) is set against exact graphs
as wide as its own rows.
Per graph: the share of a sample of rows' true 10 nearest neighbours that are among the row's
edges, recall@10 of each query set at each list (against torch_grnnd.knn) and the distances a
query computes; for a family also recall at the first list by the size of the query's cluster
(queries in brackets). The gap between "build" and "exact, pruned" is what convergence could still win;
what "exact, pruned" misses is lost to the search (the data's contrast), whatever the build does.
Writes graph_ceiling_<name>.{json,md}.
"""
import argparse
import json
import os

import torch

import torch_grnnd as grnnd
from benchmarks.common import parse_settings, timed
from benchmarks.datasets import by_cluster_size, make_rare_queries, make_set, parse_sets, sizes_text
from benchmarks.report import machine, machine_line, write_lines
from torch_grnnd.editing import prune_rows


def anisotropic_cluster(n: int, d: int, queries: int, device: torch.device, seed: int = 0):
    """Rows and queries of one cluster with zipf_aniso's per-dimension scales: float16 on a GPU,
    float32 on the CPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    scales = 10 ** (torch.rand(d, generator=g, device=device) * 1.25 - 1.0)
    rows = torch.randn(n + queries, d, generator=g, device=device) * scales
    rows = rows.half() if device.type == "cuda" else rows
    return rows[:n], rows[n:]


# Clusters of at least this many rows get their exact neighbours by a product (knn_graph); the
# smaller ones all at once by the segment scan.
PRODUCT_ROWS = 2000


def within_cluster_neighbours(data: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [N, k]: each row's k nearest other rows of its own cluster, nearest first, -1 padded."""
    n = data.shape[0]
    order = torch.argsort(labels, stable=True)
    sizes = torch.bincount(labels)
    ids = torch.full((n, k), -1, dtype=torch.long, device=data.device)
    starts = (sizes.cumsum(0) - sizes).tolist()
    small = []
    for start, size in zip(starts, sizes.tolist()):
        rows = order[start:start + size]
        if size >= PRODUCT_ROWS:
            _, near = torch.ops.grnnd.knn_graph(data[rows], k, exact=True)
            ids[rows] = torch.where(near >= 0, rows[near.clamp_min(0)], -1)
        elif size > 1:
            small.append(rows)
    if small:
        rows = torch.cat(small)
        sizes = torch.tensor([r.numel() for r in small], device=data.device)
        ptr = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        batch = torch.repeat_interleave(torch.arange(len(small), device=data.device), sizes)
        points = data[rows].float()
        _, near = torch.ops.grnnd.knn_segments(points, points, ptr, batch, k + 1)  # each row finds itself too
        near = torch.where(near >= 0, rows[near.clamp_min(0)], -1)  # ids into `points`
        near = torch.where(near == rows[:, None], -1, near)
        # The row itself (distance 0) drops out; the others keep their order.
        kept = torch.sort((near < 0).to(torch.int8), dim=1, stable=True)[1][:, :k]
        ids[rows] = near.gather(1, kept)
    return ids


def edge_recall(graph: torch.Tensor, sample: torch.Tensor, true10: torch.Tensor) -> float:
    """Share of the sampled rows' true 10 nearest neighbours that are among their edges."""
    rows = graph[sample].long()
    found = (rows.unsqueeze(2) == true10.unsqueeze(1)).any(1) & (true10 >= 0)
    return float(found.sum() / (true10 >= 0).sum())


def pruned_graph(data: torch.Tensor, candidates: torch.Tensor, degree: int, chunk: int = 1 << 20) -> torch.Tensor:
    """The build's rule applied to each row's candidates, chunk by chunk, then the repair."""
    n = data.shape[0]
    rows = [prune_rows(data, "l2", torch.arange(a, min(n, a + chunk), device=data.device), candidates[a:a + chunk],
                       degree) for a in range(0, n, chunk)]
    return torch.ops.grnnd.connect(data, torch.cat(rows))


def inputs(args, device):
    """(name, data, {query set: queries}, k -> each row's exact k nearest neighbours (int64 [N, k]),
    cluster labels: None, or (the rows', {query set: the queries'})) of every --sizes cluster and
    --sets family."""
    for n in (int(v) for v in args.sizes.split(",") if v):
        data, queries = anisotropic_cluster(n, args.dim, args.queries, device)
        yield (f"cluster {n:,} x {args.dim}", data, {"in": queries},
               lambda k: torch.ops.grnnd.knn_graph(data, k, exact=True)[1].long(), None)
    for family, n, d in parse_sets(args.sets) if args.sets else []:
        data, queries, labels, in_labels = make_set(family, n, d, want_labels=True, queries=args.queries,
                                                    device=device)
        rare, rare_labels = make_rare_queries(family, n, d, queries=args.queries, device=device)
        if device.type == "cpu":
            data, queries, rare = data.float(), queries.float(), rare.float()
        yield (f"{family} {n:,} x {d}", data, {"in": queries, "rare": rare},
               lambda k: within_cluster_neighbours(data, labels, k), (labels, {"in": in_labels, "rare": rare_labels}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024, help="dimension of the --sizes clusters")
    p.add_argument("--sizes", default="125000,1000000", help="rows of each single cluster ('' for none)")
    p.add_argument("--sets", default="", help="families as family:NxD,... (benchmarks/datasets.py)")
    p.add_argument("--builds", nargs="*", default=[], help="more build settings, as \"delta=0,outer_iters=16\"")
    p.add_argument("--lists", default="64,256,1024")
    p.add_argument("--degree", type=int, default=grnnd.BuildParams().degree, help="the builds' degree")
    p.add_argument("--exact-degree", type=int, default=0,
                   help="the exact graphs' row width (default: the first build's row width)")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--name", default="aniso")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    lists = [int(v) for v in args.lists.split(",")]
    device = torch.device(args.device)
    results = {"machine": machine(torch.get_num_threads(), cuda=device.type == "cuda"), "degree": args.degree,
               "runs": []}
    lines = [f"# Graph ceiling: the build's graph against the exact neighbours, build degree {args.degree}", "",
             machine_line(results["machine"]), "",
             "| data | graph | build s | row width | true 10-NN among edges | queries | "
             + " | ".join(f"recall@10 list {s} (distances)" for s in lists) + " |",
             "|---|---|---:|---:|---:|---|" + "---|" * len(lists)]
    for name, data, query_sets, exact_neighbours, labels in inputs(args, device):
        truths = {kind: grnnd.knn(data, q, 10)[1] for kind, q in query_sets.items()}
        graphs = []
        for text in [""] + args.builds:
            settings = {"degree": args.degree, **parse_settings(text)}
            graph, secs = timed(lambda: grnnd.build(data, **settings), device)
            graphs.append(("build " + (text or "defaults"), graph, secs))
        width = args.exact_degree or graphs[0][1].shape[1]
        exact, exact_s = timed(lambda: exact_neighbours(2 * width), device)
        sample = torch.randperm(data.shape[0], device=device)[:4000]
        true10 = exact[sample, :10]
        pruned, secs = timed(lambda: pruned_graph(data, exact, width), device)
        graphs.append(("exact, pruned", pruned, exact_s + secs))
        nearest = exact[:, :width].int().contiguous()
        graphs.append(("exact, unpruned", torch.ops.grnnd.connect(data, nearest), exact_s))
        for graph_name, graph, secs in graphs:
            row = {"data": name, "graph": graph_name, "build_s": secs, "width": graph.shape[1],
                   "edge_recall": edge_recall(graph, sample, true10), "recall": {}, "distances_per_query": {},
                   "by_cluster_size": {}}
            for kind, q in query_sets.items():
                row["recall"][kind], row["distances_per_query"][kind] = {}, {}
                for size in lists:
                    _, ids = grnnd.search(data, graph, q, 10, list_size=size)
                    row["recall"][kind][size] = grnnd.recall(ids, truths[kind], 10)
                    if labels is not None and size == lists[0]:
                        row["by_cluster_size"][kind] = by_cluster_size(ids, truths[kind], labels[0], labels[1][kind])
                    row["distances_per_query"][kind][size] = float(
                        grnnd.search_distance_counts(data, graph, q, 10, list_size=size).float().mean())
                line = (f"| {name} | {graph_name} | {secs:.2f} | {row['width']} | {row['edge_recall']:.3f} | {kind} | "
                        + " | ".join(f"{row['recall'][kind][s]:.3f} ({row['distances_per_query'][kind][s]:,.0f})"
                                     for s in lists) + " |")
                lines.append(line)
                print(line, flush=True)
            for kind, groups in row["by_cluster_size"].items():
                line = (f"| | | | | | {kind}, list {lists[0]}, by the size of the query's cluster: "
                        + "; ".join(f"{sizes_text(g['sizes'])}: {g['recall']:.3f} ({g['queries']})" for g in groups)
                        + " |" + " |" * (len(lists) - 1))
                lines.append(line)
                print(line, flush=True)
            results["runs"].append(row)
        del data, query_sets, truths, exact, graphs, pruned, nearest
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"graph_ceiling_{args.name}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", write_lines(stem + ".md", lines))


if __name__ == "__main__":
    main()
