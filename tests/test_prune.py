"""torch.ops.grnnd.prune_rows: the build's rule applied to chosen rows (csrc/build/prune.h), which
Index.add and Index.compact are made of.

The oracle is the recipe written out here in plain torch, one row at a time. Integer-valued
vectors make every distance exact in float32, whatever order a kernel sums in, so CPU, CUDA and
the oracle must agree entry for entry, ties (broken by id) included.
"""
import pytest
import torch

import torch_grnnd  # noqa: F401  (registers the ops)

from conftest import DEVICES



def distance(x, a, b):
    return float((x[a] - x[b]).pow(2).sum())


def reference_row(x, v, candidates, degree, rule, fixed=0, shrink=False):
    """The recipe of csrc/build/prune.h for one vertex, in squared l2 on float64 rows."""
    x = x.double()
    if shrink:
        return reference_shrink(x, v, candidates, degree)
    valid = [(j, int(u)) for j, u in enumerate(candidates) if 0 <= int(u) < x.shape[0] and int(u) != v]
    pinned = {u for j, u in valid if j < fixed}
    by_distance = sorted((distance(x, u, v), u) for u in {u for _, u in valid})
    ranked = sorted([e for e in by_distance if e[1] in pinned][:degree] +
                    [e for e in by_distance if e[1] not in pinned][:2 * degree])
    kept, free_places = [], degree - sum(u in pinned for _, u in ranked)
    for d_vu, u in ranked:
        if u in pinned:
            kept.append((d_vu, u))
        elif free_places > 0 and (not rule or all(distance(x, w, u) >= d_vu for _, w in kept)):
            kept.append((d_vu, u))
            free_places -= 1
    for entry in ranked:
        if len(kept) >= degree:
            break
        if entry not in kept:
            kept.append(entry)
    row = [u for _, u in sorted(kept)]
    return row + [-1] * (degree - len(row))


def reference_shrink(x, v, candidates, degree):
    """The shrink (S1-S5): the first ``degree`` columns are the row, in their order; each
    newcomer goes where a binary search over the row's distances puts it; then the surplus goes,
    farthest covered entries first, then the farthest."""
    ids = [int(u) for u in candidates]
    usable = [u for u in ids if 0 <= u < x.shape[0] and u != v]
    own = [u for u in ids[:degree] if u in usable]
    newcomers = []
    for j, u in enumerate(ids[degree:], start=degree):
        if u in usable and u not in own and u not in ids[degree:j] and len(newcomers) < degree:
            newcomers.append(u)
    newcomers.sort(key=lambda u: (distance(x, u, v), u))
    places = []
    for u in newcomers:
        lo, hi = 0, len(own)
        while lo < hi:
            mid = (lo + hi) // 2
            if distance(x, own[mid], v) <= distance(x, u, v):
                lo = mid + 1
            else:
                hi = mid
        places.append(max([lo] + places[-1:]))
    merged = []
    for i in range(len(own) + 1):
        merged += [u for u, p in zip(newcomers, places) if p == i]
        merged += own[i:i + 1]
    surplus, dropped = len(merged) - degree, set()
    for j in reversed(range(len(merged))):
        u = merged[j]
        if surplus > 0 and any(distance(x, w, u) < distance(x, u, v) for w in merged[:j]):
            dropped.add(j)
            surplus -= 1
    for j in reversed(range(len(merged))):
        if surplus > 0 and j not in dropped:
            dropped.add(j)
            surplus -= 1
    row = [u for j, u in enumerate(merged) if j not in dropped][:degree]
    return row + [-1] * (degree - len(row))


