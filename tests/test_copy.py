"""``fastdata copy``: LMDB to MongoDB and back, LMDB to LMDB; exact, checked, resumable."""

from __future__ import annotations

import signal
from pathlib import Path

import lmdb
import pytest

from fastdata import convert, copy_store, export_store, open_store, verify_store
from fastdata.errors import IncompleteStoreError, RecordError, StoreExistsError, UsageError
from fastdata.stores.mongo.layout import META_COLLECTION

from .conftest import jpeg_bytes, snapshot, write
from .mongo_server import database
from .procs import KILLED_COPY, cli, run_script


@pytest.fixture
def source(mixed_folder: Path, tmp_path: Path) -> Path:
    """A store with repaired JPEGs, several formats, odd names and skipped files."""
    dst = tmp_path / "src.lmdb"
    convert(mixed_folder, dst)
    return dst


def _contents(target: str | Path, collection: str | None = None) -> dict[str, object]:
    """Everything a user can see of a store, less where it is and its own id."""
    reader = open_store(target, collection=collection)
    try:
        meta = reader.meta.to_dict()
        for key in ("id", "copied_from", "updated"):
            meta.pop(key)
        return {
            "meta": meta,
            "labels": reader.labels.tolist(),
            "records": [(r.header, r.data) for r in reader.iter_records()],
            "skipped": reader.skipped_files(),
        }
    finally:
        reader.close()


def _exported(target: str | Path, out: Path, collection: str | None = None) -> dict[str, bytes]:
    reader = open_store(target, collection=collection)
    export_store(reader, out)
    reader.close()
    return snapshot(out)


def test_lmdb_to_mongo_to_lmdb_carries_everything(
    source: Path, mongo_uri: str, tmp_path: Path
) -> None:
    original = _contents(source)
    assert original["skipped"] and original["meta"]["repairs"]  # the fixture has both
    report = copy_store(source, mongo_uri, collection="imgs")
    assert report.count == len(original["records"]) and report.copied == report.count
    assert _contents(mongo_uri, "imgs") == original
    back = tmp_path / "back.lmdb"
    copy_store(mongo_uri, back, source_collection="imgs")
    assert _contents(back) == original
    src_meta, copy_meta = open_store(source).meta, open_store(back).meta
    assert copy_meta.id != src_meta.id  # a store of its own
    # verify and export agree on all three
    for target, coll in ((source, None), (mongo_uri, "imgs"), (back, None)):
        report = verify_store(open_store(target, collection=coll))
        assert report.ok and report.checked == len(original["records"])
    want = _exported(source, tmp_path / "e0")
    assert _exported(mongo_uri, tmp_path / "e1", "imgs") == want
    assert _exported(back, tmp_path / "e2") == want


