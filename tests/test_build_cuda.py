"""CUDA build (csrc/cuda/build_cuda.cu) against its CPU twin and against exact neighbours.

Skipped without a GPU. The CUDA kernel draws the same random numbers as the CPU one
(csrc/core/philox.h), so the parts of a build that do not depend on the timing of concurrent
inserts give the same graph on both, and the rest must give graphs of the same quality.
"""
import functools

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered as _clustered, cuda_peak_bytes, exact_neighbours
from torch_grnnd import memory

clustered = functools.partial(_clustered, spread=4.0)  # this file's data: centres spread by 4

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METRICS = ["l2", "ip", "cosine"]
N, DIM, CLUSTERS, QUERIES = 20_000, 64, 100, 1_000


@pytest.fixture(scope="module")
def dataset():
    x = clustered(N + QUERIES, DIM, CLUSTERS, seed=0)
    return x[:N].contiguous(), x[N:].contiguous()


def exact_ids(data, queries, metric, k=10):
    """Exact k-NN ids from faiss-cpu, in float32 over the values the build saw."""
    return exact_neighbours(data, queries, k, metric)[1]


def recall_at_10(data, graph, queries, metric):
    """recall@10 of the CPU search over `graph` (wherever it was built)."""
    data, queries = data.cpu(), queries.cpu()
    _, ids = grnnd.search(data, graph.cpu(), queries, 10, metric=metric)
    truth = exact_ids(data, queries, metric)
    hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, truth))
    return hits / truth.numel()


def row_distances(data, graph, metric):
    """d(v, graph[v, j]) in float32, +inf at padding."""
    x = data.float().cpu()
    g = graph.long().cpu()
    if metric == "cosine":
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    nb = x[g.clamp_min(0)]
    if metric == "l2":
        d = ((nb - x[:, None, :]) ** 2).sum(-1)
    elif metric == "ip":
        # The build ranks by squared l2 in the lifted space (csrc/core/params.h, lifts_inner_product):
        # each row gets the extra coordinate sqrt(max|x|^2 - |x|^2).
        sq = (x**2).sum(1)
        lift = (sq.max() - sq).clamp_min(0).sqrt()
        d = ((nb - x[:, None, :]) ** 2).sum(-1) + (lift[g.clamp_min(0)] - lift[:, None]) ** 2
    else:
        d = 1 - (nb * x[:, None, :]).sum(-1)
    return d.masked_fill(g < 0, float("inf"))


def check_invariants(data, graph, degree, metric):
    n = data.shape[0]
    assert graph.dtype == torch.int32
    assert graph.shape == (n, degree)
    assert graph.device == data.device
    g = graph.long().cpu()
    assert int(g.min()) >= -1 and int(g.max()) < n
    assert not (g == torch.arange(n)[:, None]).any(), "self loop"
    pad = g < 0
    # -1 only as tail padding: once a row pads, it pads to the end
    assert not (pad[:, :-1] & ~pad[:, 1:]).any(), "-1 before a real id"
    srt = g.sort(dim=1).values
    assert not ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(), "duplicate id in a row"
    d = row_distances(data, graph, metric)
    # ascending by distance (up to float rounding: the kernel sums in another order, and for
    # cosine normalises in the storage type)
    tol = 1e-2 if data.dtype != torch.float32 else 1e-4
    step = d[:, 1:] - d[:, :-1]
    finite = torch.isfinite(d[:, 1:])
    assert (step[finite] >= -tol * (1 + d[:, 1:][finite].abs())).all(), "row not ascending by distance"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_quality_and_parity(dataset, dtype, metric):
    data, queries = (t.to(dtype) for t in dataset)
    graph = grnnd.build(data.cuda(), metric=metric)
    check_invariants(data.cuda(), graph, grnnd.BuildParams().degree, metric)
    gpu_recall = recall_at_10(data, graph, queries, metric)
    assert gpu_recall >= 0.95, f"CUDA-built graph: recall@10 {gpu_recall:.4f}"
    cpu_recall = recall_at_10(data, grnnd.build(data, metric=metric), queries, metric)
    assert abs(gpu_recall - cpu_recall) <= 0.01, f"CUDA {gpu_recall:.4f} vs CPU {cpu_recall:.4f}"


def same_rows(a, b):
    """Fraction of rows holding the same set of ids."""
    a, b = a.long().cpu().sort(dim=1).values, b.long().cpu().sort(dim=1).values
    return (a == b).all(dim=1).float().mean().item()