def integer_rows(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n, dim), generator=g).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("degree,width", [(16, 40), (32, 81), (8, 300), (4, 12)])
def test_rows_follow_the_recipe_exactly(device, degree, width):
    x = integer_rows(400, 12, seed=degree)
    g = torch.Generator().manual_seed(width)
    vertices = torch.randint(0, 400, (60,), generator=g)
    candidates = torch.randint(-2, 420, (60, width), generator=g)  # repeats, -1s, ids >= n, self
    candidates[:, 0] = vertices
    for rule, fixed, shrink in ((True, 0, False), (False, 0, False), (True, degree // 2, False), (True, degree, False),
                                (False, degree, False), (False, 0, True)):
        got = torch.ops.grnnd.prune_rows(x.to(device), vertices.to(device), candidates.to(device), degree, rule=rule,
                                         fixed=fixed, shrink=shrink)
        assert got.dtype == torch.int32 and got.shape == (60, degree)
        want = [reference_row(x, int(v), c, degree, rule, fixed, shrink) for v, c in zip(vertices, candidates)]
        assert got.cpu().tolist() == want, (rule, fixed, shrink)


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_entries_stay_however_far(device):
    # Vertex 0's own row holds far entries (the long edges a graph navigates by); the many near
    # candidates offered beside them must not push them out of the list or the row.
    g = torch.Generator().manual_seed(7)
    near = torch.randn(200, 8, generator=g) * 0.1
    far = torch.randn(6, 8, generator=g) * 10
    x = torch.cat([torch.zeros(1, 8), far, near])
    own = torch.arange(1, 7)
    candidates = torch.cat([own, torch.arange(7, 207)]).unsqueeze(0)
    for rule in (True, False):
        got = torch.ops.grnnd.prune_rows(x.to(device), torch.tensor([0], device=device), candidates.to(device), 16,
                                         rule=rule, fixed=6).cpu()[0]
        assert set(own.tolist()) <= set(got.tolist()), rule
        assert (got >= 0).all(), rule  # the free places are filled from the near ones


@pytest.mark.parametrize("device", DEVICES)
def test_a_shrunk_row_keeps_its_entries_and_drops_a_covered_newcomer(device):
    # Row of vertex 0: the points 1..4 on the axes at distance 1 (none covers another), a
    # newcomer 5 behind point 1 (covered by it) and a newcomer 6 at distance 2 on a free axis.
    x = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [-1, 0, 0], [0, -1, 0], [2, 0, 0], [0, 0, 2.]])
    vertices = torch.tensor([0, 0])
    candidates = torch.tensor([[1, 2, 3, 4, 5, -1], [1, 2, 3, 4, 6, 5]])
    got = torch.ops.grnnd.prune_rows(x.to(device), vertices.to(device), candidates.to(device), 4, rule=False,
                                     shrink=True).cpu()
    # 5 is covered by 1 and goes; in the second row too few are covered, so the farthest
    # uncovered (6) goes as well. The rule gives the same rows here, at the cost of every pair
    # instead of one pass over the row.
    assert got.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]
    grown = torch.ops.grnnd.prune_rows(x.to(device), vertices.to(device), candidates.to(device), 5, rule=False,
                                       shrink=True).cpu()
    assert grown.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]


@pytest.mark.parametrize("device", DEVICES)
def test_a_shrink_of_a_sorted_row_equals_ranking_the_row_and_newcomers_together(device):
    # Graph rows are kept ascending by distance, which is what lets a shrink place each newcomer
    # by binary search instead of ranking the row again: on such rows both give the same list.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64)
    degree, m = 16, 60
    vertices = torch.randint(0, 300, (m,), generator=g)
    rows, expected = [], []
    for v in vertices.tolist():
        others = torch.randperm(300, generator=g)
        others = others[others != v]
        row = sorted(others[:degree].tolist(), key=lambda u: distance(x, u, v))
        newcomers = others[degree:degree + 1 + v % 7].tolist()
        rows.append(row + newcomers + [-1] * (7 - len(newcomers)))
        ranked = sorted(row + newcomers, key=lambda u: distance(x, u, v))
        surplus, dropped = len(ranked) - degree, set()
        for j in reversed(range(len(ranked))):
            if surplus > 0 and any(distance(x, w, ranked[j]) < distance(x, ranked[j], v) for w in ranked[:j]):
                dropped.add(j)
                surplus -= 1
        kept = [u for j, u in enumerate(ranked) if j not in dropped]
        expected.append(kept[:degree])  # the farthest uncovered ones go where too few are covered
    got = torch.ops.grnnd.prune_rows(x.float().to(device), vertices.to(device), torch.tensor(rows).to(device), degree,
                                     rule=False, shrink=True).cpu()
    assert got.tolist() == expected