def test_an_lmdb_copy_is_compacted(good_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "s.lmdb"
    convert(good_folder, src)
    # grow the file with pages that are free afterwards
    env = lmdb.open(str(src), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i in range(200):
            txn.put(b"#junk%04d" % i, b"x" * 20000)
    with env.begin(write=True) as txn:
        for i in range(200):
            txn.delete(b"#junk%04d" % i)
    env.close()
    dst = tmp_path / "d.lmdb"
    copy_store(src, dst)
    assert (dst / "data.mdb").stat().st_size < (src / "data.mdb").stat().st_size / 4
    assert _contents(dst) == _contents(src)


def test_copy_follows_the_writer_rules(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "d.lmdb"
    copy_store(source, dst)
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        copy_store(source, dst)
    report = copy_store(source, dst, resume=True)  # complete already: nothing to do
    assert report.copied == 0
    with pytest.raises(UsageError, match="the same store"):
        copy_store(source, source, overwrite=True)
    old_id = open_store(dst).meta.id
    copy_store(source, dst, overwrite=True)
    assert open_store(dst).meta.id != old_id


def test_a_damaged_record_is_not_copied(good_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "s.lmdb"
    convert(good_folder, src)
    env = lmdb.open(str(src))
    with env.begin(write=True) as txn:
        data = bytearray(txn.get(b"0000000007"))
        data[100] ^= 0xFF
        txn.put(b"0000000007", bytes(data))
    env.close()
    with pytest.raises(RecordError, match=r"record 7 .*fails its checksum"):
        copy_store(src, tmp_path / "d.lmdb")
    result = cli("copy", str(src), str(tmp_path / "e.lmdb"), "-q")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "record 7" in result.stderr


@pytest.mark.parametrize("backend", ["lmdb", "mongo"])
def test_a_killed_copy_resumes_exactly(backend: str, tmp_path: Path, mongo_uri: str) -> None:
    folder = tmp_path / "f"
    for i in range(40):
        write(folder / f"c{i % 3}" / f"{i:03d}.jpg", jpeg_bytes(seed=i))
    write(folder / "c0" / "empty.jpg", b"")
    src = tmp_path / "s.lmdb"
    convert(folder, src)
    if backend == "lmdb":
        dst, args = str(tmp_path / "d.lmdb"), []
    else:
        dst, args = mongo_uri, ["-c", "imgs"]
    result = run_script(KILLED_COPY, src, dst, 2, *args)
    assert result.returncode == -signal.SIGKILL, result.stderr
    # a reader is told it is incomplete, and how to finish
    with pytest.raises(IncompleteStoreError, match="--resume"):
        open_store(dst, collection="imgs" if backend == "mongo" else None)
    if backend == "mongo":  # the killed writer's claim: expire it rather than wait for it
        database(mongo_uri)[META_COLLECTION].update_one(
            {"_id": "imgs:writer"}, {"$set": {"expires": 0}}
        )
    done = run_script(KILLED_COPY, src, dst, 10**6, *args, "--resume")
    assert done.returncode == 0, done.stderr
    assert _contents(dst, "imgs" if backend == "mongo" else None) == _contents(src)


def test_copy_from_the_command_line(source: Path, mongo_uri: str, tmp_path: Path) -> None:
    result = cli("copy", str(source), mongo_uri, "-c", "imgs", "-q")
    assert result.returncode == 0, result.stderr
    assert "every checksum checked" in result.stdout
    back = tmp_path / "back.lmdb"
    result = cli("copy", mongo_uri, str(back), "--source-collection", "imgs", "-q")
    assert result.returncode == 0, result.stderr
    assert _contents(back) == _contents(source)
    again = cli("copy", str(source), str(back), "-q")
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_stores_keep_an_index_of_their_names(source: Path, tmp_path: Path) -> None:
    """``__names__`` lists every record's name in order (what an append compares a folder with),
    in a converted store (with skipped files) and in a copy."""
    from fastdata.records import name_bytes

    copy = tmp_path / "copy.lmdb"
    copy_store(source, copy)
    for store in (source, copy):
        reader = open_store(store)
        want = [name_bytes(h.name) for h in reader.iter_headers()]
        assert list(reader.record_names()) == want
        reader.close()
        env = lmdb.open(str(store), readonly=True, lock=False)
        with env.begin() as txn:
            assert txn.get(b"__names__").split(b"\0") == want
        env.close()


def test_a_resumed_copy_names_its_records_by_their_headers_not_a_damaged_index(
    tmp_path: Path,
) -> None:
    """A resumed copy took the names of the records copied before from the source's index of
    names: with two of them swapped there, the copy finished (exit 0) with an index that
    disagrees with its records' headers, a store verify calls damaged."""
    from fastdata.records import name_bytes

    for i in range(24):
        write(tmp_path / "f" / "c" / f"{i:02d}.jpg", jpeg_bytes(16, 16, seed=i))
    src = tmp_path / "s.lmdb"
    convert(tmp_path / "f", src)
    dst = str(tmp_path / "d.lmdb")
    killed = run_script(KILLED_COPY, src, dst, 2)  # (16 records copied)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with lmdb.open(str(src), map_size=1 << 30) as env, env.begin(write=True) as txn:
        names = bytes(txn.get(b"__names__")).split(b"\0")
        names[1], names[2] = names[2], names[1]  # (records copied before the kill)
        txn.put(b"__names__", b"\0".join(names))
    done = cli("copy", str(src), dst, "--resume", "-q")
    assert done.returncode == 0, done.stderr
    checked = cli("verify", dst)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    reader = open_store(dst)
    want = [name_bytes(h.name) for h in reader.iter_headers()]
    assert list(reader.record_names()) == want
    assert sorted(want) == sorted(name_bytes(f"c/{i:02d}.jpg") for i in range(24))
    reader.close()
