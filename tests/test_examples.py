"""The examples run and reach what they claim: the README's quickstart, and at smoke size the
training loop, RAG retrieval, manifold and out-of-core examples, and the distributed training job
under torchrun on two CPU processes (each exits non-zero on a shortfall)."""
import importlib.util
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


def run_example(name, *args):
    """Runs examples/<name> at smoke size on the CPU; the example checks its own outcome."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), "--smoke", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    return done.stdout


def test_train_loop_smoke():
    out = run_example("train_loop.py")
    purity = float(re.search(r"purity [0-9.]+ -> ([0-9.]+)", out).group(1))
    assert purity >= 0.9, out


def test_rag_retrieval_smoke():
    out = run_example("rag_retrieval.py")
    assert "context for the reader: (300, 10, 64) torch.int64 on cpu" in out, out


def test_manifold_smoke(tmp_path):
    png = tmp_path / "roll.png"
    out = run_example("manifold.py", "--out", str(png))
    if importlib.util.find_spec("matplotlib") is None:  # CI installs no matplotlib
        assert "no PNG written" in out and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_beyond_gpu_smoke():
    out = run_example("beyond_gpu.py")
    assert "graph (20000, 48) on cpu" in out and "rows of two shards joined" in out, out  # built in shards
    recall = float(re.search(r"recall@10 at list 64 over 200 queries: ([0-9.]+)", out).group(1))
    assert recall >= 0.95, out


def test_distributed_training_smoke():
    # Two processes under torchrun on the CPU (gloo), as the example's docstring launches them.
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(EXAMPLES / "distributed_training.py"), "--smoke", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK: 2 ranks" in done.stdout, done.stdout + done.stderr
    purity = float(re.search(r"purity [0-9.]+ -> ([0-9.]+)", done.stdout).group(1))
    assert purity >= 0.9, done.stdout
