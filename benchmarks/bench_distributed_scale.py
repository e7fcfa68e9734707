"""torch_grnnd.distributed at a scale no single GPU holds: each rank makes only its own rows.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=4 benchmarks/bench_distributed_scale.py \\
        --data clustered:n=100000000,d=1024,clusters=100000,queries=10000 --out DIR
    python benchmarks/bench_distributed_scale.py --table DIR/distributed_scale_*.json   # 1/2/4 GPUs

The data: clustered blobs (centres spread by 3, unit noise, float16). The centres and the
queries come from one seed on every rank; each rank draws its own share of the rows from a seed
of its own, a chunk at a time, so 100M x 1024 (205 GB) never exists in one place. Measured, all
ranks together (wall clock after a synchronisation and a barrier):
  build         ShardedIndex.build of the shards, and with partition=True (rows moved to the
                rank of their nearest balanced k-means centre);
  search        each rank's share of the queries over every shard, and over the --probes nearest
                shards of the partitioned index: queries/s of all queries, recall@10 at --list
                against the exact neighbours of all rows (distributed.knn, also timed);
  rank 0 alone  rank 0's rows alone (N / W rows) built and searched with all the queries on its
                GPU: the "one GPU holding a share" baseline.
Writes distributed_scale_<data>_w<W>.{json,md} (rank 0). --table merges such files (1, 2, 4
ranks...) into one scaling table. --device cpu runs the same on CPU processes (gloo), small.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_grnnd as grnnd  # noqa: E402
from benchmarks.report import machine, machine_line  # noqa: E402

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


def synchronise(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def say(r: dict, *steps: str) -> None:
    """Rank 0 prints finished steps' times as it goes, so that a long run shows where it is."""
    if dist.get_rank() == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        print(", ".join(f"{s} {r[s + '_s']:.2f} s" for s in steps) + f" (peak GPU memory {peak:.1f} GiB)", flush=True)


def seconds(fn, device: torch.device, repeat: int = 1, everyone: bool = True):
    """(result, median wall seconds) of fn, synchronised; with `everyone` between barriers."""
    times, out = [], None
    for _ in range(repeat):
        if everyone:
            dist.barrier()
        synchronise(device)
        start = time.perf_counter()
        out = fn()
        synchronise(device)
        if everyone:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


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
    name = f"clustered-{spec['n'] // 1000}k-d{spec['d']}-c{spec['clusters']}"
    grnnd.build(mine[:20_000])  # warm-up: kernels loaded, allocator primed
    probes = min(args.probes, world)
    r = {"data": name, **spec, "world": world, "list_size": args.list, "probes": probes,
         "rows_per_rank": counts, "machine": machine(threads=torch.get_num_threads(), cuda=use_cuda)}
    search = dict(k=K, list_size=args.list)

    sharded, r["sharded_build_s"] = seconds(lambda: grnnd.distributed.ShardedIndex.build(mine), device)
    (_, i_sh), r["sharded_search_s"] = seconds(lambda: sharded.search(my_queries, **search), device, repeat=3)
    say(r, "sharded_build", "sharded_search")
    del sharded
    parted, r["partitioned_build_s"] = seconds(
        lambda: grnnd.distributed.ShardedIndex.build(mine, partition=True, probes=probes), device)
    r["partition_rows"] = gathered(torch.tensor([len(parted.local)], device=device)).tolist()
    (_, i_pa), r["partitioned_search_s"] = seconds(lambda: parted.search(my_queries, **search), device, repeat=3)
    say(r, "partitioned_build", "partitioned_search")
    del parted
    (_, truth), r["exact_knn_s"] = seconds(lambda: grnnd.distributed.knn(mine, my_queries, K), device)
    say(r, "exact_knn")
    equal_shares = spec["queries"] % world == 0  # all_gather needs equal shapes
    if equal_shares:
        truth_all, sharded_all, parted_all = gathered(truth), gathered(i_sh), gathered(i_pa)
    if rank == 0:  # one GPU holding a share: this rank's rows alone, all the queries (the others wait)
        one, r["one_rank_build_s"] = seconds(lambda: grnnd.Index.build(mine), device, everyone=False)
        _, r["one_rank_search_s"] = seconds(lambda: one.search(queries, **search), device, repeat=3, everyone=False)
        say(r, "one_rank_build", "one_rank_search")
        del one
        if equal_shares:
            r["sharded_recall"] = grnnd.recall(sharded_all, truth_all, K)
            r["partitioned_recall"] = grnnd.recall(parted_all, truth_all, K)
        nq = spec["queries"]
        r["sharded_qps"], r["partitioned_qps"] = nq / r["sharded_search_s"], nq / r["partitioned_search_s"]
        r["one_rank_qps"] = nq / r["one_rank_search_s"]
        write(r, args.out)
    dist.barrier()
    dist.destroy_process_group()


