"""Random sequences of edits, each checked against a plain model of what the index should hold.

The model is a dict from id to vector. After every step the index must hold exactly the model's
vectors under the model's ids (``len``, ``rows_of`` and the stored rows), a search must return
only live ids, each at its true distance and once per query, and recall@10 against faiss-cpu's
exact neighbours of the live vectors must stay high. The steps mix every way an index changes:
small adds (linked by search), large ones (grown in one build), removals, an id removed and
added again, compaction, ``merge`` with another index, ``reserve``, and a round trip through
``state_dict`` and ``torch.save``, which must give identical search results. An index built
without ids numbers its vectors itself (its rows, then ids that keep those numbers once a
compaction moves rows) and must never give one number twice.
"""
import io
import random

import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours


DIM = 32
# One stream of clustered rows: the first build's, then every added batch's, then queries.
POOL_ROWS = 12_000
QUERIES = 200
# A search at this list over a few thousand clustered rows finds nearly all of the 10 nearest;
# a broken edit (a lost row, a dangling edge, a stale id) shows as a far lower recall.
LIST_SIZE = 24
MIN_RECALL = 0.95


class Model:
    """What the index should hold: the live vectors by id, the removed ids whose rows it still
    holds (as tombstones), and the next id no vector has had."""

    def __init__(self, ids, vectors, numbers_itself):
        self.live = {int(i): v for i, v in zip(ids.tolist(), vectors)}
        self.removed_only = set()  # removed, not added again, not compacted away: still rows of the index
        self.next_id = max(self.live) + 1
        self.numbers_itself = numbers_itself  # built without ids: new vectors get next_id on

    def new_ids(self, index, count, spread):
        """Ids for ``count`` new vectors and what to pass as ``ids``: None where the index
        numbers its vectors (on from next_id), else fresh user ids ``spread`` apart."""
        step = 1 if self.numbers_itself else spread
        ids = [self.next_id + step * k for k in range(count)]
        self.next_id = ids[-1] + 1
        return ids, None if self.numbers_itself else torch.tensor(ids, device=index.device)


def distances(metric, queries, vectors):
    """[Q, k] distances of queries [Q, D] to vectors [Q, k, D] in the library's convention."""
    if metric == "l2":
        return ((vectors - queries.unsqueeze(1)) ** 2).sum(-1)
    if metric == "ip":
        return -(vectors * queries.unsqueeze(1)).sum(-1)
    return 1 - torch.nn.functional.cosine_similarity(vectors, queries.unsqueeze(1), dim=-1)


def check(index, model, queries, step):
    where = f"after step {step}"
    assert len(index) == len(model.live), where
    if model.numbers_itself:
        assert (index.data.shape[0] if index.ids is None else index.next_id) == model.next_id, where
    ids = sorted(model.live)
    if ids:
        rows = index.rows_of(torch.tensor(ids, device=index.device))
        want = torch.stack([model.live[i] for i in ids])
        assert torch.equal(index.data[rows].cpu(), want.to(index.data.dtype)), where
    for gone in list(model.removed_only)[:20]:
        # A removed id still has its row until compaction; it is simply never found.
        assert bool(index.removed[index.rows_of(torch.tensor([gone], device=index.device))].all()), where
    k = min(10, len(ids))
    if k == 0:
        return
    dists, found = index.search(queries.to(index.device), k, list_size=LIST_SIZE)
    dists, found = dists.cpu(), found.cpu()
    live = torch.tensor(ids)
    assert bool(torch.isin(found, live).all()), f"{where}: a search returned an id that is not live"
    assert all(row.unique().numel() == k for row in found), f"{where}: an id found twice for one query"
    vectors = torch.stack([model.live[int(i)] for i in found.flatten()]).reshape(*found.shape, DIM)
    true_dists = distances(index.metric, queries.to(index.data.dtype).float(), vectors.to(index.data.dtype).float())
    tolerance = dict(rtol=1e-4, atol=1e-3) if index.data.dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(dists, true_dists, **tolerance, msg=f"{where}: distances")
    live_vectors = torch.stack([model.live[i] for i in ids]).to(index.data.dtype)
    truth = live[exact_neighbours(live_vectors, queries.to(index.data.dtype), k, index.metric)[1]]
    recall = grnnd.recall(found, truth)
    assert recall >= MIN_RECALL, f"{where}: recall@{k} {recall:.4f}"


def round_trip(index):
    buffer = io.BytesIO()
    torch.save(index.state_dict(), buffer)
    buffer.seek(0)
    return grnnd.Index.from_state_dict(torch.load(buffer, weights_only=True))


