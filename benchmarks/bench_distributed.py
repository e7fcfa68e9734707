"""torch_grnnd.distributed on several GPUs against one GPU, same run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_distributed.py \\
        --data clustered:n=10000000,d=384,clusters=10000,queries=10000

Every rank makes the same data (``--data`` as benchmarks/bench_gpu.py reads it, all N rows) and
takes its share as its shard. Rank 0 also runs the one-GPU baselines while the others wait:
  build      ShardedIndex.build of N rows on W GPUs  vs  Index.build of N / W rows on one GPU;
  sharded    search of the queries (each rank a share) over all shards  vs  one GPU's index of
             N / W rows searching all the queries (the issue's "half the data"); recall against
             exact neighbours of all N rows, and one GPU's index of all N rows at the same list;
  replicated the index of N / W rows on every rank, the batch split  vs  that index on one GPU;
  exact      distributed.knn of the queries over the shards  vs  grnnd.knn over all N on one GPU.
Wall-clock seconds after a CUDA synchronisation and a barrier, median of 3. Writes
distributed_<name>_w<W>.{json,md} under --out (rank 0).
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
from benchmarks.bench_gpu import load_data  # noqa: E402
from benchmarks.report import machine, machine_line  # noqa: E402

K, LIST = 10, 64


def seconds(fn, repeat: int = 3, everyone: bool = True):
    """(result, median seconds) of fn; with `everyone` all ranks run it between barriers."""
    times, out = [], None
    for _ in range(repeat):
        if everyone:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        if everyone:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    return torch.isin(found, truth).float().sum().item() / truth.numel()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="clustered:n=10000000,d=384,clusters=10000,queries=10000")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
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

    sharded, r["sharded_build_s"] = seconds(lambda: grnnd.distributed.ShardedIndex.build(mine), repeat=1)
    (d_sh, i_sh), r["sharded_search_s"] = seconds(lambda: sharded.search(my_queries, K, list_size=LIST))
    (_, i_ex), r["exact_knn_s"] = seconds(lambda: grnnd.distributed.knn(mine, my_queries, K))
    replicated = grnnd.distributed.ReplicatedIndex(grnnd.Index.build(base[:bounds[1]].contiguous()))
    _, r["replicated_search_s"] = seconds(lambda: replicated.search(queries, K, list_size=LIST))
    # Everyone's answers on rank 0 for the recall (equal shares: all_gather fits).
    gathered = [torch.empty((q_bounds[1] - q_bounds[0], K), dtype=torch.long, device="cuda") for _ in range(world)]
    sizes_equal = len({q_bounds[j + 1] - q_bounds[j] for j in range(world)}) == 1
    if sizes_equal:
        dist.all_gather(gathered, i_sh)
        sharded_ids = torch.cat(gathered)
        dist.all_gather(gathered, i_ex)
        exact_ids = torch.cat(gathered)
    if rank == 0:
        # One GPU alone (the other ranks wait at the barrier below).
        half = base[:bounds[1]].contiguous()
        one_half, r["one_gpu_build_s"] = seconds(lambda: grnnd.Index.build(half), repeat=1, everyone=False)
        _, r["one_gpu_search_s"] = seconds(lambda: one_half.search(queries, K, list_size=LIST), everyone=False)
        _, r["one_gpu_replica_search_s"] = seconds(lambda: replicated.index.search(queries, K, list_size=LIST),
                                                   everyone=False)
        (_, truth), r["one_gpu_exact_knn_s"] = seconds(lambda: grnnd.knn(base, queries, K), everyone=False)
        whole = grnnd.Index.build(base)
        r["one_gpu_whole_recall"] = recall(whole.search(queries, K, list_size=LIST)[1], truth)
        if sizes_equal:
            r["sharded_recall"] = recall(sharded_ids, truth)
            r["exact_equal"] = bool(torch.equal(exact_ids, truth))
        r["build_ratio"] = r["sharded_build_s"] / r["one_gpu_build_s"]
        r["sharded_qps_ratio"] = r["one_gpu_search_s"] / r["sharded_search_s"]
        r["replicated_speedup"] = r["one_gpu_replica_search_s"] / r["replicated_search_s"]
        r["exact_speedup"] = r["one_gpu_exact_knn_s"] / r["exact_knn_s"]
        print(json.dumps(r), flush=True)
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"distributed_{name}_w{world}")
        with open(stem + ".json", "w") as f:
            json.dump(r, f, indent=1)
        nq = queries.shape[0]
        lines = [f"# torch_grnnd.distributed, {name} ({n:,} x {r['dim']}), {world} GPUs", "",
                 f"Machine: {machine_line(r['machine'])}. {nq:,} queries, recall@10 at list {LIST}; "
                 f"`torchrun --nproc_per_node={world} benchmarks/bench_distributed.py`.", "",
                 "| | {0} GPUs | one GPU | ratio |".format(world), "|---|---|---|---|",
                 f"| build | {n:,} rows: {r['sharded_build_s']:.2f} s | {n // world:,} rows: "
                 f"{r['one_gpu_build_s']:.2f} s | {r['build_ratio']:.2f}x the time |",
                 f"| sharded search | {nq / r['sharded_search_s']:,.0f} q/s, recall "
                 f"{r.get('sharded_recall', float('nan')):.4f} | {n // world:,} rows: "
                 f"{nq / r['one_gpu_search_s']:,.0f} q/s; all {n:,} rows: recall {r['one_gpu_whole_recall']:.4f} | "
                 f"{r['sharded_qps_ratio']:.2f}x the q/s |",
                 f"| replicated search ({n // world:,} rows) | {nq / r['replicated_search_s']:,.0f} q/s | "
                 f"{nq / r['one_gpu_replica_search_s']:,.0f} q/s | {r['replicated_speedup']:.2f}x |",
                 f"| exact knn | {r['exact_knn_s'] * 1000:.1f} ms (same ids as one GPU: "
                 f"{r.get('exact_equal')}) | {r['one_gpu_exact_knn_s'] * 1000:.1f} ms | {r['exact_speedup']:.2f}x |"]
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
