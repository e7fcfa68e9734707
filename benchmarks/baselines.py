"""The faiss-cpu graph indexes the CPU benchmarks compare against (bench_cpu.py, tune_build.py):
each builds on float32 rows and searches with its own list-size setting."""
import faiss
import numpy as np
import torch

K = 10


class FaissHNSW:
    sweep_name = "efSearch"

    def __init__(self, m=32, ef_construction=40):
        self.m, self.efc = m, ef_construction
        self.name = f"faiss HNSWFlat M={m} efC={ef_construction}"

    def build(self, base, metric):
        assert metric == "l2", "faiss baselines here are L2 (normalised embeddings: same ranking as cosine)"
        self.index = faiss.IndexHNSWFlat(base.shape[1], self.m)
        self.index.hnsw.efConstruction = self.efc
        self.index.add(np.ascontiguousarray(base.numpy()))

    def search(self, queries, param):
        self.index.hnsw.efSearch = max(param, K)
        return torch.from_numpy(self.index.search(np.ascontiguousarray(queries.numpy()), K)[1])

    def describe(self):
        return {"M": self.m, "efConstruction": self.efc}


class FaissNNDescent:
    sweep_name = "search_L"

    def __init__(self, k=32):
        self.k = k
        self.name = f"faiss NNDescentFlat K={k}"

    def build(self, base, metric):
        assert metric == "l2"
        self.index = faiss.IndexNNDescentFlat(base.shape[1], self.k)
        self.index.verbose = False
        self.index.add(np.ascontiguousarray(base.numpy()))

    def search(self, queries, param):
        self.index.nndescent.search_L = max(param, K)
        return torch.from_numpy(self.index.search(np.ascontiguousarray(queries.numpy()), K)[1])

    def describe(self):
        n = self.index.nndescent
        return {"K": self.k, "S": n.S, "R": n.R, "L": n.L, "iter": n.iter}
