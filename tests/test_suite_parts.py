"""GRNND_TEST_PART (conftest.py): the parts of a suite run every test once, and a bad part is an
error, not an empty run."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# A small file of many tests, collected only: nothing runs.
SAMPLE = os.path.join(HERE, "test_bad_input.py")


def collected(part: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GRNND_TEST_PART=part)
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", SAMPLE],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(HERE))


def node_ids(result: subprocess.CompletedProcess) -> list:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_parts_run_every_test_once():
    whole = node_ids(collected("1/1"))
    parts = [node_ids(collected(f"{k}/3")) for k in (1, 2, 3)]
    assert len(whole) >= 30
    assert sorted(sum(parts, [])) == sorted(whole)
    assert all(abs(len(part) - len(whole) / 3) <= 1 for part in parts)


def test_a_bad_part_is_an_error():
    for part in ("0/3", "4/3", "2"):
        result = collected(part)
        assert result.returncode != 0
        assert "GRNND_TEST_PART" in result.stdout + result.stderr
