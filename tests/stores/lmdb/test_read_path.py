"""The raw read path: one record or a batch, every guard on it, the same bytes a bare LMDB read
gives, whichever path (single, batched, cold, subset, worker) a read takes."""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from fastdata import LMDBImageDataset, convert
from fastdata.stores.lmdb import address as address_module
from fastdata.stores.lmdb.layout import record_key

from ...conftest import evicted, jpeg_bytes, write


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for i in range(40):  # sizes from one page to several (values in and out of leaf pages)
        side = 16 + 12 * (i % 10)
        write(root / f"c{i % 3}" / f"{i:03d}.jpg", jpeg_bytes(side, side, seed=i))
    dst = tmp_path / "store.lmdb"
    convert(root, dst)
    return dst


def bare_values(store: Path) -> list[bytes]:
    env = lmdb.open(str(store), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            out = []
            i = 0
            while (value := txn.get(record_key(i))) is not None:
                out.append(bytes(value))
                i += 1
            return out
    finally:
        env.close()


def test_address_is_where_the_bytes_are(store: Path) -> None:
    """The address the value check uses is the one numpy finds, for LMDB's values and for
    memoryviews over other buffers (slices, bytearrays, maps)."""
    env = lmdb.open(str(store), readonly=True, lock=False)
    try:
        with env.begin(buffers=True) as txn:
            views = [txn.get(record_key(i)) for i in range(10)]
            mapped = mmap.mmap(-1, 3 * mmap.PAGESIZE)
            views += [memoryview(b"abcdef")[2:], memoryview(bytearray(500))[7:], memoryview(mapped)]
            for view in views:
                assert view is not None
                want = np.frombuffer(view, dtype=np.uint8).ctypes.data
                assert address_module.address(view) == want
    finally:
        env.close()
    assert address_module.fast  # CPython: the field was found (else every read pays numpy)


def test_single_and_batched_reads_give_the_stored_bytes(store: Path) -> None:
    want = bare_values(store)
    ds = LMDBImageDataset(store, output="bytes")
    labels = ds.targets
    n = len(ds)
    assert n == len(want)
    for i in range(n):
        assert ds[i] == (want[i], int(labels[i]))
        assert ds[i - n] == (want[i], int(labels[i]))  # negative indices
    order = [*np.random.default_rng(0).permutation(n), 0, 0, -1]  # numpy ints, repeats
    got = ds.__getitems__(order)
    assert got == [(want[int(i)], int(labels[int(i)])) for i in order]
    assert all(type(label) is int for _, label in got)
    with pytest.raises(IndexError, match=f"index {n} out of range for {n} records"):
        ds[n]
    with pytest.raises(IndexError, match=f"index {-n - 1} out of range"):
        ds.__getitems__([0, -n - 1])


def test_reads_through_a_subset_and_in_a_worker_are_the_same(store: Path) -> None:
    want = bare_values(store)
    ds = LMDBImageDataset(store, output="bytes")
    part = ds.subset(indices=[5, 3, 30])
    assert [part[i][0] for i in range(3)] == [want[5], want[3], want[30]]
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    assert [clone[i][0] for i in range(len(clone))] == want


def _own_pages(lease: object, keys: list[bytes]) -> set[tuple[int, int]]:
    """The byte ranges in the file of the values of ``keys`` that LMDB keeps on pages of their
    own (such a value begins just past a page's header; a value in a leaf page never does)."""
    from fastdata.stores.lmdb.pages.format import PAGEHDRSZ as PAGE_HEADER

    lo = lease.entry.span[0]  # type: ignore[attr-defined]
    with lease.env.begin(buffers=True) as txn:  # type: ignore[attr-defined]
        views = [txn.get(k) for k in keys]
        places = {(address_module.address(v) - lo, len(v)) for v in views if v is not None}
    return {(at, n) for at, n in places if at % mmap.PAGESIZE == PAGE_HEADER}


@pytest.mark.parametrize("check", [False, True])
def test_a_store_read_from_the_disk_asks_for_each_value_before_looking_any_up(
    store: Path, monkeypatch: pytest.MonkeyPatch, check: bool
) -> None:
    """After a batch that came from the disk, the next asks for the pages of every value that
    lies on pages of its own, each in one request of exactly its bytes, all before LMDB looks up
    any of them (LMDB's lookup would fault them in one page at a time, one read from the disk
    each), and returns the same bytes; a batch from memory asks for nothing. A checked read
    (which reads each record's header too) asks alike."""
    want = bare_values(store)
    ds = LMDBImageDataset(store, output="bytes", check=check)
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    batch = list(range(0, len(want), 3))
    own = _own_pages(lease, [record_key(i) for i in batch])
    assert 0 < len(own) < len(batch)  # (values on pages of their own and in leaf pages)
    events: list[tuple[str, int, int]] = []
    real_advise, real_env = os.posix_fadvise, lease.env

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        events.append(("ask", offset, length))
        real_advise(fd, offset, length, advice)

    class Txn:
        def __init__(self, txn: object) -> None:
            self.txn = txn

        def get(self, key: bytes) -> object:
            head = key.startswith(b"#")  # (a header, which a checked read reads too)
            events.append(("head" if head else "get", int(key.lstrip(b"#")), 0))
            return self.txn.get(key)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.txn, name)

    class Env:
        def begin(self, **kw: object) -> Txn:
            return Txn(real_env.begin(**kw))

        def __getattr__(self, name: str) -> object:
            return getattr(real_env, name)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(lease, "env", Env())
    lease.cold_reads.announce_left = 1
    assert [d for d, _ in ds.__getitems__(batch)] == [want[i] for i in batch]
    first_get = next(n for n, e in enumerate(events) if e[0] == "get")
    assert own <= {(at, n) for _, at, n in events[:first_get]}
    assert [e[1] for e in events if e[0] == "get"] == batch
    assert not lease.cold_reads.announce_left  # served from memory: the next batch asks for nothing
    events.clear()
    assert ds[7][0] == want[7]
    ds.__getitems__(batch)
    assert all(e[0] in ("get", "head") for e in events)


