"""Whether build quality holds as N grows: 100k to 10M rows, several data shapes, on one GPU.

    python -m benchmarks.bench_scale --out DIR
    python -m benchmarks.bench_scale --sets blobs:4000000x384,zipf:1000000x384 \\
        --builds "" "start=random,delta=0,outer_iters=3,inner_iters=6" --out DIR

Data families (made by benchmarks/datasets.py), on the GPU in float16, with 1000 held-out queries
drawn the same way:
  blobs  N / 1000 Gaussian clusters of equal expected size (centres spread by 3, unit noise),
         the generator of benchmarks/bench_gpu.py: each cluster holds about 1000 rows at any N,
         so only the number of clusters grows;
  zipf   N / 1000 clusters whose sizes fall as 1 / rank: a few huge ones and many of a few
         rows, as real collections are;
  aniso  no clusters: independent Gaussian coordinates whose scales fall geometrically from 1
         to 10^-1.5 across the dimensions (one cluster label for all rows), where the hubs'
         cells say little and neighbourhoods are hard to find;
  zipf_aniso  zipf's cluster sizes with anisotropic noise, every cluster with scales of its own
         per dimension (log-uniform over 10^-1 .. 10^0.25), and centres close enough (spread by
         1.5) that clusters overlap: rare categories next to common ones;
  zipf_tiny  zipf_aniso with N / 20 clusters (most of a few rows) whose centres are spread by 1
         only: a rare query's neighbours lie in tiny clusters inside overlapping big ones, where
         the rows converge last (200k x 256 float32 on a 2-core CPU, recall@10 at list 64 / 256:
         the rare queries 0.675 / 0.863 with the defaults and 0.724 / 0.898 running every round,
         delta=0, against 0.996 / 1.000 for zipf_aniso's rare queries at that size; the in
         queries 0.898 / 0.963; a one-off run);
  zipf_iso, zipf_aniso_apart  zipf_aniso with one thing changed, to tell its two differences from
         zipf apart: zipf_iso makes each cluster's noise isotropic at the cluster's own energy
         (the root mean square of its scales), zipf_aniso_apart puts the centres as far apart
         against the noise as zipf's (spread by 3 x 0.74, the scales' root mean square). The
         same seed draws the same cluster sizes, centre directions and scales.
Two query sets per set, 1000 queries each: "in", drawn like the rows (mostly from the big
clusters), and "rare", from clusters chosen uniformly (most clusters are small, so these are the
rare categories a search must not miss; for blobs and aniso the two are alike).
For each set and build configuration (build settings as "name=value,..."; "" = the defaults):
build time (CUDA events), rounds run and the pool entries each changed (and the unfound shares
the build measured between its outer iterations, in the JSON; two equal measures in a row appear
once), the out-degree
summary, the share of rows a search cannot reach from the hubs (breadth-first search) and of
sampled rows a search for the row itself misses (grnnd.diagnostics.unfound_share), and
recall@10 of both query sets against exact results (torch_grnnd.knn) and queries/s (batch
10 000, the in queries) at each list of
--lists (32, 64 and 128 by default), with the default entry points and with random ones only
(hub_entries=0), the distances a query computes at each list (and HNSW's, for comparisons at
equal work), recall at list 64 and at the longest list by the size of the query's cluster, with
the share of results in that cluster (lost between clusters, or inside a large one), and the
peak GPU memory of the build beyond the data. Every build of a set after its first is also
compared with the first at equal recall: its queries/s where it reaches the recall the first
reaches at each list (a wider graph reaches a recall at a shorter list, so equal lists are
unequal work). Writes
scale_<name>.{json,md,png} (the PNG: recall at list 64 against N
per family, both query sets, with faiss HNSW where --hnsw asked for it).
"""
import argparse
import json
import os
import time

import torch

import torch_grnnd as grnnd
from benchmarks.common import cuda_time, parse_settings
from benchmarks.datasets import by_cluster_size, make_rare_queries, make_set, parse_sets, sizes_text
from benchmarks.report import machine, machine_line, qps_at_recall
from torch_grnnd.memory import build_extra_bytes
from torch_grnnd.ops import _builds_on_pair_codes as builds_on_pair_codes
from torch_grnnd.params import BuildParams

