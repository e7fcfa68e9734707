"""An Index (and a Retriever, which holds one) shared by threads: searches running while another
thread adds, removes and compacts answer as of one state the edits passed through (checked
against a model of the index's contents), and never raise because of the edits."""
import contextlib
import sys
import threading
import time

import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours



def run_stress(device: str, kind: str = "Index", edits: int = 36, searchers: int = 3, seconds: float = 60.0):
    g = torch.Generator().manual_seed(21)
    vectors = clustered(14_000, 32, 40, seed=21).to(device)  # every vector ever added; id = its row here
    start = 6_000
    if kind == "Index":
        index = grnnd.Index.build(vectors[:start], ids=torch.arange(start, device=device))
        version = lambda: index.version  # noqa: E731
        search = lambda: index.search(queries, 10, list_size=32)  # noqa: E731
    else:  # the edits and searches go through the module, its buffers following the index
        index = grnnd.nn.Retriever(k=10, list_size=32).rebuild(vectors[:start], ids=torch.arange(start, device=device))
        version = lambda: index.index.version  # noqa: E731
        search = lambda: index.search(queries)  # noqa: E731
    live = set(range(start))
    states = {version(): frozenset(live)}  # the live ids of each version the edits made visible
    queries = (vectors[torch.randint(0, 14_000, (32,), generator=g).to(device)]
               + 0.1 * torch.randn(32, 32, generator=g).to(device))
    results, errors = [], []
    stop = threading.Event()

    def search_until_stopped():
        # On a GPU each searcher has a stream of its own, as a server's request threads would:
        # storage an edit replaces must not be reused while a search queued on another stream
        # still reads it (the distances checked below would be a garbage row's).
        stream = torch.cuda.Stream(device) if device == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not stop.is_set():
                    before = version()
                    dists, ids = search()
                    results.append((before, version(), dists.cpu(), ids.cpu()))
        except Exception as error:  # noqa: BLE001 - any error fails the test below
            errors.append(error)

    threads = [threading.Thread(target=search_until_stopped) for _ in range(searchers)]
    for t in threads:
        t.start()
    next_id = start
    deadline = time.monotonic() + seconds
    writer = torch.cuda.Stream(device) if device == "cuda" else None  # the edits' own stream on a GPU
    try:
        with torch.cuda.stream(writer) if writer is not None else contextlib.nullcontext():
            for step in range(edits):
                if time.monotonic() > deadline:
                    break
                if step % 6 == 5:
                    index.compact()
                elif step % 3 == 2:
                    gone = torch.tensor(sorted(live), device=device)[torch.randperm(len(live), generator=g)[:150]
                                                                   .to(device)]
                    index.remove(gone)
                    live -= set(gone.tolist())
                else:
                    batch = 1_600 if step in (1, 19) else 150  # a quarter of the index grows it in one build
                    index.add(vectors[next_id:next_id + batch],
                              ids=torch.arange(next_id, next_id + batch, device=device))
                    live |= set(range(next_id, next_id + batch))
                    next_id += batch
                states[version()] = frozenset(live)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return index, vectors, queries, states, results, errors, live


@pytest.mark.parametrize("kind", ["Index", "Retriever"])
@pytest.mark.parametrize("device", DEVICES)
def test_searches_during_edits_see_one_state(device, kind):
    index, vectors, queries, states, results, errors, live = run_stress(device, kind)
    assert errors == []
    assert len(results) >= 30 and len(states) >= 10
    overlapped = 0
    for before, after, dists, ids in results:
        found = set(ids[ids >= 0].tolist())
        # Every id of the batch is live in one version the search could have seen.
        assert any(found <= states[v] for v in range(before, after + 1)), (before, after)
        overlapped += after > before
        # Each id is the vector it names: distances are those of the query to that vector.
        rows = ids.clamp_min(0)
        want = (vectors.cpu()[rows] - queries.cpu().unsqueeze(1)).square().sum(2)
        torch.testing.assert_close(torch.where(ids >= 0, dists, want), want, rtol=1e-4, atol=1e-3)
    assert overlapped > 0  # some searches did run across an edit
    # And the index the edits left finds what it holds.
    kept = torch.tensor(sorted(live))
    truth = kept[exact_neighbours(vectors.cpu()[kept], queries.cpu(), 10)[1]]
    held = index if kind == "Index" else index.index
    assert grnnd.recall(held.search(queries, 10, list_size=64)[1].cpu(), truth) >= 0.9
    assert len(index) == len(live)
    if kind == "Retriever":  # the buffers are the index's tensors, and its state round-trips
        assert index.data is held.data and index.graph is held.graph and index.data.shape[0] == len(held.graph)
        restored = grnnd.nn.Retriever().to(device)  # loading keeps the module's device
        restored.load_state_dict(index.state_dict())
        assert torch.equal(restored.search(queries)[1], index.search(queries)[1])


def test_retriever_searches_during_many_small_adds_never_raise():
    # Threads switching every microsecond land searches between an add's publication and the
    # buffers' catching up: each must still see one state of the index.
    data = clustered(12_000, 8, 30, seed=44)
    retriever = grnnd.nn.Retriever(k=3).rebuild(data[:2000], ids=torch.arange(2000))
    retriever.index.reserve(12_000)
    stop, errors = threading.Event(), []

    def search_until_stopped():
        try:
            while not stop.is_set():
                retriever.search(data[:4])
        except Exception as error:  # noqa: BLE001 - any error fails the test below
            errors.append(error)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=search_until_stopped) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        n, deadline = 2000, time.monotonic() + 8
        while time.monotonic() < deadline and n < 12_000:
            retriever.add(data[n:n + 5], ids=torch.arange(n, n + 5))
            n += 5
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(switch)
    assert errors == [] and len(retriever) == n and retriever.data.shape[0] == n


def test_a_waiting_edit_goes_before_later_searches():
    # The shared lock prefers a waiting writer: readers that arrive after it wait for it.
    from torch_grnnd.index import _SharedLock

    lock, order = _SharedLock(), []
    first_reader_in, writer_waiting = threading.Event(), threading.Event()

    def reader(name, hold):
        with lock.shared():
            first_reader_in.set()
            order.append(name)
            time.sleep(hold)

    def writer():
        writer_waiting.set()
        with lock.exclusive():
            order.append("writer")

    early = threading.Thread(target=reader, args=("early", 0.3))
    early.start()
    first_reader_in.wait()
    w = threading.Thread(target=writer)
    w.start()
    writer_waiting.wait()
    while lock._writers_waiting == 0 and "writer" not in order:  # queued behind the early reader (or done)
        time.sleep(0.001)
    late = threading.Thread(target=reader, args=("late", 0.0))
    late.start()
    for t in (early, w, late):
        t.join()
    assert order == ["early", "writer", "late"]


def test_an_index_pickles_without_its_locks():
    import pickle

    data = clustered(3_000, 16, 10, seed=22)
    index = grnnd.Index.build(data)
    index.search(data[:4], 5)  # the locks exist now
    copy = pickle.loads(pickle.dumps(index))
    assert torch.equal(copy.search(data[:4], 5)[1], index.search(data[:4], 5)[1])
    copy.add(data[:10] + 1)  # and the copy makes locks of its own
    assert len(copy) == 3_010 and len(index) == 3_000
