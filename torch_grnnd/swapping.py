"""Rows that stay in host memory, searched shard by shard: GGNN's swapping mode (seed 001).

Two ways search rows that the GPU does not hold; which is faster depends on the batch:

- **Unified reads**: keep the rows in pinned host memory and the graph on the GPU, and call
  :func:`torch_grnnd.search` (or :class:`~torch_grnnd.Index`) with them as they are: the search
  kernel reads each row it measures over the bus. The cost is per distance, so it suits small
  and medium batches and any graph (an out-of-core build's, say).
- **Swapping** (:class:`SwappingIndex`): each shard of consecutive rows has a graph of its own;
  a batch is searched on every shard in turn while the next shard is copied in on a second
  stream, and the shards' k best are merged. Every batch reads every row over the bus once, so
  the cost is per batch: it suits large batches, and searching every shard gives higher recall
  at a list size than one graph over all rows.

On one H100, 10M clustered float16 rows, recall@10 (benchmarks/bench_host_search.py,
results/host_search_h100_d1024.md and _d128.md): at 1024-d within 8 GB, unified reads served
1 871 / 18 048 queries/s at batches of 100 / 1 000 against swapping's 231 / 2 269; at batch
10 000 swapping served 23 968 queries/s at 0.993 against unified reads' 18 561 at 0.980 (list
64 both), and 23 105 at 0.997 against 10 633 at 0.996 (list 128). At 128-d the same order:
unified reads 4-6x ahead up to batch 1 000, swapping 2.4x ahead at 10 000. Unified reads are
bound by the bytes they move (a team of 4 to 32 lanes per row made no difference), so their
cost grows with the row width and the distances a query computes.

On the CPU the shards are searched where they lie (no copies): the same results as the GPU's
up to float summation order, which is what CI checks.
"""
import dataclasses
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .memory import free_bytes, parse_bytes, shard_bytes_per_row, within_budget
from .params import BuildParams, SearchParams
from .progress import Progress, steps_reporter
from .index import check_state
from .results import best_k


