"""torch_grnnd.distributed on several GPUs against one GPU, same run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 -m benchmarks.bench_distributed \\
        --data clustered:n=10000000,d=384,clusters=10000,queries=10000

Every rank makes the same data (``--data`` as benchmarks/bench_gpu.py reads it, all N rows) and
takes its share as its shard. Rank 0 also runs the one-GPU baselines while the others wait:
  build      ShardedIndex.build of N rows on W GPUs  vs  Index.build of N / W rows on one GPU;
  sharded    search of the queries (each rank a share) over all shards  vs  one GPU's index of
             N / W rows searching all the queries (the issue's "half the data"); recall against
             exact neighbours of all N rows, and one GPU's index of all N rows at the same list;
  partitioned  the same with ShardedIndex.build(partition=True, cells=--cells): rows placed by a
             balanced k-means (--cells cells a rank), each query sent to the --probes shards of its
             nearest cells (auto: its own, then those the partition's borders say may hold its
             neighbours);
  replicated the index of N / W rows on every rank, the batch split  vs  that index on one GPU;
  exact      distributed.knn of the queries over the shards  vs  grnnd.knn over all N on one GPU.
Wall-clock seconds from a barrier to the slowest rank's CUDA synchronisation, median of 9
(the sharded build 3, the others 1). Also: each rank's own build time (the sharded build waits
for the slowest), the steps of a sharded search one by one (the collectives' share), the
replicated search's recall beside one GPU's, and the replicated search at --big-batch queries
(the batch repeated), where one GPU is busier, and its calls back to back (20 without a
synchronisation between them, as a server makes them). Writes distributed_<name>_w<W>.{json,md}
under --out (rank 0); ``--table RUN.json ...`` merges runs on 2, 4 ... GPUs into one scaling
table (distributed_<name>_table.md).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import torch_grnnd as grnnd
from benchmarks.common import seconds_on_ranks
from benchmarks.datasets import load_data
from benchmarks.report import machine, machine_line, scaling_runs, write_lines

K, LIST = 10, 64
BACK_TO_BACK = 20  # replicated searches timed one after another without a synchronisation


def timed_locally(fn, into: list):
    """fn, with this rank's own synchronised seconds appended to ``into`` (before any barrier)."""
    def run():
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        into.append(time.perf_counter() - start)
        return out
    return run


def sharded_search_steps(index, queries: torch.Tensor) -> dict:
    """Seconds of each step of ``index.search(queries, K, list_size=LIST)`` on this rank, the GPU
    synchronised after each (the same steps ShardedIndex.search takes)."""
    gd = grnnd.distributed
    steps, last = {}, None

    def mark(name):
        nonlocal last
        torch.cuda.synchronize()
        now = time.perf_counter()
        if name is not None:
            steps[name] = now - last
        last = now

    dist.barrier()
    mark(None)
    _, _, sizes = gd._setup("steps", None, index.local.data, index.local.metric, queries, k=K, list_size=LIST)
    mark("agree_s")
    everyone = gd._all_gather_rows(queries, sizes, None)
    mark("gather_queries_s")
    dists, ids = index.local.search(everyone, K, list_size=LIST)
    mark("local_search_s")
    dists, ids = gd._exchange(dists, ids, sizes, None)
    mark("exchange_s")
    gd._best(dists, ids, K, ids_follow_ranks=not index.user_ids)
    mark("merge_s")
    return steps


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    return grnnd.recall(found, truth, K)


