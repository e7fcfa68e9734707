"""A searchable index: the vectors, their GRNND graph, and how they were built."""
import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .params import BuildParams, SearchParams
from .progress import Progress


class Index:
    """Vectors plus their GRNND graph, searchable in batches.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> emb = torch.randn(2000, 32)
        >>> index = grnnd.Index.build(emb, metric="cosine")
        >>> dists, ids = index.search(emb[:4], k=5)
        >>> ids.shape
        torch.Size([4, 5])
        >>> state = index.state_dict()          # plain tensors and numbers: torch.save works
        >>> grnnd.Index.from_state_dict(state).search(emb[:4], k=5)[1].equal(ids)
        True
    """

    def __init__(self, data: Tensor, graph: Tensor, metric: ops.Metric = "l2",
                 build_params: Optional[BuildParams] = None):
        """Wrap existing ``data`` and the ``graph`` that ``build`` made of it (no copy)."""
        self.data = data
        self.graph = graph
        self.metric = metric
        self.build_params = build_params if build_params is not None else BuildParams()

    @classmethod
    def build(cls, data: Tensor, params: Optional[BuildParams] = None, *, metric: ops.Metric = "l2",
              progress: Progress = False, **settings: Any) -> "Index":
        """Build the graph of ``data`` with :func:`torch_grnnd.build`'s ``params`` and
        ``settings`` (kept in :meth:`state_dict`); ``progress`` reports the build (not kept)."""
        params = BuildParams.merge(params, **settings)
        graph = ops.build(data, params, metric=metric, progress=progress)
        return cls(data, graph, metric, params)

    def search(self, queries: Tensor, k: Optional[int] = None, *, params: Optional[SearchParams] = None,
               **settings: Any) -> Tuple[Tensor, Tensor]:
        """``(dists, ids)`` of the k nearest rows of each query; see :func:`torch_grnnd.search`."""
        return ops.search(self.data, self.graph, queries, k, params=params, metric=self.metric, **settings)

    def __len__(self) -> int:
        return self.data.shape[0]

    @property
    def dim(self) -> int:
        return self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> "Index":
        """The same index with its tensors on ``device``."""
        return Index(self.data.to(device), self.graph.to(device), self.metric, self.build_params)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to restore the index, as tensors, strings and numbers."""
        return {"data": self.data, "graph": self.graph, "metric": self.metric,
                "build_params": dataclasses.asdict(self.build_params)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "Index":
        """Inverse of :meth:`state_dict` (e.g. after ``torch.load(path, weights_only=True)``).

        Raises on missing keys and on anything :func:`check_state` rejects."""
        missing = {"data", "graph", "metric"} - set(state)
        if missing:
            raise ValueError(f"state: missing keys {sorted(missing)}")
        data, graph, metric = state["data"], state["graph"], state["metric"]
        check_state(data, graph, metric)
        return cls(data, graph, metric, BuildParams().replace(**state.get("build_params", {})))

    def __repr__(self) -> str:
        return (f"Index(n={len(self)}, dim={self.dim}, degree={self.graph.shape[1]}, metric={self.metric!r}, "
                f"dtype={self.data.dtype}, device={self.device})")


def check_state(data: Any, graph: Any, metric: Any) -> None:
    """Reject a restored index that a damaged or foreign file could hold: tensors of the wrong
    kind or shape, graph ids outside the data (one scan of the graph), an unknown metric."""
    for key, value in (("data", data), ("graph", graph)):
        if not isinstance(value, Tensor):
            raise TypeError(f"state: {key} must be a tensor, got {type(value).__name__}")
    if not data.is_floating_point() or data.dim() != 2:
        raise TypeError(f"state: data must be a 2-D floating-point tensor, got {data.dtype} of shape "
                        f"{tuple(data.shape)}")
    if graph.dtype != torch.int32:
        raise TypeError(f"state: graph must be int32 (as build returns), got {graph.dtype}")
    if graph.dim() != 2 or graph.shape[0] != data.shape[0]:
        raise ValueError(f"state: graph of shape {tuple(graph.shape)} does not fit data of shape "
                         f"{tuple(data.shape)}")
    if graph.device != data.device:
        raise ValueError(f"state: data is on {data.device} but graph is on {graph.device}")
    if graph.numel() > 0:
        lo, hi = (int(v) for v in torch.aminmax(graph))
        if lo < -1 or hi >= data.shape[0]:
            raise ValueError(f"state: graph ids must lie in [0, {data.shape[0]}) with -1 as padding, found "
                             f"{lo if lo < -1 else hi}")
    if metric not in ("l2", "ip", "cosine"):
        raise ValueError(f'state: metric must be "l2", "ip" or "cosine", got {metric!r}')
