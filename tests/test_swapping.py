"""SwappingIndex: host rows searched shard by shard (torch_grnnd/swapping.py), faiss-cpu as oracle.

The CPU searches each shard where it lies; the GPU copies each shard in while the one before is
searched. Both must answer as the shards' own searches merged, and find the exact neighbours.
"""
import io

import pytest
import torch

import torch_grnnd as grnnd
from conftest import DEVICES, clustered, exact_neighbours

N, SHARD, K = 9_000, 2_500, 10  # four shards, the last of 1 500 rows


@pytest.fixture(scope="module")
def points():
    x = clustered(N + 300, 32, 30, seed=5)
    return x[:N].contiguous(), x[N:].contiguous()


_indexes = {}


def index_for(points, device, metric="l2"):
    if (device, metric) not in _indexes:
        data = points[0].pin_memory() if device == "cuda" else points[0]
        _indexes[device, metric] = grnnd.SwappingIndex.build(data, device=device, metric=metric, shard_rows=SHARD,
                                                             degree=24, pool_size=48)
    return _indexes[device, metric]


def merged_by_hand(index, queries, k, **settings):
    """Each shard searched on its own (rows on the queries' device), ids made global, the k best kept."""
    dists, ids = [], []
    for (start, end), graph in zip(index.bounds, index.graphs):
        rows = index.data[start:end].to(queries.device)
        d, i = grnnd.search(rows, graph.to(queries.device), queries, min(k, end - start), metric=index.metric,
                            **settings)
        dists.append(d)
        ids.append(torch.where(i >= 0, i + start, i))
    dists, ids = torch.cat(dists, 1), torch.cat(ids, 1)
    order = dists.argsort(dim=1, stable=True)[:, :k]
    return dists.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_shards_searched_in_turn_find_the_exact_neighbours(points, device, metric):
    data, queries = points
    index = index_for(points, device, metric)
    assert index.bounds == [(0, 2500), (2500, 5000), (5000, 7500), (7500, 9000)]
    q = queries.to(device)
    dists, ids = index.search(q, K, list_size=32)
    assert ids.device == q.device and ids.shape == (300, K)
    ref_d, ref_i = merged_by_hand(index, q, K, list_size=32)
    assert torch.equal(ids, ref_i) and torch.equal(dists, ref_d)
    truth = exact_neighbours(data, queries, K, metric)[1]
    assert grnnd.recall(ids, truth) >= 0.97
    # Every shard searched at list 32 finds at least what one graph over all rows finds there.
    whole = grnnd.Index.build(data.to(device), metric=metric, degree=24, pool_size=48)
    assert grnnd.recall(ids, truth) >= grnnd.recall(whole.search(q, K, list_size=32)[1], truth) - 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_filter_over_all_rows(points, device):
    data, queries = points
    index = index_for(points, device)
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(3)) < 0.4
    dists, ids = index.search(queries.to(device), K, list_size=48, filter=allowed.to(device))
    assert allowed[ids.cpu()].all(), "a filtered-out row was returned"
    allowed_ids = allowed.nonzero().squeeze(1)
    truth = allowed_ids[exact_neighbours(data[allowed], queries, K)[1]]
    assert grnnd.recall(ids, truth) >= 0.95


def test_k_beyond_a_shard_and_beyond_the_rows(points):
    index = grnnd.SwappingIndex.build(points[0][:2010], device="cpu", shard_rows=1000, degree=16, pool_size=32)
    assert [end - start for start, end in index.bounds] == [1000, 1000, 10]
    dists, ids = index.search(points[1][:5], 40)  # the last shard has 10 rows
    assert ids.shape == (5, 40) and (ids >= 0).all() and (dists[:, 1:] >= dists[:, :-1]).all()
    assert all(len(set(row)) == 40 for row in ids.tolist())
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 2010"):
        index.search(points[1][:5], 2011, list_size=4096)


def test_budget_sets_the_shards_and_progress_counts_rows(points):
    data = points[0]
    params = grnnd.BuildParams(degree=16, pool_size=32)
    per_row = grnnd.swapping.swapping_bytes_per_row(32, 4, params)
    seen = []
    index = grnnd.SwappingIndex.build(data, params, device="cpu", max_gpu_memory=3000 * per_row,
                                      progress=lambda done, total: seen.append((done, total)))
    assert [end - start for start, end in index.bounds] == [3000, 3000, 3000]
    assert seen == [(3000, N), (6000, N), (9000, N)]
    with pytest.raises(ValueError, match="give shard_rows or max_gpu_memory on the CPU"):
        grnnd.SwappingIndex.build(data, device="cpu")
    with pytest.raises(ValueError, match="hold only 10 rows of a shard"):
        grnnd.SwappingIndex.build(data, params, device="cpu", max_gpu_memory=10 * per_row)


def test_state_dict_round_trip(points):
    index = index_for(points, "cpu")
    buffer = io.BytesIO()
    torch.save(index.state_dict(), buffer)
    buffer.seek(0)
    again = grnnd.SwappingIndex.from_state_dict(torch.load(buffer, weights_only=True))
    assert again.bounds == index.bounds and again.build_params == index.build_params
    ref, got = index.search(points[1], K), again.search(points[1], K)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    with pytest.raises(ValueError, match="missing keys"):
        grnnd.SwappingIndex.from_state_dict({"data": points[0]})


def test_bad_input(points):
    index = index_for(points, "cpu")
    with pytest.raises(ValueError, match="queries: expected them on cpu"):
        index.search(points[1].to("meta"), K)
    with pytest.raises(ValueError, match=r"filter: expected shape \[9000\]"):
        index.search(points[1], K, filter=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="graphs: expected shards covering the 9000 rows"):
        grnnd.SwappingIndex(points[0], index.graphs[:2])
    with pytest.raises(ValueError, match="data: expected rows in host memory"):
        grnnd.SwappingIndex.build(points[0].to("meta"), device="cpu", shard_rows=10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_index_searches_on_a_side_stream_safely(points):
    # The copies run on a stream of their own; results must not depend on what the caller's
    # stream is, nor change from call to call.
    index = index_for(points, "cuda")
    q = points[1].cuda()
    ref = index.search(q, K, list_size=32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = index.search(q, K, list_size=32)
    stream.synchronize()
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0])
    assert all(g.is_pinned() for g in index.graphs)
