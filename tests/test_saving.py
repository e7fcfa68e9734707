"""Index.save / Index.load (torch_grnnd/saving.py): round trips, files mapped rather than read,
and no file a crash, truncation, corruption or a newer format can pass off as an index."""
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import pytest
import torch

import torch_grnnd as grnnd
from conftest import clustered
from torch_grnnd import saving


@pytest.fixture(scope="module")
def index():
    data = clustered(4_000, 32, 20, seed=11)
    ix = grnnd.Index.build(data, ids=torch.arange(4_000) * 7, codes="int8")
    ix.remove(torch.tensor([7, 14]))
    return ix


def test_an_index_survives_save_and_load(index, tmp_path):
    path = tmp_path / "index.grnnd"
    index.save(path)
    loaded = grnnd.Index.load(path)
    for key in ("data", "graph", "ids", "removed"):
        assert torch.equal(getattr(loaded, key), getattr(index, key)), key
    assert torch.equal(loaded.codes.rows, index.codes.rows) and loaded.metric == index.metric
    queries = index.data[:20]
    assert torch.equal(loaded.search(queries, 5)[1], index.search(queries, 5)[1])
    # Mapped from the file, not read into fresh memory; adds still work (they make room).
    if os.path.exists("/proc/self/maps"):
        assert any(str(path) in line for line in open("/proc/self/maps"))
    loaded.add(queries + 0.5, ids=torch.arange(10**6, 10**6 + 20))
    assert len(loaded) == len(index) + 20
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_save_leaves_the_old_file(index, tmp_path, monkeypatch):
    path = tmp_path / "index.grnnd"
    index.save(path)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saving.torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        grnnd.Index.build(index.data[:100]).save(path)
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_truncated_corrupted_foreign_and_newer_files_are_refused(index, tmp_path):
    path = tmp_path / "index.grnnd"
    index.save(path)
    raw = path.read_bytes()
    truncated = tmp_path / "truncated.grnnd"
    for keep in (100, len(raw) // 3, len(raw) - 1):  # in the header, in the rows, the last byte lost
        truncated.write_bytes(raw[:keep])
        with pytest.raises(ValueError, match=f"{truncated}: not a readable torch_grnnd index file"):
            grnnd.Index.load(truncated)
    # A flipped byte in the rows' payload: found by its checksum, whatever else it breaks.
    flipped = bytearray(raw)
    at = raw.index(index.data.numpy().tobytes()[:64]) + 1000
    flipped[at] ^= 0x40
    corrupted = tmp_path / "corrupted.grnnd"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=f"{corrupted}: tensor 'data' does not match its checksum"):
        grnnd.Index.load(corrupted)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(ValueError, match=f"{foreign}: not a torch_grnnd index file"):
        grnnd.Index.load(foreign)
    newer = tmp_path / "newer.grnnd"
    torch.save({"format": saving.FORMAT, "version": saving.VERSION + 1, "state": {}, "checksums": {}}, newer)
    with pytest.raises(ValueError, match=rf"{newer}: written in index format {saving.VERSION + 1}, newer than this "
                                         rf"torch_grnnd reads \({saving.VERSION}\)"):
        grnnd.Index.load(newer)
    with pytest.raises(FileNotFoundError):
        grnnd.Index.load(tmp_path / "missing.grnnd")


def test_every_chunk_is_checksummed_and_checked(index, tmp_path, monkeypatch):
    # Chunks of 4 KiB: the rows' checksums are a list, computed in parallel, in order; a byte
    # flipped in the last chunk of the rows is found as surely as one in the first.
    monkeypatch.setattr(saving, "_CRC_CHUNK", 4096)
    path = tmp_path / "index.grnnd"
    index.save(path)
    record = torch.load(path, weights_only=True)
    rows = index.data.numpy().tobytes()
    assert record["version"] == saving.VERSION == 3
    assert record["checksums"]["data"] == [zlib.crc32(rows[s:s + 4096]) for s in range(0, len(rows), 4096)]
    raw = bytearray(path.read_bytes())
    raw[raw.index(rows[-64:]) + 10] ^= 0x01
    flipped = tmp_path / "flipped.grnnd"
    flipped.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="tensor 'data' does not match its checksum"):
        grnnd.Index.load(flipped)


