"""What the benchmark scripts share beyond data (datasets.py) and reports (report.py): timing,
build settings from the command line, plain-PyTorch exact search, and the update benchmarks'
command line and recall."""
import argparse
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import torch_grnnd as grnnd
from benchmarks.datasets import load_data


def cuda_time(fn, repeat: int = 1):
    """(result, seconds per call) by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) / 1000 / repeat


def timed(fn, device: torch.device):
    """(result, seconds) of one call."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / 1000
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def synchronise(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_on_ranks(fn, repeat: int = 9, everyone: bool = True, device: Optional[torch.device] = None):
    """(result, median seconds) of fn, each run synchronised with ``device`` (the current GPU
    unless given). With `everyone` all ranks start a run together (a barrier) and it takes as long
    as its slowest rank: each rank's own time to its synchronisation, the longest of them (a
    barrier after the work would add its own round trip to every run)."""
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    times, out = [], None
    for _ in range(repeat):
        if everyone:
            dist.barrier()
        synchronise(device)
        start = time.perf_counter()
        out = fn()
        synchronise(device)
        times.append(time.perf_counter() - start)
    if everyone:
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
    return out, statistics.median(times)


def back_to_back_ms(run, slices: list, calls: int, device: torch.device) -> float:
    """Milliseconds a call takes as a caller sees it: ``calls`` calls of ``run`` back to back from
    Python, on ``slices`` in turn, then a synchronisation, wall clock; the median of five timings
    (one timing of a batch of 1 000 swung by +-20% between runs of the same code)."""
    timings = []
    for _ in range(5):
        synchronise(device)
        start = time.perf_counter()
        for call in range(calls):
            run(slices[call % len(slices)])
        synchronise(device)
        timings.append((time.perf_counter() - start) / calls * 1000)
    return statistics.median(timings)


def median_ms(fn, repeat: int = 10, device: str = "cuda") -> float:
    """Median milliseconds of ``repeat`` calls after a warm-up: CUDA events, or the wall clock
    for ``device="cpu"``."""
    fn()
    times = []
    for _ in range(repeat):
        if device == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parse_settings(text: str) -> dict:
    """"pool_size=64,reverse_ratio=0.8,update_order=descending,pair_codes=False" -> keyword arguments of build."""
    def value(v: str):
        if v in ("True", "False"):
            return v == "True"
        return float(v) if "." in v else int(v) if v.lstrip("-").isdigit() else v
    return {k: value(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def brute_force(base: torch.Tensor, queries: torch.Tensor, k: int, dtype: torch.dtype, chunk: int = 2048,
                max_scores: int = 2**31):
    """Plain PyTorch exact search: ||x||^2 - 2 q.X^T per query chunk, then topk. Chunks of at most
    max_scores scores (8 GiB in float32): 2048 queries up to 1M rows, fewer beyond."""
    x = base.to(dtype)
    x_norm = x.float().pow(2).sum(1)
    ids = []
    for q in queries.to(dtype).split(max(1, min(chunk, max_scores // base.shape[0]))):
        scores = x_norm - 2 * (q @ x.T).float()
        ids.append(scores.topk(k, dim=1, largest=False).indices)
    return torch.cat(ids)


def exact_knn_graph(base: torch.Tensor, k: int, chunk: int = 4096):
    """Plain PyTorch exact k-NN graph of all rows (self excluded), float16 matmul."""
    x_norm = base.float().pow(2).sum(1)
    out = []
    for s in range(0, base.shape[0], chunk):
        q = base[s:s + chunk]
        scores = x_norm - 2 * (q @ base.T).float()
        scores[torch.arange(q.shape[0], device=q.device), torch.arange(s, s + q.shape[0], device=q.device)] = float("inf")
        out.append(scores.topk(k, dim=1, largest=False).indices)
    return torch.cat(out)


# The update benchmarks (bench_update.py, bench_merge.py): recall@K at list LIST.
LIST = 64
K = 10


def recall(index: grnnd.Index, queries: torch.Tensor, truth: torch.Tensor) -> float:
    """recall@10 of the index's ids against ``truth`` (ids of the same kind)."""
    found = index.search(queries, K, list_size=LIST)[1]
    return grnnd.recall(found, truth, K)


def setup(description: str, data: str, arguments=None):
    """The command line of the update benchmarks (--data, --device, --out, and whatever
    ``arguments(parser)`` adds), the data loaded (float32 on the CPU) and a warm-up build:
    ``(args, device, name, base, queries)``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=data)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results")
    if arguments is not None:
        arguments(p)
    args = p.parse_args()
    # The command as the result files quote it: the script with the arguments it was given but --out.
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    args.command = " ".join([f"python -m benchmarks.{script}"] + [
        f"--{key} {value}" for key, value in vars(args).items() if key != "out" and value != p.get_default(key)])
    device = torch.device(args.device)
    name, base, queries, _ = load_data(args.data, device)
    if device.type == "cpu":
        base, queries = base.float(), queries.float()
    # Warm-up. On the GPU the first build of a size also grows the caching allocator's pool,
    # which every later build finds ready: on one H100 a first build of 1M x 384 rows took 0.71 s
    # against 0.47 s. So the whole data set is built once before anything is timed.
    grnnd.build(base if device.type == "cuda" else base[: min(50_000, base.shape[0])])
    return args, device, name, base, queries