LISTS = (32, 64, 128)  # list sizes measured by default; 64 is the one the PNG and the issue compare



def measure(base, queries, truth, settings: dict, lists, labels, rare) -> dict:
    """One build of base and its search; labels: (base_labels, query_labels), make_set's clusters;
    rare: (queries, truth, labels) of make_rare_queries."""
    rounds, measured = [], []
    longest = max(lists)

    def report(done, total, changes, unfound):
        rounds.append(changes)
        if unfound is not None and (not measured or measured[-1] != unfound):
            measured.append(unfound)

    grnnd.build(base, progress=report, **settings)
    # Progress costs a synchronisation per round; time the build again without it, and take the
    # peak GPU memory it needs beyond the data, against what the library counts for it
    # (memory.build_extra_bytes: the widest pools and rows the build may end with, BuildParams.widen,
    # and pair codes where the build takes them).
    p = BuildParams(**{name: value for name, value in settings.items() if name in BuildParams.__dataclass_fields__})
    coded = builds_on_pair_codes(p, base, "l2")  # the build's own choice, asked before it runs
    counted = build_extra_bytes(*base.shape, base.element_size(), p.replace(pair_codes=coded))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph, secs = cuda_time(lambda: grnnd.build(base, **settings))
    peak = torch.cuda.max_memory_allocated() - before
    hubs = grnnd.diagnostics.hubs(base)
    unreachable = float((~grnnd.diagnostics.reachable(graph, hubs)).double().mean()) if hubs.numel() else None
    row = {"build": settings, "build_s": secs, "rounds": len(rounds), "changes": rounds, "build_unfound": measured,
           "peak_extra_bytes": peak, "counted_extra_bytes": counted,
           "degree": grnnd.diagnostics.degree_summary(graph),
           "degree_histogram": torch.bincount((graph >= 0).sum(1)).tolist(), "unreachable_from_hubs": unreachable,
           "unfound_share": grnnd.diagnostics.unfound_share(base, graph)}
    # Recall on the held-out queries; queries/s on a batch of 10 000 (the queries ten times over).
    batch = queries.repeat(10, 1)
    # Distances a query computes, for comparisons at equal work (HNSW's in hnsw_reference).
    row["distances_per_query"] = {size: float(grnnd.search_distance_counts(base, graph, queries, 10, list_size=size)
                                              .float().mean()) for size in lists}
    for entries, key in ((-1, "recall"), (0, "recall_random_entries")):
        row[key], row[key + "_qps"] = {}, {}
        for size in lists:
            _, ids = grnnd.search(base, graph, queries, 10, list_size=size, hub_entries=entries)
            row[key][size] = grnnd.recall(ids, truth, 10)
            if key == "recall" and size in (64, longest):
                row["by_cluster_size" + ("" if size == 64 else "_longest")] = by_cluster_size(ids, truth, *labels)
            _, secs = cuda_time(lambda: grnnd.search(base, graph, batch, 10, list_size=size, hub_entries=entries),
                                repeat=5)
            row[key + "_qps"][size] = batch.shape[0] / secs
    rare_queries, rare_truth, rare_labels = rare
    row["recall_rare"] = {}
    for size in lists:
        _, ids = grnnd.search(base, graph, rare_queries, 10, list_size=size)
        row["recall_rare"][size] = grnnd.recall(ids, rare_truth, 10)
        if size in (64, longest):
            row["by_cluster_size_rare" + ("" if size == 64 else "_longest")] = by_cluster_size(
                ids, rare_truth, labels[0], rare_labels)
    del graph
    torch.cuda.empty_cache()
    return row


def hnsw_reference(base, queries, truth, ef_search=(32, 64, 128)) -> dict:
    """faiss-cpu HNSW (M = 32, efConstruction = 40) on the same rows, as the issue measured it."""
    import faiss
    index = faiss.IndexHNSWFlat(base.shape[1], 32)
    index.hnsw.efConstruction = 40
    x = base.float().cpu().numpy()
    start = time.perf_counter()
    index.add(x)
    row = {"build_s": time.perf_counter() - start, "threads": faiss.omp_get_max_threads(), "recall": {},
           "distances_per_query": {}}
    q = queries.float().cpu().numpy()
    for ef in ef_search:
        index.hnsw.efSearch = ef
        faiss.cvar.hnsw_stats.reset()
        _, ids = index.search(q, 10)
        row["distances_per_query"][ef] = faiss.cvar.hnsw_stats.ndis / q.shape[0]
        row["recall"][ef] = grnnd.recall(torch.from_numpy(ids).to(truth.device), truth, 10)
    return row


