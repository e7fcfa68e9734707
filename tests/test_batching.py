"""QueryBatcher: single searches from many threads answered as batches, each caller its own rows."""
import contextlib
import threading
import time

import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours


class _Recording:
    """A SearchIndex that records its batches' sizes and holds its first search for `hold`
    seconds, so that calls arriving meanwhile wait for the next batch."""

    def __init__(self, index, hold=0.0, fail=False):
        self.index, self.hold, self.fail, self.sizes = index, hold, fail, []

    def search(self, queries, k=None, **settings):
        self.sizes.append(queries.shape[0])
        if len(self.sizes) == 1:
            time.sleep(self.hold)
        if self.fail:
            raise ValueError("search failed on purpose")
        return self.index.search(queries, k, **settings)

    def __len__(self):
        return len(self.index)

    def state_dict(self):
        return self.index.state_dict()


def _in_threads(count, work):
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as error:  # noqa: BLE001  (reported by the test)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("device", DEVICES)
def test_every_caller_gets_its_own_answers(device):
    data = clustered(6_000, 32, 30, seed=11).to(device)
    index = grnnd.Index.build(data)
    batcher = grnnd.QueryBatcher(index, k=10, list_size=64, searches=1)
    answers = {}

    def ask(i):
        # Each CUDA caller on a stream of its own: the batch waits for its queries there.
        with torch.cuda.stream(torch.cuda.Stream()) if device == "cuda" else contextlib.nullcontext():
            for j in range(i, 6_000, 400):  # rows of the data: each is its own nearest at distance 0
                d, ids = batcher.search(data[j] + 0)
                answers[j] = (d.cpu(), ids.cpu())
            queries = data[i * 7:i * 7 + 3] + 0.01
            d, ids = batcher.search(queries)
            answers[("q", i)] = (queries.cpu(), d.cpu(), ids.cpu())

    assert _in_threads(16, ask) == []
    rows = [j for j in answers if not isinstance(j, tuple)]
    assert len(rows) == 16 * 15
    for j in rows:
        d, ids = answers[j]
        assert d.shape == (10,) and ids[0].item() == j and abs(d[0].item()) < 1e-3
    for i in range(16):
        queries, d, ids = answers[("q", i)]
        assert ids.shape == (3, 10)
        truth = exact_neighbours(data.cpu(), queries, 10)[1]
        assert grnnd.recall(ids, truth) >= 0.9
    assert 1 <= batcher.batches <= len(answers)


def test_calls_arriving_during_a_batch_share_the_next():
    data = clustered(3_000, 16, 10, seed=12)
    recording = _Recording(grnnd.Index.build(data), hold=0.3)
    batcher = grnnd.QueryBatcher(recording, k=5, max_batch=4)
    found = {}

    def ask(i):
        if i > 0:
            time.sleep(0.1)  # while the first call's batch is held
        found[i] = batcher.search(data[i:i + 1])[1][0, 0].item()

    assert _in_threads(9, ask) == []
    assert found == {i: i for i in range(9)}
    # The first call alone, then the eight that waited, at most four a batch.
    assert recording.sizes[0] == 1 and sorted(recording.sizes[1:]) == [4, 4]
    assert batcher.batches == 3


def test_a_failed_search_reaches_every_caller_of_its_batch_and_the_next_batch_runs():
    data = clustered(2_000, 16, 10, seed=13)
    recording = _Recording(grnnd.Index.build(data), hold=0.3, fail=True)
    batcher = grnnd.QueryBatcher(recording, k=5)

    def ask(i):
        if i > 0:
            time.sleep(0.1)
        batcher.search(data[i])

    errors = _in_threads(5, ask)
    assert len(errors) == 5 and all("failed on purpose" in str(e) for e in errors)
    recording.fail = False
    assert batcher.search(data[7])[1][0].item() == 7


def test_refuses_bad_arguments():
    index = grnnd.Index.build(clustered(500, 8, 5, seed=14))
    with pytest.raises(ValueError, match="max_batch: expected a positive int"):
        grnnd.QueryBatcher(index, k=5, max_batch=0)
    with pytest.raises(TypeError, match="index: expected a torch_grnnd.SearchIndex"):
        grnnd.QueryBatcher(object(), k=5)
    with pytest.raises(ValueError, match=r"queries: expected a \[Q, D\] or \[D\] tensor"):
        grnnd.QueryBatcher(index, k=5).search(torch.zeros(2, 3, 4))
