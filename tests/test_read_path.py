"""The raw read path: one record or a batch, every guard on it, the same bytes a bare LMDB read
gives, whichever path (single, batched, cold, subset, worker) a read takes."""

from __future__ import annotations

import mmap
import os
import pickle
from pathlib import Path

import lmdb
import numpy as np
import pytest

from fastdata import LMDBImageDataset, convert
from fastdata.stores.lmdb import address as address_module
from fastdata.stores.lmdb.layout import record_key

from .conftest import jpeg_bytes, write


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


def test_a_store_read_from_the_disk_asks_for_each_batch_at_once(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a batch that came from the disk, the next announces every value before copying
    any (one request each, all in flight together), and still returns the same bytes."""
    want = bare_values(store)
    ds = LMDBImageDataset(store, output="bytes")
    ds[0]
    lease = ds.reader._env()  # type: ignore[attr-defined]
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    lease._cold = 1
    batch = list(range(0, len(want), 3))
    assert [d for d, _ in ds.__getitems__(batch)] == [want[i] for i in batch]
    assert sorted(length for _, length in asked) == sorted(len(want[i]) for i in batch)
    assert not lease._cold  # served from memory: the next batch asks for nothing
    asked.clear()
    assert ds[7][0] == want[7]
    ds.__getitems__(batch)
    assert asked == []


def test_a_source_file_is_read_whole_and_never_past_the_limit(tmp_path: Path) -> None:
    """A conversion reads each file with one read of the size fstat gives (plus a byte): the
    bytes are the file's, a file at the limit is read, one byte over is refused, an empty file
    is empty, and a short read (as some file systems give) is continued to the end."""
    from fastdata.sources import folder

    data = bytes(range(256)) * 1000
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert folder.read_file(str(path), len(data)) == data
    assert folder.read_file(str(path), len(data) - 1) == (
        f"too large ({len(data)} bytes; the limit is {len(data) - 1}: --max-file-size)"
    )
    (tmp_path / "empty").write_bytes(b"")
    assert folder.read_file(str(tmp_path / "empty"), 10) == b""
    fd = os.open(path, os.O_RDONLY)
    try:
        first = os.read(fd, 1000)  # as if the file system stopped early
        assert folder._read_rest(fd, first, len(data)) == data
        os.lseek(fd, 1000, os.SEEK_SET)
        grown = folder._read_rest(fd, first, 5000)  # never more than the limit + 1
        assert grown == data[:5001]
    finally:
        os.close(fd)
