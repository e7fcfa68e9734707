"""Files an index is saved to, which a crash cannot leave half-written.

:meth:`Index.save <torch_grnnd.Index.save>` writes the index's ``state_dict`` with ``torch.save``
to a temporary file beside the target, flushes it to disk and renames it over the target: the
rename is atomic, so a reader (or a restart after a crash) finds the old file or the new one,
never part of either. The file records a format name and version, a CRC-32 of every 64 MiB
chunk of every tensor's bytes and one of the rest (numbers, strings, the tensors' dtypes and
shapes); :meth:`Index.load <torch_grnnd.Index.load>` maps the file into memory
(``torch.load(mmap=True)``), refuses files of a newer format, and checks the file against its
checksums, so a truncated or corrupted file raises an error that names it instead of loading
(``torch.load`` checks none of the CRC-32s in the zip archive ``torch.save`` writes). The chunks
are checksummed on all the CPU's cores at once (``zlib.crc32`` lets go of the interpreter's
lock): they are a pass over every byte before the file is written.

The temporary file is named ``<target name>.<16 hex digits>.tmp`` (``index.grnnd.3f0c...e1.tmp``).
A save killed part-way leaves its temporary file behind; the next save to the same path deletes
every such file whose writer is gone, so one killed save's file at most waits there. A writer holds
an exclusive ``flock`` on its file until the rename, which tells another process's live save from
a dead one (a process knows its own); where ``fcntl`` is missing (Windows) nothing is deleted, and
stray files by that name can be removed by hand when no save is running.

Files saved with ``torch.save(index.state_dict(), path)``, the way to keep an index before
``Index.save`` existed, record no format and no checksums; they load as they are, unchecked.
"""
import collections
import contextlib
import os
import re
import secrets
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Deque, Dict, Iterator, List, Set, Tuple, Union

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # Windows: no flock, so no telling a live save's temporary file from a dead one's
    fcntl = None

FORMAT = "torch_grnnd.index"
# Raised when the layout of a saved file changes; a file of a higher version is refused.
# Version 1 kept one CRC per tensor; version 2 one per chunk of _CRC_CHUNK bytes; version 3 adds
# the CRC of the layout (everything but the tensors' bytes) and checks tensors inside lists too.
# All load.
VERSION = 3
_CRC_CHUNK = 1 << 26  # bytes checksummed at a time: bounds the host copy of a GPU tensor
# This process's temporary files being written, named before they exist: remove_abandoned skips
# them without asking flock, which on NFS is emulated by locks that one process never refuses itself.
_WRITING: Set[str] = set()
_WRITING_LOCK = threading.Lock()


def _tensors(state: Any, prefix: str = "", lists: bool = True) -> Iterator[Tuple[str, Tensor]]:
    """Every tensor of nested dicts (and, with ``lists``, lists and tuples: formats before 3 looked
    in dicts only) by its dotted path, a list's items by their positions (``graphs.0``)."""
    if isinstance(state, Tensor):
        yield prefix, state
        return
    if isinstance(state, dict):
        items = state.items()
    elif lists and isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return
    for key, value in items:
        yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key), lists)


