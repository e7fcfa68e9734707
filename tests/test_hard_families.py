"""The scale issue's hard family at 200k rows on both twins: clusters of Zipf-distributed sizes,
most of a few rows, with per-cluster anisotropic noise, inside one another (``zipf_tiny`` of
benchmarks/datasets.py), searched by queries drawn like the rows ("in") and by queries of clusters
chosen uniformly ("rare": the small categories). The library's defaults against faiss HNSW (M 32,
efConstruction 40) at the same list (ef) of 64, and exact neighbours from faiss."""
import os
import sys

import faiss
import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, exact_neighbours

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.datasets import make_rare_queries, make_set  # noqa: E402

ROWS, DIM, QUERIES, LIST = 200_000, 64, 500, 64


@pytest.fixture(scope="module")
def hard_family():
    """(rows, {query set: queries}, {query set: exact ids}), float32 on the CPU."""
    rows, queries = make_set("zipf_tiny", ROWS, DIM, device="cpu")
    rare, _ = make_rare_queries("zipf_tiny", ROWS, DIM, device="cpu")
    rows = rows.float()
    sets = {"in": queries[:QUERIES].float(), "rare": rare[:QUERIES].float()}
    return rows, sets, {name: exact_neighbours(rows, q, 10)[1] for name, q in sets.items()}


@pytest.fixture(scope="module")
def hnsw_recall(hard_family):
    rows, sets, truth = hard_family
    index = faiss.IndexHNSWFlat(DIM, 32)
    index.hnsw.efConstruction = 40
    index.add(rows.numpy())
    index.hnsw.efSearch = LIST
    return {name: grnnd.recall(torch.from_numpy(index.search(q.numpy(), 10)[1]), truth[name], 10)
            for name, q in sets.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_the_hard_family_at_200k_rows_is_ahead_of_hnsw(device, hard_family, hnsw_recall):
    # Measured on the CPU (2 threads): in 0.971 against HNSW's 0.955, rare 0.862 against 0.820.
    # The rare queries' true neighbours lie in clusters of a few rows inside big ones, which only
    # the long links a build leaves reach (benchmarks/README.md, "What reaches the rare queries").
    rows, sets, truth = hard_family
    x = rows.to(device)
    graph = grnnd.build(x)
    recall = {name: grnnd.recall(grnnd.search(x, graph, q.to(device), 10, list_size=LIST)[1].cpu(), truth[name], 10)
              for name, q in sets.items()}
    assert recall["in"] > hnsw_recall["in"] and recall["rare"] > hnsw_recall["rare"], (recall, hnsw_recall)
    assert recall["in"] >= 0.95 and recall["rare"] >= 0.83, recall