def test_a_shrink_takes_no_fixed_columns():
    x = torch.randn(10, 4)
    with pytest.raises(ValueError, match="fixed"):
        torch.ops.grnnd.prune_rows(x, torch.tensor([0]), torch.tensor([[1, 2, 3]]), 2, shrink=True, fixed=1)
    with pytest.raises(ValueError, match="fixed"):
        torch.ops.grnnd.prune_rows(x, torch.tensor([0]), torch.tensor([[1, 2, 3]]), 2, fixed=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_storage_types_give_the_same_rows(device, dtype):
    # Small integers are exact in every storage type.
    x = integer_rows(300, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    vertices = torch.arange(300)
    candidates = torch.randint(0, 300, (300, 64), generator=g)
    want = torch.ops.grnnd.prune_rows(x, vertices, candidates, 24)
    got = torch.ops.grnnd.prune_rows(x.to(device, dtype), vertices.to(device), candidates.int().to(device), 24)
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("metric", ["l2", "cosine", "ip"])
def test_cuda_matches_the_cpu(metric):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, 48, generator=g)
    vertices = torch.randint(0, 5000, (2000,), generator=g)
    candidates = torch.randint(-1, 5000, (2000, 1100), generator=g)
    for shrink in (False, True):
        want = torch.ops.grnnd.prune_rows(x, vertices, candidates, 32, metric=metric, shrink=shrink)
        got = torch.ops.grnnd.prune_rows(x.cuda(), vertices.cuda(), candidates.cuda(), 32, metric=metric,
                                         shrink=shrink).cpu()
        # Sums in another order may flip a near tie of the rule; rows must agree all but rarely.
        assert (got == want).all(1).float().mean() >= 0.99, shrink


@pytest.mark.parametrize("device", DEVICES)
def test_metrics_rank_as_the_build_does(device):
    # Cosine ranks as l2 on the normalised rows; inner product as l2 on the lifted rows.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(500, 8, generator=g).to(device)
    vertices = torch.arange(500, device=device)
    candidates = torch.randint(0, 500, (500, 40), generator=g).to(device)
    unit = torch.nn.functional.normalize(x, dim=1)
    sq = x.pow(2).sum(1)
    lifted = torch.cat([x, (sq.max() - sq).clamp_min(0).sqrt()[:, None]], dim=1)
    for metric, space in (("cosine", unit), ("ip", lifted)):
        got = torch.ops.grnnd.prune_rows(x, vertices, candidates, 16, metric=metric)
        want = torch.ops.grnnd.prune_rows(space, vertices, candidates, 16)
        assert (got == want).all(1).float().mean() >= 0.99, metric


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_refused(device):
    x = torch.randn(50, 4, device=device)
    v = torch.arange(3, device=device)
    c = torch.zeros(3, 5, dtype=torch.long, device=device)
    prune = torch.ops.grnnd.prune_rows
    for args, error, match in [
        ((x, v.int(), c, 4), TypeError, "vertices: expected int64"),
        ((x, v, c.float(), 4), TypeError, "candidates: expected int32 or int64"),
        ((x, v, c[:2], 4), ValueError, r"candidates: expected shape \[3, c\]"),
        ((x, v, c, 0), ValueError, "degree: expected 1 .. 256"),
        ((x, v + 48, c, 4), ValueError, r"vertices: expected ids in \[0, 50\), found 50"),
        ((x, v, torch.zeros(3, 2049, dtype=torch.long, device=device), 4), ValueError, "at most 2048"),
    ]:
        with pytest.raises(error, match=match):
            prune(*args)
    assert prune(x, v[:0], c[:0], 4).shape == (0, 4)
