"""The README's quickstart runs and reports a good recall."""
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_small():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--n", "5000", "--dim", "32", "--queries", "200",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    recall = float(re.search(r"recall@10 of graph search against exact search: ([0-9.]+)", out).group(1))
    assert recall >= 0.95, out
