"""Content that fastdata did not write is not damage: ``verify`` names it as what it is (another
tool's content), passes a store whose records are all sound, and advises no repair; opening,
reading and appending go on around it, and keep it."""

from __future__ import annotations

import shlex
import struct
from pathlib import Path

import lmdb
import pytest

from fastdata import LMDBImageDataset, convert, open_store
from fastdata.stores.lmdb.pages import check_file

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
    assert "'their-notes'" not in out.replace("a named database 'their-notes'", ""), out  # once
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
    head = check_file(str(data_file))
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


def _put_key(store: Path, key: bytes) -> None:
    """Another tool adds ``key`` to the store, with plain ``lmdb``."""
    env = lmdb.open(str(store))
    with env.begin(write=True) as txn:
        txn.put(key, b"theirs")
    env.close()


def _kept(store: Path, key: bytes) -> bool:
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        found = txn.get(key) == b"theirs"
    env.close()
    return found


def test_another_tools_key_is_named_and_an_append_keeps_it(tmp_path: Path) -> None:
    """verify said "20 records OK" and named nothing."""
    store = tiny_store(tmp_path, 20)
    _put_key(store, b"zzz_extra")
    result = cli("verify", str(store), "-q")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert (
        "content fastdata did not write" in out and "'zzz_extra'" in out and "20 records OK" in out
    )
    _no_repair_advised(out)
    _add_images(tmp_path / "src", 20, 3)
    append = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q")
    assert append.returncode == 0, append.stderr
    assert _kept(store, b"zzz_extra")
    again = cli("verify", str(store), "-q")
    assert (
        again.returncode == 0 and "'zzz_extra'" in again.stdout and "23 records OK" in again.stdout
    )


@pytest.mark.parametrize("key", [b"0000000099", b"#0000000020"])
def test_another_tools_key_where_an_append_writes_is_named_and_the_append_refused(
    tmp_path: Path, key: bytes
) -> None:
    """verify said "20 records OK" and named nothing; every append then ended in "breaks its
    invariants ... This is a fault in fastdata: please report it"."""
    store = tiny_store(tmp_path, 20)
    _put_key(store, key)
    expected = [bytes(d) for d, _ in open_store(store).read_samples(range(20))]
    result = cli("verify", str(store), "-q")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "content fastdata did not write" in out and repr(key.decode()) in out, out
    assert "an append refuses it" in out and "20 records OK" in out
    _no_repair_advised(out)
    _add_images(tmp_path / "src", 20, 3)
    append = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q")
    assert append.returncode == 1, append.stderr
    message = append.stderr.strip()
    assert message.count("\n") == 0 and repr(key.decode()) in message, message
    assert "fault in fastdata" not in message and "--overwrite" not in message, message
    assert [bytes(d) for d, _ in open_store(store).read_samples(range(20))] == expected
    assert _kept(store, key)
    # the copy it advises, run as printed, leaves the key out; the append goes to the copy
    command = shlex.split(message.split("`")[1])
    assert command[:2] == ["fastdata", "copy"]
    assert cli(*command[1:], "-q").returncode == 0
    copy = Path(command[3])
    assert convert(tmp_path / "src", copy, append=True, workers=1).count == 23
    assert cli("verify", str(copy), "-q").returncode == 0