def test_runs_of_announced_batches_double_while_the_store_stays_on_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where whether pages are in memory cannot be known (no mincore), only a batch's time
    tells: each batch timed unannounced that came from the disk starts a run twice as long as
    the last (up to a bound), so a store larger than memory pays for few unannounced batches;
    one from memory brings the run back to its first length."""
    from fastdata.stores.lmdb import readahead

    from ...test_hostile_input import write_store_with

    monkeypatch.setattr(readahead, "resident", lambda address: None)
    reads = itertools.count(0, 10**6)  # (each batch read a million pages from the disk)
    monkeypatch.setattr(readahead, "major_faults", lambda: next(reads))

    write_store_with(tmp_path / "s.lmdb", [bytes([i]) * 300 for i in range(200)])
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    batch = [1, 2, 3]
    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", -(10**12))  # every batch: from disk
    runs = []
    for _ in range(6):
        ds.__getitems__(batch)  # timed
        runs.append(lease.cold_reads.announce_left)
        for _ in range(lease.cold_reads.announce_left):
            assert ds.__getitems__(batch)[1][0] == bytes([2]) * 300  # announced
        assert lease.cold_reads.announce_left == 0
    first, most = readahead.COLD_BATCHES, readahead.COLD_BATCHES_MOST
    assert runs == [min(first << k, most) for k in range(6)]
    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", 10**12)  # from memory
    ds.__getitems__(batch)
    assert lease.cold_reads.announce_left == 0 and lease.cold_reads.announce_run == first


def _small_records_in_memory(tmp_path: Path) -> tuple[LMDBImageDataset, Any, list[int]]:
    """A store of 3,000 records of 900 bytes, a batch of it read (in memory, not announced
    after it): the dataset, its reader's share of the environment and that batch."""
    from ...test_hostile_input import write_store_with

    write_store_with(tmp_path / "s.lmdb", [bytes([i % 256]) * 900 for i in range(3000)])
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    batch = list(range(0, 3000, 47))
    ds.__getitems__(batch)
    lease = ds.reader._env()  # type: ignore[attr-defined]
    assert lease.cold_reads.announce_left == 0
    return ds, lease, batch


