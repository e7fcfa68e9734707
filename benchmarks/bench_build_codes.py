#!/usr/bin/env python3
"""Builds whose distances come from one-byte codes of the rows: build time and what the graph
loses, every graph searched with the exact rows (recall@10 of the in and rare-category queries of
benchmarks/datasets.py's families).

    python -m benchmarks.bench_build_codes --sets zipf_aniso:1000000x1024,aniso:1000000x384,.data/text/embeddings.pt \
        [--variants rows,pair_codes,rotated,codes,rotated_codes] [--seeds 0,1] [--lists 64,256] [--metric cosine] \
        [--search-batches 100,1000,10000 --search-lists 32,64 --trials 4]

Variants: ``default`` (the build as ``BuildParams()`` has it: pair codes from
``PAIR_CODES_MIN_DIM`` dimensions on where they fit), ``rows`` (the build on the rows,
``pair_codes=False``, with the rows' default ``delta``), ``pair_codes`` (``BuildParams.pair_codes``: the update rounds' pair distances from the
codes, by the kernels, with the codes' default ``delta``),
``pair_codes_rows_delta`` (the same at the rows' ``delta``), and three emulations, each a build on
other rows with ``pair_codes=False``: ``rotated`` (the rows turned by one random orthogonal
matrix: the same distances up to float16 rounding, a control for the build's run-to-run spread),
``codes`` (the rows replaced by their codes decoded, ``codes.pair_codes``: every distance of the
build from the codes, up to float16 rounding) and ``rotated_codes`` (the rotation, then the codes:
it evens out the dimensions' spreads, which one step for all of them needs). ``--seeds``: builds
of each variant with these build seeds, for the spread. ``--search-batches``: then the time a
search call takes on each of those graphs, batch by batch (``search_times``), and the distances a
query computes there (the mean, and the most a query of a call computes): what a graph built
otherwise costs the searches, with the spread of graphs built alike beside it; with two graphs or
more, each graph's time a call at the recalls the first one reached, and each variant's against
the first variant's (``at_equal_recall``). One GPU.
"""
import argparse
import statistics
import time

import torch

import torch_grnnd as grnnd
from benchmarks.common import back_to_back_ms, synchronise
from benchmarks.datasets import load_data, make_rare_queries, make_set, parse_sets
from benchmarks.report import qps_at_recall
from torch_grnnd.codes import pair_codes
from torch_grnnd.params import ROWS_DELTA

_CHUNK = 1 << 20


def rotated(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x turned by a random orthogonal matrix (QR of a Gaussian one), float16."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(x.shape[1], x.shape[1], generator=g, device=x.device))
    q = q * torch.sign(torch.diagonal(r))
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], _CHUNK):
        out[start:start + _CHUNK] = (x[start:start + _CHUNK].float() @ q).half()
    return out


def decoded_codes(x: torch.Tensor) -> torch.Tensor:
    """x's pair codes (torch_grnnd.codes.pair_codes) decoded: o + s q, float16."""
    codes, scale = pair_codes(x)
    lo, step = x.min(0).values.float(), scale ** 0.5
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], _CHUNK):
        out[start:start + _CHUNK] = (lo + codes[start:start + _CHUNK, :x.shape[1]].float() * step).half()
    return out


