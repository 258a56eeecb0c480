"""A reader's costs do not grow with the store: its leaves are checked in the first batches
whatever its size (NOTE [ Leaves beside a read ] in leaves.py), and the pages of its map that
the kernel holds are mapped in ahead of the reads (``advice.MapFill``), without reading from the
disk what the kernel does not hold."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from fastdata import LMDBImageDataset
from fastdata.stores.lmdb import env as env_module
from fastdata.stores.lmdb.pages import advice

from ...test_hostile_input import write_store_with


def _values(n: int) -> list[bytes]:
    return [bytes([i % 251]) * 1400 + i.to_bytes(4, "big") for i in range(n)]  # 2 a leaf


def _evicted(data_file: Path) -> None:
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _held_share(span: tuple[int, int]) -> float:
    """The share of the pages of this process's map ``span`` that the kernel holds."""
    libc = advice.c_library()
    pages = -(-(span[1] - span[0]) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(span[0], span[1] - span[0], vec) == 0
    return sum(b & 1 for b in vec.raw) / pages


def _mapped_in(span: tuple[int, int]) -> int:
    """Bytes of the map starting at ``span[0]`` that this process has mapped in (its Rss)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == span[0]
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the store's map is not in /proc/self/smaps")


def test_a_store_in_memory_is_checked_whole_in_its_first_batches(tmp_path: Path) -> None:
    """Random batches of a store in memory: beside their own leaves, each checks others from
    a cursor, so that within a few batches every leaf is checked and reads take the shortest
    path, where the batches' own leaves alone would take about an epoch; every value read
    is the one written."""
    values = _values(4000)
    write_store_with(tmp_path / "s.lmdb", values)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0  # (known to be in memory, as after its first batch)
    leaves = lease.entry.leaves
    before = len(leaves._unread)
    assert before > 2000  # (two values a leaf, and the headers' leaves)
    rng = random.Random(0)
    batches = 0
    while not leaves.all_sound:
        batch = rng.sample(range(len(values)), 64)
        got = ds.__getitems__(batch)
        assert [data for data, _ in got] == [values[i] for i in batch]
        batches += 1
        assert batches <= 10, f"{len(leaves._unread)} of {before} leaves unread"
    assert ds.__getitems__([3999])[0][0] == values[3999]


def test_leaves_the_kernel_does_not_hold_are_left_to_the_reads_that_want_them(
    tmp_path: Path,
) -> None:
    """Of a store on the disk, a batch checks its own leaves and hardly any other: none is
    read from the disk for the check alone."""
    values = _values(4000)
    write_store_with(tmp_path / "s.lmdb", values)
    _evicted(tmp_path / "s.lmdb" / "data.mdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0  # (taken for a store in memory: the cursor is tried)
    leaves = lease.entry.leaves
    _evicted(tmp_path / "s.lmdb" / "data.mdb")  # (what the first read brought in)
    before = len(leaves._unread)
    batch = list(range(0, 4000, 125))
    assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
    checked = before - len(leaves._unread)
    assert checked <= 2 * len(batch) + 8  # (its own: a value's leaf and a header's each)


@pytest.fixture
def fill_every_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env_module, "FILL_FROM", 0)


def _entry(ds: LMDBImageDataset) -> object:
    return ds.reader._env().entry  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fill_every_store")
def test_a_store_in_memory_is_mapped_in_ahead_of_its_reads(tmp_path: Path) -> None:
    write_store_with(tmp_path / "s.lmdb", _values(3000))
    data_file = tmp_path / "s.lmdb" / "data.mdb"
    with open(data_file, "rb") as f:
        f.read()  # (in the page cache)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    entry = _entry(ds)
    entry.fill._thread.join(timeout=30)  # type: ignore[attr-defined]
    span = entry.span  # type: ignore[attr-defined]
    assert _mapped_in(span) >= 0.9 * (span[1] - span[0])
    ds.reader.close()
    assert not [t for t in threading.enumerate() if t.name == "fastdata-map-fill"]


@pytest.mark.usefixtures("fill_every_store")
def test_mapping_in_reads_nothing_from_the_disk(tmp_path: Path) -> None:
    write_store_with(tmp_path / "s.lmdb", _values(3000))
    _evicted(tmp_path / "s.lmdb" / "data.mdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    entry = _entry(ds)
    entry.fill._thread.join(timeout=30)  # type: ignore[attr-defined]
    assert _held_share(entry.span) < 0.5  # type: ignore[attr-defined]
    assert ds[2999][0] == _values(3000)[2999]  # (and reads go on as before)


def _open_and_read(store: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(LMDBImageDataset(store, output="bytes")[7][0][-4:])


@pytest.mark.usefixtures("fill_every_store")
def test_a_child_forked_while_the_map_is_filled_opens_the_store_again(tmp_path: Path) -> None:
    """The thread that fills the map may hold its lock at a fork; the child, which closes what
    it inherited before it opens the store again, does not wait for a thread it lacks."""
    write_store_with(tmp_path / "s.lmdb", _values(500))
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    fill = _entry(ds).fill  # type: ignore[attr-defined]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with fill._lock:  # (as if a chunk were being mapped in at the fork)
        child = ctx.Process(target=_open_and_read, args=(str(tmp_path / "s.lmdb"), out))
        child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert out.get(timeout=5) == (7).to_bytes(4, "big")


def test_which_pages_are_in_memory_is_asked_a_stretch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resident_pages`` answers as asking page by page does, in stretches of pages, pages
    far apart and repeated included."""
    data = tmp_path / "f"
    data.write_bytes(os.urandom(64 * mmap.PAGESIZE))
    _evicted(data)
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.madvise(mmap.MADV_RANDOM)  # (no read-ahead around the pages touched)
        for page in (1, 2, 3, 40, 41):
            m[page * mmap.PAGESIZE]  # (these in memory now)
        base = int(np.frombuffer(m, np.uint8).ctypes.data)
        pages = [41, 0, 3, 63, 2, 40, 41, 17, 1]
        alone = [bool(advice.resident(base + p * mmap.PAGESIZE)) for p in pages]
        monkeypatch.setattr(advice, "RESIDENT_SPAN_MOST", 4)
        assert advice.resident_pages(base, pages, mmap.PAGESIZE) == alone
        monkeypatch.setattr(advice, "RESIDENT_SPAN_MOST", 1 << 16)
        assert advice.resident_pages(base, pages, mmap.PAGESIZE) == alone
        assert alone[2] and not all(alone)  # (some in memory, some not)