@pytest.mark.parametrize("metric", METRICS)
def test_initial_graph_matches_cpu(metric):
    # No update round: the graph is the S random neighbours, drawn from the same Philox
    # streams on both backends, so every row holds exactly the same ids.
    data = clustered(3_000, 48, 30, seed=1)
    kw = dict(degree=16, initial_degree=16, pool_size=32, outer_iters=1, inner_iters=0, reverse_ratio=0.0,
              metric=metric, seed=7)
    cpu = grnnd.build(data, **kw)
    gpu = grnnd.build(data.cuda(), **kw)
    assert same_rows(cpu, gpu) == 1.0


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_initial_graph_from_hub_cells_matches_cpu(metric, dtype):
    # 50 000 half-precision rows: the CUDA build finds each row's two nearest hubs with the fused
    # product (csrc/build/hubs.h; inner product through the lift), the CPU through float32 scores. The
    # draws come from the same cells only if no row changes cells: a draw is a position in its
    # cell's member list, so one row that moves shifts the draws of all who draw from its cells.
    # Cosine rows are normalised in their storage type on both devices for that reason
    # (csrc/cpu/vectors_cpu.h, prepare_build_vectors).
    data = clustered(50_000, 32, 500, seed=4).to(dtype)
    kw = dict(degree=16, initial_degree=16, pool_size=32, outer_iters=1, inner_iters=0, reverse_ratio=0.0,
              metric=metric, seed=7)
    same = same_rows(grnnd.build(data, **kw), grnnd.build(data.cuda(), **kw))
    assert same >= 0.99, f"{same:.4f} of the rows drew what the CPU drew"


def test_reverse_edges_match_cpu():
    # Reverse-edge sampling alone: a pool keeps the R closest of everything offered to it,
    # whatever the order of the concurrent inserts, so the sets match the CPU's (up to rows
    # where float rounding reorders two nearly equal distances at the capacity boundary).
    data = clustered(3_000, 48, 30, seed=2)
    kw = dict(degree=24, initial_degree=16, pool_size=24, outer_iters=2, inner_iters=0, reverse_ratio=0.6, seed=3)
    assert same_rows(grnnd.build(data, **kw), grnnd.build(data.cuda(), **kw)) >= 0.995


def one_round_share(update_order, pool_size, dim=48):
    """Share of rows alike after one update round on both devices (no reverse edges)."""
    data = clustered(3_000, dim, 30, seed=5)
    kw = dict(degree=pool_size, initial_degree=16, pool_size=pool_size, outer_iters=1, inner_iters=1,
              reverse_ratio=0.0, delta=0.0, update_order=update_order, seed=11)
    return same_rows(grnnd.build(data, **kw), grnnd.build(data.cuda(), **kw))


# One round of the rule from the same draws: the CUDA walk (a prefix of old entries taken at
# once, a batch of pairs decided a team each, pools of up to 64 entries ordered in registers
# and larger ones by counting) must keep and hand on what the CPU's one-pair-at-a-time walk
# does. A pool keeps the nearest of what is offered to it whatever the order of the concurrent
# inserts, so rows differ only where float rounding decides a pair differently. Rows of 384
# float32 values (1.5 KiB) take whole-warp teams (team_for_row), those of 48 teams of 8 lanes.
@pytest.mark.parametrize("update_order", ["random", "ascending", "descending"])
@pytest.mark.parametrize("pool_size", [32, 96])
@pytest.mark.parametrize("dim", [48, 384])
def test_one_round_matches_cpu(update_order, pool_size, dim):
    share = one_round_share(update_order, pool_size, dim)
    assert share >= 0.99, f"{share:.4f} of the rows alike after one round"


@pytest.mark.parametrize("update_order", ["random", "ascending", "descending", "descending_then_random"])
@pytest.mark.parametrize("reverse_ratio", [0.0, 0.6])
def test_components_switch(dataset, update_order, reverse_ratio):
    data, queries = dataset
    data, queries = data[:5_000], queries[:200]
    graph = grnnd.build(data.cuda(), update_order=update_order, reverse_ratio=reverse_ratio)
    check_invariants(data.cuda(), graph, grnnd.BuildParams().degree, "l2")
    cpu = grnnd.build(data, update_order=update_order, reverse_ratio=reverse_ratio)
    assert abs(recall_at_10(data, graph, queries, "l2") - recall_at_10(data, cpu, queries, "l2")) <= 0.02


@pytest.mark.parametrize(
    "dim,dtype",
    [(1, torch.float32), (3, torch.float32), (100, torch.float16), (130, torch.bfloat16), (600, torch.float16),
     (4096, torch.float16)],
)
def test_odd_and_large_dims(dim, dtype):
    n = 1_500 if dim < 4096 else 600
    data = clustered(n + 50, dim, 20, seed=dim).to(dtype)
    data, queries = data[:n].contiguous(), data[n:].contiguous()
    graph = grnnd.build(data.cuda(), degree=16, pool_size=32)
    check_invariants(data.cuda(), graph, 16, "l2")
    if dim > 1:  # on a line, ties make "exact" ambiguous
        assert recall_at_10(data, graph, queries, "l2") >= 0.9