def gather_floats(value: float, world: int) -> list:
    """Every rank's ``value``, in rank order."""
    mine = torch.tensor([value], dtype=torch.float64, device="cuda")
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def table(paths: list, out: str) -> str:
    """One scaling table from runs of this script on 2, 4, ... GPUs (each against one GPU in its
    own run); returns the path written."""
    runs, names = scaling_runs(paths)
    lines = [f"# Scaling of torch_grnnd.distributed against one GPU, {', '.join(names)}", "",
             f"Machine: {machine_line(runs[0]['machine'])}. Each run against one GPU in the same run "
             "(N / W rows for the build and the sharded searches, the replica for the replicated ones).", "",
             "| GPUs | rows | build (time vs one GPU's N / W) | sharded q/s, recall | partitioned q/s, recall "
             "(probes) | replicated, batch of the query set / big batch | exact knn |",
             "|---:|---:|---|---|---|---|---|"]
    for r in runs:
        nan = float("nan")
        lines.append(
            f"| {r['world']} | {r['n']:,} | {r['build_ratio']:.2f}x | {r['sharded_qps_ratio']:.2f}x, "
            f"{r.get('sharded_recall', nan):.4f} | {r.get('partitioned_qps_ratio', nan):.2f}x, "  # runs before it: nan
            f"{r.get('partitioned_recall', nan):.4f} ({r.get('probes')}) | {r['replicated_speedup']:.2f}x / "
            f"{r['replicated_big_speedup']:.2f}x | {r['exact_speedup']:.2f}x |")
    return write_lines(os.path.join(out, f"distributed_{runs[-1]['data']}_table.md"), lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=10000000,d=384,clusters=10000,queries=10000")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--big-batch", type=int, default=100_000,
                   help="queries of the second replicated measurement (the query set repeated)")
    p.add_argument("--probes", default="2", help="shards a query visits in the partitioned index "
                   "(auto: as many as the partition's borders ask)")
    p.add_argument("--cells", type=int, default=1, help="k-means cells a rank of the partitioned index")
    p.add_argument("--table", nargs="+", help="merge these JSON runs (2, 4 ... GPUs) into one scaling table instead")
    args = p.parse_args()
    if args.table:
        table(args.table, args.out)
        return
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    name, base, queries, _ = load_data(args.data, "cuda")
    n = base.shape[0]
    bounds = [n * r // world for r in range(world + 1)]
    mine = base[bounds[rank]:bounds[rank + 1]].contiguous()
    q_bounds = [queries.shape[0] * r // world for r in range(world + 1)]
    my_queries = queries[q_bounds[rank]:q_bounds[rank + 1]].contiguous()
    grnnd.build(mine[:50_000])  # warm-up
    r = {"data": name, "n": n, "dim": base.shape[1], "world": world, "queries": queries.shape[0], "list_size": LIST,
         "machine": machine(threads=torch.get_num_threads(), cuda=True)}

    own_builds = []
    sharded, r["sharded_build_s"] = seconds_on_ranks(
        timed_locally(lambda: grnnd.distributed.ShardedIndex.build(mine), own_builds), repeat=3)
    r["rank_build_s"] = gather_floats(statistics.median(own_builds), world)
    (d_sh, i_sh), r["sharded_search_s"] = seconds_on_ranks(lambda: sharded.search(my_queries, K, list_size=LIST))
    steps = [sharded_search_steps(sharded, my_queries) for _ in range(3)]
    r["sharded_steps_s"] = {name: gather_floats(statistics.median(s[name] for s in steps), world)
                            for name in steps[0]}
    parted, r["partitioned_build_s"] = seconds_on_ranks(
        lambda: grnnd.distributed.ShardedIndex.build(
            mine, partition=True, probes=None if args.probes == "auto" else int(args.probes), cells=args.cells),
        repeat=1)
    r["probes"] = args.probes
    r["partition_rows"] = gather_floats(float(len(parted.local)), world)
    (_, i_part), r["partitioned_search_s"] = seconds_on_ranks(lambda: parted.search(my_queries, K, list_size=LIST))
    r["partitioned_shards_per_query"] = statistics.mean(gather_floats(parted.shards_per_query, world))
    (_, i_ex), r["exact_knn_s"] = seconds_on_ranks(lambda: grnnd.distributed.knn(mine, my_queries, K))
    replicated = grnnd.distributed.ReplicatedIndex(grnnd.Index.build(base[:bounds[1]].contiguous()))
    (_, i_rep), r["replicated_search_s"] = seconds_on_ranks(lambda: replicated.search(queries, K, list_size=LIST))
    big = queries.repeat((args.big_batch + queries.shape[0] - 1) // queries.shape[0], 1)[:args.big_batch]
    _, r["replicated_big_search_s"] = seconds_on_ranks(lambda: replicated.search(big, K, list_size=LIST))
    # Calls one after another with no synchronisation between them, as a server's loop makes them.
    _, back_to_back = seconds_on_ranks(
        lambda: [replicated.search(queries, K, list_size=LIST) for _ in range(BACK_TO_BACK)])
    r["replicated_back_to_back_s"] = back_to_back / BACK_TO_BACK
    # Everyone's answers on rank 0 for the recall (equal shares: all_gather fits).
    gathered = [torch.empty((q_bounds[1] - q_bounds[0], K), dtype=torch.long, device="cuda") for _ in range(world)]
    sizes_equal = len({q_bounds[j + 1] - q_bounds[j] for j in range(world)}) == 1
    if sizes_equal:
        dist.all_gather(gathered, i_sh)
        sharded_ids = torch.cat(gathered)
        dist.all_gather(gathered, i_part)
        partitioned_ids = torch.cat(gathered)
        dist.all_gather(gathered, i_ex)
        exact_ids = torch.cat(gathered)
    if rank == 0:
        # One GPU alone (the other ranks wait at the barrier below).
        half = base[:bounds[1]].contiguous()
        one_half, r["one_gpu_build_s"] = seconds_on_ranks(lambda: grnnd.Index.build(half), repeat=1, everyone=False)
        _, r["one_gpu_search_s"] = seconds_on_ranks(lambda: one_half.search(queries, K, list_size=LIST), everyone=False)
        (_, i_one), r["one_gpu_replica_search_s"] = seconds_on_ranks(
            lambda: replicated.index.search(queries, K, list_size=LIST), everyone=False)
        _, r["one_gpu_replica_big_search_s"] = seconds_on_ranks(
            lambda: replicated.index.search(big, K, list_size=LIST), everyone=False)
        _, back_to_back = seconds_on_ranks(
            lambda: [replicated.index.search(queries, K, list_size=LIST) for _ in range(BACK_TO_BACK)], everyone=False)
        r["one_gpu_replica_back_to_back_s"] = back_to_back / BACK_TO_BACK
        _, r["one_gpu_share_search_s"] = seconds_on_ranks(
            lambda: replicated.index.search(queries[:q_bounds[1]], K, list_size=LIST), everyone=False)
        (_, truth), r["one_gpu_exact_knn_s"] = seconds_on_ranks(lambda: grnnd.knn(base, queries, K), everyone=False)
        whole = grnnd.Index.build(base)
        r["one_gpu_whole_recall"] = recall(whole.search(queries, K, list_size=LIST)[1], truth)
        # Recall of the replicated index (N / W rows) against those rows' own exact neighbours.
        replica_truth = grnnd.knn(replicated.index.data, queries, K)[1]
        r["replicated_recall"] = recall(i_rep, replica_truth)
        r["one_gpu_replica_recall"] = recall(i_one, replica_truth)
        if sizes_equal:
            r["sharded_recall"] = recall(sharded_ids, truth)
            r["partitioned_recall"] = recall(partitioned_ids, truth)
            r["exact_equal"] = bool(torch.equal(exact_ids, truth))
        r["build_ratio"] = r["sharded_build_s"] / r["one_gpu_build_s"]
        r["sharded_qps_ratio"] = r["one_gpu_search_s"] / r["sharded_search_s"]
        r["partitioned_qps_ratio"] = r["one_gpu_search_s"] / r["partitioned_search_s"]
        r["replicated_speedup"] = r["one_gpu_replica_search_s"] / r["replicated_search_s"]
        r["replicated_big_speedup"] = r["one_gpu_replica_big_search_s"] / r["replicated_big_search_s"]
        r["replicated_back_to_back_speedup"] = r["one_gpu_replica_back_to_back_s"] / r["replicated_back_to_back_s"]
        r["collective_share"] = 1 - max(r["sharded_steps_s"]["local_search_s"]) / r["sharded_search_s"]
        r["exact_speedup"] = r["one_gpu_exact_knn_s"] / r["exact_knn_s"]
        print(json.dumps(r), flush=True)
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"distributed_{name}_w{world}")
        with open(stem + ".json", "w") as f:
            json.dump(r, f, indent=1)
        nq = queries.shape[0]
        lines = [f"# torch_grnnd.distributed, {name} ({n:,} x {r['dim']}), {world} GPUs", "",
                 f"Machine: {machine_line(r['machine'])}. {nq:,} queries, recall@10 at list {LIST}; "
                 f"`torchrun --nproc_per_node={world} -m benchmarks.bench_distributed`.", "",
                 "| | {0} GPUs | one GPU | ratio |".format(world), "|---|---|---|---|",
                 f"| build | {n:,} rows: {r['sharded_build_s']:.2f} s | {n // world:,} rows: "
                 f"{r['one_gpu_build_s']:.2f} s | {r['build_ratio']:.2f}x the time |",
                 f"| sharded search | {nq / r['sharded_search_s']:,.0f} q/s, recall "
                 f"{r.get('sharded_recall', float('nan')):.4f} | {n // world:,} rows: "
                 f"{nq / r['one_gpu_search_s']:,.0f} q/s; all {n:,} rows: recall {r['one_gpu_whole_recall']:.4f} | "
                 f"{r['sharded_qps_ratio']:.2f}x the q/s |",
                 f"| partitioned search, {r['partitioned_shards_per_query']:.2f} of {world} shards a query "
                 f"(probes {args.probes}, {args.cells} cells a rank; built in "
                 f"{r['partitioned_build_s']:.2f} s; rows per rank "
                 f"{' / '.join(f'{v:,.0f}' for v in r['partition_rows'])}) | "
                 f"{nq / r['partitioned_search_s']:,.0f} q/s, recall {r.get('partitioned_recall', float('nan')):.4f} | "
                 f"{n // world:,} rows: {nq / r['one_gpu_search_s']:,.0f} q/s | "
                 f"{r['partitioned_qps_ratio']:.2f}x the q/s |",
                 f"| replicated search ({n // world:,} rows) | {nq / r['replicated_search_s']:,.0f} q/s, recall "
                 f"{r['replicated_recall']:.4f} | {nq / r['one_gpu_replica_search_s']:,.0f} q/s, recall "
                 f"{r['one_gpu_replica_recall']:.4f}; {nq // world:,} queries: "
                 f"{(nq // world) / r['one_gpu_share_search_s']:,.0f} q/s | {r['replicated_speedup']:.2f}x |",
                 f"| replicated search, {args.big_batch:,} queries | {args.big_batch / r['replicated_big_search_s']:,.0f}"
                 f" q/s | {args.big_batch / r['one_gpu_replica_big_search_s']:,.0f} q/s | "
                 f"{r['replicated_big_speedup']:.2f}x |",
                 f"| replicated search, {BACK_TO_BACK} calls of {nq:,} queries back to back | "
                 f"{nq / r['replicated_back_to_back_s']:,.0f} q/s | {nq / r['one_gpu_replica_back_to_back_s']:,.0f} q/s | "
                 f"{r['replicated_back_to_back_speedup']:.2f}x |",
                 f"| exact knn | {r['exact_knn_s'] * 1000:.1f} ms (same ids as one GPU: "
                 f"{r.get('exact_equal')}) | {r['one_gpu_exact_knn_s'] * 1000:.1f} ms | {r['exact_speedup']:.2f}x |"]
        steps = ", ".join(f"{name[:-2].replace('_', ' ')} {' / '.join(f'{t * 1000:.2f}' for t in ts)}"
                          for name, ts in r["sharded_steps_s"].items())
        lines += ["", f"Each rank's own build: {', '.join(f'{t:.2f} s' for t in r['rank_build_s'])}. Steps of one "
                  f"sharded search, ms per rank (synchronised after each): {steps}; the collectives and the "
                  f"merge are {r['collective_share']:.0%} of the search's time."]
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