def test_a_slow_batch_that_read_nothing_from_the_disk_is_not_taken_for_a_cold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small records in memory, a batch slower than memory (its thread waited for a core) but
    with no page read from the disk (no major fault): nothing is announced after it."""
    from fastdata.stores.lmdb import readahead

    if readahead.major_faults() is None:
        pytest.skip("this system does not count a thread's major faults")
    ds, lease, batch = _small_records_in_memory(tmp_path)
    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", -(10**12))  # (every batch: slow)
    for _ in range(3):
        ds.__getitems__(batch)
        assert lease.cold_reads.announce_left == 0


def test_a_store_in_memory_taken_for_one_on_the_disk_costs_one_announced_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small records in memory, a batch timed as from the disk (slow, its thread counted
    major faults: the kernel had let a few pages go): the next batch is announced, finds its
    leaf pages in memory, and announcing stops there."""
    from fastdata.stores.lmdb import readahead

    ds, lease, batch = _small_records_in_memory(tmp_path)
    reads = itertools.count(0, 10**6)
    monkeypatch.setattr(readahead, "major_faults", lambda: next(reads))
    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", -(10**12))
    ds.__getitems__(batch)  # timed: taken for a batch from the disk
    assert lease.cold_reads.announce_left == readahead.COLD_BATCHES
    monkeypatch.setattr(readahead, "COLD_NS_PER_PAGE", 10**12)
    assert ds.__getitems__(batch)[1][0] == bytes([47]) * 900  # announced: all in memory
    assert (
        lease.cold_reads.announce_left == 0
        and lease.cold_reads.announce_run == readahead.COLD_BATCHES
    )


@pytest.mark.parametrize(("every", "announced"), [(50, False), (4, True)])
def test_a_store_in_memory_but_a_few_pages_is_not_announced_batch_after_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int, announced: bool
) -> None:
    """Small records in memory but for one page in ``every`` (the kernel let them go): an
    announced batch finds nearly all its pages in memory, and the next is not announced (each
    announced batch of a million small records cost about 10 ms); with a quarter of them gone,
    the store is taken for one on the disk and the next batch is announced too."""
    from fastdata.stores.lmdb import readahead

    from ...test_hostile_input import write_store_with

    write_store_with(tmp_path / "s.lmdb", [bytes([i % 256]) * 900 for i in range(3000)])
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    gone = lambda address: address // mmap.PAGESIZE % every != 0  # noqa: E731
    monkeypatch.setattr(readahead, "resident", gone)
    for start in range(3):
        lease.cold_reads.announce_left = 1  # (after a batch timed as from the disk)
        batch = list(range(start, 3000, 23))
        assert [d for d, _ in ds.__getitems__(batch)] == [bytes([i % 256]) * 900 for i in batch]
        assert bool(lease.cold_reads.announce_left) is announced


def test_large_values_are_announced_while_they_come_from_the_disk_and_no_longer(
    tmp_path: Path,
) -> None:
    """Values on pages of their own: a store opened cold announces every batch (its first
    one too) as long as the values asked for are not in memory (a value whose first page alone
    is, is not), and stops at the first batch whose values are, with no batch timed
    unannounced in between."""
    from fastdata.stores.lmdb.pages import value_places

    from ...test_hostile_input import write_store_with

    rng = np.random.default_rng(5)
    images = [rng.bytes(30_000) for _ in range(64)]
    write_store_with(tmp_path / "s.lmdb", images)
    data_file = tmp_path / "s.lmdb" / "data.mdb"
    fd = os.open(data_file, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    places, _ = value_places(fd, [record_key(i) for i in (0, 9, 17)])
    for at, _n in places:  # (the first page of each in memory, the rest not)
        os.pread(fd, 100, at)
    os.close(fd)
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    lease = ds.reader._env()  # type: ignore[attr-defined]
    for part in ([0, 9, 17], [30, 2, 44], [5, 63]):
        assert lease.cold_reads.announce_left  # (announced)
        got = ds.__getitems__(part)
        assert [d for d, _ in got] == [images[i] for i in part]
        if not lease.cold_reads.announce_left:
            pytest.skip("this file system kept the store's pages in memory")
    assert lease.cold_reads.announce_left == 1
    ds.__getitems__([0, 30])  # in memory now
    assert lease.cold_reads.announce_left == 0
    assert [ds[i][0] for i in (1, 63)] == [images[1], images[63]]


def test_the_places_found_down_the_tree_are_where_lmdb_finds_the_values(tmp_path: Path) -> None:
    """value_places finds, for any keys (missing ones, values in leaf pages, a tree of several
    levels), exactly the byte ranges of the values LMDB keeps on pages of their own."""
    from fastdata.stores.lmdb.pages import value_places

    from ...test_hostile_input import write_store_with

    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.choice([300, 1500, 5000, 20000], 3000)]
    write_store_with(tmp_path / "s.lmdb", [rng.bytes(n) for n in sizes])
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    keys = [record_key(i) for i in rng.permutation(3100)]  # (100 not there)
    want = _own_pages(lease, keys)
    assert len(want) > 1000
    fd = os.open(tmp_path / "s.lmdb" / "data.mdb", os.O_RDONLY)
    try:
        assert sorted(value_places(fd, keys)[0]) == sorted(want)
        assert value_places(fd, [*keys[:1], b"#" + keys[0], b"zzz", b""]) == value_places(
            fd, keys[:1]
        )
        asked, none_missing = value_places(fd, keys, lambda offset: True)[1]  # type: ignore[misc]
        assert asked > len(want) and none_missing == 0
        count, missing = value_places(fd, keys, lambda offset: offset < 1 << 20)[1]  # type: ignore[misc]
        assert count == asked and 0 < missing < count
        assert value_places(fd, keys, lambda offset: None if offset > 1 << 20 else True)[1] is None
    finally:
        os.close(fd)


