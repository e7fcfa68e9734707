"""Many callers' small searches answered as one batch: the threads of a retrieval server.

A search of one query leaves most of a GPU idle: it waits on its chain of iterations, not on the
device's width (``benchmarks/README.md``, "Small batches"), so a hundred threads that each search
their own query serve little more than one. :class:`QueryBatcher` gathers the queries that
arrive while a batch runs and searches them together on the next one. There is no thread of its
own: the first caller that finds no batch running leads one (it searches for everyone waiting,
hands out the results, and passes the lead to the next waiting caller), so an idle batcher costs
nothing and a lone caller's query is searched at once.
"""
import threading
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .index import SearchIndex


class _Request:
    """One caller's queries, and the answer or error its batch left for it."""

    def __init__(self, queries: Tensor):
        self.queries = queries
        # A GPU caller's queries may still be in flight on its own stream: the batch waits for them.
        self.ready = _recorded_event(queries.device)
        self.done = threading.Event()
        self.lead = False  # handed the lead rather than an answer
        self.result: Optional[Tuple[Tensor, Tensor]] = None
        self.error: Optional[BaseException] = None
        self.finished: Optional[Any] = None  # the batch's CUDA event, recorded after its search


def _recorded_event(device: torch.device) -> Optional[Any]:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class QueryBatcher:
    """Answers ``search(queries)`` calls from many threads with batched searches of ``index``.

    Every call's queries are searched with the same ``k`` and ``settings`` (those of
    :meth:`Index.search <torch_grnnd.Index.search>` or of any :class:`~torch_grnnd.SearchIndex`),
    in a batch of at most ``max_batch`` queries with the other calls waiting at the time. A call
    returns its own rows of the batch's answers, ``(dists [Q, k], ids [Q, k])``, or raises what
    the batch's search raised. Pass explicit settings where answers must not depend on the
    batch: the automatic ``searches`` of the CUDA search follow the batch's size
    (``SearchParams``).

    On the GPU the answers come back in order on each caller's current stream: the batch waits for
    the callers' queries on their streams, and each caller's stream waits for the batch.

    Example:
        >>> import threading, torch, torch_grnnd as grnnd
        >>> x = torch.randn(2000, 16)
        >>> batcher = grnnd.QueryBatcher(grnnd.Index.build(x), k=1)
        >>> found = [None] * 8
        >>> def ask(i): found[i] = batcher.search(x[i])[1].item()
        >>> threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> found
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self, index: SearchIndex, k: int, *, max_batch: int = 1024, **settings: Any):
        if not callable(getattr(index, "search", None)):
            raise TypeError(f"index: expected a torch_grnnd.SearchIndex, got {type(index).__name__}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch!r}")
        self.index, self.k, self.max_batch, self.settings = index, k, max_batch, settings
        self._lock = threading.Lock()
        self._waiting: List[_Request] = []
        self._leading = False
        self.batches = 0  # batches searched so far (how well calls were gathered: calls / batches)

    def search(self, queries: Tensor) -> Tuple[Tensor, Tensor]:
        """The ``k`` nearest rows of each query: ``queries`` [Q, D] or one query [D] (then the
        answers are [k]); safe to call from any number of threads at once."""
        if not isinstance(queries, Tensor) or queries.dim() not in (1, 2):
            raise ValueError(f"queries: expected a [Q, D] or [D] tensor, got "
                             f"{tuple(queries.shape) if isinstance(queries, Tensor) else type(queries).__name__}")
        one = queries.dim() == 1
        request = _Request(queries[None] if one else queries)
        with self._lock:
            self._waiting.append(request)
            lead = not self._leading
            self._leading = True
        if not lead:
            request.done.wait()
            if request.lead:  # the previous leader passed the lead on: search for whoever waits
                request.done.clear()
                self._lead()
                request.done.wait()
        else:
            self._lead()
        if request.error is not None:
            raise request.error
        dists, ids = request.result
        if request.finished is not None:  # the caller's stream waits for the batch's search
            stream = torch.cuda.current_stream(dists.device)
            stream.wait_event(request.finished)
            dists.record_stream(stream)
            ids.record_stream(stream)
        return (dists[0], ids[0]) if one else (dists, ids)

    def _lead(self) -> None:
        """Search one batch of the waiting calls, answer them, and pass the lead on."""
        with self._lock:
            batch, taken = [], 0
            while self._waiting and (not batch or taken + self._waiting[0].queries.shape[0] <= self.max_batch):
                request = self._waiting.pop(0)
                batch.append(request)
                taken += request.queries.shape[0]
        try:
            queries = self._gathered(batch)
            dists, ids = self.index.search(queries, self.k, **self.settings)
            finished = _recorded_event(dists.device)
            start = 0
            for request in batch:
                rows = request.queries.shape[0]
                request.result, request.finished = (dists[start:start + rows], ids[start:start + rows]), finished
                start += rows
        except Exception as error:  # every caller of the batch gets the search's error
            for request in batch:
                request.error = error
        finally:
            self.batches += 1
            for request in batch:
                request.done.set()
            with self._lock:
                if self._waiting:
                    successor = self._waiting.pop(0)
                    self._waiting.insert(0, successor)
                    successor.lead = True
                    successor.done.set()
                else:
                    self._leading = False

    @staticmethod
    def _gathered(batch: List[_Request]) -> Tensor:
        """The batch's queries as one tensor, once every caller's queries are ready."""
        device = batch[0].queries.device
        for request in batch:
            if request.ready is not None:
                torch.cuda.current_stream(device).wait_event(request.ready)
        return batch[0].queries if len(batch) == 1 else torch.cat([r.queries for r in batch])
