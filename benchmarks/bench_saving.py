"""Index.save / Index.load throughput on the CPU, against plain torch.save / torch.load of the same
state_dict in the same run and folder.

    python -m benchmarks.bench_saving --n 2000000 --dim 160 --dir /tmp --out benchmarks/results

The index is random rows (float32, or --dtype float16) and a random int32 graph of the given degree
(no build: saving reads bytes, not neighbourhoods). Timed, each --repeat times (the table gives the median):
  - crc32: zlib.crc32 over the rows on one core, and saving.chunk_checksums on all cores;
  - torch.save of the state_dict to a writer that discards the bytes, with and without the CRC-32
    that torch computes for each record of its zip archive (torch.serialization.set_crc32_options,
    torch >= 2.6; torch.load never checks those): the serialisation's own cost, no file system;
  - save: torch.save of the state_dict over the previous file followed by an fsync (the plain
    path, made as durable), the same into a new file renamed over the previous one (the plain path
    made atomic), and Index.save (checksums, new temporary file, fsync, rename);
  - load, cold: the file's pages dropped from the page cache first (posix_fadvise DONTNEED after
    the save's fsync), then torch.load (read into memory) + Index.from_state_dict, Index.load
    (mapped, every checksum checked) and Index.load(verify=False) followed by a first touch of
    every page of the rows and graph (what the first searches would read);
  - load, warm: Index.load again with the file in the page cache.
Throughput is the file's size over the time. Writes saving_<n>k-d<dim>[_<label>].json and .md under --out.
"""
import argparse
import gc
import io
import json
import os
import statistics
import tempfile
import time
import zlib
from functools import partial

import torch

import torch_grnnd as grnnd
from benchmarks.report import machine
from torch_grnnd import saving


def seconds(fn, *args):
    """(seconds ``fn(*args)`` took, what it returned)."""
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def drop_from_cache(path: str) -> None:
    """The file's pages out of the page cache (clean pages only, and none still mapped), so that
    the next load reads the disk."""
    gc.collect()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return len(b)


def serialise(index: grnnd.Index, zip_crc: bool = True) -> None:
    # The CRC option is process-wide (torch >= 2.6): off for this call only.
    if not zip_crc:
        torch.serialization.set_crc32_options(False)
    try:
        torch.save(index.state_dict(), Discard())
    finally:
        if not zip_crc:
            torch.serialization.set_crc32_options(True)


