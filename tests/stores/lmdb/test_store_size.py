"""A reader's costs do not grow with the store: its leaves are checked in the first batches
whatever its size (NOTE [ Leaves beside a read ] in leaves.py), without reading from the disk
what the kernel does not hold."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE
from typing import Any

import numpy as np
import pytest

from fastdata import LMDBImageDataset
from fastdata.stores.lmdb.pages import advice

from ...conftest import evicted
from ...test_hostile_input import write_store_with


def _values(n: int) -> list[bytes]:
    return [bytes([i % 251]) * 1400 + i.to_bytes(4, "big") for i in range(n)]  # 2 a leaf


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


def _read_from_memory(tmp_path: Path, values: list[bytes], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A dataset over a store of ``values``, its reader's cold-read policy told the store is in
    memory (as after its first batch), and no pause of a loaded machine taken for the disk;
    the dataset and its leaves. The kernel's answer is the same (a machine that reclaims
    memory may let part of a store written a moment ago go, and a pass leaves those leaves)."""
    from fastdata.stores.lmdb import leaves as leaves_module
    from fastdata.stores.lmdb import readahead

    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", 10**12)
    monkeypatch.setattr(
        leaves_module, "resident_pages", lambda base, pages, psize: [True] * len(pages)
    )
    write_store_with(tmp_path / "s.lmdb", values)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0
    return ds, lease.entry.leaves