def test_misaligned_view_and_pool_bounds():
    # A view that starts 4 bytes into its storage (16-byte loads must not see it misaligned),
    # and the largest pool the kernels accept.
    flat = clustered(2_001, 64, 20, seed=5).flatten()
    data = flat.cuda()[1 : 1 + 2_000 * 64].view(2_000, 64)
    assert data.data_ptr() % 16 != 0
    graph = grnnd.build(data, degree=256, initial_degree=64, pool_size=256, outer_iters=2, inner_iters=2)
    check_invariants(data, graph, 256, "l2")


@pytest.mark.parametrize("n", [1, 2, 5])
def test_tiny_inputs_match_cpu(n):
    data = torch.randn(n, 8)
    kw = dict(degree=4, initial_degree=4, pool_size=8)
    gpu = grnnd.build(data.cuda(), **kw)
    check_invariants(data.cuda(), gpu, 4, "l2")
    assert (gpu.cpu() < 0).sum() == (grnnd.build(data, **kw) < 0).sum()


def test_float64_is_accepted():
    data = clustered(2_000, 32, 20, seed=6).double()
    check_invariants(data.cuda(), grnnd.build(data.cuda(), degree=16), 16, "l2")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device():
    data = clustered(3_000, 32, 20, seed=8).to("cuda:1")
    graph = grnnd.build(data, degree=16)
    assert graph.device == data.device
    check_invariants(data, graph, 16, "l2")


def test_opcheck():
    data = clustered(500, 16, 10, seed=9).cuda()
    kwargs = dict(degree=8, initial_degree=8, pool_size=16, outer_iters=2, inner_iters=2, reverse_ratio=0.6,
                  update_order="random", metric="l2", seed=0)
    torch.library.opcheck(torch.ops.grnnd.build.default, (data,), kwargs, test_utils=("test_schema", "test_faketensor"))


def error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


@pytest.mark.parametrize(
    "make,kwargs",
    [
        (lambda: torch.randn(10, 4).index_put_((torch.tensor([3]), torch.tensor([1])), torch.tensor(float("nan"))), {}),
        (lambda: torch.randn(10, 4).index_put_((torch.tensor([7]), torch.tensor([0])), torch.tensor(float("inf"))), {}),
        (lambda: torch.randn(10), {}),
        (lambda: torch.randint(0, 5, (10, 4)), {}),
        (lambda: torch.randn(0, 4), {}),
        (lambda: torch.randn(10, 4), {"pool_size": 300}),
        (lambda: torch.randn(10, 4), {"degree": 300}),
        (lambda: torch.randn(10, 4), {"metric": "hamming"}),
        (lambda: torch.randn(10, 4), {"update_order": "sideways"}),
        (lambda: torch.randn(10, 4), {"reverse_ratio": 1.5}),
    ],
)
def test_bad_input_errors_match_cpu(make, kwargs):
    data = make()
    cpu = error_of(lambda: grnnd.build(data, **kwargs))
    gpu = error_of(lambda: grnnd.build(data.cuda(), **kwargs))
    assert gpu == cpu


def test_nan_row_names_data():
    data = torch.randn(100, 8, device="cuda")
    data[42, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^data: expected finite values, row 42"):
        grnnd.build(data)


def test_too_large_build_says_how_much_memory():
    # 200M rows of one float16 (a stride-0 view, no memory of its own) need ~800 GiB of pools
    # at pool_size 256; the build must refuse with the size, not crash in the allocator.
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs a GPU with room for the 200M-row input's temporaries")
    data = torch.zeros(1, 1, dtype=torch.float16, device="cuda").expand(200_000_000, 1)
    with pytest.raises(torch.OutOfMemoryError, match=r"build: needs [0-9.]+ [GM]iB of GPU memory.*pool_size = 256"):
        grnnd.build(data, degree=16, pool_size=256)


def test_out_of_memory_says_how_much_and_the_process_goes_on():
    # A build whose pools (2 x N x pool_size x 8 bytes = 800 MiB here) exceed what a per-process
    # memory fraction leaves raises torch.OutOfMemoryError naming both amounts; afterwards the
    # same process builds a smaller graph as usual.
    data = torch.randn(200_000, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # cached blocks of earlier tests would serve the build without a new allocation
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * 2**20) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"(?s)build: needs [0-9.]+ MiB of GPU memory.*free"):
            grnnd.build(data, degree=16, pool_size=256)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    graph = grnnd.build(data[:5000], degree=8, pool_size=16, widen=False)
    assert graph.shape == (5000, 8) and int(graph.max()) < 5000