def describe(settings: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


def ratio_text(value: float) -> str:
    return f"{value:.2f}x" if value == value else "-"


def at_equal_recall(first: dict, other: dict) -> dict:
    """Queries/s of ``other``'s build against ``first``'s (two rows of one set) where both reach the
    recall ``first`` reached at each of its lists: ``other``'s curve (in queries, hub entries) read
    log-linearly between its lists, as a ratio. NaN where ``other``'s curve does not span that
    recall: never reached, or passed already at its shortest list (its speed there was not
    measured). A wider graph reaches a recall at a shorter list, so equal lists are unequal work."""
    curve = [{"recall": other["recall"][size], "qps": other["recall_qps"][size]} for size in other["recall"]]
    lowest = min(point["recall"] for point in curve)
    return {size: (qps_at_recall(curve, first["recall"][size]) / first["recall_qps"][size]
                   if first["recall"][size] >= lowest else float("nan")) for size in first["recall"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families = ("blobs", "zipf", "zipf_aniso", "zipf_tiny")
    p.add_argument("--sets", default=",".join(f"{family}:{n}x{d}" for family in families
                                              for n in (100_000, 1_000_000, 4_000_000, 10_000_000)
                                              for d in (128, 384, 1024)),
                   help="family:NxD,... (default: every family of datasets.FAMILIES but aniso, 100k to 10M rows)")
    p.add_argument("--builds", nargs="+", default=[""],
                   help="build settings per configuration; '' = the defaults")
    p.add_argument("--hnsw", default="", help="comma-separated sets (as in --sets) that also get a faiss HNSW reference")
    p.add_argument("--lists", default=",".join(map(str, LISTS)),
                   help="list sizes (and HNSW efSearch values) to measure; must include 64")
    p.add_argument("--name", default="gpu")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    lists = tuple(int(v) for v in args.lists.split(","))
    if 64 not in lists:
        p.error("--lists must include 64 (the list the PNG and the issue's goals compare)")
    rows = []
    for family, n, d in parse_sets(args.sets):
        base, queries, *labels = make_set(family, n, d, want_labels=True)
        truth = grnnd.knn(base, queries, 10)[1]
        rare_queries, rare_labels = make_rare_queries(family, n, d)
        rare = (rare_queries, grnnd.knn(base, rare_queries, 10)[1], rare_labels)
        grnnd.build(base[:50_000])  # warm-up: kernels loaded, allocator primed
        first = None  # this set's first build, which the others are compared with
        for text in args.builds:
            settings = parse_settings(text)
            row = {"family": family, "n": n, "d": d, **measure(base, queries, truth, settings, lists, labels, rare)}
            if first is None:
                first = row
            else:
                row["qps_at_equal_recall"] = at_equal_recall(first, row)
            rows.append(row)
            print(f"{family} {n:>10,} x {d:<5} {describe(settings):<50} build {row['build_s']:7.3f} s, "
                  f"{row['rounds']:2d} rounds, peak extra {row['peak_extra_bytes'] / 2**20:,.0f} MiB "
                  f"(counted {row['counted_extra_bytes'] / 2**20:,.0f}), "
                  f"degree min {row['degree']['min']} mean {row['degree']['mean']:.1f}, "
                  f"unreachable {row['unreachable_from_hubs']}, unfound {row['unfound_share']:.4f} "
                  f"(measured in the build: {' '.join(f'{u:.4f}' for u in row['build_unfound']) or '-'}), "
                  f"recall@10 list {'/'.join(map(str, lists))} "
                  + "/".join(f"{row['recall'][s]:.3f}" for s in lists) + " (random entries "
                  + "/".join(f"{row['recall_random_entries'][s]:.3f}" for s in lists) + "), rare queries "
                  + "/".join(f"{row['recall_rare'][s]:.3f}" for s in lists) + ", queries/s "
                  + "/".join(f"{row['recall_qps'][s]:,.0f}" for s in lists) + ", distances/query "
                  + "/".join(f"{row['distances_per_query'][s]:,.0f}" for s in lists), flush=True)
            for kind in ("in", "rare"):
                for group in row["by_cluster_size" + ("_rare" if kind == "rare" else "")]:
                    print(f"    {kind} queries, clusters of {sizes_text(group['sizes'])} rows: {group['queries']} queries, "
                          f"recall@10 list 64 {group['recall']:.3f}, results in the query's cluster "
                          f"{group['in_own_cluster']:.3f}", flush=True)
            if "qps_at_equal_recall" in row:
                print(f"    queries/s against {describe(first['build'])} at the recall it reaches at list "
                      f"{'/'.join(map(str, lists))}: "
                      + "/".join(map(ratio_text, row["qps_at_equal_recall"].values())),
                      flush=True)
        if f"{family}:{n}x{d}" in args.hnsw.split(","):
            ref = hnsw_reference(base, queries, truth, lists)
            rows.append({"family": family, "n": n, "d": d, "hnsw": ref})
            print(f"{family} {n:>10,} x {d:<5} faiss HNSW M=32 efC=40: build {ref['build_s']:.1f} s on "
                  f"{ref['threads']} threads, recall@10 efSearch {'/'.join(map(str, lists))} "
                  + "/".join(f"{v:.3f}" for v in ref["recall"].values()) + ", distances/query "
                  + "/".join(f"{v:,.0f}" for v in ref["distances_per_query"].values()), flush=True)
        del base, queries, truth, labels, rare
        torch.cuda.empty_cache()
        write(rows, args)  # after every set, so a run cut short keeps what it measured


def write(rows, args):
    lists = tuple(int(v) for v in args.lists.split(","))
    results = {"title": "Build quality from 100k to 10M rows", "machine": machine(threads=torch.get_num_threads(), cuda=True),
               "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"scale_{args.name}")
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# {results['title']}", "", f"Machine: {machine_line(results['machine'])}.", "",
             "float16 rows, L2, 1000 held-out queries, recall@10 against exact results (`grnnd.knn`); "
             "hub / random: the default entry points / random entry points only; queries/s on a batch of "
             "10 000 with the default entry points; peak: GPU memory the build needs beyond the data, against "
             "what the library counts for it (`memory.build_extra_bytes`); unfound: the share of 10 000 sampled "
             "rows that a search for the row itself (list 16) misses (`grnnd.diagnostics.unfound_share`). "
             "Degree histograms in the JSON.", "",
             "| data | N | D | build | s | rounds | peak / counted MiB | degree min / p1 / mean | unreachable | unfound | "
             f"recall list {' / '.join(map(str, lists))} (hub entries) | rare queries | queries/s | "
             "(random entries) | distances/query |",
             "|---|---:|---:|---|---:|---:|---|---|---:|---:|---|---|---|---|---|"]
    longest = max(lists)
    clusters = ["", f"Recall@10 at list 64 and {longest} (default entries) by the size of the query's cluster, and "
                "the share of returned rows at list 64 that lie in the query's cluster:", "",
                f"| data | N | D | build | query set | cluster rows | queries | recall list 64 / {longest} | "
                "in own cluster |",
                "|---|---:|---:|---|---|---|---:|---|---:|"]
    for r in rows:
        if "hnsw" in r:
            h = r["hnsw"]
            lines.append(f"| {r['family']} | {r['n']:,} | {r['d']} | faiss-cpu HNSW M=32 efC=40 ({h['threads']} threads) | "
                         f"{h['build_s']:.1f} | | | | | | " + " / ".join(f"{v:.3f}" for v in h["recall"].values())
                         + " (efSearch) | | | | " + " / ".join(f"{v:,.0f}" for v in h["distances_per_query"].values())
                         + " |")
            continue
        for kind in ("in", "rare"):
            key = "by_cluster_size" + ("_rare" if kind == "rare" else "")
            # Runs before the longest list was broken down have list 64 alone; a longest list of 64 is list 64.
            at_64 = r.get(key, [])
            at_longest = r.get(key + "_longest", at_64 if longest == 64 else [None] * len(at_64))
            for group, far in zip(at_64, at_longest):
                recall = f"{group['recall']:.3f} / " + ("-" if far is None else f"{far['recall']:.3f}")
                clusters.append(f"| {r['family']} | {r['n']:,} | {r['d']} | {describe(r['build'])} | {kind} | "
                                f"{sizes_text(group['sizes'])} | {group['queries']} | {recall} | "
                                f"{group['in_own_cluster']:.3f} |")
        deg = r["degree"]
        unreachable = "-" if r["unreachable_from_hubs"] is None else f"{r['unreachable_from_hubs']:.2e}"
        unfound = f"{r['unfound_share']:.4f}" if "unfound_share" in r else "-"  # runs before it was measured
        mib = f"{r['peak_extra_bytes'] / 2**20:,.0f} / {r['counted_extra_bytes'] / 2**20:,.0f}"
        lines.append(f"| {r['family']} | {r['n']:,} | {r['d']} | {describe(r['build'])} | {r['build_s']:.2f} | "
                     f"{r['rounds']} | {mib} | "
                     f"{deg['min']} / {deg['p1']:.0f} / {deg['mean']:.1f} | {unreachable} | {unfound} | "
                     + " / ".join(f"{r['recall'][s]:.3f}" for s in lists) + " | "
                     + " / ".join(f"{r['recall_rare'][s]:.3f}" for s in lists) + " | "
                     + " / ".join(f"{r['recall_qps'][s] / 1e6:.2f}M" for s in lists) + " | "
                     + " / ".join(f"{r['recall_random_entries'][s]:.3f}" for s in lists) + " | "
                     + " / ".join(f"{r['distances_per_query'][s]:,.0f}" for s in lists) + " |")
    if len(clusters) > 5:
        lines += clusters
    compared = [r for r in rows if "qps_at_equal_recall" in r]
    if compared:
        lines += ["", "Queries/s (batch 10 000, in queries) against the set's first build where both reach the "
                  "recall the first reaches at each list (the other's curve read log-linearly between its lists; "
                  "-: outside the other's curve, never reached or passed at its shortest list), and the unfound "
                  "shares each build measured between its outer iterations:",
                  "", f"| data | N | D | build | against | at list {' / '.join(map(str, lists))} | "
                  "measured in the build |",
                  "|---|---:|---:|---|---|---|---|"]
        for r in compared:
            first = next(f for f in rows if (f["family"], f["n"], f["d"]) == (r["family"], r["n"], r["d"]))
            lines.append(f"| {r['family']} | {r['n']:,} | {r['d']} | {describe(r['build'])} | "
                         f"{describe(first['build'])} | "
                         + " / ".join(map(ratio_text, r["qps_at_equal_recall"].values())) + " | "
                         + " ".join(f"{u:.4f}" for u in r["build_unfound"]) + " (first: "
                         + (" ".join(f"{u:.4f}" for u in first["build_unfound"]) or "-") + ") |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(results, base + ".png")
    print("wrote", base + ".json", base + ".md", base + ".png")


def plot(results: dict, path: str):
    """Recall@10 at list 64 against N, a line per family and width for each build configuration
    (the rare queries dotted, in the same colour), faiss HNSW at efSearch 64 as crosses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    lines, colours = {}, {}
    for r in results["rows"]:
        key = (r["family"], r["d"])
        colours.setdefault(key, f"C{len(colours) % 10}")
        if "hnsw" in r:
            ax.plot([r["n"]], [r["hnsw"]["recall"][64]], "x", ms=8, color=colours[key])
        else:
            lines.setdefault(key + (describe(r["build"]), "in"), []).append((r["n"], r["recall"][64]))
            if "recall_rare" in r:
                lines.setdefault(key + (describe(r["build"]), "rare"), []).append((r["n"], r["recall_rare"][64]))
    for (family, d, build, kind), points in lines.items():
        points.sort()
        style = ":" if kind == "rare" else "-" if build == "defaults" else "--"
        ax.plot(*zip(*points), marker="o", ms=4, color=colours[(family, d)], linestyle=style,
                label=f"{family} d={d} ({build}, {kind} queries)")
    ax.plot([], [], "x", color="0.3", label="faiss-cpu HNSW M=32 efC=40, efSearch 64")
    ax.axhline(0.95, color="0.6", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("N (rows)")
    ax.set_ylabel("recall@10 at list 64")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{results['title']}\n{machine_line(results['machine'])}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
