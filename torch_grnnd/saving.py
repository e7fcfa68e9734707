"""Files an index is saved to, which a crash cannot leave half-written.

:meth:`Index.save <torch_grnnd.Index.save>` writes the index's ``state_dict`` with ``torch.save``
to a temporary file beside the target, flushes it to disk and renames it over the target: the
rename is atomic, so a reader (or a restart after a crash) finds the old file or the new one,
never part of either. The file records a format name and version and a CRC-32 of every 64 MiB
chunk of every tensor's bytes; :meth:`Index.load <torch_grnnd.Index.load>` maps the file into
memory (``torch.load(mmap=True)``), refuses files of a newer format, and checks every tensor
against its checksums, so a truncated or corrupted file raises an error that names it instead of
loading. The chunks are checksummed on all the CPU's cores at once (``zlib.crc32`` lets go of the
interpreter's lock): they are a pass over every byte before the file is written.
"""
import collections
import os
import tempfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Deque, Dict, Iterator, List, Tuple

import torch
from torch import Tensor

FORMAT = "torch_grnnd.index"
# Raised when the layout of a saved file changes; a file of a higher version is refused.
# Version 1 kept one CRC per tensor; version 2 one per chunk of _CRC_CHUNK bytes. Both load.
VERSION = 2
_CRC_CHUNK = 1 << 26  # bytes checksummed at a time: bounds the host copy of a GPU tensor


def _tensors(state: Any, prefix: str = "") -> Iterator[Tuple[str, Tensor]]:
    """Every tensor of a nested dict, by its dotted path."""
    if isinstance(state, Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def _chunks(t: Tensor) -> Iterator[Tensor]:
    """A tensor's bytes in row-major order as host uint8 tensors of at most _CRC_CHUNK bytes (views
    of a contiguous host tensor; copies of a GPU tensor's chunks, one at a time)."""
    flat = t.detach().reshape(-1)
    per_chunk = max(1, _CRC_CHUNK // max(t.element_size(), 1))
    for start in range(0, flat.numel(), per_chunk):
        yield flat[start:start + per_chunk].cpu().contiguous().view(torch.uint8)


def checksum(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order: version 1's one checksum per tensor."""
    crc = 0
    for part in _chunks(t):
        crc = zlib.crc32(part.numpy(), crc)
    return crc


def chunk_checksums(tensors: Dict[str, Tensor]) -> Dict[str, List[int]]:
    """The CRC-32 of every _CRC_CHUNK-byte chunk of each tensor's bytes (row-major), computed on
    the CPU's cores at once. At most two chunks per core wait, which bounds the host copies of a
    GPU tensor's chunks."""
    workers = os.cpu_count() or 1
    out: Dict[str, List[int]] = {name: [] for name in tensors}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        waiting: Deque[Tuple[str, Future]] = collections.deque()
        for name, t in tensors.items():
            for part in _chunks(t):
                waiting.append((name, pool.submit(lambda b: zlib.crc32(b.numpy()), part)))
                if len(waiting) > 2 * workers:
                    done_name, job = waiting.popleft()
                    out[done_name].append(job.result())
        for done_name, job in waiting:
            out[done_name].append(job.result())
    return out


def save_state(state: Dict[str, Any], path: str) -> None:
    """Write ``state`` (an index's state_dict) to ``path`` atomically: a temporary file in the same
    folder, flushed to disk, then renamed over ``path``; a failed or interrupted save leaves
    whatever ``path`` held before (and at worst a stray ``.tmp`` file beside it)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    record = {"format": FORMAT, "version": VERSION, "state": state,
              "checksums": chunk_checksums(dict(_tensors(state)))}
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    """Make the rename itself durable (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_state(path: str, *, verify: bool = True) -> Dict[str, Any]:
    """The state saved by :func:`save_state`, its tensors mapped from the file (on the CPU).
    ``verify`` checks every tensor's checksum, which reads the whole file; without it only what
    a search touches is read. Raises ValueError naming the file when it is not an index file,
    is truncated or corrupted, or was written in a newer format."""
    path = os.fspath(path)
    try:
        record = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch names no specific error for a damaged archive
        raise ValueError(f"{path}: not a readable torch_grnnd index file (truncated or corrupted?): {error}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path}: not a torch_grnnd index file (no {FORMAT!r} format record)")
    version = record.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(f"{path}: written in index format {version!r}, newer than this torch_grnnd reads ({VERSION}); "
                         "upgrade torch_grnnd to load it")
    state, expected = record.get("state"), record.get("checksums")
    if not isinstance(state, dict) or not isinstance(expected, dict):
        raise ValueError(f"{path}: the index record lacks its state or checksums")
    found = dict(_tensors(state))
    if set(found) != set(expected):
        raise ValueError(f"{path}: tensors {sorted(set(found) ^ set(expected))} are missing or unexpected")
    if verify:
        found_sums = ({name: checksum(t) for name, t in found.items()} if version < 2
                      else chunk_checksums(found))
        for name in found:
            if found_sums[name] != expected[name]:
                raise ValueError(f"{path}: tensor {name!r} does not match its checksum (the file is corrupted)")
    return state
