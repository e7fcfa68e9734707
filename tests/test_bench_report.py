"""The benchmarks' regression guard (benchmarks/report.py, regressions): a point slower at equal
recall than the previous run on the same GPU model is flagged, nothing else is; the data families
of benchmarks/bench_scale.py with their rare-category queries; bench_distributed_scale.py at toy
size on two CPU ranks; bench_concurrency.py's searches during edits and bench_graph_ceiling.py at toy size. The scripts run as modules (python -m benchmarks.NAME) from the repository's
root, as their documentation says."""
import copy
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import latest_result, regression_table, regressions  # noqa: E402

RUN = os.path.join(ROOT, "benchmarks", "results", "gpu_text1m_minilm_int8_h200.json")


@pytest.fixture
def run():
    with open(RUN) as f:
        return json.load(f)


def test_a_run_against_itself_has_no_regression(run):
    assert regressions(run, copy.deepcopy(run)) == []
    assert regression_table([], RUN)["rows"] == [["none", "", "", "", ""]]


def test_a_point_slower_at_equal_recall_is_flagged(run):
    previous = copy.deepcopy(run)
    point = previous["methods"][2]["curve"][4]  # int8 codes, list 64
    point["qps"] *= 1.10  # the previous run was 10% faster there
    found = regressions(run, previous)
    assert [row[0] for row in found] == [f"{run['methods'][2]['name']} {point['param']}"]
    assert found[0][4] == pytest.approx(1 / 1.10)
    point["qps"] = run["methods"][2]["curve"][4]["qps"] * 1.04  # within the 5% allowed
    assert regressions(run, previous) == []


def test_a_slower_point_of_higher_recall_is_not_a_regression(run):
    current = copy.deepcopy(run)
    point = current["methods"][2]["curve"][4]
    point["qps"] *= 0.9
    point["recall"] = 0.999  # slower, but at a recall the previous curve never reached
    assert regressions(current, run) == []


def test_small_batch_rows_are_compared_by_their_settings(run):
    current = copy.deepcopy(run)
    table = next(t for t in current["tables"] if "ms per call" in t["columns"])
    ms = table["columns"].index("ms per call")
    table["rows"][0][ms] *= 1.2
    found = regressions(current, run)
    assert len(found) == 1 and found[0][0].startswith("small batch: codes none, batch 1, list 32")


def test_runs_of_other_gpus_are_not_compared(run):
    other = copy.deepcopy(run)
    other["machine"]["gpu"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="compare runs of one GPU model"):
        regressions(run, other)


def test_builds_of_a_scale_set_are_compared_at_equal_recall():
    # benchmarks/bench_scale.py: a wider graph reaches each recall at a shorter list; its speed is
    # read off its own curve where the first build's recall lies, and left out where its curve
    # does not span that recall (passed at its shortest list, or never reached).
    from benchmarks.bench_scale import at_equal_recall, ratio_text

    def curve(recalls, qps):
        return {"recall": dict(zip((32, 64, 128, 256), recalls)), "recall_qps": dict(zip((32, 64, 128, 256), qps))}

    first = curve((0.60, 0.70, 0.80, 0.95), (4e6, 2e6, 1e6, 0.5e6))
    wider = curve((0.70, 0.80, 0.90, 0.94), (3e6, 1.5e6, 0.6e6, 0.3e6))
    ratios = at_equal_recall(first, wider)
    assert ratios[32] != ratios[32]  # 0.60: passed at the wider graph's shortest list
    assert ratios[64] == pytest.approx(3e6 / 2e6)  # 0.70: the wider graph's list 32
    assert ratios[128] == pytest.approx(1.5e6 / 1e6)
    assert ratios[256] != ratios[256]  # 0.95: never reached
    assert [ratio_text(v) for v in ratios.values()] == ["-", "1.50x", "1.50x", "-"]
    between = at_equal_recall(curve((0.75, 0.75, 0.75, 0.75), (1e6,) * 4), wider)
    assert between[32] == pytest.approx((3e6 * 1.5e6) ** 0.5 / 1e6)  # halfway between 0.70 and 0.80, log-linear