# variant -> (the rows a build runs on, its settings)
ON_ROWS = {"pair_codes": False}
VARIANTS = {"default": (lambda x: x, {}), "rows": (lambda x: x, ON_ROWS),
            "pair_codes": (lambda x: x, {"pair_codes": True}),
            "pair_codes_rows_delta": (lambda x: x, {"pair_codes": True, "delta": ROWS_DELTA}),
            "rotated": (rotated, ON_ROWS), "codes": (decoded_codes, ON_ROWS),
            "rotated_codes": (lambda x: decoded_codes(rotated(x)), ON_ROWS)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", required=True, help="family:NxD or saved embeddings (a .pt file), ... (benchmarks/datasets.py)")
    p.add_argument("--variants", default="rows,pair_codes")
    p.add_argument("--seeds", default="0,1", help="build seeds")
    p.add_argument("--lists", default="64,256")
    p.add_argument("--metric", default="l2", choices=["l2", "cosine"],
                   help="the builds' and searches' metric (the emulations are of l2 codes: rows and pair_codes only)")
    p.add_argument("--search-batches", default="",
                   help="also time back-to-back searches in batches of these sizes (e.g. 100,1000,10000) on every "
                        "graph the variants and seeds built, the graphs alternating (search_times)")
    p.add_argument("--search-lists", default="32,64", help="list sizes of --search-batches")
    p.add_argument("--trials", type=int, default=4, help="rounds over the graphs of --search-batches")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check the script on small sets")
    args = p.parse_args()
    if args.metric != "l2" and set(args.variants.split(",")) - {"default", "rows", "pair_codes",
                                                                   "pair_codes_rows_delta"}:
        p.error("--metric cosine takes the variants default, rows, pair_codes and pair_codes_rows_delta only")
    metric, device = args.metric, torch.device(args.device)
    lists = [int(v) for v in args.lists.split(",")]
    batches = [int(v) for v in args.search_batches.split(",") if v]
    for spec in args.sets.split(","):
        if spec.endswith(".pt"):  # saved embeddings (datasets.load_data): their own queries
            name, x, q, _ = load_data(spec, args.device)
            queries = {"queries": q.to(x.dtype)}
        else:
            (family, n, d), = parse_sets(spec)
            name, (x, q_in) = f"{family} {n}x{d}", make_set(family, n, d, device=args.device)
            queries = {"in": q_in, "rare": make_rare_queries(family, n, d, device=args.device)[0]}
        truth = {key: grnnd.knn(x, q, 10, metric=metric)[1] for key, q in queries.items()}
        for codes in (True, False):  # warm-up: kernels loaded before the first timed build
            grnnd.build(x[:100_000], pair_codes=codes, metric=metric)
        graphs = {}
        for variant in args.variants.split(","):
            make_rows, settings = VARIANTS[variant]
            rows = make_rows(x)
            for seed in (int(v) for v in args.seeds.split(",")):
                synchronise(device)
                start = time.perf_counter()
                graph = grnnd.build(rows, seed=seed, metric=metric, **settings)
                synchronise(device)
                took = time.perf_counter() - start
                found = []
                for size in lists:
                    for key, q in queries.items():
                        ids = grnnd.search(x, graph, q, 10, list_size=size, metric=metric)[1]
                        found.append(f"{key} {grnnd.recall(ids, truth[key], 10):.4f}")
                print(f"{name} {variant}, seed {seed}: build {took:.2f} s; recall@10 at lists "
                      f"{'/'.join(map(str, lists))}: {', '.join(found)}", flush=True)
                if batches:
                    graphs[f"{variant} {seed}"] = graph
                del graph
            del rows
        key = next(iter(queries))
        for batch in batches:
            curves = {label: [] for label in graphs}  # {label: [{"recall", "qps": calls a second}]}
            for size in (int(v) for v in args.search_lists.split(",")):
                times, found, distances = search_times(x, graphs, queries[key], truth[key], batch, size, args.trials,
                                                       metric, device)
                for label in graphs:
                    curves[label].append({"recall": found[label], "qps": 1e3 / statistics.median(times[label])})
                print(f"{name} search, {key} queries, batch {batch}, list {size}, ms a call (median of the trials, "
                      "their range), recall@10, distances a query (mean / the most in a call): " + "; ".join(
                          f"{label} {statistics.median(times[label]):.3f} [{min(times[label]):.3f}-"
                          f"{max(times[label]):.3f}] {found[label]:.4f} {distances[label][0]:.0f} / "
                          f"{distances[label][1]:.0f}" for label in graphs), flush=True)
            if len(graphs) > 1:
                print(at_equal_recall(f"{name} search, {key} queries, batch {batch}", curves), flush=True)
        del x, queries, truth, graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()


def at_equal_recall(what: str, curves: dict) -> str:
    """Each graph's time a call at the recalls the first graph reached at the searched lists
    (report.qps_at_recall on calls a second: log-linear between a graph's two bracketing lists, or
    a faster list of higher recall), and each variant's mean over its seeds against the first
    variant's: graphs of unequal recall compared at equal recall, as bench_gpu --compare does."""
    labels = list(curves)
    targets = [point["recall"] for point in curves[labels[0]]]
    ms = {label: [1e3 / qps_at_recall(curves[label], target) for target in targets] for label in labels}
    variants = {}
    for label in labels:
        variants.setdefault(label.rsplit(" ", 1)[0], []).append(ms[label])
    first = next(iter(variants))
    def mean_ms(variant):
        return [statistics.fmean(graph[i] for graph in variants[variant]) for i in range(len(targets))]
    ratios = {variant: ["nan" if a != a or b != b else f"{a / b:.3f}x"
                        for a, b in zip(mean_ms(variant), mean_ms(first))] for variant in variants}
    return (f"{what}, ms a call at the recalls {labels[0]} reached ({', '.join(f'{t:.4f}' for t in targets)}; nan: "
            "not reached): " + "; ".join(f"{label} " + "/".join(f"{v:.3f}" for v in ms[label]) for label in labels)
            + f"; each variant's mean over its seeds against {first}'s: " + "; ".join(
                f"{variant} " + "/".join(ratios[variant]) for variant in variants))


def search_times(x, graphs: dict, queries, truth, batch: int, size: int, trials: int, metric: str, device):
    """Latency as a caller sees it, per graph: back-to-back calls of ``batch`` queries (consecutive
    slices of at least 1 000, the queries repeated where there are fewer; common.back_to_back_ms)
    a trial; the graphs take turns in each trial, so that a slow spell of
    the machine falls on all of them. ({label: [ms a call, one a trial]}, {label: recall@10},
    {label: (distances a query, the most a query of a call computes, averaged over the calls)}):
    a call of a batch that runs in one wave lasts as long as its longest walks."""
    total = max(1_000, batch)
    repeats = -(-total // queries.shape[0])
    queries, truth = queries.repeat(repeats, 1)[:total], truth.repeat(repeats, 1)[:total]
    slices = queries.split(batch)
    calls = max(len(slices), 200_000 // max(batch, 1_000))  # about 200 calls of up to 1 000 queries
    times = {label: [] for label in graphs}
    found, distances = {}, {}
    for _ in range(trials):
        for label, graph in graphs.items():
            def run(q):
                return grnnd.search(x, graph, q, 10, list_size=size, metric=metric)[1]
            ids = [run(q) for q in slices]  # warm-up, and the answers recall is measured on
            found[label] = grnnd.recall(torch.cat(ids), truth, 10)
            times[label].append(back_to_back_ms(run, slices, calls, device))
    for label, graph in graphs.items():
        counts = [grnnd.search_distance_counts(x, graph, q, 10, list_size=size, metric=metric).float() for q in slices]
        distances[label] = (float(torch.cat(counts).mean()), statistics.fmean(float(c.max()) for c in counts))
    return times, found, distances


if __name__ == "__main__":
    main()