def test_finding_places_in_a_damaged_file_gives_only_places_inside_it(tmp_path: Path) -> None:
    """The descent is advice read from an untrusted file: on pages with any bytes changed, it
    raises nothing, ends, and gives only ranges inside the file."""
    from fastdata.stores.lmdb.pages import value_places

    from ...test_hostile_input import write_store_with

    rng = np.random.default_rng(4)
    write_store_with(tmp_path / "s.lmdb", [rng.bytes(int(n)) for n in rng.integers(100, 9000, 600)])
    clean = (tmp_path / "s.lmdb" / "data.mdb").read_bytes()
    keys = [record_key(i) for i in range(600)] + [b"#" + record_key(i) for i in range(0, 600, 7)]
    damaged = tmp_path / "damaged.mdb"
    for trial in range(300):
        data = bytearray(clean)
        for _ in range(int(rng.integers(1, 40))):
            at = int(rng.integers(0, len(data)))
            data[at : at + 8] = rng.bytes(8) if trial % 3 else b"\xff" * 8
        if trial % 5 == 0:
            del data[int(rng.integers(0, len(data))) :]
        damaged.write_bytes(bytes(data))
        fd = os.open(damaged, os.O_RDONLY)
        try:
            for at, n in value_places(fd, keys)[0]:
                assert at >= 0 and at + n <= len(data)
        finally:
            os.close(fd)


def test_a_source_file_is_read_whole_and_never_past_the_limit(tmp_path: Path) -> None:
    """A conversion reads each file with one read of the size fstat gives (plus a byte): the
    bytes are the file's, a file at the limit is read, one byte over is refused, an empty file
    is empty, and a short read (as some file systems give) is continued to the end."""
    from fastdata.sources import reading

    data = bytes(range(256)) * 1000
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert reading.read_file(str(path), len(data)) == data
    assert reading.read_file(str(path), len(data) - 1) == (
        f"too large ({len(data)} bytes; the limit is {len(data) - 1}: --max-file-size)"
    )
    (tmp_path / "empty").write_bytes(b"")
    assert reading.read_file(str(tmp_path / "empty"), 10) == b""
    fd = os.open(path, os.O_RDONLY)
    try:
        first = os.read(fd, 1000)  # as if the file system stopped early
        assert reading._read_rest(fd, first, len(data)) == data
        os.lseek(fd, 1000, os.SEEK_SET)
        grown = reading._read_rest(fd, first, 5000)  # never more than the limit + 1
        assert grown == data[:5001]
    finally:
        os.close(fd)


