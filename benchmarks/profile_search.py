"""The search launches ncu profiles: one search per query at batch 1 and 1000 (list 64), and a
split batch of 1 (list 16).

    ncu -k regex:search_kernel --set full -o search python benchmarks/profile_search.py DIR/embeddings.pt
    ncu -i search.ncu-rep --page details --section WarpStateStats --section SpeedOfLight
"""
import sys

import torch

import torch_grnnd as grnnd


def main(path: str):
    blob = torch.load(path, map_location="cuda")
    data, queries = blob["base"].contiguous(), blob["queries"].contiguous()
    graph = grnnd.build(data)
    for batch in (1, 1000):
        grnnd.search(data, graph, queries[:batch], 10, list_size=64, searches=1)
    grnnd.search(data, graph, queries[:1], 10, list_size=16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
