"""Build time of the families at the defaults, one line a set, for alternating builds of the extension.

    python -m benchmarks.bench_build_time --sets zipf_aniso:10000000x1024,blobs:1000000x384 --label before

For each set (benchmarks/datasets.py's families, float16 on the GPU): a warm-up build of its
first 100 000 rows, then two builds of all rows timed with CUDA events, a checksum of the first
build's graph (equal checksums: the same graph; builds of millions of rows insert concurrently
and differ from run to run) and its recall@10 of the 1 000 in queries at lists 64 and 256 against
exact results (torch_grnnd.knn). A before/after runs this once per extension, alternating, in one
call on one GPU: the line's label says which.
"""
import argparse

import torch

import torch_grnnd as grnnd
from benchmarks.common import cuda_time
from benchmarks.datasets import make_set, parse_sets

LISTS = (64, 256)


def checksum(graph: torch.Tensor) -> tuple:
    """Two sums of the graph's ids, one weighted by their places in the row."""
    places = torch.arange(1, graph.shape[1] + 1, device=graph.device)
    return int((graph.long() * places).sum()), int(graph.long().pow(2).sum())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", required=True, help="comma-separated family:NxD, as bench_scale's --sets")
    p.add_argument("--label", default="", help="names the extension the line measured (before, after)")
    args = p.parse_args()
    for family, n, d in parse_sets(args.sets):
        base, queries = (t.cuda() for t in make_set(family, n, d))
        _, truth = grnnd.knn(base, queries, 10)
        grnnd.build(base[:100_000])
        graph, first = cuda_time(lambda: grnnd.build(base))
        _, second = cuda_time(lambda: grnnd.build(base))
        recall = [grnnd.recall(grnnd.search(base, graph, queries, 10, list_size=size)[1], truth, 10) for size in LISTS]
        print(f"{args.label} {family}:{n}x{d} on {torch.cuda.get_device_name()}: build {first:.3f} {second:.3f} s, "
              f"degree {graph.shape[1]}, checksum {checksum(graph)}, recall@10 list "
              f"{' / '.join(map(str, LISTS))} {' / '.join(f'{r:.4f}' for r in recall)}", flush=True)
        del base, queries, truth, graph
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