def _asks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every request for pages from here on, as ``(offset, length)``."""
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    return asked


def _covered(place: tuple[int, int], asked: list[tuple[int, int]]) -> bool:
    """Whether the requests cover every byte of ``place``."""
    at, n = place
    reached = at
    for offset, length in sorted(asked):
        if offset <= reached < offset + length:
            reached = offset + length
    return reached >= at + n


def test_a_value_of_many_pages_from_the_disk_is_asked_for_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value larger than the kernel reads for one request (its read-ahead, 128 KiB by
    default: it drops the rest) is asked for in requests of at most that, which together cover
    every byte of it; then read as stored."""
    from fastdata.stores.lmdb.pages.advice import ASK_MOST

    from ...test_hostile_input import write_store_with

    rng = np.random.default_rng(6)
    images = [rng.bytes(900_000), rng.bytes(200), rng.bytes(300_000)]
    write_store_with(tmp_path / "s.lmdb", images)
    evicted(tmp_path / "s.lmdb" / "data.mdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    lease = ds.reader._env()  # type: ignore[attr-defined]
    places = _own_pages(lease, [record_key(0), record_key(2)])
    assert len(places) == 2
    asked = _asks(monkeypatch)
    assert [d for d, _ in ds.__getitems__([0, 2])] == [images[0], images[2]]
    assert all(_covered(place, asked) for place in places)
    assert asked and all(length <= ASK_MOST for _, length in asked)


def test_a_store_opened_from_the_disk_asks_for_its_labels_and_names_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The labels (4 or 8 bytes a record, read on opening) and the index of names (read by verify,
    append, copy) are values of many pages: each is asked for whole before LMDB reads it, not
    faulted in a page at a time, a read from the disk each."""
    from fastdata import open_store
    from fastdata.stores.lmdb.layout import LABELS_KEY, NAMES_KEY

    image = jpeg_bytes(8, 8)
    for i in range(1000):
        write(tmp_path / "images" / f"c{i % 2}" / f"{i:04d}.jpg", image)
    convert(tmp_path / "images", tmp_path / "s.lmdb")
    evicted(tmp_path / "s.lmdb" / "data.mdb")
    asked = _asks(monkeypatch)
    reader = open_store(tmp_path / "s.lmdb")
    lease = reader._env()  # type: ignore[attr-defined]
    (labels,) = _own_pages(lease, [LABELS_KEY])
    assert labels[1] >= 4 * 1000 and _covered(labels, asked)
    (names,) = _own_pages(lease, [NAMES_KEY])
    assert not _covered(names, asked)
    index = reader.names_index()  # type: ignore[attr-defined]
    assert _covered(names, asked)
    assert index is not None and index[999] == b"c1/0999.jpg"
    assert np.array_equal(reader.labels, np.repeat([0, 1], 500))


def test_the_read_ahead_of_a_check_fills_the_page_cache_with_or_without_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What reads a file ahead of a full check: every byte of it comes into memory, each
    chunk once, with sendfile to the null device (no copy) or, where that fails or what stands
    at the null device's path is not one, with reads."""
    from fastdata.stores.lmdb.pages.advice import AHEAD_CHUNK, resident
    from fastdata.stores.lmdb.pages.advice import Sink as _Sink

    path = tmp_path / "big.bin"
    size = 3 * AHEAD_CHUNK + 12345
    path.write_bytes(np.random.default_rng(7).bytes(size))

    def read_all() -> list[int]:
        evicted(path)
        fd = os.open(path, os.O_RDONLY)
        sink = _Sink()
        try:
            got, offset = [], 0
            while got[-1:] != [0]:
                got.append(sink.read(fd, offset))
                offset += got[-1]
            return got
        finally:
            sink.close()
            os.close(fd)

    def in_memory() -> bool | None:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            base = np.frombuffer(mapped, np.uint8).ctypes.data
            return all(resident(base + k) for k in range(0, size, mmap.PAGESIZE))

    want = [AHEAD_CHUNK] * 3 + [12345, 0]
    assert read_all() == want
    assert in_memory() in (True, None)  # (None: no mincore here)
    sent: list[int] = []

    def refused(out: int, fd: int, offset: int | None, count: int) -> int:
        sent.append(count)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", refused)
    assert read_all() == want
    assert in_memory() in (True, None)
    assert len(sent) <= 1  # (tried once, then reads)
    monkeypatch.undo()
    stand_in = tmp_path / "null"  # a plain file where the null device should be: not written
    stand_in.write_bytes(b"")
    monkeypatch.setattr(os, "devnull", str(stand_in))
    assert read_all() == want
    assert stand_in.stat().st_size == 0


def test_a_branchs_children_are_asked_for_as_about_the_pages_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check asks for a branch's children before reading them: a run of pages next to each
    other as one span, but pages a damaged branch spreads apart only each alone (not the
    gigabytes between them), and nothing at all stops the check where the kernel refuses."""
    from fastdata.stores.lmdb.pages import walk
    from fastdata.stores.lmdb.pages.advice import prefetch as _prefetch

    from ...test_damaged_stores import deep_tree

    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(20_000 * 4096)
    fd = os.open(sparse, os.O_RDONLY)
    try:
        asked = _asks(monkeypatch)
        _prefetch(fd, list(range(100, 300)), 4096)
        assert _covered((100 * 4096, 200 * 4096), asked)
        assert sum(n for _, n in asked) == 200 * 4096
        asked.clear()
        spread = list(range(0, 16 * 1000, 16))
        _prefetch(fd, spread + spread, 4096)  # (each twice, as a damaged branch may list them)
        assert all(_covered((page * 4096, 4096), asked) for page in spread)
        assert sum(n for _, n in asked) <= 2 * 1000 * 4096
    finally:
        os.close(fd)
    monkeypatch.undo()
    source = deep_tree(tmp_path / "deep")

    def refused(*args: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refused)
    assert walk(str(source)) == []


def test_nothing_but_the_null_device_is_sent_a_store_to_read_it_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the null device's path holds a FIFO (opening it to write would wait for a reader
    forever) or a terminal (it would be sent the store's bytes), the read-ahead reads instead,
    and opens nothing that would block."""
    import threading

    from fastdata.stores.lmdb.pages.advice import Sink as _Sink

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(os, "devnull", str(fifo))
    made: list[_Sink] = []
    thread = threading.Thread(target=lambda: made.append(_Sink()), daemon=True)
    thread.start()
    thread.join(10)
    try:
        assert not thread.is_alive(), "the read-ahead blocked opening a FIFO"
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # (lets a blocked open go on)
    assert made[0]._null == -1
    leader, follower = os.openpty()
    try:
        monkeypatch.setattr(os, "devnull", os.ttyname(follower))
        sink = _Sink()
        assert sink._null == -1
        data = tmp_path / "data.bin"
        data.write_bytes(b"x" * 10_000)
        fd = os.open(data, os.O_RDONLY)
        try:
            assert sink.read(fd, 0) == 10_000
        finally:
            os.close(fd)
            sink.close()
    finally:
        os.close(leader)
        os.close(follower)


def test_the_check_of_leaves_not_seen_yet_is_not_taken_for_a_read_from_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose leaves are checked on its way (the first touch of a leaf, at a million
    records most batches' leaves) takes longer than its lookups: only the lookups' time says
    whether it came from the disk, so a store in memory is not announced batch after batch."""
    import time

    from fastdata.stores.lmdb import lease as lease_module

    from ...test_hostile_input import write_store_with

    write_store_with(tmp_path / "s.lmdb", [bytes([i]) * 300 for i in range(200)])
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    lease.cold_reads.announce_left = 0
    clock = [time.perf_counter_ns()]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: clock[0])
    checked = []
    original = lease_module.Lease.refuse_damaged

    def slow_check(self: object, keys: object, where: object) -> None:
        checked.append(keys)
        clock[0] += 10**9  # a second of checking leaves (a million records' first touches)
        original(self, keys, where)  # type: ignore[arg-type]

    monkeypatch.setattr(lease_module.Lease, "refuse_damaged", slow_check)
    monkeypatch.setattr(lease.entry.leaves, "known_sound", lambda keys: False)
    assert ds.__getitems__([5, 90, 150])[1] == (bytes([90]) * 300, 0)
    assert checked  # the leaves were checked on the batch's way
    assert lease.cold_reads.announce_left == 0  # and that was not a read from the disk


def test_a_store_in_memory_checks_new_leaves_without_asking_the_kernel_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the cold-read policy knows the store is in memory, the leaves a batch meets first are
    read and checked without asking for them (POSIX_FADV_WILLNEED walks the page cache for each
    page: 3x the check's cost at a million records); a store on the disk still asks."""
    from ...conftest import tiny_store

    store = tiny_store(tmp_path, 3000)
    ds = LMDBImageDataset(store, output="bytes")
    ds.__getitems__(list(range(0, 64)))  # the first batch: announced, found in memory
    lease = ds.reader._env()  # type: ignore[attr-defined]
    assert lease.cold_reads.announce_left == 0
    unread = len(lease.entry.leaves._unread)  # (leaves not checked yet)
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, at, n, advice: asked.append((at, n)) or real(fd, at, n, advice),
    )
    ds.__getitems__(list(range(1500, 3000, 25)))
    assert len(lease.entry.leaves._unread) < unread  # new leaves were checked
    assert asked == []  # and none was asked for
    lease.cold_reads.announce_left = 1  # (as on the disk)
    ds.__getitems__(list(range(1501, 3000, 25)))
    assert asked  # the values and the leaves are asked for