# (seed, user ids from the start, metric, dtype on the GPU; the CPU runs float32)
CASES = [(0, True, "l2", torch.float32), (1, True, "l2", torch.float16), (2, False, "l2", torch.float32),
         (3, True, "cosine", torch.float16), (4, False, "ip", torch.float32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,with_ids,metric,dtype", CASES)
def test_random_edits_keep_the_index_true_to_its_vectors(device, seed, with_ids, metric, dtype):
    dtype = dtype if device == "cuda" else torch.float32
    rng = random.Random(seed)
    pool = clustered(POOL_ROWS + QUERIES, DIM, 40, seed=100 + seed)
    queries, pool = pool[POOL_ROWS:].contiguous(), pool[:POOL_ROWS]
    taken = 2000

    def next_rows(count):
        nonlocal taken
        assert taken + count <= POOL_ROWS
        rows = pool[taken:taken + count]
        taken += count
        return rows

    first_ids = torch.randperm(taken, generator=torch.Generator().manual_seed(seed)) * 3 + 10 if with_ids \
        else torch.arange(taken)
    model = Model(first_ids, pool[:taken], numbers_itself=not with_ids)
    index = grnnd.Index.build(pool[:taken].to(device, dtype), metric=metric,
                              ids=first_ids.to(device) if with_ids else None)
    check(index, model, queries, 0)
    # Every kind of step three times, in an order of the seed's.
    plan = ["add", "add", "add_large", "remove", "remove", "add_again", "compact", "merge", "round_trip",
            "reserve"] * 3
    rng.shuffle(plan)
    for step, op in enumerate(plan, start=1):
        n = len(model.live)
        if op in ("add", "add_large", "merge") and taken + index.data.shape[0] > POOL_ROWS:
            op = "remove"  # no batch takes more rows than the index holds
        if op in ("add", "add_large"):
            # Linked by a search of the graph, or from a quarter of the rows on grown in one build.
            quarter = (index.data.shape[0] + 3) // 4
            count = rng.randint(1, max(1, n // 10)) if op == "add" else rng.randint(quarter, max(quarter, n // 2))
            vectors = next_rows(count)
            ids, given = model.new_ids(index, count, rng.randint(1, 5))
            index.add(vectors.to(device, dtype), given)
            model.live.update(zip(ids, vectors))
        elif op == "remove" and n > 100:
            gone = rng.sample(sorted(model.live), rng.randint(1, n // 8))
            index.remove(torch.tensor(gone, device=device))
            for i in gone:
                del model.live[i]
            model.removed_only.update(gone)
        elif op == "add_again" and model.removed_only:  # a removed id takes a new vector
            again = rng.sample(sorted(model.removed_only), min(len(model.removed_only), rng.randint(1, 50)))
            vectors = next_rows(len(again))
            # (an index without ids takes them now)
            index.add(vectors.to(device, dtype), torch.tensor(again, device=device))
            model.live.update(zip(again, vectors))
            model.removed_only.difference_update(again)
        elif op == "compact":
            index.compact()
            model.removed_only.clear()
            assert index.removed is None and index.data.shape[0] == len(model.live)
        elif op == "merge":  # another index's vectors, with removals of its own
            vectors = next_rows(rng.randint(200, max(200, n // 2)))
            ids, given = model.new_ids(index, vectors.shape[0], 2)
            if given is not None and model.removed_only:  # ids removed here may be live there
                again = rng.sample(sorted(model.removed_only), min(len(model.removed_only), 20))
                ids[:len(again)] = again
                given = torch.tensor(ids, device=device)
                model.removed_only.difference_update(again)
            other = grnnd.Index.build(vectors.to(device, dtype), metric=metric, ids=given)
            gone = rng.sample(ids, 10)
            # Without ids the other index numbers its own rows; merged, they follow the index's.
            other.remove(torch.tensor(gone if given is not None else [ids.index(i) for i in gone], device=device))
            index = grnnd.merge(index, other)
            model.live.update(zip(ids, vectors))
            for i in gone:
                del model.live[i]
            model.removed_only.update(gone)
        elif op == "round_trip":
            restored = round_trip(index)
            before = index.search(queries.to(device), 10, list_size=LIST_SIZE)
            after = restored.search(queries.to(device), 10, list_size=LIST_SIZE)
            assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), f"step {step}"
            assert restored.capacity == index.capacity
            index = restored
        elif op == "reserve":
            index.reserve(index.data.shape[0] + rng.randint(1, 3000))
        check(index, model, queries, f"{step} ({op})")
