"""Index.save / Index.load (torch_grnnd/saving.py): round trips, files mapped rather than read,
and no file a crash, truncation, corruption or a newer format can pass off as an index."""
import os
import random
import subprocess
import sys
import textwrap
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
    truncated.write_bytes(raw[:len(raw) // 3])
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
    with pytest.raises(ValueError, match=f"{newer}: written in index format {saving.VERSION + 1}, newer"):
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
    assert record["version"] == saving.VERSION == 2
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
    # A killed save leaves at most its temporary file beside the index, never a half-written index.
    assert {p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")} == {"index.grnnd", "rows.pt"}