def plain_save(index: grnnd.Index, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(index.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())


def plain_save_renamed(index: grnnd.Index, path: str) -> None:
    # The previous file stays whole until the rename, as Index.save's does.
    with open(path + ".new", "wb") as f:
        torch.save(index.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".new", path)


def plain_load(path: str) -> grnnd.Index:
    return grnnd.Index.from_state_dict(torch.load(path, weights_only=True))


def first_pass(index: grnnd.Index) -> None:
    # One byte of every 4 KiB page of the rows and graph: the reads that searches over the whole
    # index would fault in, without the arithmetic of a full pass.
    for t in (index.data, index.graph):
        t.view(torch.uint8).reshape(-1)[::4096].sum()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=160)
    parser.add_argument("--degree", type=int, default=48)
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--library-only", action="store_true",
                        help="time Index.save and Index.load only (no plain torch.save copy of the file, for indexes "
                             "that fill half the disk or memory)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="folder the index files are written to")
    parser.add_argument("--label", default="", help="appended to the result's name (e.g. before, after)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    # Made in chunks: a float32 copy of a float16 index would need twice its memory.
    rows = torch.empty(args.n, args.dim, dtype=getattr(torch, args.dtype))
    for start in range(0, args.n, 1 << 20):
        part = rows[start:start + (1 << 20)]
        part.copy_(torch.randn(part.shape, generator=g))
    graph = torch.randint(args.n, (args.n, args.degree), generator=g, dtype=torch.int32)
    index = grnnd.Index(rows, graph)
    rows_bytes = rows.view(torch.uint8).numpy()
    work = tempfile.mkdtemp(prefix="bench_saving.", dir=args.dir)
    plain_path, path = os.path.join(work, "plain.pt"), os.path.join(work, "index.grnnd")

    times = {}
    for r in range(args.repeat):
        step = {"chunk_checksums": seconds(saving.chunk_checksums, {"data": rows})[0]}
        if not args.library_only:
            step["crc32_one_core"] = seconds(zlib.crc32, rows_bytes)[0]
            step["serialise"] = seconds(serialise, index)[0]
            if hasattr(torch.serialization, "set_crc32_options"):
                step["serialise_no_zip_crc"] = seconds(serialise, index, False)[0]
            step["plain_save"] = seconds(plain_save, index, plain_path)[0]
            step["plain_save_renamed"] = seconds(plain_save_renamed, index, plain_path)[0]
        step["save"] = seconds(index.save, path)[0]
        if not args.library_only:
            drop_from_cache(plain_path)
            step["plain_load_cold"] = seconds(plain_load, plain_path)[0]
        drop_from_cache(path)
        step["load_cold"] = seconds(grnnd.Index.load, path)[0]
        drop_from_cache(path)
        step["load_unverified_cold"], loaded = seconds(partial(grnnd.Index.load, verify=False), path)
        step["first_pass"] = seconds(first_pass, loaded)[0]
        del loaded
        step["load_warm"] = seconds(grnnd.Index.load, path)[0]
        for key, value in step.items():
            times.setdefault(key, []).append(value)
        print(f"repeat {r}: " + ", ".join(f"{key} {value:.3f} s" for key, value in step.items()), flush=True)

    file_bytes = os.path.getsize(path)
    plain_bytes = os.path.getsize(plain_path) if os.path.exists(plain_path) else 0
    for name in (path, plain_path):
        if os.path.exists(name):
            os.unlink(name)
    os.rmdir(work)
    median = {key: statistics.median(values) for key, values in times.items()}
    row_bytes = rows.numel() * rows.element_size()
    sizes = {"crc32_one_core": row_bytes, "chunk_checksums": row_bytes, "plain_save": plain_bytes,
             "plain_save_renamed": plain_bytes, "plain_load_cold": plain_bytes, "serialise": plain_bytes,
             "serialise_no_zip_crc": plain_bytes}
    rate = {key: sizes.get(key, file_bytes) / median[key] / 1e9 for key in median}
    result = {"machine": machine(threads=torch.get_num_threads()), "n": args.n, "dim": args.dim,
              "dtype": args.dtype, "degree": args.degree, "file_bytes": file_bytes, "plain_file_bytes": plain_bytes, "dir": args.dir,
              "times_s": times, "median_s": median, "gb_per_s": rate}
    os.makedirs(args.out, exist_ok=True)
    name = (f"saving_{args.n // 1000}k-d{args.dim}" + ("_f16" if args.dtype == "float16" else "")
            + (f"_{args.label}" if args.label else ""))
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    labels = {"crc32_one_core": "zlib.crc32 of the rows, one core",
              "chunk_checksums": "chunk_checksums of the rows, all cores",
              "serialise": "torch.save to a discarding writer",
              "serialise_no_zip_crc": "the same without the zip records' CRC-32",
              "plain_save": "torch.save + fsync, over the file",
              "plain_save_renamed": "torch.save + fsync, new file renamed over it", "save": "Index.save",
              "plain_load_cold": "torch.load + from_state_dict, cold", "load_cold": "Index.load, cold",
              "load_unverified_cold": "Index.load(verify=False), cold",
              "first_pass": "then a first touch of every page", "load_warm": "Index.load, warm"}
    m = result["machine"]
    size = f"{args.n} x {args.dim} {args.dtype} rows, degree {args.degree} ({file_bytes / 1e9:.2f} GB file)"
    lines = [f"# Saving and loading {size}", "",
             f"{m['cpu']}, {m['cpu_count']} cores, torch {m['torch']}; files in {args.dir}; median of {args.repeat}.",
             "", "| step | s | GB/s |", "|---|---:|---:|"]
    lines += [f"| {labels[key]} | {median[key]:.3f} | {rate[key]:.2f} |" for key in median]
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
