"""Neural-network layers: the k-NN graph of a batch, and a searchable index held by a model.

Both work under ``torch.compile(fullgraph=True)`` (``KNNGraph`` without ``batch``), and the
distances they return carry gradients to the embeddings (see :mod:`torch_grnnd.autograd`).
"""
import dataclasses
import threading
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .graph import check_flow, knn_graph
from .index import Index, _locks, _own_storage, check_ids, check_next_id, check_removed, check_state
from .ops import Metric
from .params import BuildParams, SearchParams
from .progress import Progress


class KNNGraph(nn.Module):
    """k-NN graph of the rows of its input, as in :func:`torch_grnnd.knn_graph`.

    ``forward(x, batch=None)`` returns ``(edge_index [2, N * k], dists [N * k])``: PyG's edge
    convention (``flow``), and each edge's distance, differentiable with respect to ``x``.
    With ``batch`` (sorted int64 [N]) every example gets its own graph (``batch_size``, the number
    of examples, spares reading it: see :func:`torch_grnnd.knn_graph`). ``loop=True`` makes the
    self loop one of each point's k edges; an example of k points or fewer gives what it has
    (torch_cluster's semantics). :class:`torch_grnnd.pyg.KNNGraph` is this module as PyG's
    transform: PyG's arguments, a data object in and out, torch_cluster's edges.

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> layer = grnnd.nn.KNNGraph(k=5, metric="cosine")
        >>> x = torch.randn(300, 16, requires_grad=True)
        >>> edge_index, dists = layer(x)
        >>> edge_index.shape, dists.shape
        (torch.Size([2, 1500]), torch.Size([1500]))
        >>> dists.mean().backward()          # gradients reach the embeddings
        >>> x.grad.shape
        torch.Size([300, 16])
    """

    def __init__(self, k: int, *, metric: Metric = "l2", exact: bool = False, loop: bool = False,
                 flow: str = "source_to_target", list_size: int = 0, seed: int = 0):
        super().__init__()
        check_flow(flow)
        self.k, self.metric, self.exact, self.loop, self.flow = k, metric, exact, loop, flow
        self.list_size, self.seed = list_size, seed

    def forward(self, x: Tensor, batch: Optional[Tensor] = None,
                batch_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        return knn_graph(x, self.k, batch, metric=self.metric, exact=self.exact, loop=self.loop, flow=self.flow,
                         list_size=self.list_size, seed=self.seed, return_distances=True, batch_size=batch_size)

    def extra_repr(self) -> str:
        return f"k={self.k}, metric={self.metric!r}, exact={self.exact}, loop={self.loop}, flow={self.flow!r}"


# Held while a Retriever's buffers and the Index behind them are compared or changed together (a
# few attribute reads and writes): threads then never see one half of an edit's buffers. One lock
# for every retriever, so that a module keeps nothing a copy or a pickle could not take.
_SYNCING = threading.RLock()


class Retriever(nn.Module):
    """A :class:`torch_grnnd.Index` as a module attribute.

    The vectors and their graph are buffers: they are in ``state_dict()``, move with
    ``.to(device)`` and follow ``.half()`` (the graph stays int32). The metric, ``k``,
    ``list_size`` and the build parameters travel in the state dict too, so
    ``Retriever().load_state_dict(state)`` restores the whole index. ``rebuild(emb)`` indexes
    new embeddings (e.g. once per epoch); ``add``, ``remove`` and ``compact`` edit them in place
    (as :class:`~torch_grnnd.Index` does, user ids included); ``forward(queries)`` searches
    them. The indexed rows are detached: distances carry gradients to the queries only (use
    :func:`torch_grnnd.search` on live embeddings for gradients to the data too).

    Example:
        >>> import torch, torch_grnnd as grnnd
        >>> retriever = grnnd.nn.Retriever(torch.randn(1000, 16), k=3, metric="cosine")
        >>> dists, ids = retriever(torch.randn(4, 16))
        >>> ids.shape
        torch.Size([4, 3])
        >>> restored = grnnd.nn.Retriever()
        >>> _ = restored.load_state_dict(retriever.state_dict())
        >>> queries = torch.randn(4, 16)
        >>> restored(queries)[1].equal(retriever(queries)[1])
        True
    """

    def __init__(self, data: Optional[Tensor] = None, *, k: int = 10, metric: Metric = "l2", list_size: int = 0,
                 params: Optional[SearchParams] = None, build_params: Optional[BuildParams] = None,
                 progress: Progress = False, **build_settings: Any):
        """Index ``data`` now, or leave the retriever empty until :meth:`rebuild` or
        :meth:`load_state_dict`. The search settings are ``params`` (a
        :class:`~torch_grnnd.SearchParams`) with ``k`` and ``list_size`` applied; the build's are
        ``build_params`` with ``build_settings`` (fields of :class:`~torch_grnnd.BuildParams`)."""
        super().__init__()
        self.metric = metric
        self.search_params = SearchParams.merge(params, k=k, list_size=list_size)
        self.build_params = BuildParams.merge(build_params, **build_settings)
        self.register_buffer("data", torch.empty(0, 0))
        self.register_buffer("graph", torch.empty(0, 0, dtype=torch.int32))
        # User ids and tombstones; empty when the index has none.
        self.register_buffer("ids", torch.empty(0, dtype=torch.long))
        self.register_buffer("removed", torch.empty(0, dtype=torch.bool))
        self.next_id: Optional[int] = None  # Index.next_id: where the retriever numbers its rows itself
        self._index: Optional[Index] = None  # the buffers as an Index (see index)
        self._index_version = 0  # its version when the buffers last took its tensors
        self._installed: Tuple[Tensor, ...] = ()  # the buffer tensors they took then
        self._register_state_dict_hook(_saved_without_room)
        if data is not None:
            self.rebuild(data, progress=progress)

    @property
    def k(self) -> int:
        return self.search_params.k

    @property
    def list_size(self) -> int:
        return self.search_params.list_size

    @property
    def index(self) -> Index:
        """The buffers as an :class:`~torch_grnnd.Index` (no copy): one object for as long as the
        buffers and settings stay what it holds, so the room it reserves (``index.reserve``,
        adds) and the lock that lets threads search while another edits last from call to call.
        Edits made through it directly show in the buffers at the next use; once ``.to()``,
        ``.half()`` or ``load_state_dict`` replaced the buffers, a new one wraps them. Threads may
        search a retriever while one edits it, with :class:`~torch_grnnd.Index`'s promise: each
        search answers as of the index before an edit or after it."""
        if torch.compiler.is_compiling():  # a compiled graph keeps nothing between calls: a view for this one
            return Index(self.data, self.graph, self.metric, self.build_params, ids=self._ids(),
                         removed=self._removed(), next_id=self.next_id)
        with _SYNCING:
            index = self._index
            replaced = index is None or any(a is not b for a, b in zip(self._installed, self._buffer_tensors()))
            if replaced or index.metric != self.metric or index.build_params != self.build_params:
                # New buffers or settings (.to(), .half(), load_state_dict): they win over the held index.
                self._take(Index(self.data, self.graph, self.metric, self.build_params, ids=self._ids(),
                                 removed=self._removed(), next_id=self.next_id))
            else:
                with _locks(index)[0].shared():  # not while an edit publishes its fields
                    if index.version != self._index_version:  # edited through retriever.index
                        self._take(index)
            return self._index

    def _buffer_tensors(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.data, self.graph, self.ids, self.removed

    def _ids(self) -> Optional[Tensor]:
        """The ids buffer as Index.ids: None where empty, unless the retriever numbers its rows
        itself (next_id), whose ids may all have been compacted away."""
        return self.ids if self.ids.numel() or self.next_id is not None else None

    def _removed(self) -> Optional[Tensor]:
        """The removed buffer as Index.removed: None where empty (no tombstones)."""
        return self.removed if self.removed.numel() else None

    def rebuild(self, data: Tensor, *, ids: Optional[Tensor] = None, progress: Progress = False) -> "Retriever":
        """Index ``data`` (its rows, detached, without a copy) in place of the current vectors;
        ``ids``: optional user ids, as in :meth:`Index.build`."""
        self._take(Index.build(data.detach(), self.build_params, metric=self.metric, ids=ids, progress=progress))
        return self

    def add(self, data: Tensor, ids: Optional[Tensor] = None, *, progress: Progress = False) -> "Retriever":
        """Add rows (detached) without a rebuild; see :meth:`Index.add`."""
        if self.data.shape[1] == 0:  # never indexed
            return self.rebuild(data, ids=ids, progress=progress)
        index = self.index
        index.add(data.detach(), ids, progress=progress)
        return self._take(index)

    def remove(self, ids: Tensor) -> "Retriever":
        """Hide these rows from every later search; see :meth:`Index.remove`."""
        index = self.index
        index.remove(ids)
        return self._take(index)

    def compact(self) -> "Retriever":
        """Drop the removed rows for good; see :meth:`Index.compact`."""
        index = self.index
        index.compact()
        return self._take(index)

    def _take(self, index: Index) -> "Retriever":
        """Hold ``index``: its tensors become the buffers, and it stays the retriever's index. Its
        fields are read as one state (under its read lock: not while an edit publishes)."""
        with _SYNCING, _locks(index)[0].shared():
            self.data, self.graph = index.data, index.graph
            self.ids = index.ids if index.ids is not None else self.ids.new_empty(0)
            self.removed = index.removed if index.removed is not None else self.removed.new_empty(0)
            self.next_id = index.next_id
            self._index, self._index_version = index, index.version
            self._installed = self._buffer_tensors()  # what index compares to tell a replacement
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The buffers as of the index's latest edit (one made through retriever.index included),
        # and not changed by another thread while they are written out.
        if torch.compiler.is_compiling():
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        with _SYNCING:
            if self.data.shape[1]:
                self.index  # noqa: B018  (brings the buffers up to date)
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def forward(self, queries: Tensor, k: Optional[int] = None, *,
                filter: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """``(dists [Q, k], ids [Q, k])`` of the nearest indexed rows; see :meth:`Index.search`."""
        return self.search(queries, k, filter=filter)

    def search(self, queries: Tensor, k: Optional[int] = None, *, params: Optional[SearchParams] = None,
               **settings: Any) -> Tuple[Tensor, Tensor]:
        """What calling the module does (:meth:`forward`), under the name every index uses, taking
        this call's search settings (``params`` instead of the retriever's, ``list_size=...``,
        ``filter=...``) as :meth:`Index.search` does."""
        if self.data.shape[1] == 0:  # never indexed (rows all removed and compacted away keep their width)
            raise RuntimeError("Retriever is empty: call rebuild(embeddings) or load_state_dict(state) first")
        return self.index.search(queries, k, params=self.search_params if params is None else params, **settings)

    def __len__(self) -> int:
        """The live rows (removed ones not counted)."""
        return len(self.index) if self.data.shape[0] else 0

    def get_extra_state(self) -> Dict[str, Any]:
        return {"k": self.k, "metric": self.metric, "list_size": self.list_size,
                "build_params": dataclasses.asdict(self.build_params), "next_id": self.next_id}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        self.metric = state["metric"]
        self.search_params = self.search_params.replace(k=state["k"], list_size=state["list_size"])
        self.build_params = BuildParams().replace(**state["build_params"])
        self.next_id = state.get("next_id")  # states saved before it existed: user ids, as they were

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The number of rows is data, not configuration: take the incoming shapes (keeping
        # this module's device and dtype) so that any retriever can load any index.
        # States saved before ids and tombstones existed have neither: none.
        for name in ("ids", "removed"):
            if prefix + "data" in state_dict and prefix + name not in state_dict:
                state_dict[prefix + name] = getattr(self, name).new_empty(0)
        for name in ("data", "graph", "ids", "removed"):
            incoming = state_dict.get(prefix + name)
            if incoming is not None:
                setattr(self, name, getattr(self, name).new_empty(incoming.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.data.shape[0] > 0:
            check_state(self.data, self.graph, self.metric)
            if self._removed() is not None:
                check_removed(self.removed, self.data)
            if self.ids.numel():
                check_ids(self.ids, self.data, removed=self._removed())
        check_next_id(self.next_id, self._ids())

    def extra_repr(self) -> str:
        return (f"n={self.data.shape[0]}, dim={self.data.shape[1]}, k={self.k}, metric={self.metric!r}, "
                f"list_size={self.list_size}")


def _saved_without_room(module: Retriever, state: Dict[str, Any], prefix: str, _metadata: Any) -> None:
    """A Retriever's state holds its rows, not the room reserved past them (torch.save writes a
    view's whole storage)."""
    for name in ("data", "graph"):
        state[prefix + name] = _own_storage(state[prefix + name])

