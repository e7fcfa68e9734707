"""torch_grnnd.distributed at a scale no single GPU holds: each rank makes only its own rows.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=4 -m benchmarks.bench_distributed_scale \\
        --data clustered:n=100000000,d=1024,clusters=100000,queries=10000 --out DIR
    python -m benchmarks.bench_distributed_scale --table DIR/distributed_scale_*.json   # 1/2/4 GPUs

The data: clustered blobs (centres spread by 3, unit noise, float16). The centres and the
queries come from one seed on every rank; each rank draws its own share of the rows from a seed
of its own, a chunk at a time, so 100M x 1024 (205 GB) never exists in one place. Measured, all
ranks together (wall clock from a barrier to the slowest rank's synchronisation):
  build         ShardedIndex.build of the shards, and with partition=True (rows moved to the
                rank of their nearest balanced k-means centre);
  search        each rank's share of the queries over every shard, and over the nearest shards
                (each of --probes) of the partitioned index: queries/s of all queries and recall@10
                at each of --lists against the exact neighbours of all rows (distributed.knn, also
                timed); --codes int8/int4 makes every index search by codes;
  rank 0 alone  rank 0's rows alone (N / W rows) built and searched with all the queries on its
                GPU: the "one GPU holding a share" baseline.
Writes distributed_scale_<data>_w<W>.{json,md} (rank 0). --table merges such files (1, 2, 4
ranks...) into one scaling table. --device cpu runs the same on CPU processes (gloo), small.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import torch_grnnd as grnnd
from benchmarks.common import seconds_on_ranks
from benchmarks.report import machine, machine_line, scaling_runs, write_lines

K = 10
CHUNK = 1 << 20  # rows made at a time


def parse(spec: str) -> dict:
    family, _, options = spec.partition(":")
    if family != "clustered":
        raise SystemExit(f"--data: expected clustered:n=...,d=...,clusters=...,queries=...,seed=..., got {spec!r}")
    kv = dict(item.split("=", 1) for item in options.split(",") if item)
    return {"n": int(kv.get("n", 1_000_000)), "d": int(kv.get("d", 128)), "clusters": int(kv.get("clusters", 1000)),
            "queries": int(kv.get("queries", 10_000)), "seed": int(kv.get("seed", 0))}


def own_rows(spec: dict, rank: int, world: int, device: torch.device):
    """(this rank's rows, this rank's queries, every rank's row counts): float16, made here."""
    d, clusters, nq = spec["d"], spec["clusters"], spec["queries"]
    shared = torch.Generator(device=device).manual_seed(spec["seed"])
    centres = torch.randn(clusters, d, generator=shared, device=device) * 3
    q_labels = torch.randint(clusters, (nq,), generator=shared, device=device)
    queries = (centres[q_labels] + torch.randn(nq, d, generator=shared, device=device)).half()
    counts = [spec["n"] * (r + 1) // world - spec["n"] * r // world for r in range(world)]
    own = torch.Generator(device=device).manual_seed(spec["seed"] + 1 + rank)
    rows = torch.empty(counts[rank], d, dtype=torch.float16, device=device)
    for start in range(0, counts[rank], CHUNK):
        m = min(CHUNK, counts[rank] - start)
        labels = torch.randint(clusters, (m,), generator=own, device=device)
        rows[start:start + m] = (centres[labels] + torch.randn(m, d, generator=own, device=device)).half()
    share = [nq * r // world for r in range(world + 1)]
    return rows, queries[share[rank]:share[rank + 1]].contiguous(), queries, counts


def say(r: dict, step: str) -> None:
    """Rank 0 prints a finished step's time as it goes, so that a long run shows where it is."""
    if dist.get_rank() == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        print(f"{step} {r[step + '_s']:.2f} s (peak GPU memory {peak:.1f} GiB)", flush=True)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's t (equal shapes), in rank order, on every rank."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def measure(args) -> None:
    device = grnnd.distributed.init_process_group(args.device)
    use_cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse(args.data)
    mine, my_queries, queries, counts = own_rows(spec, rank, world, device)
    name = f"clustered-{spec['n'] // 1000}k-d{spec['d']}-c{spec['clusters']}" + (f"-{args.codes}" if args.codes else "")
    grnnd.build(mine[:20_000])  # warm-up: kernels loaded, allocator primed
    lists = [int(v) for v in args.lists.split(",")]
    # "auto": routed by the partition's borders (probes=None); a number caps the shards a query visits.
    probes = list(dict.fromkeys(v if v == "auto" else min(int(v), world) for v in args.probes.split(",")))
    settings = {"codes": args.codes} if args.codes else {}
    r = {"data": name, **spec, "world": world, "list_size": lists[0], "probes": probes[0], "codes": args.codes,
         "cells": args.cells,
         "rows_per_rank": counts, "machine": machine(threads=torch.get_num_threads(), cuda=use_cuda)}
    found = {}  # (mode, list, probes) -> this rank's ids; the times go to r["points"]
    points = []

    def searched(mode, index, qs, lst, probe=None, everyone=True):
        (_, ids), t = seconds_on_ranks(lambda: index.search(qs, k=K, list_size=lst), repeat=3, everyone=everyone,
                                       device=device)
        found[mode, lst, probe] = ids
        # Shards a query visited, over all ranks' queries (a collective: not for rank 0 alone).
        visits = gathered(torch.tensor([index.shards_per_query], device=device)).mean().item() if everyone else 1.0
        points.append({"mode": mode, "list": lst, "probes": probe, "s": t, "qps": spec["queries"] / t,
                       "shards_per_query": visits})

    sharded, r["sharded_build_s"] = seconds_on_ranks(lambda: grnnd.distributed.ShardedIndex.build(mine, **settings),
                                                     1, device=device)
    for lst in lists:
        searched("all shards", sharded, my_queries, lst)
    say(r, "sharded_build")
    del sharded
    parted, r["partitioned_build_s"] = seconds_on_ranks(
        lambda: grnnd.distributed.ShardedIndex.build(mine, partition=True, cells=args.cells, **settings), 1,
        device=device)
    r["partition_rows"] = gathered(torch.tensor([len(parted.local)], device=device)).tolist()
    for probe in probes:
        parted.probes = None if probe == "auto" else probe
        for lst in lists:
            searched("partitioned", parted, my_queries, lst, probe)
    say(r, "partitioned_build")
    del parted
    (_, truth), r["exact_knn_s"] = seconds_on_ranks(lambda: grnnd.distributed.knn(mine, my_queries, K), 1,
                                                    device=device)
    say(r, "exact_knn")
    equal_shares = spec["queries"] % world == 0  # all_gather needs equal shapes
    if equal_shares:
        truth_all = gathered(truth)
        everyone_found = {key: gathered(ids) for key, ids in found.items()}
    if rank == 0:  # one GPU holding a share: this rank's rows alone, all the queries (the others wait)
        one, r["one_rank_build_s"] = seconds_on_ranks(lambda: grnnd.Index.build(mine, **settings), 1,
                                                      everyone=False, device=device)
        for lst in lists:
            searched("rank 0 alone", one, queries, lst, everyone=False)
        say(r, "one_rank_build")
        del one
        for point in points:
            key = (point["mode"], point["list"], point["probes"])
            if equal_shares and point["mode"] != "rank 0 alone":
                point["recall"] = grnnd.recall(everyone_found[key], truth_all, K)
        first = {(p["mode"], p["probes"]): p for p in reversed(points) if p["list"] == lists[0]}
        r["points"] = points
        r["sharded_qps"] = first["all shards", None]["qps"]
        r["partitioned_qps"] = first["partitioned", probes[0]]["qps"]
        r["one_rank_qps"] = first["rank 0 alone", None]["qps"]
        r["sharded_recall"] = first["all shards", None].get("recall", float("nan"))
        r["partitioned_recall"] = first["partitioned", probes[0]].get("recall", float("nan"))
        r["partitioned_shards_per_query"] = first["partitioned", probes[0]]["shards_per_query"]
        write(r, args.out)
    dist.barrier()
    dist.destroy_process_group()


def write(r: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"distributed_scale_{r['data']}_w{r['world']}")
    with open(stem + ".json", "w") as f:
        json.dump(r, f, indent=1)
    w, n = r["world"], r["n"]
    alone = {p["list"]: p["qps"] for p in r["points"] if p["mode"] == "rank 0 alone"}
    lines = [f"# torch_grnnd.distributed, {r['data']} ({n:,} x {r['d']}), {w} ranks", "",
             f"Machine: {machine_line(r['machine'])}. Each rank made its own {n // w:,} rows; {r['queries']:,} "
             f"queries at once, recall@10 against distributed.knn; codes: {r.get('codes') or 'none (rows)'}; "
             f"partition cells a rank: {r.get('cells', 1)}.", "",
             "| search | list | queries/s | recall@10 | vs rank 0 alone |", "|---|---:|---:|---:|---:|"]
    for p in r["points"]:
        mode = p["mode"]
        if p["probes"] == "auto":
            mode += f", routed by borders ({p['shards_per_query']:.2f} of {w} shards a query)"
        elif p["probes"]:
            mode += f", {p['probes']} of {w} shards"
        lines.append(f"| {mode} | {p['list']} | {p['qps']:,.0f} | {p.get('recall', float('nan')):.4f} | "
                     f"{p['qps'] / alone[p['list']]:.2f}x |")
    lines += ["", "| build | s |", "|---|---:|", f"| all shards | {r['sharded_build_s']:.2f} |",
              f"| partitioned | {r['partitioned_build_s']:.2f} |",
              f"| rank 0 alone, {n // w:,} rows | {r['one_rank_build_s']:.2f} |", "",
              f"Partitioned rows per rank: {', '.join(f'{v:,}' for v in r['partition_rows'])}. Exact "
              f"distributed.knn of the queries: {r['exact_knn_s']:.2f} s. Rank 0 alone searches all the queries "
              "over its own rows (no recall: its rows are a quarter of the data)."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def table(paths: list, out: str) -> None:
    """One scaling table from the runs in ``paths`` (1, 2, 4 ... ranks; the same data, or the same rows
    per rank)."""
    runs, names = scaling_runs(paths)
    lines = [f"# Scaling of torch_grnnd.distributed, {', '.join(names)}", "",
             f"Machine: {machine_line(runs[0]['machine'])}.", "",
             "| ranks | rows | rows per rank | build s | all shards q/s (recall) | partitioned q/s (recall, probes) | "
             "rank 0 alone q/s |", "|---:|---:|---:|---:|---|---|---:|"]
    for r in runs:
        lines.append(f"| {r['world']} | {r['n']:,} | {r['n'] // r['world']:,} | {r['sharded_build_s']:.2f} | "
                     f"{r['sharded_qps']:,.0f} ({r.get('sharded_recall', float('nan')):.4f}) | "
                     f"{r['partitioned_qps']:,.0f} ({r.get('partitioned_recall', float('nan')):.4f}, {r['probes']}) | "
                     f"{r['one_rank_qps']:,.0f} |")
    write_lines(os.path.join(out, f"distributed_scale_{runs[-1]['data']}_table.md"), lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=100000000,d=1024,clusters=100000,queries=10000")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lists", default="64", help="search list sizes, comma-separated (the first is the table's)")
    p.add_argument("--cells", type=int, default=1, help="k-means cells a rank of the partitioned index")
    p.add_argument("--probes", default="2,auto", help="shards a partitioned search visits, comma-separated; "
                   "auto: as many as the partition's borders ask (the first is the table's)")
    p.add_argument("--codes", default=None, choices=["int8", "int4"], help="search by codes (every index)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--table", nargs="+", help="merge these JSON runs into one scaling table instead")
    args = p.parse_args()
    if args.table:
        table(args.table, args.out)
    else:
        measure(args)


if __name__ == "__main__":
    main()