def layout_checksum(state: Any) -> int:
    """CRC-32 of what a saved file holds besides the tensors' bytes: the state written out with
    every tensor replaced by its dtype and shape. A bit flipped there (an id counter, a setting, a
    shape) would otherwise load as a different value."""
    def outline(value: Any) -> Any:
        if isinstance(value, Tensor):
            return ("tensor", str(value.dtype), tuple(value.shape))
        if isinstance(value, dict):
            return {key: outline(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(outline(item) for item in value)
        if isinstance(value, (set, frozenset)):  # printed in an order that changes between runs
            return sorted(repr(outline(item)) for item in value)
        return value
    return zlib.crc32(repr(outline(state)).encode())


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
    whatever ``path`` held before (and at worst its ``<name>.<hex>.tmp`` file beside it, which the
    next save to ``path`` deletes)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    record = {"format": FORMAT, "version": VERSION, "state": state, "layout": layout_checksum(state),
              "checksums": chunk_checksums(dict(_tensors(state)))}
    remove_abandoned(path)  # before writing: a dead save's file may hold the room this one needs
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(record, f)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:  # renamed under the lock, so that no other save takes it for abandoned
                os.replace(tmp, path)
        if fcntl is None:  # Windows renames no open file (and there is no lock to hold)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _written(tmp)
    _sync_folder(folder)


def _create_temporary(path: str) -> Tuple[int, str]:
    """A new, empty temporary file beside ``path`` (permissions from the umask, as ``torch.save``
    gives), listed in _WRITING and locked for as long as its descriptor is open."""
    while True:
        tmp = os.path.abspath(f"{path}.{secrets.token_hex(8)}.tmp")
        with _WRITING_LOCK:
            _WRITING.add(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            _written(tmp)
            continue
        except BaseException:
            _written(tmp)
            raise
        if fcntl is None:
            return fd, tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: remove_abandoned cannot lock it either
            return fd, tmp
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        # Between its creation and the lock a save in another process took it for abandoned.
        os.close(fd)
        _written(tmp)


def _written(tmp: str) -> None:
    """``tmp`` off the list of this process's files being written."""
    with _WRITING_LOCK:
        _WRITING.discard(tmp)


def remove_abandoned(path: Union[str, os.PathLike]) -> List[str]:
    """Delete the temporary files that saves to ``path`` left when they died, and return their
    paths. A file whose writer is alive (it holds the file's lock) is kept; without ``fcntl``
    (Windows) nothing is deleted."""
    path = os.path.abspath(os.fspath(path))
    if fcntl is None:
        return []
    folder, name = os.path.split(path)
    pattern, removed = re.compile(re.escape(name) + r"\.[0-9a-f]{16}\.tmp"), []
    for entry in os.scandir(folder):
        if not pattern.fullmatch(entry.name):
            continue
        with _WRITING_LOCK:
            if os.path.abspath(entry.path) in _WRITING:
                continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:  # renamed over its target or deleted meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its writer lives
            # Still the file opened: its name was not renamed away and reused since.
            if os.path.samestat(os.stat(entry.path), os.fstat(fd)):
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


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
    a search touches is read (the layout's checksum is checked either way). A bare state_dict
    saved by ``torch.save`` (no format recorded) loads unchecked. Raises ValueError naming the
    file when it is not an index file, is truncated or corrupted, or was written in a newer
    format."""
    path = os.fspath(path)
    try:
        record = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch names no specific error for a damaged archive
        raise ValueError(f"{path}: not a readable torch_grnnd index file (truncated or corrupted?): {error}") from None
    if isinstance(record, dict) and "format" not in record and {"data", "graph", "metric"} <= set(record):
        return record  # torch.save(index.state_dict()): nothing recorded to check it by
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path}: not a torch_grnnd index file (no {FORMAT!r} format record)")
    version = record.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(f"{path}: written in index format {version!r}, newer than this torch_grnnd reads ({VERSION}); "
                         "upgrade torch_grnnd to load it")
    state, expected = record.get("state"), record.get("checksums")
    if not isinstance(state, dict) or not isinstance(expected, dict):
        raise ValueError(f"{path}: the index record lacks its state or checksums")
    if version >= 3 and record.get("layout") != layout_checksum(state):
        raise ValueError(f"{path}: the numbers, strings or tensor shapes it holds do not match their checksum "
                         "(the file is corrupted)")
    found = dict(_tensors(state, lists=version >= 3))
    if set(found) != set(expected):
        raise ValueError(f"{path}: tensors {sorted(set(found) ^ set(expected))} are missing or unexpected")
    if verify:
        found_sums = ({name: checksum(t) for name, t in found.items()} if version < 2
                      else chunk_checksums(found))
        for name in found:
            if found_sums[name] != expected[name]:
                raise ValueError(f"{path}: tensor {name!r} does not match its checksum (the file is corrupted)")
    return state
