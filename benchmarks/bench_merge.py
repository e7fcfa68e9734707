"""grnnd.merge of two built halves against a fresh build of the whole set, same run.

    python -m benchmarks.bench_merge --data clustered:n=10000000,d=128,clusters=10000,queries=10000
    python -m benchmarks.bench_merge --data aniso:2000000x96 --settings "inner_iters=6;update_order=ascending"
    python -m benchmarks.bench_merge --device cpu --data clustered:n=40000,d=32,clusters=40,queries=1000

Data as benchmarks/bench_gpu.py loads it. recall@10 at list 64 against exact neighbours
(grnnd.knn); times are CUDA events on a GPU (each of one call, after the untimed build of the
whole set that bench_update.setup runs there), wall clock on the CPU. ``--settings``: merges with
other settings beside the default one, ``;`` between merges, each a list of BuildParams fields
(``inner_iters=6,update_order=ascending``) given to grnnd.merge. Writes merge_<name>.{json,md}
under --out.
"""
import json
import os

import torch

import torch_grnnd as grnnd
from benchmarks.common import K, LIST, parse_settings, recall, setup, timed
from benchmarks.report import machine, machine_line


def main():
    args, device, name, base, queries = setup(
        __doc__, "clustered:n=10000000,d=128,clusters=10000,queries=10000",
        lambda p: p.add_argument("--settings", default="", help="merges beside the default one, ';' between them"))
    variants = [""] + [text.strip() for text in args.settings.split(";") if text.strip()]
    settings = [parse_settings(text) for text in variants]
    for s in settings:
        grnnd.BuildParams.merge(None, **s)  # an unknown field fails here, before any build
    n = base.shape[0]
    truth = grnnd.knn(base, queries, K)[1]
    fresh, fresh_s = timed(lambda: grnnd.Index.build(base), device)
    fresh_recall = recall(fresh, queries, truth)
    del fresh
    a, a_s = timed(lambda: grnnd.Index.build(base[: n // 2]), device)
    b, b_s = timed(lambda: grnnd.Index.build(base[n // 2:]), device)
    merges = []
    for text, s in zip(variants, settings):
        merged, merge_s = timed(lambda: grnnd.merge(a, b, **s), device)
        merges.append({"settings": text, "merge_s": merge_s, "merge_recall": recall(merged, queries, truth)})
        del merged
    r = {"data": name, "n": n, "dim": base.shape[1], "list_size": LIST,
         "machine": machine(threads=torch.get_num_threads(), cuda=device.type == "cuda"),
         "fresh_build_s": fresh_s, "fresh_recall": fresh_recall, "build_halves_s": [a_s, b_s],
         "merge_s": merges[0]["merge_s"], "merge_recall": merges[0]["merge_recall"], "merges": merges}
    print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"merge_{name}")
    with open(stem + ".json", "w") as f:
        json.dump(r, f, indent=1)
    lines = [f"# Merge of two halves, {name} ({n:,} x {r['dim']})", "",
             f"Machine: {machine_line(r['machine'])}. recall@10 at list {LIST}; `{args.command}`"
             + (f" `--settings \"{args.settings}\"`" if args.settings else "") + ".",
             "", "| | time | recall |", "|---|---|---:|",
             f"| fresh build of all rows | {fresh_s:.2f} s | {fresh_recall:.4f} |",
             f"| build of each half | {a_s:.2f} s + {b_s:.2f} s | |"]
    for m in merges:
        label = f"grnnd.merge of the halves, {m['settings']}" if m["settings"] else "grnnd.merge of the halves"
        lines.append(f"| {label} | {m['merge_s']:.2f} s ({m['merge_s'] / fresh_s:.0%} of the fresh build) | "
                     f"{m['merge_recall']:.4f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", stem + ".json", stem + ".md")


if __name__ == "__main__":
    main()