def test_scale_report_breaks_recall_down_at_list_64_and_the_longest(tmp_path, monkeypatch):
    # benchmarks/bench_scale.py's markdown: recall by the query's cluster size at list 64 and at
    # the longest list side by side, and "-" for runs written before the longest list was kept.
    import argparse

    from benchmarks import bench_scale
    monkeypatch.setattr(bench_scale, "plot", lambda results, path: None)
    lists = (32, 64, 256)

    def groups(*recalls):
        return [{"sizes": size, "queries": 5, "recall": recall, "in_own_cluster": 1.0}
                for size, recall in zip(([0, 1000], [1000000, None]), recalls)]

    row = {"family": "zipf_aniso", "n": 2000, "d": 8, "build": {}, "build_s": 0.1, "rounds": 3,
           "peak_extra_bytes": 0, "counted_extra_bytes": 0, "degree": {"min": 1, "p1": 1, "mean": 2.0},
           "unreachable_from_hubs": 0.0, "unfound_share": 0.1,
           **{key: dict.fromkeys(lists, 0.5) for key in ("recall", "recall_rare", "recall_qps", "recall_random_entries",
                                                          "distances_per_query")},
           "by_cluster_size": groups(0.9, 0.3), "by_cluster_size_longest": groups(0.99, 0.6),
           "by_cluster_size_rare": groups(0.8, 0.2), "by_cluster_size_rare_longest": groups(0.95, 0.5)}
    older = {key: value for key, value in row.items() if not key.endswith("_longest")}
    older["n"] = 1000
    bench_scale.write([row, older], argparse.Namespace(lists="32,64,256", out=str(tmp_path), name="t"))
    text = (tmp_path / "scale_t.md").read_text()
    assert "| recall list 64 / 256 |" in text
    assert "| zipf_aniso | 2,000 | 8 | defaults | in | 1,000,000 or more | 5 | 0.300 / 0.600 | 1.000 |" in text
    assert "| zipf_aniso | 2,000 | 8 | defaults | rare | 0 to 999 | 5 | 0.800 / 0.950 | 1.000 |" in text
    assert "| zipf_aniso | 1,000 | 8 | defaults | in | 0 to 999 | 5 | 0.900 / - | 1.000 |" in text


def test_scale_families_and_their_rare_queries():
    # benchmarks/bench_scale.py: zipf_aniso rows come from clusters of Zipf sizes, each with noise
    # scales of its own per dimension; the rare queries come from clusters chosen uniformly.
    from benchmarks.datasets import make_rare_queries, make_set
    base, queries, base_labels, query_labels = make_set("zipf_aniso", 20_000, 16, want_labels=True, device="cpu")
    assert base.shape == (20_000, 16) and queries.shape == (1_000, 16) and base.dtype == torch.float16
    again = make_set("zipf_aniso", 20_000, 16, device="cpu")[0]
    assert torch.equal(base, again)
    rare, rare_labels = make_rare_queries("zipf_aniso", 20_000, 16, device="cpu")
    assert rare.shape == (1_000, 16) and rare_labels.shape == (1_000,)
    sizes = torch.bincount(base_labels, minlength=20)
    assert sizes.max() > 5 * sizes.min()  # Zipf: a few big clusters, many small ones
    assert sizes[query_labels].float().median() > 2 * sizes[rare_labels].float().median()
    # The rare queries belong to make_set's clusters: each lies nearer its own cluster's mean.
    means = torch.stack([base[base_labels == c].float().mean(0) for c in range(20)])
    nearest = torch.cdist(rare.float(), means).argmin(1)
    assert (nearest == rare_labels).float().mean() > 0.8
    # Anisotropic per cluster: the two largest clusters spread differently along the dimensions.
    big = sizes.argsort(descending=True)[:2]
    spread = torch.stack([base[base_labels == c].float().std(0) for c in big])
    assert (spread[0] / spread[1]).max() > 2 and (spread[0] / spread[1]).min() < 0.5