def test_peak_memory_stays_within_the_pools():
    # The bound the design promises: extra GPU memory of a build at most the pools, 2 x N x
    # pool_size x 8 bytes, + 10% for counts, locks, the start's cells and the repairs. The
    # graph used to add its own N x degree x 4 bytes while the pools were alive (1.20x the
    # pools at these settings); it is now written into the spare pool buffer.
    n, pool_size = 200_000, 48
    data = torch.randn(n, 32, device="cuda", dtype=torch.float16)
    # A smaller build first. A process's first matrix product allocates cuBLAS's workspace through
    # the caching allocator, once, and keeps it; builds of 16 000 rows or more make products (their
    # hubs). Measured as a process's first build on an H200 this one peaked at 189 MiB (1.29x the
    # pools), 32 MiB of it that workspace, and at 157 MiB (1.07x) after a build of 20 000 rows.
    # The pools are the ones the build ends with: these rows are hard to find (one Gaussian), so
    # the default build widens, by a third (isotropic rows, BuildParams.wide_pool_size_for), and
    # widen=False keeps the pool size.
    grnnd.build(data[:20_000], pool_size=pool_size)
    p = grnnd.BuildParams(pool_size=pool_size)
    for widen, pool in ((True, p.wide_pool_size_for(1.0)), (False, p.pool_size)):
        graph, peak = cuda_peak_bytes(lambda: grnnd.build(data, pool_size=pool_size, widen=widen))
        pools = 2 * n * pool * 8
        assert graph.shape[0] == n and int(graph.min()) >= 0
        assert graph.shape[1] in ((p.wide_degree_for(0.0), p.wide_degree) if widen else (p.degree,)), graph.shape
        assert peak <= 1.10 * pools, f"peak extra {peak / 2**20:.1f} MiB against pools {pools / 2**20:.1f} MiB"
        del graph


def test_a_widening_build_grows_pools_twice_as_large_where_neighbourhoods_spread_over_few_dimensions():
    # One Gaussian whose scales differ by dimension (log-uniform over 1.25 decades, as the noise of
    # benchmarks/datasets.py's anisotropic families): hard to find, so the build widens, and its
    # neighbourhoods spread over about 0.4 of the dimensions, so its pools grow to twice the size.
    # The pools are the build's peak memory: above what pools a third larger take, within twice.
    n, dim, pool_size = 200_000, 256, 48
    g = torch.Generator(device="cuda").manual_seed(7)
    scales = 10 ** (torch.rand(dim, generator=g, device="cuda") * 1.25 - 1.25)
    data = (torch.randn(n, dim, generator=g, device="cuda") * scales).half()
    assert grnnd.diagnostics.neighbourhood_dimensions(data) < 0.65
    grnnd.build(data[:20_000], pool_size=pool_size)  # cuBLAS's workspace (above)
    p = grnnd.BuildParams(pool_size=pool_size)
    graph, peak = cuda_peak_bytes(lambda: grnnd.build(data, pool_size=pool_size))
    assert graph.shape[1] > p.degree and int(graph.min()) >= 0  # widened
    third, twice = (2 * n * p.wide_pool_size_for(share) * 8 for share in (1.0, 0.0))
    assert 1.10 * third < peak <= 1.10 * twice, f"peak extra {peak / 2**20:.1f} MiB, pools {third}, {twice} bytes"


def test_a_cosine_build_stays_within_the_memory_model():
    # Cosine rows are normalised into one copy (memory.bytes_per_row counts it); the float32 steps
    # of normalising all rows at once took 10 bytes an element beside them, 2.5 GiB here against
    # the model's 1.6 GiB.
    n, dim = 1_000_000, 256
    data = torch.randn(n, dim, device="cuda", dtype=torch.float16)
    grnnd.build(data[:20_000], metric="cosine")  # cuBLAS's workspace, kept by the process (above)
    graph, peak = cuda_peak_bytes(lambda: grnnd.build(data, metric="cosine"))
    # beside the rows; the model counts the pools and rows of a widened build, which one Gaussian's
    # rows get (BuildParams.widen)
    p = grnnd.BuildParams()
    counted = memory.build_extra_bytes(n, dim, 2, p, "cosine")
    assert graph.shape[0] == n and graph.shape[1] in (p.wide_degree_for(0.0), p.wide_degree) and int(graph.min()) >= 0
    assert peak <= counted, f"peak extra {peak / 2**20:.0f} MiB against the model's {counted / 2**20:.0f} MiB"