def test_a_store_in_memory_is_checked_whole_in_its_first_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random batches of a store in memory: beside their own leaves, each checks others from
    a cursor, so that within a few batches every leaf is checked and reads take the shortest
    path, where the batches' own leaves alone would take about an epoch; every value read
    is the one written."""
    values = _values(4000)
    ds, leaves = _read_from_memory(tmp_path, values, monkeypatch)
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
    evicted(tmp_path / "s.lmdb" / "data.mdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0  # (taken for a store in memory: the cursor is tried)
    leaves = lease.entry.leaves
    evicted(tmp_path / "s.lmdb" / "data.mdb")  # (what the first read brought in)
    before = len(leaves._unread)
    unread = sorted(leaves._unread)
    held = advice.resident_pages(lease.entry.span[0], unread, leaves._tree.head.psize)
    batch = list(range(0, 4000, 125))
    assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
    checked = before - len(leaves._unread)
    # (its own: a value's leaf and a header's each; beside them, only leaves the kernel held,
    # such as those this process maps, which it does not let go)
    assert checked <= 2 * len(batch) + sum(held) and sum(held) < 40


def test_a_reader_maps_in_only_the_pages_it_reads(tmp_path: Path) -> None:
    """A store in memory is not mapped in ahead of its reads (that would save a page fault a
    read, and make every worker's RSS the whole store at once: where a job's memory is
    counted as its processes' RSS summed, workers x the store)."""
    write_store_with(tmp_path / "s.lmdb", _values(3000))
    with open(tmp_path / "s.lmdb" / "data.mdb", "rb") as f:
        f.read()  # (in the page cache)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    assert ds.__getitems__([0, 1500])[1][0] == _values(3000)[1500]
    span = ds.reader._env().entry.span  # type: ignore[attr-defined]
    assert _mapped_in(span) < 0.25 * (span[1] - span[0])


def test_which_pages_are_in_memory_is_asked_a_stretch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resident_pages`` answers as asking page by page does, in stretches of pages, pages
    far apart and repeated included."""
    data = tmp_path / "f"
    data.write_bytes(os.urandom(64 * mmap.PAGESIZE))
    evicted(data)
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


def test_pages_far_apart_are_asked_about_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel looks up every page of a stretch asked about: pages far apart are asked about
    one call each, not in a stretch that spans the pages between them (a few leaves spread over
    a million-record store had cost 10 ms a pass, in the kernel)."""
    asked: list[int] = []

    class Kernel:
        def mincore(self, address: int, length: int, vec: Any) -> int:
            asked.append(length // mmap.PAGESIZE)
            ctypes.memset(vec, 1, length // mmap.PAGESIZE)
            return 0

    monkeypatch.setattr(advice, "c_library", Kernel)
    pages = [5, 6, 9, 30_000, 60_000, 60_003]
    assert advice.resident_pages(0, pages, mmap.PAGESIZE) == [True] * len(pages)
    assert sorted(asked) == [1, 4, 5]  # (5-9, 30,000 alone, 60,000-60,003)


def test_the_last_few_leaves_the_kernel_let_go_of_are_read_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store in memory but a few leaves the kernel let go of, which no batch wants: the
    cursor passes them, and once they are all that is left they are read together, so that
    reads take the shortest path (before, every batch looked its keys up among them for as
    long as no batch wanted one: most of a first epoch at a million records)."""
    from fastdata.stores.lmdb import leaves as leaves_module

    values = _values(4000)
    ds, leaves = _read_from_memory(tmp_path, values, monkeypatch)
    value_routes = [r for r in leaves._routes if r[2] is not None and b"0" < r[2] < b":"]
    let_go = {value_routes[k * len(value_routes) // 6][0] for k in range(1, 6)}  # (five)
    assert len(let_go) == 5 <= len(leaves._routes) >> 8  # (a 256th of them at most)
    held = leaves_module.resident_pages
    monkeypatch.setattr(
        leaves_module,
        "resident_pages",
        lambda base, pages, psize: [
            h and p not in let_go for p, h in zip(pages, held(base, pages, psize), strict=True)
        ],
    )
    under = [(r[2], r[3]) for r in leaves._routes if r[0] in let_go]
    avoided = {i for i in range(len(values)) if any(lo <= b"%010d" % i < hi for lo, hi in under)}
    assert avoided  # (the records under those leaves: no batch asks for them)
    rng = random.Random(1)
    others = [i for i in range(len(values)) if i not in avoided]
    batches = 0
    while batches < 30 and not leaves.all_sound:
        batch = rng.sample(others, 64)
        assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
        batches += 1
    assert leaves.all_sound, f"{len(leaves._unread)} leaves unread after {batches} batches"
    assert let_go.isdisjoint(leaves._unread)
    assert [ds[i][0] for i in sorted(avoided)[:3]] == [values[i] for i in sorted(avoided)[:3]]


def test_leaves_beside_a_batch_are_checked_a_full_pass_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch checks as many leaves beside its own as MOST_BESIDE allows while as many are
    left (a pass's own work costs more a leaf in small passes: three times, at a million
    records), not a 256th of those left: few batches check them all."""
    from fastdata.stores.lmdb import leaves as leaves_module

    monkeypatch.setattr(leaves_module, "MOST_BESIDE", 1000)
    values = _values(4000)
    ds, leaves = _read_from_memory(tmp_path, values, monkeypatch)
    before = len(leaves._unread)
    rng = random.Random(2)
    batches = 0
    while not leaves.all_sound:
        batch = rng.sample(range(len(values)), 8)
        assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
        batches += 1
        assert batches <= before // 1000 + 3, f"{len(leaves._unread)} of {before} left"


def test_a_pass_over_a_store_on_the_disk_asks_the_kernel_about_a_few_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel holds few of the leaves a pass looks at, the pass ends among the first
    it asks about: it does not ask about a full pass's worth each batch (a store of which the
    kernel had let a fifth go spent 6 ms a batch asking, through most of a first epoch)."""
    from fastdata.stores.lmdb import leaves as leaves_module

    values = _values(12000)
    write_store_with(tmp_path / "s.lmdb", values)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0  # (taken for a store in memory: the cursor is tried)
    leaves = lease.entry.leaves
    evicted(tmp_path / "s.lmdb" / "data.mdb")
    asked: list[int] = []
    held = leaves_module.resident_pages

    def counted(base: int, pages: list[int], psize: int) -> list[bool]:
        asked.append(len(pages))
        return held(base, pages, psize)

    monkeypatch.setattr(leaves_module, "resident_pages", counted)
    assert len(leaves._unread) > 4 * leaves_module.PASSED_MOST
    batch = list(range(0, 12000, 400))
    assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
    assert asked and sum(asked) <= 2 * leaves_module.PASSED_MOST, asked


def _in_a_slot_of_its_own(slots: int) -> subprocess.Popen:
    """A process that waits on its stdin, whose id takes another of ``slots`` than this one's
    (two of one slot are taken for one: the one that checks would clear the other's)."""
    while True:
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE
        )
        if process.pid % slots != os.getpid() % slots:
            return process
        process.kill()
        process.wait()


def test_leaves_a_sibling_is_checking_are_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass beside a batch leaves the leaves a process beside this one is checking (marked
    so in the memory they share) to that process, rather than checking them side by side with
    it; it checks them itself only where a read of its own wants one, or once that process is
    no longer checking (killed in its check, its marks stay)."""
    from fastdata.stores.lmdb import leaves as leaves_module

    values = _values(4000)
    ds, leaves = _read_from_memory(tmp_path, values, monkeypatch)
    assert leaves._shared is not None and leaves._checkers is not None
    value_routes = [r for r in leaves._routes if r[2] is not None and b"0" < r[2] < b":"]
    theirs = {r[0] for r in value_routes[::3] if r[0] in leaves._unread}
    for page in theirs:
        leaves._shared[page] = leaves_module.CHECKING
    under = [(r[2], r[3]) for r in leaves._routes if r[0] in theirs]
    others = [i for i in range(4000) if not any(lo <= b"%010d" % i < hi for lo, hi in under)]
    rng = random.Random(3)
    sibling = _in_a_slot_of_its_own(leaves_module.CHECKERS)
    with sibling:
        try:  # (listed as checking, as a sibling is while it checks them)
            at = 4 * (sibling.pid % leaves_module.CHECKERS)
            struct.pack_into("=i", leaves._checkers, at, sibling.pid)
            for _ in range(5):
                batch = rng.sample(others, 64)
                assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
            assert theirs <= leaves._unread  # (every other leaf checked meanwhile)
            assert len(leaves._unread) == len(theirs)
            wanted = next(i for i in range(4000) if i not in set(others))
            assert ds[wanted][0] == values[wanted]  # (one it wants: checked here)
            assert len(leaves._unread) == len(theirs) - 1
        finally:
            sibling.kill()  # (gone in the middle of its check: its marks stay)
    batch = [max(set(range(4000)) - set(others)), *rng.sample(others, 63)]  # (one of theirs)
    assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
    assert leaves.all_sound  # (its leaves, never marked sound: checked beside the batch's)


def test_leaves_whose_check_was_interrupted_are_checked_by_a_later_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over leaves interrupted (Ctrl-C in a notebook, an I/O error) leaves them marked
    as being checked, by no one: a later pass checks them (they had been left for good, to a
    check that had ended, and a store read in part never took the shortest path)."""
    from fastdata.stores.lmdb.pages import tree

    values = _values(4000)
    ds, leaves = _read_from_memory(tmp_path, values, monkeypatch)
    check = tree.Tree._checked_level

    def interrupted(self, level, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(level) > 200:  # (a pass beside a batch)
            monkeypatch.setattr(tree.Tree, "_checked_level", check)
            raise KeyboardInterrupt
        return check(self, level, *args, **kwargs)

    monkeypatch.setattr(tree.Tree, "_checked_level", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ds.__getitems__(list(range(1000, 1064)))
    for first in range(0, 400, 64):  # (reads of part of the store)
        batch = list(range(first, first + 64))
        assert [d for d, _ in ds.__getitems__(batch)] == [values[i] for i in batch]
    assert leaves.all_sound