def test_the_tiny_cluster_family_is_mostly_rare_categories():
    # zipf_tiny: N / 20 clusters of Zipf sizes, so most clusters (and most rare queries) hold a
    # few rows, while the in queries come from the big ones; its centres overlap more than
    # zipf_aniso's (spread 1 against 1.5).
    from benchmarks.datasets import make_rare_queries, make_set
    base, queries, base_labels, query_labels = make_set("zipf_tiny", 20_000, 16, want_labels=True, device="cpu")
    assert base.shape == (20_000, 16) and queries.shape == (1_000, 16)
    sizes = torch.bincount(base_labels, minlength=1_000)
    assert sizes.numel() == 1_000 and base_labels.max() < 1_000
    assert (sizes <= 10).float().mean() > 0.5  # most clusters hold a few rows
    rare, rare_labels = make_rare_queries("zipf_tiny", 20_000, 16, device="cpu")
    assert sizes[rare_labels].float().median() <= 10 < sizes[query_labels].float().median()
    # The spread of the centres, from the means of the five largest clusters (labels 0-4).
    def spread(rows, labels):
        return torch.stack([rows[labels == c].float().mean(0) for c in range(5)]).std().item()
    other, _, other_labels, _ = make_set("zipf_aniso", 20_000, 16, want_labels=True, device="cpu")
    assert spread(base, base_labels) < spread(other, other_labels)


def test_the_variants_of_zipf_aniso_change_one_thing_each():
    # zipf_iso: zipf_aniso's clusters with isotropic noise of each cluster's own energy;
    # zipf_aniso_apart: its noise with the centres as far apart against it as zipf's (spread 3
    # against a noise of 1): 3 x 0.74 (the scales' root mean square) against zipf_aniso's 1.5.
    from benchmarks.datasets import make_set
    sets = {family: make_set(family, 20_000, 32, want_labels=True, device="cpu")
            for family in ("zipf_aniso", "zipf_iso", "zipf_aniso_apart")}
    labels = sets["zipf_aniso"][2]
    assert all(torch.equal(rows[2], labels) for rows in sets.values())  # the same sizes and members
    big = torch.bincount(labels).argsort(descending=True)[:3]

    def centres(family):
        rows, _, row_labels, _ = sets[family]
        return torch.stack([rows[row_labels == c].float().mean(0) for c in big])

    def spreads(family):  # each big cluster's standard deviation along every dimension
        rows, _, row_labels, _ = sets[family]
        return torch.stack([rows[row_labels == c].float().std(0) for c in big])

    aniso, iso = spreads("zipf_aniso"), spreads("zipf_iso")
    assert (aniso.max(1).values / aniso.min(1).values).min() > 5  # scales over 1.25 decades
    assert (iso.max(1).values / iso.min(1).values).max() < 1.5  # the same along every dimension
    energy = aniso.pow(2).sum(1), iso.pow(2).sum(1)
    assert torch.allclose(energy[0], energy[1], rtol=0.1)  # and as much noise in all
    assert torch.allclose(centres("zipf_iso"), centres("zipf_aniso"), atol=0.1)
    assert torch.allclose(spreads("zipf_aniso_apart"), aniso, rtol=0.1)
    assert torch.allclose(centres("zipf_aniso_apart"), 3 * 0.74 / 1.5 * centres("zipf_aniso"), atol=0.2)
    # The noise's root mean square over the big clusters is near the scales' expected 0.74.
    assert 0.6 < aniso.pow(2).mean().sqrt().item() < 0.9