def test_version_1_files_still_load(index, tmp_path):
    # Version 1 kept one CRC per tensor.
    state = index.state_dict()
    sums = {name: saving.checksum(t) for name, t in saving._tensors(state)}
    old = tmp_path / "v1.grnnd"
    torch.save({"format": saving.FORMAT, "version": 1, "state": state, "checksums": sums}, old)
    assert torch.equal(grnnd.Index.load(old).graph, index.graph)
    sums["graph"] ^= 1
    torch.save({"format": saving.FORMAT, "version": 1, "state": state, "checksums": sums}, old)
    with pytest.raises(ValueError, match="tensor 'graph' does not match its checksum"):
        grnnd.Index.load(old)


def test_version_2_files_still_load(index, tmp_path):
    # Version 2 kept a CRC per chunk of each tensor, none of the layout.
    state = index.state_dict()
    sums = saving.chunk_checksums(dict(saving._tensors(state)))
    old = tmp_path / "v2.grnnd"
    torch.save({"format": saving.FORMAT, "version": 2, "state": state, "checksums": sums}, old)
    assert torch.equal(grnnd.Index.load(old).data, index.data)
    sums["removed"][0] ^= 1
    torch.save({"format": saving.FORMAT, "version": 2, "state": state, "checksums": sums}, old)
    with pytest.raises(ValueError, match="tensor 'removed' does not match its checksum"):
        grnnd.Index.load(old)


def test_a_flipped_bit_outside_the_tensors_is_found(index, tmp_path):
    # next_id is a number in the pickled record, not a tensor: flipped, it would still be a valid
    # next_id (above every id) and load silently but for the layout's checksum.
    state = index.state_dict()
    state["next_id"] = 0x5EED1234
    path = tmp_path / "index.grnnd"
    saving.save_state(state, path)
    assert grnnd.Index.load(path, verify=False).next_id == 0x5EED1234
    raw = bytearray(path.read_bytes())
    at = raw.index((0x5EED1234).to_bytes(4, "little"))
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{path}: the numbers, strings or tensor shapes it holds do not match"):
        grnnd.Index.load(path, verify=False)


def test_tensors_in_lists_are_checked(tmp_path):
    # A SwappingIndex's state keeps one graph a shard in a list; save_state checks each.
    swapping = grnnd.SwappingIndex.build(clustered(3_000, 16, 10, seed=5), device="cpu", shard_rows=1_000)
    path = tmp_path / "swapping.grnnd"
    saving.save_state(swapping.state_dict(), path)
    restored = grnnd.SwappingIndex.from_state_dict(saving.load_state(path))
    assert all(torch.equal(a, b) for a, b in zip(restored.graphs, swapping.graphs))
    raw = bytearray(path.read_bytes())
    raw[raw.index(swapping.graphs[1].numpy().tobytes()[:256]) + 100] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{path}: tensor 'graphs.1' does not match its checksum"):
        saving.load_state(path)


def test_state_dicts_saved_by_torch_save_still_load(index, tmp_path):
    # Before Index.save the guide kept an index with torch.save(index.state_dict(), path): no
    # format record, no checksums. Such files load (mapped) as they are.
    old = tmp_path / "old.pt"
    torch.save(index.state_dict(), old)
    loaded = grnnd.Index.load(old)
    for key in ("data", "graph", "ids", "removed"):
        assert torch.equal(getattr(loaded, key), getattr(index, key)), key
    assert torch.equal(loaded.codes.rows, index.codes.rows) and loaded.next_id == index.next_id
    raw = old.read_bytes()
    old.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match=f"{old}: not a readable torch_grnnd index file"):
        grnnd.Index.load(old)


def test_saving_over_a_loaded_file_leaves_the_loaded_index_as_it_was(index, tmp_path):
    # The loaded index maps the file; the save renames a new file over the name, so the mapping
    # keeps the old contents.
    path = tmp_path / "index.grnnd"
    index.save(path)
    loaded = grnnd.Index.load(path, verify=False)
    other = grnnd.Index.build(clustered(500, 32, 5, seed=3))
    other.save(path)
    assert torch.equal(loaded.data, index.data) and torch.equal(loaded.graph, index.graph)
    assert torch.equal(grnnd.Index.load(path).data, other.data)


