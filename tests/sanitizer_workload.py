"""A small CUDA workload for compute-sanitizer: every kernel path once, tiny sizes.

    compute-sanitizer --tool memcheck python tests/sanitizer_workload.py
    compute-sanitizer --tool racecheck python tests/sanitizer_workload.py
    compute-sanitizer --tool racecheck python tests/sanitizer_workload.py editing   # one part
    (parts: see PARTS)
"""
import sys
import time

import torch

import torch_grnnd as grnnd
from torch_grnnd import memory


def basics(g: torch.Generator):
    """Builds and searches of each storage type and metric, each search loop, knn."""
    for dtype, metric, dim in [(torch.float32, "l2", 32), (torch.float16, "cosine", 64), (torch.bfloat16, "ip", 30),
                               (torch.float32, "l2", 3), (torch.float32, "l2", 1100)]:
        data = torch.randn(1500, dim, generator=g, device="cuda").to(dtype)
        # Four outer iterations: the build searches its pools' graph after the second and third
        # (build_schedule.h, unfound_share).
        graph = grnnd.build(data, metric=metric, outer_iters=4, inner_iters=1)
        # Width 1: the warp loop, two neighbour slots a lane at degree 48; width 4: six a lane;
        # width 8 (384 slots): the block loop.
        for width in (1, 4, 8):
            grnnd.search(data, graph, data[:64], 10, list_size=64, search_width=width, metric=metric)
        grnnd.search(data, graph, data.repeat(2, 1), 10, list_size=32, metric=metric)  # 64-thread blocks
        allowed = torch.rand(1500, generator=g, device="cuda") < 0.3
        grnnd.search(data, graph, data[:16], 10, list_size=256, metric=metric, filter=allowed)
        grnnd.search(data, graph, data[:16], 10, list_size=256, metric=metric)  # eight register rows
        # Split queries (small batches split automatically too): merges of 320 and 800 keys.
        grnnd.search_distance_counts(data, graph, data[:3], 10, list_size=32, searches=32, metric=metric)
        grnnd.search(data, graph, data[:5], 100, list_size=128, searches=8, metric=metric)
    grnnd.build(torch.randn(1500, 16, device="cuda"), update_order="ascending", outer_iters=1, inner_iters=2)
    # Pools wider than 64 entries: the update round's visit order by counting, not in registers.
    grnnd.build(torch.randn(1500, 16, device="cuda"), update_order="random", pool_size=96, degree=64, outer_iters=1,
                inner_iters=2)
    # A build that widens: rows hard to find in narrow pools, which grow from 16 to 21 entries a row
    # after the second outer iteration (build_schedule.h, kWidenShare), on the rows and on pair codes;
    # to 32 where the rows' scales differ by dimension (BuildParams.wide_pool_size_for), after their
    # neighbourhood_dimensions.
    scales = 10 ** (torch.rand(128, generator=g, device="cuda") * 1.25 - 1.25)
    for pair_codes, rows in ((False, torch.randn(3000, 64, generator=g, device="cuda")),
                             (True, torch.randn(3000, 64, generator=g, device="cuda")),
                             (False, torch.randn(3000, 128, generator=g, device="cuda") * scales)):
        graph = grnnd.build(rows, degree=16, pool_size=16, initial_degree=8, outer_iters=4, inner_iters=2,
                            pair_codes=pair_codes)
        assert graph.shape[1] in (21, 32), graph.shape  # wider by the share it measured (wide_degree_for)
    for dtype, metric, k in [(torch.float32, "l2", 10), (torch.float16, "cosine", 300), (torch.bfloat16, "ip", 1)]:
        data = torch.randn(3000, 24, generator=g, device="cuda").to(dtype)
        grnnd.knn(data, data[:40], k, metric=metric)


