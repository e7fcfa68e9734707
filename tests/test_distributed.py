"""torch_grnnd.distributed on CPU processes joined by gloo (2 and 3 ranks, spawned here), against
one process holding all the data: exact ops give the same neighbours, the sharded index the
same recall within 0.01; the partitioned index, growth and restores onto fewer ranks; mismatched
ranks raise on every rank instead of hanging, and a rank that dies makes the other raise.

With a GPU, two gloo ranks share it (the CUDA path of the same code); with two, NCCL joins them.
"""
import functools
import os
import tempfile
import time
from typing import Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_grnnd as grnnd
from conftest import clustered, exact_neighbours

N, DIM, QUERIES = 6000, 16, 300
EXTRA = 40  # rows each rank adds


def extra_rows(world: int):
    return clustered(world * EXTRA, DIM, 30, seed=52)


def dataset():
    x = clustered(N + QUERIES, DIM, 30, seed=51)
    return x[:N].contiguous(), x[N:].contiguous()


def shard_bounds(world: int):
    # Uneven shards: rank r holds a share that grows with r.
    weights = torch.arange(1, world + 1, dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * N).round().long().tolist()
    return [0] + cuts


def worker(rank: int, world: int, init: str, out: str, device: str, backend: str = "gloo"):
    if backend == "nccl":
        torch.cuda.set_device(rank)  # a GPU a rank
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    data, queries = dataset()
    bounds = shard_bounds(world)
    mine = data[bounds[rank]:bounds[rank + 1]].to(device)
    # Each rank asks its own third (or half) of the queries.
    q_bounds = [QUERIES * r // world for r in range(world + 1)]
    my_queries = queries[q_bounds[rank]:q_bounds[rank + 1]].to(device)
    result = {}
    result["knn"] = [t.cpu() for t in grnnd.distributed.knn(mine, my_queries, 10)]
    result["knn_graph"] = [t.cpu() for t in grnnd.distributed.knn_graph(mine, 8)]
    sharded = grnnd.distributed.ShardedIndex.build(mine)
    result["sharded"] = [t.cpu() for t in sharded.search(my_queries, 10, list_size=64)]
    restored = grnnd.distributed.ShardedIndex.from_state_dict(sharded.state_dict())
    result["restored_equal"] = torch.equal(restored.search(my_queries, 10, list_size=64)[1].cpu(),
                                           result["sharded"][1])
    for kind in ("int8", "int4"):
        coded = grnnd.distributed.ShardedIndex.build(mine, codes=kind)  # each shard walks by its own codes
        result[f"coded_{kind}"] = coded.search(my_queries, 10, list_size=64)[1].cpu()
        result[f"coded_{kind}_restored_equal"] = torch.equal(
            grnnd.distributed.ShardedIndex.from_state_dict(coded.state_dict()).search(my_queries, 10,
                                                                                      list_size=64)[1].cpu(),
            result[f"coded_{kind}"])
    user = grnnd.distributed.ShardedIndex.build(mine, ids=torch.arange(bounds[rank], bounds[rank + 1]).to(device)
                                                * 3 + 7)
    result["user_ids"] = user.search(my_queries, 10, list_size=64)[1].cpu()
    # Partitioned: rows placed by proximity (cells of a k-means, grouped by rank), each query sent
    # to its own shard, then to those whose cells' borders its k-th distance there reaches.
    parted = grnnd.distributed.ShardedIndex.build(mine, partition=True, probes=None, cells=16)
    result["partition_rows"] = len(parted.local)
    result["partition_ids"] = parted.local.ids.cpu()
    result["partitioned_routed"] = parted.search(my_queries, 10, list_size=64)[1].cpu()
    result["routed_shards"] = parted.shards_per_query
    parted.probes = 1
    result["partitioned_1"] = parted.search(my_queries, 10, list_size=64)[1].cpu()
    result["probes_1_shards"] = parted.shards_per_query
    parted.probes = None
    # A state saved when partitions were one centre a rank (no biases) routes by nearness: to
    # every shard at probes = ranks.
    old = {key: value for key, value in parted.state_dict().items() if key != "partition"}
    old.update(centres=torch.randn(world, DIM), probes=world)
    everywhere = grnnd.distributed.ShardedIndex.from_state_dict(old)
    result["partitioned_everywhere"] = everywhere.search(my_queries, 10, list_size=64)[1].cpu()
    result["everywhere_shards"] = everywhere.shards_per_query
    # Index.build's own settings (codes) pass through a partitioned build.
    coded = grnnd.distributed.ShardedIndex.build(mine, partition=True, codes="int4")  # a centre a rank, 2 probes
    result["partitioned_int4"] = coded.search(my_queries, 10, list_size=64)[1].cpu()
    # The rows move in rounds bounded in bytes: rounds of 37 rows (a different number of rounds
    # on each rank, the shards being uneven) give each rank the rows one round gives, intact.
    own_ids = torch.arange(bounds[rank], bounds[rank + 1]).to(device)
    _, one_round = grnnd.distributed._to_ranks(mine, own_ids, parted.partition.ranks(mine), None)
    grnnd.distributed._EXCHANGE_BYTES = 37 * DIM * mine.element_size()
    rows, ids = grnnd.distributed._to_ranks(mine, own_ids, parted.partition.ranks(mine), None)
    grnnd.distributed._EXCHANGE_BYTES = 1 << 30
    result["rounds_same_ids"] = torch.equal(ids.sort().values.cpu(), one_round.sort().values.cpu())
    result["rounds_rows_intact"] = torch.equal(rows.cpu(), data[ids.cpu()].to(rows.dtype))
    result["partitioned_restored_equal"] = torch.equal(
        grnnd.distributed.ShardedIndex.from_state_dict(parted.state_dict()).search(my_queries, 10,
                                                                                   list_size=64)[1].cpu(),
        result["partitioned_routed"])
    # Growth: each rank adds rows of its own (numbered after every id, rank by rank), to its
    # shard or, partitioned, to the shard of their cell; then ranks remove vectors that
    # any rank holds.
    added = extra_rows(world)[rank * EXTRA:(rank + 1) * EXTRA].to(device)
    want = N + rank * EXTRA + torch.arange(EXTRA)
    grown = grnnd.distributed.ShardedIndex.build(mine)
    for index, key in ((grown, "grown"), (parted, "parted")):
        index.add(added)
        result[f"{key}_added_found"] = torch.equal(index.search(added, 1, list_size=64)[1][:, 0].cpu(), want)
    gone = torch.tensor([7 * rank, N + rank * EXTRA + 1])  # an original row and an added one, any rank's
    grown.remove(gone.to(device))
    result["grown_len"] = len(grown)
    result["grown_search"] = grown.search(my_queries, 10, list_size=64)[1].cpu()
    try:
        grown.remove(torch.tensor([7 * rank], device=device))  # already removed: every rank raises
        result["remove_again"] = None
    except ValueError as e:
        result["remove_again"] = str(e)
    # Restored onto fewer ranks: each takes some saved shards and merges them.
    torch.save(grown.state_dict(), os.path.join(out, f"grown{rank}.pt"))
    dist.barrier()
    states = [torch.load(os.path.join(out, f"grown{r}.pt"), weights_only=True) for r in range(world)]
    fewer = dist.new_group(list(range(world - 1)))
    if rank < world - 1:
        restored = grnnd.distributed.ShardedIndex.from_state_dicts(states, group=fewer)
        result["resharded"] = restored.search(queries.to(device), 10, list_size=64)[1].cpu()
        result["resharded_len"] = len(restored)
    # ... and saved from those fewer ranks, restored onto all of them again: the ranks that share a
    # saved shard split its vectors and build their runs anew.
    if rank < world - 1:
        torch.save(restored.state_dict(), os.path.join(out, f"fewer{rank}.pt"))
    dist.barrier()
    states = [torch.load(os.path.join(out, f"fewer{r}.pt"), weights_only=True) for r in range(world - 1)]
    more = grnnd.distributed.ShardedIndex.from_state_dicts(states)
    result["more_search"] = more.search(my_queries, 10, list_size=64)[1].cpu()
    result["more_len"], result["more_rows"] = len(more), len(more.local)
    result["more_ids"] = more.local.ids.cpu()
    local_rows = more.local.data  # a copy of this rank's run alone, not a view of the saved shard
    result["more_own_storage"] = local_rows.untyped_storage().nbytes() == local_rows.numel() * local_rows.element_size()
    replicated = grnnd.distributed.ReplicatedIndex(grnnd.Index.build(data.to(device)))
    result["replicated"] = [t.cpu() for t in replicated.search(queries.to(device), 10, list_size=64)]
    # Over a group of fewer ranks (under NCCL it agrees through NCCL itself, not a host group).
    if rank < world - 1:
        fewer_copy = grnnd.distributed.ReplicatedIndex(replicated.index, group=fewer)
        result["replicated_fewer"] = fewer_copy.search(queries.to(device), 10, list_size=64)[1].cpu()
    # Mismatches: every rank must raise (a hang would time the test out).
    errors = []
    # A saved shard with one live vector cannot be split over every rank.
    tiny = grnnd.Index.build(data[:40].to(device))
    tiny.remove(torch.arange(1, 40, device=device))
    tiny_states = [{"local": tiny.state_dict(), "offset": 0, "total": 1, "user_ids": True, "rank": 0, "world_size": 1,
                    "partition": None, "probes": None, "next_id": 40}]
    for bad in (lambda: grnnd.distributed.knn(mine[:, :DIM - rank % 2], my_queries[:, :DIM - rank % 2], 10),
                lambda: grnnd.distributed.knn(mine, my_queries, 10 + rank % 2),
                lambda: grnnd.distributed.knn(mine.double() if rank == 1 else mine, my_queries, 10),
                lambda: grnnd.distributed.knn(mine, my_queries[:, :4], 10),
                lambda: grnnd.distributed.ShardedIndex.from_state_dicts(tiny_states),
                # The replicated search: a mismatch, a share's search that fails where the settings
                # cannot tell (a filter of the wrong length, on one rank), and queries of another
                # width on one rank.
                lambda: replicated.search(queries.to(device), 10 + rank % 2, list_size=64),
                lambda: replicated.search(queries.to(device), 10, list_size=64,
                                          filter=torch.ones(N - rank % 2, dtype=torch.bool, device=device)),
                lambda: replicated.search(queries[:, :DIM - 12 * (rank % 2)].to(device), 10, list_size=64),
                # The sharded search with a filter, or a setting it does not know, on one rank.
                lambda: sharded.search(my_queries, 10, list_size=64,
                                       filter=torch.ones(len(sharded.local), dtype=torch.bool, device=device)
                                       if rank == 0 else None),
                lambda: sharded.search(my_queries, 10, list_size=64, **({"lst_size": 32} if rank == 1 else {})),
                lambda: replicated.search(queries.to(device), 10, list_size=64,
                                          **({"lst_size": 32} if rank == 1 else {})),
                # Something other than a tensor on one rank.
                lambda: grnnd.distributed.knn(mine, my_queries.tolist() if rank == 1 else my_queries, 10),
                lambda: sharded.add(mine[:3].tolist() if rank == 1 else mine[:3]),
                lambda: sharded.remove([1] if rank == 1 else torch.zeros(0, dtype=torch.long))):
        try:
            bad()
            errors.append(None)
        except (ValueError, TypeError, RuntimeError) as e:
            errors.append(str(e))
    result["errors"] = errors
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, device: str = "cpu", backend: str = "gloo"):
    out = tempfile.mkdtemp()
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(worker, args=(world, init, out, device, backend), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def recall(found, truth):
    return grnnd.recall(found, truth)


def check(results, world):
    data, queries = dataset()
    truth = exact_neighbours(data, queries, 10)[1]
    rows = lambda key, j: torch.cat([r[key][j] for r in results])  # noqa: E731  (this rank's queries, in rank order)
    # Exact ops: the same neighbours as one process with all the data.
    single_d, single = grnnd.knn(data, queries, 10)
    assert torch.equal(rows("knn", 1), single) and torch.allclose(rows("knn", 0), single_d)
    assert recall(single, truth) == 1.0
    graph_ids = rows("knn_graph", 1)
    want = grnnd.knn(data, data, 9)[1]
    want = torch.stack([r[r != i][:8] for i, r in enumerate(want)])
    assert torch.equal(graph_ids, want)
    # The sharded index: recall within 0.01 of one index over all the data.
    one = grnnd.Index.build(data).search(queries, 10, list_size=64)[1]
    assert recall(rows("sharded", 1), truth) >= recall(one, truth) - 0.01
    assert all(r["restored_equal"] for r in results)
    for kind in ("int8", "int4"):
        coded = torch.cat([r[f"coded_{kind}"] for r in results])
        assert recall(coded, truth) >= recall(one, truth) - 0.01, kind
        assert all(r[f"coded_{kind}_restored_equal"] for r in results), kind
    # Partitioned: every row on exactly one rank, shares within 25% of equal; a query sent to
    # every shard finds what the all-shards search finds, to its own shard alone nearly as much,
    # and routed by the borders as much while most queries (clusters whole in a shard) visit one.
    placed = torch.cat([r["partition_ids"] for r in results])
    assert torch.equal(placed.sort().values, torch.arange(N))
    shares = torch.tensor([r["partition_rows"] for r in results], dtype=torch.float64) * world / N
    assert float((shares - 1).abs().max()) <= 0.25, shares
    everywhere = torch.cat([r["partitioned_everywhere"] for r in results])
    assert all(r["everywhere_shards"] == world and r["probes_1_shards"] == 1 for r in results)
    assert recall(everywhere, truth) >= recall(one, truth) - 0.01
    assert recall(torch.cat([r["partitioned_1"] for r in results]), truth) >= recall(everywhere, truth) - 0.05
    # A shard the borders rule out holds nothing nearer than the k-th found: the same answers.
    routed = torch.cat([r["partitioned_routed"] for r in results])
    assert float((routed == everywhere).all(1).float().mean()) >= 0.99
    shards = sum(r["routed_shards"] for r in results) / world
    assert 1 <= shards <= 1.5, shards
    assert all(r["partitioned_restored_equal"] for r in results)
    assert recall(torch.cat([r["partitioned_int4"] for r in results]), truth) >= recall(everywhere, truth) - 0.01
    assert all(r["rounds_same_ids"] and r["rounds_rows_intact"] for r in results)
    # Growth: added rows found under the ids they were numbered with; removed ones never again.
    assert all(r["grown_added_found"] and r["parted_added_found"] for r in results)
    gone = torch.tensor([g for r in range(world) for g in (7 * r, N + r * EXTRA + 1)])
    assert all(r["grown_len"] == N + world * EXTRA - 2 * world for r in results)
    grown = torch.cat([r["grown_search"] for r in results])
    assert not bool(torch.isin(grown, gone).any()) and recall(grown, truth) >= recall(one, truth) - 0.02
    assert all("every id must name one live vector" in r["remove_again"] for r in results)
    # Restored onto one rank fewer: the same vectors, the same recall.
    for r in results[:-1]:
        assert r["resharded_len"] == N + world * EXTRA - 2 * world
        assert not bool(torch.isin(r["resharded"], gone).any())
        assert recall(r["resharded"], truth) >= recall(one, truth) - 0.02
    # Restored onto more ranks than saved shards: every live vector on exactly one rank.
    kept = torch.cat([r["more_ids"] for r in results])
    assert kept.numel() == N + world * EXTRA - 2 * world and kept.unique().numel() == kept.numel()
    assert not bool(torch.isin(kept, gone).any()) and all(r["more_rows"] > 0 and r["more_own_storage"] for r in results)
    assert all(r["more_len"] == N + world * EXTRA - 2 * world for r in results)
    more = torch.cat([r["more_search"] for r in results])
    assert not bool(torch.isin(more, gone).any()) and recall(more, truth) >= recall(one, truth) - 0.02
    user = torch.cat([r["user_ids"] for r in results])
    assert ((user - 7) % 3 == 0).all() and recall((user - 7) // 3, truth) >= recall(one, truth) - 0.01
    # Replicated: every rank gets the same answer for the whole batch, as good as one index's.
    for r in results:
        assert torch.equal(r["replicated"][1], results[0]["replicated"][1])
    assert results[0]["replicated"][1].shape == (QUERIES, 10)
    for r in results[:world - 1]:
        assert torch.equal(r["replicated_fewer"], results[0]["replicated"][1])
    assert recall(results[0]["replicated"][1], truth) >= recall(one, truth) - 0.01
    # Every rank raised on every mismatch, with a message naming what differs; a rank whose own
    # search failed gives its own error.
    for rank, r in enumerate(results):
        e = r["errors"]
        assert "disagree on dim" in e[0] and "disagree on k" in e[1] and "disagree on dtype" in e[2]
        assert "queries have 4 columns, the data 16" in e[3]
        assert "saved shard 0 holds 1 live vectors, fewer than the" in e[4]
        assert "disagree on k" in e[5]
        assert ("filter: expected shape" if rank % 2 else "failed on rank(s) [1]") in e[6]
        assert "disagree on query_dim" in e[7]
        assert ("a filter is over one shard's rows" if rank == 0 else "failed on rank(s) [0]") in e[8]
        for j in (9, 10):
            assert ("unknown setting(s) ['lst_size']" if rank == 1 else "failed on rank(s) [1]") in e[j]
        assert "knn: the ranks disagree on query_dim: [16, -1" in e[11]
        assert "ShardedIndex.add: the ranks disagree on dim: [16, -1" in e[12]
        assert "ShardedIndex.remove: expected a tensor of ids on every rank; rank(s) [1] passed" in e[13]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_with_one_process(world):
    check(run(world), world)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_sharing_one_gpu():
    check(run(2, "cuda"), 2)


# NCCL between two GPUs, as torchrun jobs run: every agreement and exchange then goes through NCCL,
# and each rank's restored shards must land on its own GPU.
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_over_nccl():
    check(run(2, "cuda", "nccl"), 2)


def test_the_merge_of_shard_answers_orders_ties_by_id():
    # Two shards' sorted answers for two queries, with a distance tie across the shards. With
    # user ids the lower id must come first whatever shard holds it; with rank-offset ids the
    # shard order already is the id order, and the single sort must agree with the two.
    inf = float("inf")
    dists = torch.tensor([[[1.0, 2.0, inf], [0.5, 3.0, 3.0]],
                          [[1.0, 1.5, 2.0], [3.0, inf, inf]]])
    user = torch.tensor([[[70, 10, -1], [4, 8, 9]],
                         [[20, 30, 40], [5, -1, -1]]])
    d, i = grnnd.distributed._best(dists, user, 4)
    assert i.tolist() == [[20, 70, 30, 10], [4, 5, 8, 9]]
    assert d.tolist() == [[1.0, 1.0, 1.5, 2.0], [0.5, 3.0, 3.0, 3.0]]
    offsets = torch.tensor([[[0, 1, -1], [2, 3, 4]],
                            [[10, 11, 12], [13, -1, -1]]])
    for follow in (False, True):
        d, i = grnnd.distributed._best(dists, offsets, 5, ids_follow_ranks=follow)
        assert i.tolist() == [[0, 10, 11, 1, 12], [2, 3, 4, 13, -1]]
        assert d[1, -1] == inf


def dying_worker(rank: int, init: str, out: str):
    import datetime
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=10))
    torch.set_num_threads(1)
    data, queries = dataset()
    dist.barrier()  # both connected: else rank 0 may fail in init_process_group, not in the op
    if rank == 1:
        os._exit(0)  # a rank that dies without a word, before the op's collectives
    start = time.monotonic()
    try:
        grnnd.distributed.knn(data[:100], queries[:10], 5)
        outcome = "returned"
    except Exception as e:  # what gloo raises for a lost peer or a timeout
        outcome = f"raised {type(e).__name__}: {e}"
    with open(os.path.join(out, "outcome.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{outcome}")
    os._exit(0)


def spawn_ranks(target, world: int, seconds: float) -> Tuple[str, bool]:
    """Run ``target(rank, init, out)`` in ``world`` spawned processes joined by a file rendezvous
    in a new folder ``out``; ``(out, whether any was still running after seconds)``, the hung
    ones killed."""
    out = tempfile.mkdtemp()
    init = "file://" + os.path.join(out, "rendezvous")
    context = mp.get_context("spawn")
    workers = [context.Process(target=target, args=(rank, init, out)) for rank in range(world)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + seconds
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = any(w.is_alive() for w in workers)
    for w in workers:
        if w.is_alive():
            w.kill()
    return out, hung


def test_a_rank_that_dies_makes_the_others_raise():
    out, hung = spawn_ranks(dying_worker, 2, seconds=120)
    assert not hung, "a rank hung"
    seconds, outcome = open(os.path.join(out, "outcome.txt")).read().split("\n", 1)
    assert outcome.startswith("raised") and float(seconds) <= 60, outcome


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_a_shard_the_borders_rule_out_holds_no_neighbour(metric):
    # The routing's promise, on clustered and on structureless rows: every exact neighbour of a
    # query lies on a shard that Partition.reachable gives for the query's exact k-th distance.
    for x in (clustered(6000, 16, 30, seed=53), torch.randn(6000, 16, generator=torch.Generator().manual_seed(54))):
        rows, queries = x[:5500], x[5500:]
        part = grnnd.distributed._plan_partition(rows, 3, metric, seed=0, cells=16)
        ranks = part.ranks(rows)
        assert torch.bincount(ranks, minlength=3).min() > 0
        dists, ids = grnnd.knn(rows, queries, 10, metric=metric)
        reach = part.reachable(part.scores(queries), dists[:, -1])
        assert bool(reach.gather(1, ranks[ids]).all())
        # The query's own shard is always reachable; a shard is not reachable at radius zero
        # unless the query sits on a border.
        own = part.rank_order(part.scores(queries))[:, 0]
        assert bool(reach.gather(1, own[:, None]).all())
        assert float(part.reachable(part.scores(queries), torch.zeros(500)).sum(1).float().mean()) < 1.01


def host_group_worker(rank: int, init: str, out: str):
    from unittest import mock
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    dist.new_group([0, 1])  # a group of the program's own, made before the library's
    subgroup = dist.new_group([1, 2])
    # As under NCCL: the host group is made inside a call, after the program's groups. A group
    # spanning every rank gets a gloo group of its own (the same one on every later call); a group
    # of fewer ranks agrees through itself.
    with mock.patch.object(grnnd.distributed.dist, "get_backend", return_value="nccl"):
        host = grnnd.distributed._host_group(None)
        again = grnnd.distributed._host_group(None)
        sub = grnnd.distributed._host_group(subgroup) if rank > 0 else None
    gathered = torch.empty(3, dtype=torch.long)
    dist.all_gather_into_tensor(gathered, torch.tensor([10 + rank]), group=host)
    torch.save({"same": host is again, "distinct": host is not dist.group.WORLD and host is not None,
                "gathered": gathered.tolist(), "sub_itself": sub is subgroup if rank > 0 else True},
               os.path.join(out, f"host{rank}.pt"))
    dist.destroy_process_group()


def test_the_host_group_of_an_nccl_group_is_made_after_other_groups_without_hanging():
    # ReplicatedIndex.search agrees on the host (a gloo group beside NCCL's), a group made on the
    # first search, after whatever groups the program made before; made there with
    # use_local_synchronization it hung (torch 2.11 over NCCL, 2.13 over gloo).
    out, hung = spawn_ranks(host_group_worker, 3, seconds=90)
    assert not hung, "the host group's creation hung"
    for rank in range(3):
        seen = torch.load(os.path.join(out, f"host{rank}.pt"))
        assert seen == {"same": True, "distinct": True, "gathered": [10, 11, 12], "sub_itself": True}, (rank, seen)


def balance_worker(rank: int, init: str, out: str, world: int = 3, device: str = "cpu", backend: str = "gloo"):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    data, _ = dataset()
    loads = [300 * (r + 1) for r in range(world)]  # uneven shards: 300, 600, 900 rows
    first = sum(loads[:rank])
    index = grnnd.distributed.ShardedIndex.build(data[first:first + loads[rank]].to(device))
    # Every new row reaches rank 0 (a stream of them arriving there): they go to the least-loaded
    # shards, numbered after every id so far as without balance.
    everyone = clustered(sum(loads) // 2, DIM, 30, seed=53).to(device)
    new = everyone if rank == 0 else everyone[:0]
    index.add(new, balance=True)
    result = {"live": len(index.local), "total": len(index)}
    result["found"] = index.search(everyone, 1, list_size=64)[1][:, 0].cpu()
    # No new rows anywhere: nothing moves.
    index.add(torch.empty(0, DIM, device=device), balance=True)
    result["live_after_none"] = len(index.local)
    errors = []
    shard = data[first:first + loads[rank]].to(device)
    parted = grnnd.distributed.ShardedIndex.build(shard, partition=True)
    user = grnnd.distributed.ShardedIndex.build(shard, ids=torch.arange(first, first + loads[rank], device=device))
    for bad in (lambda: index.add(new[:0], balance=rank == 0),  # the ranks disagree
                lambda: parted.add(new[:0], balance=True),  # a partition places rows itself
                # ids of the wrong length on one rank: every rank raises before the rows move.
                lambda: user.add(everyone[:4], ids=torch.arange(10**6, 10**6 + 4 + (rank == 0), device=device),
                                 balance=True)):
        try:
            bad()
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    result["errors"] = errors
    torch.save(result, os.path.join(out, f"balance{rank}.pt"))
    dist.destroy_process_group()


def check_balance(out: str, world: int):
    loads = [300 * (r + 1) for r in range(world)]
    added = sum(loads) // 2
    results = [torch.load(os.path.join(out, f"balance{r}.pt")) for r in range(world)]
    live = [r["live"] for r in results]
    # Water filling: the shards end level where the new rows suffice, the fuller ones unchanged.
    level = (sum(loads) + added) // world
    assert max(live) - min(live) <= max(0, max(loads) - level) + 1, live
    assert sum(live) == sum(loads) + added and all(r["total"] == sum(loads) + added for r in results)
    assert all(after >= before for after, before in zip(live, loads))
    want = torch.arange(sum(loads), sum(loads) + added)
    for r in results:
        assert (r["found"] == want).float().mean() >= 0.99  # every rank finds the added rows by their ids
        assert r["live_after_none"] == r["live"]
        assert "disagree on balance" in r["errors"][0]
        assert "a partitioned index places each vector" in r["errors"][1]
    assert "ids: expected shape [4], got (5,)" in results[0]["errors"][2]
    assert all("failed on rank(s) [0]" in r["errors"][2] for r in results[1:])


def test_a_balanced_add_fills_the_least_loaded_shards():
    out, hung = spawn_ranks(balance_worker, 3, seconds=120)
    assert not hung, "a rank hung"
    check_balance(out, 3)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_balanced_add_over_nccl():
    out, hung = spawn_ranks(functools.partial(balance_worker, world=2, device="cuda", backend="nccl"), 2, seconds=180)
    assert not hung, "a rank hung"
    check_balance(out, 2)


@pytest.mark.parametrize("live, rows, quotas", [
    ([300, 600, 900], [900, 0, 0], [600, 300, 0]),  # level 900
    ([10, 10, 10], [4, 0, 0], [2, 1, 1]),  # the leftover to the lower ranks
    ([5, 0], [0, 3], [0, 3]),  # the shards stay uneven where the rows do not suffice
    ([0, 0], [0, 0], [0, 0]),
])
def test_least_loaded_placement(live, rows, quotas):
    got = [0] * len(live)
    for rank in range(len(live)):
        for place in grnnd.distributed._least_loaded_ranks(rows, live, rank, torch.device("cpu")).tolist():
            got[place] += 1
    assert got == quotas