def test_the_distributed_scale_benchmark_runs_on_two_cpu_ranks(tmp_path):
    # benchmarks/bench_distributed_scale.py at toy size under torchrun (gloo): each rank makes its
    # own rows, both indexes are built and searched, rank 0 writes the run and --table the table.
    import subprocess
    script = "benchmarks.bench_distributed_scale"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           script, "--data", "clustered:n=6000,d=16,clusters=20,queries=200", "--device", "cpu",
                           "--lists", "64,32", "--probes", "auto,1", "--cells", "16", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.load(open(tmp_path / "distributed_scale_clustered-6k-d16-c20_w2.json"))
    assert run["sharded_recall"] >= 0.95 and run["partitioned_recall"] >= 0.95 and sum(run["partition_rows"]) == 6000
    # one point a mode, list and probe count: all shards and rank 0 at 2 lists, partitioned at 2 x 2
    assert sorted((p["mode"], p["list"], str(p["probes"] or 0)) for p in run["points"]) == sorted(
        [(m, lst, "0") for m in ("all shards", "rank 0 alone") for lst in (64, 32)]
        + [("partitioned", lst, probes) for lst in (64, 32) for probes in ("1", "auto")])
    # routed by the borders, a query of these 20 clusters mostly stays in its own shard
    shards = {p["probes"]: p["shards_per_query"] for p in run["points"] if p["mode"] == "partitioned"}
    assert shards[1] == 1 and 1 <= shards["auto"] <= 1.5 and run["partitioned_shards_per_query"] == shards["auto"]
    subprocess.run([sys.executable, "-m", script, "--table",
                    str(tmp_path / "distributed_scale_clustered-6k-d16-c20_w2.json"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=120, cwd=ROOT)
    assert "| 2 | 6,000 | 3,000 |" in (tmp_path / "distributed_scale_clustered-6k-d16-c20_table.md").read_text()


def test_the_distributed_benchmark_merges_runs_into_one_scaling_table(tmp_path):
    # benchmarks/bench_distributed.py --table: runs on 2 and 4 GPUs (each against one GPU in its
    # own run) side by side, ratios as the runs measured them.
    import subprocess
    script = "benchmarks.bench_distributed"
    runs = []
    for world, ratio in ((4, 3.1), (2, 1.7)):
        run = {"data": "clustered-1000k-d64-c100", "n": 1_000_000, "world": world, "probes": 2,
               "machine": {"cpu": "test", "cpu_count": 2, "threads": 1}, "build_ratio": 1.01, "sharded_qps_ratio": 0.9,
               "sharded_recall": 0.97, "partitioned_qps_ratio": ratio, "partitioned_recall": 0.96,
               "replicated_speedup": ratio, "replicated_big_speedup": ratio + 0.3, "exact_speedup": world * 0.95}
        path = tmp_path / f"run{world}.json"
        path.write_text(json.dumps(run))
        runs.append(str(path))
    subprocess.run([sys.executable, "-m", script, "--table", *runs, "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120, cwd=ROOT)
    text = (tmp_path / "distributed_clustered-1000k-d64-c100_table.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")]
    assert [row.split(" |")[0] for row in rows] == ["| 2", "| 4"]  # by the number of GPUs
    assert "1.70x, 0.9600 (2) | 1.70x / 2.00x | 1.90x" in rows[0] and "| 3.80x |" in rows[1]


def test_the_concurrency_benchmark_finds_no_mixed_state_on_the_cpu(tmp_path):
    # benchmarks/bench_concurrency.py at toy size: three threads search while a fourth adds,
    # removes and compacts; every batch's ids are live in one version, and the run says so.
    import subprocess
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_concurrency", "--device", "cpu", "--data",
                           "clustered:n=8000,d=16,clusters=20,queries=300", "--edits", "12", "--seconds", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.load(open(tmp_path / "concurrency_clustered-8k-d16-c20_cpu.json"))
    assert run["errors"] == 0 and run["inconsistent"] == 0 and run["searches_during_edits"] > 0
    assert run["recall"] >= 0.9 and run["alone_qps"] > 0 and run["shared_qps"] > 0


def test_the_concurrency_benchmark_with_a_writer_that_only_adds(tmp_path):
    # --writer adds: the index starts without the rows the adds bring, and every edit is an add.
    import subprocess
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_concurrency", "--device", "cpu", "--data",
                           "clustered:n=8000,d=16,clusters=20,queries=300", "--edits", "5", "--seconds", "1",
                           "--writer", "adds", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.load(open(tmp_path / "concurrency_clustered-8k-d16-c20_cpu_adds.json"))
    assert run["writer"] == "adds" and list(run["median_ms"]) == ["add"]
    assert run["errors"] == 0 and run["inconsistent"] == 0 and run["recall"] >= 0.9


def test_the_graph_ceiling_benchmark_compares_the_build_with_the_exact_graphs(tmp_path):
    # benchmarks/bench_graph_ceiling.py at toy size on the CPU: the build's graph beside the graphs
    # made from the exact neighbours, whose edges hold every row's true 10 nearest.
    import subprocess

    def ceiling_runs(name, *options):
        done = subprocess.run([sys.executable, "-m", "benchmarks.bench_graph_ceiling", "--device", "cpu", "--dim", "32",
                               "--sizes", "2000", "--name", name, "--out", str(tmp_path), *options],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        return {r["graph"]: r for r in json.load(open(tmp_path / f"graph_ceiling_{name}.json"))["runs"]}

    runs = ceiling_runs("aniso", "--lists", "16,32", "--queries", "100", "--builds", "delta=0")
    assert list(runs) == ["build defaults", "build delta=0", "exact, pruned", "exact, unpruned"]
    assert runs["exact, unpruned"]["edge_recall"] == 1.0
    assert runs["exact, pruned"]["edge_recall"] >= runs["build defaults"]["edge_recall"]
    for r in runs.values():
        recall, work = r["recall"]["in"], r["distances_per_query"]["in"]  # lists as JSON keys
        assert 0.5 < recall["32"] <= 1.0 and recall["16"] <= recall["32"] + 0.02 and work["16"] < work["32"]
    # The exact graphs are as wide as the first build's rows, or as --exact-degree asks.
    assert runs["exact, pruned"]["width"] == runs["exact, unpruned"]["width"] == runs["build defaults"]["width"]
    runs = ceiling_runs("wide", "--lists", "32", "--queries", "50", "--exact-degree", "64")
    assert runs["exact, unpruned"]["width"] == 64 and runs["exact, unpruned"]["edge_recall"] == 1.0
    assert runs["build defaults"]["width"] == 48


def test_neighbours_within_clusters_are_the_exact_ones_where_clusters_lie_apart():
    # bench_graph_ceiling.py's neighbours of a family's rows: a product for big clusters, the
    # segment scan for the others; where the clusters lie far apart they are the exact neighbours.
    from benchmarks.bench_graph_ceiling import within_cluster_neighbours
    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.zeros(2500, dtype=torch.long), torch.ones(40, dtype=torch.long),
                        torch.full((7,), 2), torch.full((1,), 3)])[torch.randperm(2548, generator=g)]
    data = torch.randn(2548, 8, generator=g) + 100 * torch.randn(4, 8, generator=g)[labels]
    near = within_cluster_neighbours(data, labels, 12)
    table = torch.cdist(data.double(), data.double()).fill_diagonal_(float("inf"))
    exact = table.topk(12, largest=False)[0]
    found = table.gather(1, near.clamp_min(0))  # the distances of the rows found, in their order
    alone = labels == 3  # a cluster of one row has no neighbours
    assert (near[alone] == -1).all()
    seven = labels == 2  # six others: the rest is padding
    assert (near[seven, 6:] == -1).all() and torch.allclose(found[seven, :6], exact[seven, :6], rtol=1e-5)
    rest = ~(alone | seven)
    assert (near[rest] >= 0).all() and torch.allclose(found[rest], exact[rest], rtol=1e-5)


def test_latest_result_is_the_newest_of_the_same_data_gpu_and_build(tmp_path):
    # bench_gpu.py --compare latest: the previous result to compare a run with is the newest of
    # the same data, GPU model and build settings (outside git: by the files' times), and of two
    # saved together the one not named *_before.
    def saved(name, when, gpu="NVIDIA H200", params=None, data="embeddings (1000000, 384) torch.float16"):
        path = tmp_path / name
        path.write_text(json.dumps({"data": data, "machine": {"gpu": gpu}, "build": {"params": params or {}},
                                    "methods": []}))
        os.utime(path, (when, when))
        return str(path)

    saved("gpu_a.json", 100)
    newest = saved("gpu_b.json", 200)
    saved("gpu_b_before.json", 200)
    saved("gpu_c.json", 300, gpu="NVIDIA H100 80GB HBM3")
    saved("gpu_d.json", 400, params={"degree": 32})
    saved("gpu_e.json", 500, data="clustered (1000000, 384) torch.float16")
    (tmp_path / "gpu_f.json").write_text("{ not json")
    run = {"data": "embeddings (1000000, 384) torch.float16", "machine": {"gpu": "NVIDIA H200"},
           "build": {"params": {}}}
    assert latest_result(str(tmp_path), run) == newest
    assert latest_result(str(tmp_path), {**run, "build": {"params": {"degree": 32}}}) == str(tmp_path / "gpu_d.json")
    assert latest_result(str(tmp_path), {**run, "machine": {"gpu": "NVIDIA B200"}}) is None


def test_the_code_bits_proxy_spends_its_bits_where_the_rows_vary():
    # benchmarks/code_bits_proxy.py --transform: every bit of the budget placed, none beyond four
    # an axis, more to the axes of more variance; axes without bits or spread code to 0, finitely.
    from benchmarks.code_bits_proxy import levels, water_filling

    variance = torch.tensor([4.0, 1.0, 0.25, 0.0])
    bits = water_filling(variance, 7)
    assert int(bits.sum()) == 7 and int(bits.max()) <= 4
    assert bits.tolist() == sorted(bits.tolist(), reverse=True) and bits[0] > bits[2]
    assert water_filling(variance, 100).tolist() == [4, 4, 4, 4]
    g = torch.Generator().manual_seed(0)
    r = torch.randn(200, 4, generator=g) * variance.sqrt()
    v = levels(r, water_filling(variance, 6), variance.sqrt())
    assert torch.isfinite(v).all() and (v[:, 3] == 0).all()
    cos = (v * r).sum(1) / (v.norm(dim=1) * r.norm(dim=1))
    assert float(cos.mean()) > 0.9
    # The rotation within bit groups is orthogonal and mixes no two groups.
    from benchmarks.code_bits_proxy import group_rotation, group_spread
    bits = torch.tensor([4, 4, 3, 3, 3, 0])
    turn = group_rotation(bits)
    assert torch.allclose(turn @ turn.T, torch.eye(6), atol=1e-5)
    assert (turn[:2, 2:] == 0).all() and (turn[2:5, :2] == 0).all() and (turn[2:5, 5:] == 0).all()
    spread = group_spread(torch.tensor([4.0, 2.0, 1.0, 1.0, 4.0, 0.0]), bits)
    assert torch.allclose(spread, torch.tensor([3.0, 3.0, 2.0, 2.0, 2.0, 0.0]).sqrt())


def test_code_specs_name_the_cells_and_the_coordinates_kept():
    import torch_grnnd as grnnd
    from benchmarks.bench_gpu import code_label, code_spec

    assert code_spec("int8") == ("int8", None, None)
    assert code_spec("int4@1000/384") == ("int4", 1000, 384)
    assert code_spec("int4/352") == ("int4", None, 352)
    g = torch.Generator().manual_seed(0)
    low_rank = torch.randn(4_000, 8, generator=g) @ torch.randn(8, 64, generator=g)
    assert code_label(grnnd.encode(low_rank, "int4", cells=1)) == "int4/32"  # 8 axes hold the rows
    assert code_label(grnnd.encode(low_rank, "int4", cells=4)) == "int4@4/32"
    assert code_label(grnnd.encode(low_rank, "int4", cells=1, coded_dims=64)) == "int4"
    assert code_label(grnnd.encode(low_rank, "int8")) == "int8"