class SwappingIndex:
    """Host rows cut into shards of consecutive rows, a graph per shard, searched shard by shard.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> rows = torch.randn(3000, 16)
        >>> index = grnnd.SwappingIndex.build(rows, device="cpu", shard_rows=1000)
        >>> len(index.graphs)
        3
        >>> index.search(rows[:2], k=1)[1].flatten().tolist()
        [0, 1]
    """

    def __init__(self, data: Tensor, graphs: List[Tensor], metric: ops.Metric = "l2",
                 build_params: Optional[BuildParams] = None, device: Union[str, torch.device] = "cpu"):
        """Wrap host ``data`` [N, D] and one graph per shard (int32 [rows, degree] of shard-local
        ids, in row order; the shards are the consecutive runs of rows the graphs' lengths give),
        searched on ``device``."""
        if sum(g.shape[0] for g in graphs) != data.shape[0] or not graphs:
            raise ValueError(f"graphs: expected shards covering the {data.shape[0]} rows, got "
                             f"{[g.shape[0] for g in graphs]} rows")
        self.data, self.graphs, self.metric = data, graphs, metric
        self.build_params = build_params if build_params is not None else BuildParams()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        ends = torch.tensor([g.shape[0] for g in graphs]).cumsum(0).tolist()
        self.bounds: List[Tuple[int, int]] = list(zip([0] + ends[:-1], ends))

    @classmethod
    def build(cls, data: Tensor, params: Optional[BuildParams] = None, *, metric: ops.Metric = "l2",
              device: Union[str, torch.device] = "cuda", max_gpu_memory: Optional[Union[int, str]] = None,
              shard_rows: Optional[int] = None, progress: Progress = False, **settings: Any) -> "SwappingIndex":
        """Build a graph for each shard of ``data`` (host rows, pinned for the fastest copies) on
        ``device``, one shard after another. The shards are ``shard_rows`` rows, or as many as fit
        ``max_gpu_memory`` (bytes or a size like ``"8GB"``; default: what is free on a GPU) for
        the larger of a shard's build and two shards' rows and graphs (one searched, one coming
        in). ``progress`` counts the rows built. The graphs stay in (pinned) host memory."""
        params = BuildParams.merge(params, **settings)
        shard_params = within_budget(params)  # the shards' builds and their plan: the rows unless asked
        device = torch.device(device)
        if data.device.type != "cpu":
            raise ValueError(f"data: expected rows in host memory, got rows on {data.device} (use Index there)")
        if shard_rows is None:
            if max_gpu_memory is None and device.type != "cuda":
                raise ValueError("SwappingIndex.build: give shard_rows or max_gpu_memory on the CPU")
            budget = parse_bytes(max_gpu_memory) if max_gpu_memory is not None else free_bytes(device)
            shard_rows = budget // swapping_bytes_per_row(data.shape[1], data.element_size(), shard_params, metric)
            if shard_rows < 2 * params.pool_size:
                raise ValueError(f"max_gpu_memory: {budget} bytes hold only {shard_rows} rows of a shard; "
                                 "give it more")
        if shard_rows < 1:
            raise ValueError(f"shard_rows: expected >= 1, got {shard_rows}")
        report, close = steps_reporter(progress, "swapping index build (rows built)")
        graphs = []
        try:
            for start in range(0, data.shape[0], shard_rows):
                rows = data[start:start + shard_rows]
                graph = ops.build(rows.to(device, non_blocking=True), shard_params, metric=metric)
                if device.type == "cuda":  # pinned, so that each search copies it in at full speed
                    graph = torch.empty(graph.shape, dtype=graph.dtype, pin_memory=True).copy_(graph)
                graphs.append(graph)
                report(start + rows.shape[0], data.shape[0])
        finally:
            close()
        return cls(data, graphs, metric, params, device)

    def search(self, queries: Tensor, k: Optional[int] = None, *, params: Optional[SearchParams] = None,
               **settings: Any) -> Tuple[Tensor, Tensor]:
        """``(dists, ids)`` of the k nearest rows of each query (queries on the index's device),
        as :func:`torch_grnnd.search` gives them; a ``filter`` is over all rows."""
        p = SearchParams.merge(params, k=k, **settings)
        if queries.device != self.device:
            raise ValueError(f"queries: expected them on {self.device}, where this index searches, got "
                             f"{queries.device}")
        if p.filter is not None and p.filter.shape != (self.data.shape[0],):
            raise ValueError(f"filter: expected shape [{self.data.shape[0]}] (one flag per row), "
                             f"got {tuple(p.filter.shape)}")
        if not 1 <= p.k <= self.data.shape[0]:
            raise ValueError(f"k: expected 1 <= k <= {self.data.shape[0]} (number of data rows), got {p.k}")
        found_dists, found_ids = [], []
        for (start, end), (rows, graph) in zip(self.bounds, self._shards()):
            allowed = None if p.filter is None else p.filter[start:end].to(self.device)
            k_here = min(p.k, end - start)
            dists, ids = ops.search(rows, graph, queries, params=p.replace(k=k_here, filter=allowed),
                                    metric=self.metric)
            found_dists.append(dists)
            found_ids.append(torch.where(ids >= 0, ids + start, ids))
        # The k best of the shards' k best, ties by id as every merge of parts (results.py).
        return best_k(torch.cat(found_dists, 1), torch.cat(found_ids, 1), p.k)

    def _shards(self):
        """(rows, graph) of each shard on the search's device in turn: on a GPU the next shard is
        copied in on a second stream while the one before it is searched."""
        if self.device.type != "cuda":
            yield from ((self.data[start:end], graph) for (start, end), graph in zip(self.bounds, self.graphs))
            return
        copies, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)

        def load(i: int) -> Tuple[Tensor, Tensor]:
            start, end = self.bounds[i]
            with torch.cuda.stream(copies):
                return (self.data[start:end].to(self.device, non_blocking=True),
                        self.graphs[i].to(self.device, non_blocking=True))

        coming = load(0)
        for i in range(len(self.bounds)):
            current.wait_stream(copies)
            rows, graph = coming
            for t in (rows, graph):  # allocated on the copy stream, read on this one
                t.record_stream(current)
            if i + 1 < len(self.bounds):
                coming = load(i + 1)
            yield rows, graph

    def __len__(self) -> int:
        return self.data.shape[0]

    def state_dict(self) -> Dict[str, Any]:
        """The rows, the shards' graphs and the settings, as tensors, strings and numbers."""
        return {"data": self.data, "graphs": list(self.graphs), "metric": self.metric,
                "build_params": dataclasses.asdict(self.build_params)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], device: Union[str, torch.device] = "cpu") -> "SwappingIndex":
        """Inverse of :meth:`state_dict`, searching on ``device``."""
        missing = {"data", "graphs", "metric"} - set(state)
        if missing:
            raise ValueError(f"state: missing keys {sorted(missing)}")
        data, graphs = state["data"], state["graphs"]
        if not isinstance(graphs, (list, tuple)) or not graphs:
            raise ValueError("state: graphs must be a non-empty list of one graph per shard")
        if not isinstance(data, Tensor) or data.dim() != 2:
            raise TypeError("state: data must be a 2-D floating-point tensor")
        start = 0
        for graph in graphs:  # each shard's graph against its own rows, as Index checks its one graph
            rows = graph.shape[0] if isinstance(graph, Tensor) and graph.dim() == 2 else -1
            if rows < 0 or start + rows > data.shape[0]:
                raise ValueError(f"state: graphs must be 2-D and cover the {data.shape[0]} rows in order")
            check_state(data[start:start + rows], graph, state["metric"])
            start += rows
        return cls(state["data"], list(state["graphs"]), state["metric"],
                   BuildParams().replace(**state.get("build_params", {})), device)

    def __repr__(self) -> str:
        return (f"SwappingIndex(n={len(self)}, dim={self.data.shape[1]}, shards={len(self.graphs)}, "
                f"metric={self.metric!r}, device={self.device})")


def swapping_bytes_per_row(dim: int, element_size: int, p: BuildParams, metric: str = "l2") -> int:
    """Device bytes a shard needs per row: its build, or two shards' rows and graphs at search."""
    return max(shard_bytes_per_row(dim, element_size, p, metric), 2 * (dim * element_size + p.degree * 4))
