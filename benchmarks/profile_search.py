"""The search launches ncu profiles, on real embeddings.

By default: one search per query at batch 1 and 1000 (list 64), and a split batch of 1 (list 16).

    ncu -k regex:search_kernel --set full -o search python -m benchmarks.profile_search DIR/embeddings.pt
    ncu -i search.ncu-rep --page details --section WarpStateStats --section SpeedOfLight

With --batch and --list, one search of that batch at that list instead (one search per query
unless --searches says otherwise; by --codes int8 or int4 if given), over a graph built with
--build's parameters, e.g.

    ncu -k regex:search_kernel --set full -o search python -m benchmarks.profile_search \\
        DIR/embeddings.pt --build update_order=descending --batch 10000 --list 128
"""
import argparse

import torch

import torch_grnnd as grnnd
from benchmarks.common import parse_settings


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a .pt file with 'base' and 'queries' (text_embeddings.py)")
    p.add_argument("--build", default="", help="build parameters, e.g. update_order=descending")
    p.add_argument("--batch", type=int, default=0, help="profile this batch only")
    p.add_argument("--list", type=int, default=64, help="list_size with --batch")
    p.add_argument("--searches", type=int, default=1, help="searches per query with --batch (0 = automatic)")
    p.add_argument("--codes", default="", help="search by these codes (int8, int4) with --batch")
    args = p.parse_args()
    blob = torch.load(args.data, map_location="cuda")
    data, queries = blob["base"].contiguous(), blob["queries"].contiguous()
    graph = grnnd.build(data, **parse_settings(args.build))
    if args.batch:
        codes = grnnd.encode(data, args.codes) if args.codes else None
        grnnd.search(data, graph, queries[:args.batch], 10, list_size=args.list, searches=args.searches, codes=codes)
    else:
        for batch in (1, 1000):
            grnnd.search(data, graph, queries[:batch], 10, list_size=64, searches=1)
        grnnd.search(data, graph, queries[:1], 10, list_size=16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