def write(r: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"distributed_scale_{r['data']}_w{r['world']}")
    with open(stem + ".json", "w") as f:
        json.dump(r, f, indent=1)
    w, n = r["world"], r["n"]
    lines = [f"# torch_grnnd.distributed, {r['data']} ({n:,} x {r['d']}), {w} ranks", "",
             f"Machine: {machine_line(r['machine'])}. Each rank made its own {n // w:,} rows; {r['queries']:,} "
             f"queries, recall@10 at list {r['list_size']} against distributed.knn.", "",
             "| | build s | queries/s | recall@10 | vs rank 0 alone |", "|---|---:|---:|---:|---:|",
             f"| all shards | {r['sharded_build_s']:.2f} | {r['sharded_qps']:,.0f} | "
             f"{r.get('sharded_recall', float('nan')):.4f} | {r['sharded_qps'] / r['one_rank_qps']:.2f}x |",
             f"| partitioned, {r['probes']} of {w} shards | {r['partitioned_build_s']:.2f} | "
             f"{r['partitioned_qps']:,.0f} | {r.get('partitioned_recall', float('nan')):.4f} | "
             f"{r['partitioned_qps'] / r['one_rank_qps']:.2f}x |",
             f"| rank 0 alone, {n // w:,} rows | {r['one_rank_build_s']:.2f} | {r['one_rank_qps']:,.0f} | | 1.00x |", "",
             f"Partitioned rows per rank: {', '.join(f'{v:,}' for v in r['partition_rows'])}. Exact "
             f"distributed.knn of the queries: {r['exact_knn_s']:.2f} s."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def table(paths: list, out: str) -> None:
    """One scaling table from the runs in ``paths`` (same data, 1, 2, 4 ... ranks)."""
    runs = sorted((json.load(open(p)) for p in paths), key=lambda r: r["world"])
    lines = [f"# Scaling of torch_grnnd.distributed, {runs[0]['data']}", "",
             f"Machine: {machine_line(runs[0]['machine'])}.", "",
             "| ranks | rows per rank | build s | all shards q/s (recall) | partitioned q/s (recall, probes) | "
             "rank 0 alone q/s |", "|---:|---:|---:|---|---|---:|"]
    for r in runs:
        lines.append(f"| {r['world']} | {r['n'] // r['world']:,} | {r['sharded_build_s']:.2f} | "
                     f"{r['sharded_qps']:,.0f} ({r.get('sharded_recall', float('nan')):.4f}) | "
                     f"{r['partitioned_qps']:,.0f} ({r.get('partitioned_recall', float('nan')):.4f}, {r['probes']}) | "
                     f"{r['one_rank_qps']:,.0f} |")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"distributed_scale_{runs[0]['data']}_table.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=100000000,d=1024,clusters=100000,queries=10000")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--list", type=int, default=64)
    p.add_argument("--probes", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--table", nargs="+", help="merge these JSON runs into one scaling table instead")
    args = p.parse_args()
    if args.table:
        table(args.table, args.out)
    else:
        measure(args)


if __name__ == "__main__":
    main()
