"""Content that fastdata did not write is not damage: ``verify`` names it as what it is (another
tool's content), passes a store whose records are all sound, and advises no repair; opening,
reading and appending go on around it, and keep it."""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import pytest

from fastdata import LMDBImageDataset, convert, open_store
from fastdata.stores.lmdb import file as lmdb_file

from .conftest import jpeg_bytes, tiny_store, write
from .procs import cli


def _add_images(src: Path, first: int, n: int) -> None:
    for i in range(first, first + n):
        write(src / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))


def _no_repair_advised(out: str) -> None:
    assert "damaged" not in out and "--overwrite" not in out and "--skip-damaged" not in out, out


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_named_database_of_another_tool_is_named_not_damage(tmp_path: Path, workers: str) -> None:
    store = tiny_store(tmp_path, 200)
    env = lmdb.open(str(store), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"their-notes")) as txn:
        txn.put(b"k", b"kept")
    env.close()
    result = cli("verify", str(store), "-q", "--workers", workers)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "content fastdata did not write" in out and "a named database 'their-notes'" in out
    assert "200 records OK" in out
    _no_repair_advised(out)
    ds = LMDBImageDataset(store, output="bytes")
    assert [len(ds[i][0]) > 0 for i in range(200)] == [True] * 200
    ds.close()
    _add_images(tmp_path / "src", 200, 5)  # an append finishes, and keeps it
    assert convert(tmp_path / "src", store, append=True, workers=1).count == 205
    env = lmdb.open(str(store), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"their-notes", create=False)) as txn:
        assert txn.get(b"k") == b"kept"
    env.close()


def _zero_the_count_of_keys(store: Path) -> None:
    """LMDB's count of the main database's keys, in the current meta page, set to 0: plain
    ``lmdb`` reads every record still."""
    data_file = store / "data.mdb"
    head = lmdb_file.check_file(str(data_file))
    raw = bytearray(data_file.read_bytes())
    for meta in (0, 1):
        base = meta * head.psize
        if struct.unpack_from("<Q", raw, base + 144)[0] == head.txnid:  # (mm_txnid)
            struct.pack_into("<Q", raw, base + 120, 0)  # (the main database's md_entries)
    data_file.write_bytes(bytes(raw))
    env = lmdb.open(str(store), readonly=True, lock=False)
    assert env.stat()["entries"] == 0
    with env.begin() as txn:
        assert txn.get(b"0000000003")[:2] == b"\xff\xd8"
    env.close()


def test_a_zeroed_count_of_keys_is_named_not_an_empty_store(tmp_path: Path) -> None:
    """It was "an empty store: run fastdata convert" for every command."""
    store = tiny_store(tmp_path, 20)
    expected = [bytes(d) for d, _ in open_store(store).read_samples(range(20))]
    _zero_the_count_of_keys(store)
    info = cli("info", str(store))
    assert info.returncode == 0 and "images:     20" in info.stdout, info.stderr
    result = cli("verify", str(store), "-q")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "LMDB's header counts 0 keys in the store, and it holds 46" in out
    assert "20 records OK" in out and "empty store" not in out
    _no_repair_advised(out)
    ds = LMDBImageDataset(store, output="bytes")
    assert [ds[i][0] for i in range(20)] == expected
    ds.close()
    # a conversion into it without --overwrite is refused: it holds a store
    again = cli("convert", str(tmp_path / "src"), str(store), "-q")
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr
    assert [bytes(d) for d, _ in open_store(store).read_samples(range(20))] == expected
    _add_images(tmp_path / "src", 20, 5)
    assert convert(tmp_path / "src", store, append=True, workers=1).count == 25
    assert cli("verify", str(store), "-q").returncode == 0