def edge_sizes(g: torch.Generator):
    """The sizes where indexing goes wrong first: one row, fewer rows than the degree, k = N,
    one column, rows of 4096 columns; every storage type, each search path, knn and knn_graph."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n, dim in [(1, 8), (5, 8), (40, 1), (300, 4096)]:
            data = torch.randn(n, dim, generator=g, device="cuda").to(dtype)
            graph = grnnd.build(data, degree=16, pool_size=32, initial_degree=8, outer_iters=2, inner_iters=2)
            queries = torch.randn(3, dim, generator=g, device="cuda").to(dtype)
            k = min(n, 10)
            grnnd.search(data, graph, queries, n if n <= 64 else k, list_size=64, searches=1)  # k = N where small
            grnnd.search(data, graph, queries, k, list_size=64, searches=4)  # split, then merged
            grnnd.search(data, graph, queries, k, list_size=256, search_width=2, searches=1)  # eight rows
            grnnd.search(data, graph, queries, k, list_size=512, search_width=2, searches=1)  # block loop
            allowed = torch.rand(n, generator=g, device="cuda") < 0.5
            grnnd.search(data, graph, queries, k, list_size=64, filter=allowed)
            grnnd.knn(data, queries, n if n <= 1024 else k)
            if n > 1:
                grnnd.knn_graph(data, min(n - 1, 5))
                grnnd.knn_graph(data, min(n - 1, 5), exact=True)


def hubs_and_repair(g: torch.Generator):
    """Data large enough for hubs (the start from cells, hub entry points, split searches taking
    their share of the hubs, the nearest-hub selection) and far islands that the reachability
    repair must link in."""
    cloud = torch.randn(20_000, 16, generator=g, device="cuda")
    far = (torch.randn(10, 16, generator=g, device="cuda") * 8).repeat_interleave(4, 0)
    for dtype, metric in [(torch.float16, "l2"), (torch.float32, "ip")]:
        data = torch.cat([cloud, far + 0.1 * torch.randn_like(far)]).to(dtype)
        graph = grnnd.build(data, metric=metric, degree=16, pool_size=32, initial_degree=8, outer_iters=2,
                            inner_iters=2)
        grnnd.search(data, graph, data[-40:], 10, list_size=64, metric=metric)
        grnnd.search(data, graph, data[:3], 10, list_size=64, searches=8, metric=metric)
        grnnd.search_distance_counts(data, graph, data[:20], 10, hub_entries=8, metric=metric)
    # 70 hubs: every register list of the fused hub selection (one, two and four slots a lane).
    many = torch.randn(70_000, 16, generator=g, device="cuda")
    for dtype, metric in [(torch.float16, "l2"), (torch.float32, "ip"), (torch.float32, "cosine")]:
        for k in (1, 5, 20, 64, 70):
            grnnd.diagnostics.nearest_hubs(many.to(dtype), many[-33:].to(dtype), k, metric=metric)
    # 5 000 queries are more (query, hub) pairs than the direct kernels take: the gathered hub rows.
    for dtype, metric in [(torch.float16, "l2"), (torch.bfloat16, "ip"), (torch.float32, "cosine")]:
        for k in (5, 64, 70):
            grnnd.diagnostics.nearest_hubs(many.to(dtype), many[:5_000].to(dtype), k, metric=metric)
    # 70 000 half-precision rows for one or two hubs: the fused product (a partial block and tile).
    for dtype, metric in [(torch.float16, "l2"), (torch.bfloat16, "cosine")]:
        for k in (1, 2):
            grnnd.diagnostics.nearest_hubs(many.to(dtype), many.to(dtype), k, metric=metric)
    grnnd.build(many.half(), metric="ip", outer_iters=1, inner_iters=1)  # the fused product with the lift


def segments(g: torch.Generator):
    """knn_segments in every variant: dimension passes of 4, 16 and 64 (two passes at 100), best k
    in registers (8, 16, 32) and in the output row (40); examples empty, smaller than k and
    larger than a tile; a block whose queries span examples; query indices out of range; x's
    examples as ptr_x and as batch_x."""
    sizes = torch.tensor([0, 3, 70, 1, 33, 0, 100], device="cuda")
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), sizes.cumsum(0)])
    batch_y = torch.randint(-1, sizes.numel() + 1, (150,), generator=g, device="cuda")
    batch_x = torch.repeat_interleave(torch.arange(sizes.numel(), device="cuda"), sizes)
    for dim in (3, 10, 64, 100):
        x = torch.randn(int(sizes.sum()), dim, generator=g, device="cuda")
        y = torch.randn(batch_y.numel(), dim, generator=g, device="cuda")
        for k in (1, 16, 20, 40):
            torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y.sort().values, k, method="scan")
            torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k, method="scan")
            # x's examples as a batch vector: each query searches it for its rows.
            torch.ops.grnnd.knn_segments(x, y, None, batch_y, k, method="scan", batch_x=batch_x, examples=7)
            torch.ops.grnnd.knn_segments(x, y, None, batch_y, k, method="scan", batch_x=batch_x, examples=3)
            if k <= 32:  # the grid path (csrc/pyg/grid.h), every register list size
                torch.ops.grnnd.knn_segments(x, y, ptr_x, batch_y, k, method="grid")
                torch.ops.grnnd.knn_segments(x, y * 40, ptr_x, batch_y, k + 7, method="grid")
    # Many small examples in one launch: 4 000 of 1 to 39 rows.
    many = torch.randint(1, 40, (4000,), generator=g, device="cuda")
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), many.cumsum(0)])
    batch = torch.repeat_interleave(torch.arange(4000, device="cuda"), many)
    x = torch.randn(batch.numel(), 3, generator=g, device="cuda")
    for k in (16, 40):
        torch.ops.grnnd.knn_segments(x, x, ptr_x, batch, k)
        torch.ops.grnnd.knn_segments(x, x, None, batch, k, method="scan", batch_x=batch, examples=4000)
    # Clouds of 512 to 4096 points an example, with many ties (queued candidates, csrc/cuda/knn_segments_cuda.cu).
    sizes = torch.tensor([1500, 0, 7, 2048, 900], device="cuda")
    ptr_x = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), sizes.cumsum(0)])
    x = torch.randint(0, 4, (int(sizes.sum()), 3), generator=g, device="cuda").float()
    y = torch.randn(700, 3, generator=g, device="cuda")
    for k in (1, 21, 32):
        dists, ids = torch.ops.grnnd.knn_segments(x, y, ptr_x, torch.randint(-1, 6, (700,), generator=g, device="cuda"),
                                                  k, method="scan")
        # The edges of those results, every filter (csrc/cuda/segment_edges_cuda.cu).
        torch.ops.grnnd.segment_edges(dists, ids)
        torch.ops.grnnd.segment_edges(dists, ids, max_distance=1.0, drop_self=True, neighbour_first=True)
        torch.ops.grnnd.segment_edges(dists, ids, drop_self=True, most=3)
    torch.ops.grnnd.segment_edges(torch.rand(50, 40, device="cuda"), torch.randint(-1, 50, (50, 40), device="cuda"))
    flat = torch.randn(50_000, 3, generator=g, device="cuda")
    flat[:, 2] = 0.5  # a plane: one cell along z
    ends = torch.tensor([0, 20_000, 50_000], device="cuda")
    torch.ops.grnnd.knn_segments(flat, flat, ends, (torch.arange(50_000, device="cuda") >= 20_000).long(), 16)


def editing(g: torch.Generator):
    """prune_rows at every team size and storage type, with repeats, self, -1 and ids past the
    data among the candidates, widths below one warp and up to the limit (2048); then an index
    edited as a user would: add (reverse edges into full rows), remove, compact."""
    for dtype, metric, dim in [(torch.float32, "l2", 3), (torch.float16, "cosine", 64), (torch.bfloat16, "ip", 30),
                               (torch.float32, "l2", 1100)]:
        data = torch.randn(700, dim, generator=g, device="cuda").to(dtype)
        vertices = torch.randint(0, 700, (90,), generator=g, device="cuda")
        for width, degree in [(5, 4), (81, 32), (300, 16), (2048, 64)]:
            candidates = torch.randint(-3, 720, (90, width), generator=g, device="cuda")
            candidates[:, 0] = vertices
            for rule, fixed, shrink in ((True, 0, False), (False, 0, False), (False, 0, True), (True, degree, False)):
                torch.ops.grnnd.prune_rows(data, vertices, candidates, degree, metric=metric, rule=rule,
                                           fixed=min(fixed, width), shrink=shrink)
    data = torch.randn(6000, 16, generator=g, device="cuda")
    index = grnnd.Index.build(data[:4000], degree=16, pool_size=32, outer_iters=2, inner_iters=2)
    index.add(data[4000:5000])  # a quarter of the rows: one build grows the graph (init_mode="grow")
    index.add(data[5000:5100])  # reverse edges into full rows
    exact_rows, grnnd.index.EXACT_BATCH_ROWS = grnnd.index.EXACT_BATCH_ROWS, 500
    try:
        index.add(data[5100:])  # 900 rows: their candidates among themselves from their own build
    finally:
        grnnd.index.EXACT_BATCH_ROWS = exact_rows
    index.remove(torch.arange(0, 6000, 7, device="cuda"))
    index.compact()
    index.search(data[:10], 5)
    # A build started from given entries (the merge's start), junk entries among them. Both
    # indexes number their vectors themselves (built without ids), as a merge asks.
    other = grnnd.Index.build(torch.randn(3000, 16, generator=g, device="cuda"), degree=16, pool_size=32,
                              outer_iters=2, inner_iters=2)
    grnnd.merge(index, other, outer_iters=2, inner_iters=2)
    junk = torch.randint(-5, 7000, (6000, 40), generator=g, device="cuda", dtype=torch.int32)
    grnnd.build(data, degree=16, pool_size=32, outer_iters=1, inner_iters=2, init=junk)
    # A merge's start with hubs: draws from the other part's members of a cell (binary search),
    # init entries pruned among themselves first.
    rows = torch.randn(40_000, 8, generator=g, device="cuda")
    init = torch.randint(-1, 40_000, (40_000, 12), generator=g, device="cuda", dtype=torch.int32)
    for mode in ("merge", "grow"):  # a growing graph's new rows draw from all members, skip their init rows
        grnnd.build(rows, degree=8, pool_size=16, initial_degree=4, outer_iters=1, inner_iters=1, init=init,
                    init_split=20_000, init_mode=mode)
    # The rule among the start's entries: from their Gram matrix (16-bit rows of whole chunks, one
    # of 40 wide whose last 8 coordinates stand alone; the distances to the row from the same
    # loads, for each metric) and a distance at a time (rows not of whole chunks, float32 rows).
    for dtype, metric, dim in [(torch.float16, "cosine", 64), (torch.float16, "l2", 48), (torch.bfloat16, "ip", 40),
                               (torch.bfloat16, "ip", 30), (torch.float32, "l2", 1100)]:
        rows = torch.randn(2000, dim, generator=g, device="cuda").to(dtype)
        init = torch.randint(-1, 2000, (2000, 24), generator=g, device="cuda", dtype=torch.int32)
        grnnd.build(rows, metric=metric, degree=16, pool_size=32, initial_degree=8, outer_iters=1, inner_iters=1,
                    init=init, init_split=1000)
    # The fill on its own: rows of every length, the widest degree; rows of 2 KiB (four chunks in
    # flight a lane, kFillChunksInFlight) and of 4 400 bytes (nine a lane, the last group short).
    for degree, dim, dtype in [(6, 24, torch.float16), (256, 24, torch.float16), (48, 1024, torch.float16),
                               (48, 1100, torch.float32)]:
        rows = torch.randn(1000, dim, generator=g, device="cuda").to(dtype)
        graph = torch.randint(-1, 1000, (1000, degree), generator=g, device="cuda", dtype=torch.int32)
        grnnd.diagnostics.fill(rows, graph.sort(1, descending=True).values)


def out_of_core(g: torch.Generator):
    # gather_rows from pinned host rows: 16-, 8-, 4-, 2- and 1-byte words, rows at an offset
    for dtype, dim in [(torch.float16, 1024), (torch.float16, 4), (torch.float32, 3), (torch.float16, 3),
                       (torch.int8, 5)]:
        host = (torch.randn(700, dim) * 50).to(dtype).pin_memory()
        ids = torch.randint(0, 699, (2000,), generator=g, device="cuda")
        torch.ops.grnnd.gather_rows(host, ids)
        torch.ops.grnnd.gather_rows(host[1:], ids)
    # A build in shards from host rows: read by the GPU (pinned) and through the staging buffer.
    rows = torch.randn(6000, 24).half()
    budget = 1500 * memory.shard_bytes_per_row(24, 2, grnnd.BuildParams())
    for host in (rows.pin_memory(), rows):
        graph = grnnd.build(host, device="cuda", max_gpu_memory=budget, outer_iters=2, inner_iters=2)
    # A search of pinned host rows (hubs gathered by the GPU), whole and split into several searches.
    queries = torch.randn(300, 24, generator=g, device="cuda").half()
    more = torch.randn(20_000, 24).half().pin_memory()  # enough rows for hubs
    more_graph = grnnd.build(more.cuda(), degree=16, pool_size=32, outer_iters=2, inner_iters=2)
    for q in (queries, queries[:3]):
        grnnd.search(rows.pin_memory(), graph.cuda(), q, 5, list_size=32)
        grnnd.search(more, more_graph, q, 5, list_size=64, metric="l2")


def _search_by_codes(g: torch.Generator, settings):
    """Searches by codes with the exact re-rank, one (dtype, metric, dim, kind) of ``settings`` at a
    time: each loop, a filter, split searches, pinned host rows."""
    for dtype, metric, dim, kind in settings:
        print(f"  codes {kind}: {dtype}, {metric}, {dim} dimensions", flush=True)
        data = torch.randn(2000, dim, generator=g, device="cuda").to(dtype)
        graph = grnnd.build(data, metric=metric, outer_iters=1, inner_iters=1)
        kind, _, cells = kind.partition("@")  # int4 about the default cells (45 here), or as many as given
        coded = grnnd.encode(data, kind, metric=metric, cells=int(cells) if cells else None)
        grnnd.search(data, graph, data[:70], 10, list_size=32, metric=metric, codes=coded)
        for width in (1, 4, 8):  # the warp loop (two slots a lane); the block loop (few blocks, wide rounds)
            grnnd.search(data, graph, data[:4], 10, list_size=64, search_width=width, metric=metric, codes=coded,
                         searches=1)
        # 560 blocks, at least four per SM: wide rounds (six slots a lane) in the warp loop
        grnnd.search(data, graph, data[:70], 10, list_size=32, search_width=4, searches=8, metric=metric,
                     codes=coded)
        # A long list at a batch of more than 8 blocks an SM: six parents (params.h, resolve_search_width),
        # the block loop with 128 threads a block (pick_threads)
        grnnd.search(data, graph, data.repeat(2, 1)[:2200], 10, list_size=192, metric=metric, codes=coded)
        allowed = torch.rand(2000, generator=g, device="cuda") < 0.3
        grnnd.search(data, graph, data[:2], 10, list_size=256, metric=metric, filter=allowed, codes=coded, searches=1)
        grnnd.search(data, graph, data[:1], 10, list_size=64, searches=8, metric=metric, codes=coded)
        grnnd.search(data.cpu().pin_memory(), graph, data[:3], 10, list_size=48, metric=metric, codes=coded)


# The searches by codes in three parts, each short enough for one racecheck run (the three as one
# part ran past 150 s under racecheck on an H200 without a verdict).
def codes_int8(g: torch.Generator):
    """Searches by 8-bit codes: each storage type and metric, dimensions that are and are not
    multiples of 16."""
    _search_by_codes(g, [(torch.float32, "l2", 48, "int8"), (torch.float16, "cosine", 40, "int8"),
                         (torch.bfloat16, "ip", 1100, "int8")])


def codes_int4(g: torch.Generator):
    """Searches by 4-bit codes about the default cells: each storage type and metric, dimensions
    that are and are not multiples of 32, the query rotation for batches below and above 64."""
    _search_by_codes(g, [(torch.float32, "l2", 40, "int4"), (torch.float16, "cosine", 300, "int4"),
                         (torch.bfloat16, "ip", 70, "int4")])


def codes_int4_cells(g: torch.Generator):
    """Searches by 4-bit codes about one cell and about more cells than dimensions."""
    _search_by_codes(g, [(torch.float32, "l2", 40, "int4@1"), (torch.float16, "ip", 24, "int4@200")])


def small_batches(g: torch.Generator):
    """What a batch of a few queries runs: the direct hub distances and their sort (2 100 hubs: a
    sort of 4 096 keys in several passes; 20 hubs: one warp), then split searches expanding four
    parents per iteration, by rows and by codes, in the warp loop (degree 16: two neighbour slots
    a lane) and in the block loop, which sorts only the candidates that can enter the list
    (degree 32, and nine parents). No 16-bit matrix product, so racecheck runs it whole."""
    wide = torch.randn(2_100_000, 8, generator=g, device="cuda")
    for dtype, metric in [(torch.float32, "l2"), (torch.bfloat16, "cosine"), (torch.float32, "ip")]:
        grnnd.diagnostics.nearest_hubs(wide.to(dtype), wide[:3].to(dtype), 70, metric=metric)
    del wide
    data = torch.randn(20_000, 32, generator=g, device="cuda")
    codes = grnnd.encode(data)
    for degree in (16, 32):
        graph = grnnd.build(data, degree=degree, pool_size=32, initial_degree=8, outer_iters=1, inner_iters=2)
        for coded in (None, codes):
            grnnd.search(data, graph, data[:1], 10, list_size=32, codes=coded)
            grnnd.search(data, graph, data[:1], 10, list_size=32, search_width=9, codes=coded)  # block loop
            grnnd.search(data, graph, data[:5], 10, list_size=64, codes=coded)
            grnnd.search_distance_counts(data, graph, data[:2], 10, list_size=16, codes=coded)


PARTS = ("basics", "edge_sizes", "hubs_and_repair", "segments", "editing", "out_of_core", "codes_int8", "codes_int4",
         "codes_int4_cells", "small_batches")


def main(parts=PARTS):
    g = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    for name in parts:
        getattr(sys.modules[__name__], name)(g)
        # where a run cut by a time limit got to (racecheck takes minutes a part)
        torch.cuda.synchronize()
        print(f"part {name} done at {time.perf_counter() - started:.0f} s", flush=True)
    print("sanitizer workload done")


if __name__ == "__main__":
    main(sys.argv[1:] or PARTS)
