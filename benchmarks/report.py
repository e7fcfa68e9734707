"""Benchmark outputs: one JSON with every number, a markdown table, and a recall-vs-QPS plot.

    from benchmarks.report import machine, write
    write("benchmarks/results", "cpu_text100k_t2", {"machine": machine(threads=2), ...})

``results`` is a dict with at least "machine" and "methods": a list of
{"name", "build_s", "params", "curve": [{"param", "recall", "qps"}, ...]}; any extra keys are
kept in the JSON.
"""
import argparse
import glob
import json
import math
import os
import platform
import subprocess
import time

import torch


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(threads: int, cuda: bool = False) -> dict:
    """What the numbers were measured on: CPU model, cores, threads used, GPU when CUDA is used."""
    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": threads,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import faiss
        info["faiss"] = faiss.__version__
    except ImportError:
        pass
    try:
        info["loadavg_start"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    if cuda and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def gpu_result_stem(out_dir: str, prefix: str, name: str = "") -> str:
    """``out_dir/<prefix>_<gpu>[_<name>]`` (the GPU's model, as "h100"), out_dir made if missing."""
    os.makedirs(out_dir, exist_ok=True)
    gpu = torch.cuda.get_device_name().split()[1].lower()
    return os.path.join(out_dir, f"{prefix}_{gpu}" + (f"_{name}" if name else ""))


def sized_gpu_run(description: str, default_sizes: str, measure, title: str, stem: str):
    """The GPU scripts that time one thing per size: parses ``--sizes`` (comma-separated NxD,
    ``default_sizes`` unless given) and ``--out``, calls ``measure(n, d)`` for each size and writes
    ``{"title", "machine", "rows"}`` to ``<out>/<stem>.json``. Returns ``(results, path stem,
    markdown head)``: the head is the title and machine lines the table follows."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=default_sizes, help="comma-separated NxD")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rows = [measure(*(int(v) for v in size.split("x"))) for size in args.sizes.split(",")]
    results = {"title": title, "machine": machine(threads=torch.get_num_threads(), cuda=True), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, stem)
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    return results, base, [f"# {title}", "", f"Machine: {machine_line(results['machine'])}.", ""]


def scaling_runs(paths: list) -> tuple:
    """``(runs, names)``: the JSON runs of a distributed benchmark by rank count, and the data sets
    they name (one, or one a rank count where the rows per rank stay the same)."""
    runs = sorted((json.load(open(p)) for p in paths), key=lambda run: run["world"])
    return runs, list(dict.fromkeys(run["data"] for run in runs))


def write_lines(path: str, lines: list) -> str:
    """Write a markdown table's lines to ``path`` (its folder made if needed), print them, return the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def machine_line(m: dict) -> str:
    s = f"{m['cpu']} ({m['cpu_count']} cores), {m['threads']} threads"
    if "gpu" in m:
        s += f", GPU {m['gpu']} (CUDA {m.get('cuda')})"
    return s


def qps_at_recall(curve: list, target: float) -> float:
    """QPS where the curve crosses ``target`` recall, log-linear between the bracketing points;
    NaN when the curve never reaches it. Takes the best QPS among points that reach it too."""
    pts = sorted(curve, key=lambda c: c["recall"])
    best = max((c["qps"] for c in pts if c["recall"] >= target), default=float("nan"))
    for lo, hi in zip(pts, pts[1:]):
        if lo["recall"] < target <= hi["recall"]:
            t = (target - lo["recall"]) / (hi["recall"] - lo["recall"])
            interp = math.exp(math.log(lo["qps"]) * (1 - t) + math.log(hi["qps"]) * t)
            return max(interp, best) if best == best else interp
    return best


# A point slower than this share below the previous run's speed at the same recall is a regression.
REGRESSION_TOLERANCE = 0.05


def regressions(current: dict, previous: dict, tolerance: float = REGRESSION_TOLERANCE) -> list:
    """The points of ``current`` slower than ``previous`` at equal recall by more than ``tolerance``:
    each curve point against the previous curve of the method of the same name at that point's
    recall (``qps_at_recall``: interpolated, or a faster point of higher recall), and each row of
    the small-batch tables against the row of the same codes, batch, list and searches whose recall
    was no higher (by 0.002). Both runs must be on one GPU model (else ValueError). Returns rows
    [what, recall, previous, now, now / previous]."""
    gpus = current["machine"].get("gpu"), previous["machine"].get("gpu")
    if gpus[0] != gpus[1]:
        raise ValueError(f"compare runs of one GPU model: the previous run was on {gpus[1]}, this one on {gpus[0]}")
    found = []
    before = {m["name"]: m["curve"] for m in previous.get("methods", [])}
    for method in current.get("methods", []):
        for point in method["curve"] if method["name"] in before else []:
            then = qps_at_recall(before[method["name"]], point["recall"])
            if then == then and point["qps"] < (1 - tolerance) * then:
                found.append([f"{method['name']} {point['param']}", point["recall"], then, point["qps"],
                              point["qps"] / then])
    key_columns = ("codes", "batch", "list", "searches")
    for table in current.get("tables", []):
        if "ms per call" not in table["columns"]:
            continue
        keyed = {}
        for old in previous.get("tables", []):
            if old["columns"] == table["columns"]:
                keyed.update({tuple(r[old["columns"].index(c)] for c in key_columns if c in old["columns"]): r
                              for r in old["rows"]})
        ms, recall = table["columns"].index("ms per call"), table["columns"].index("recall@10")
        for row in table["rows"]:
            old = keyed.get(tuple(row[table["columns"].index(c)] for c in key_columns if c in table["columns"]))
            if old is not None and row[recall] <= old[recall] + 0.002 and row[ms] > old[ms] / (1 - tolerance):
                what = ", ".join(f"{c} {row[table['columns'].index(c)]}" for c in key_columns if c in table["columns"])
                found.append([f"small batch: {what}", row[recall], 1000 / old[ms], 1000 / row[ms], old[ms] / row[ms]])
    return found


def _saved_at(path: str) -> float:
    """When a result was saved: the time of the last commit that changed it, else (no git, or a
    file not committed) the file's own time."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", os.path.basename(path)],
                             cwd=os.path.dirname(os.path.abspath(path)), capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return float(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.getmtime(path)


def latest_result(directory: str, like: dict, prefix: str = "gpu_"):
    """The newest result in ``directory`` (``prefix``*.json) of ``like``'s data, GPU model and
    build settings, to compare ``like`` against (:func:`regressions`), or None. Newest by
    :func:`_saved_at`; of two saved together, the one not named ``*_before``."""
    def key(results: dict) -> tuple:
        return (results.get("data"), results.get("machine", {}).get("gpu"),
                json.dumps(results.get("build", {}).get("params"), sort_keys=True))
    wanted, found = key(like), []
    for path in glob.glob(os.path.join(directory, prefix + "*.json")):
        try:
            with open(path) as f:
                if key(json.load(f)) == wanted:
                    found.append(path)
        except (OSError, ValueError):
            continue
    return max(found, key=lambda p: (_saved_at(p), not p.endswith("_before.json"), p), default=None)


def regression_table(found: list, previous_path: str) -> dict:
    """``regressions``' rows as a table of the report."""
    return {"title": f"Against {previous_path} (same GPU model): points more than {REGRESSION_TOLERANCE:.0%} slower at "
                     f"equal recall ({len(found)}; calls/s for small batches):",
            "columns": ["point", "recall@10", "previous q/s", "now q/s", "now / previous"],
            "rows": found or [["none", "", "", "", ""]]}


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"
    return str(v)


def markdown(results: dict, target: float = 0.95) -> str:
    m = results["machine"]
    lines = [f"# {results.get('title', 'benchmark')}", "",
             f"Machine: {machine_line(m)}. Data: {results.get('data', '?')}.", ""]
    if results.get("note"):
        lines += [results["note"], ""]
    lines += [f"| method | build s | QPS @ recall@10 {target} | max recall@10 |", "|---|---:|---:|---:|"]
    for meth in results["methods"]:
        q = qps_at_recall(meth["curve"], target)
        lines.append(f"| {meth['name']} | {meth['build_s']:.2f} | {'n/a' if q != q else f'{q:,.0f}'} | "
                     f"{max(c['recall'] for c in meth['curve']):.4f} |")
    if "build" in results:
        b = results["build"]
        lines += ["", f"torch_grnnd build: {b['seconds']:.3f} s, peak extra GPU memory {b['peak_extra_bytes'] / 2**20:,.0f} MiB "
                  f"(data {b['data_bytes'] / 2**20:,.0f} MiB), mean out-degree {b['degree_mean']:.1f}, params {b['params'] or 'defaults'}."]
    if "exact_knn_graph_s" in results:
        lines += ["", f"Plain-PyTorch exact k-NN graph of all points (float16 matmul + topk): {results['exact_knn_graph_s']:.2f} s."]
    if results.get("ablation"):
        lines += ["", "Ablation (seed 000, Figures 7-8): build time and recall@10 of the CUDA search at list 64.", "",
                  "| update order | reverse_ratio | build s | recall@10 |", "|---|---:|---:|---:|"]
        lines += [f"| {a['update_order']} | {a['reverse_ratio']} | {a['build_s']:.3f} | {a['recall_list64']:.4f} |"
                  for a in results["ablation"]]
    for table in results.get("tables", []):
        lines += ["", table["title"], "", "| " + " | ".join(table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table["rows"]]
    lines += ["", "Curves (search parameter: recall@10, QPS):", ""]
    for meth in results["methods"]:
        pts = ", ".join(f"{c['param']}: {c['recall']:.4f} @ {c['qps']:,.0f}"
                        + (f" ({c['dists_per_query']:,.0f} distances/query)" if "dists_per_query" in c else "")
                        for c in meth["curve"])
        lines.append(f"- **{meth['name']}** ({meth.get('sweep', 'param')}): {pts}")
    return "\n".join(lines) + "\n"


# Peers that cannot run here, drawn as reference curves beside the measured ones where the data
# is the same. CAGRA: cuVS 26.10, graph degree 32, batch 10 000, on one H200, on 1M x 384 float16
# MiniLM sentence embeddings, from the project's reference run (not rerun by these scripts).
REFERENCE_CURVES = [
    {"name": "cuVS CAGRA (reference, H200, not rerun here)", "data": "sentence embeddings (all-MiniLM-L6-v2",
     "gpu": "H200", "curve": [{"recall": 0.950, "qps": 1.48e6}, {"recall": 0.964, "qps": 1.24e6},
                              {"recall": 0.977, "qps": 805e3}, {"recall": 0.984, "qps": 657e3},
                              {"recall": 0.993, "qps": 273e3}]},
]


def references_for(results: dict) -> list:
    """The reference curves for the data and GPU of ``results``."""
    data, gpu = results.get("data", ""), results["machine"].get("gpu", "")
    return [r for r in REFERENCE_CURVES if r["data"] in data and r["gpu"] in gpu]


def plot(results: dict, path: str):
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for meth in results["methods"]:
        c = sorted(meth["curve"], key=lambda c: c["recall"])
        ax.plot([p["recall"] for p in c], [p["qps"] for p in c], marker="o", ms=3,
                label=f"{meth['name']} (build {meth['build_s']:.1f} s)")
    for ref in references_for(results):
        c = sorted(ref["curve"], key=lambda c: c["recall"])
        ax.plot([p["recall"] for p in c], [p["qps"] for p in c], linestyle="--", marker="s", ms=3, color="0.4",
                label=ref["name"])
    ax.set_yscale("log")
    ax.set_xlabel("recall@10")
    ax.set_ylabel("queries per second")
    ax.grid(True, which="both", alpha=0.3)
    title = "\n".join(textwrap.wrap(results.get("data", ""), 90) + textwrap.wrap(machine_line(results["machine"]), 90))
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out_dir: str, name: str, results: dict, target: float = 0.95) -> list:
    """Write out_dir/name.{json,md,png}; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    try:
        results["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    for meth in results["methods"]:
        meth[f"qps_at_recall_{target}"] = qps_at_recall(meth["curve"], target)
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(results, target))
    plot(results, base + ".png")
    return [base + ".json", base + ".md", base + ".png"]


if __name__ == "__main__":
    # Redraw the plots of written results (after a change to the plot), without rerunning anything:
    #   python -m benchmarks.report benchmarks/results/*.json
    import sys

    for json_path in sys.argv[1:]:
        with open(json_path) as f:
            written = json.load(f)
        if "methods" in written:
            plot(written, json_path[:-len(".json")] + ".png")
            print("redrew", json_path[:-len(".json")] + ".png")
