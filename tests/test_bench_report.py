"""The benchmarks' regression guard (benchmarks/report.py, regressions): a point slower at equal
recall than the previous run on the same GPU model is flagged, nothing else is."""
import copy
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import regression_table, regressions  # noqa: E402

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