TEMPORARY = re.compile(r"index\.grnnd\.[0-9a-f]{16}\.tmp")


@pytest.mark.skipif(saving.fcntl is None, reason="no flock: abandoned temporary files are left")
def test_a_save_removes_abandoned_temporary_files_and_keeps_live_ones(tmp_path):
    path = tmp_path / "index.grnnd"
    small = grnnd.Index.build(clustered(300, 8, 3, seed=4))
    abandoned = tmp_path / "index.grnnd.0123456789abcdef.tmp"  # its writer is gone: no lock held
    abandoned.write_bytes(b"partial")
    live = tmp_path / "index.grnnd.fedcba9876543210.tmp"  # a save in another process: it holds the lock
    live_fd = os.open(live, os.O_WRONLY | os.O_CREAT)
    saving.fcntl.flock(live_fd, saving.fcntl.LOCK_EX)
    others = [tmp_path / "index.grnnd.v2.0123456789abcdef.tmp", tmp_path / "index.grnnd.tmp",
              tmp_path / "other.grnnd.0123456789abcdef.tmp"]  # not temporary files of this path
    for other in others:
        other.write_bytes(b"x")
    try:
        small.save(path)
        assert not abandoned.exists() and live.exists() and all(o.exists() for o in others)
    finally:
        os.close(live_fd)  # the other save dies
    small.save(path)
    assert not live.exists() and all(o.exists() for o in others)
    assert torch.equal(grnnd.Index.load(path).data, small.data)


def test_saves_from_several_threads_to_one_path(tmp_path):
    # Each save's temporary file is live while another thread's save looks for abandoned ones;
    # every save succeeds, the file is one of them, whole, and no temporary file is left.
    path = tmp_path / "index.grnnd"
    indexes = [grnnd.Index.build(clustered(2_000, 16, 5, seed=s)) for s in range(3)]
    errors = []

    def save_often(ix):
        try:
            for _ in range(6):
                ix.save(path)
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(error)

    threads = [threading.Thread(target=save_often, args=(ix,)) for ix in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    loaded = grnnd.Index.load(path)
    assert any(torch.equal(loaded.data, ix.data) for ix in indexes)
    assert {p.name for p in tmp_path.iterdir()} == {"index.grnnd"}


def test_a_save_killed_part_way_leaves_a_loadable_file(tmp_path):
    # A process saves one index over and over to the same file and is killed at random moments;
    # the file always loads, as the first index or the second, never a mix.
    path = tmp_path / "index.grnnd"
    first = grnnd.Index.build(clustered(3_000, 16, 10, seed=12))
    first.save(path)
    second_rows = clustered(150_000, 64, 50, seed=13)
    script = textwrap.dedent(f"""
        import torch, torch_grnnd as grnnd
        rows = torch.load({str(tmp_path / "rows.pt")!r})
        index = grnnd.Index(rows, torch.zeros(rows.shape[0], 4, dtype=torch.int32))
        print("ready", flush=True)
        while True:
            index.save({str(path)!r})
    """)
    torch.save(second_rows, tmp_path / "rows.pt")
    rng = random.Random(0)
    for _ in range(4):
        worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            worker.kill()
            worker.wait()
        loaded = grnnd.Index.load(path)
        assert loaded.data.shape[0] in (3_000, 150_000)
        expected = first.data if loaded.data.shape[0] == 3_000 else second_rows
        assert torch.equal(loaded.data, expected)
    # A killed save leaves at most its temporary file beside the index, never a half-written index;
    # each save deletes those of the saves killed before it, so they do not pile up.
    left = {p.name for p in tmp_path.iterdir()} - {"index.grnnd", "rows.pt"}
    assert all(TEMPORARY.fullmatch(name) for name in left), left
    assert len(left) <= (1 if saving.fcntl is not None else 4), left
