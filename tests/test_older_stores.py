"""Stores of the first format (see ``tests/earlier_formats.py``): info, verify, export, copy and
append work on them, readers opened before an append read on, and their skipped list is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdata import convert, copy_store, export_store, open_store, verify_store

from .conftest import jpeg_bytes, snapshot, write
from .earlier_formats import SKIPPED, write_first_lmdb, write_first_mongo
from .mongo_server import database
from .procs import cli

BACKENDS = ["lmdb", "mongo"]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for cls in ("a", "b"):
        for i in range(3):
            write(root / cls / f"{i}.jpg", jpeg_bytes(seed=ord(cls) * 10 + i))
    write(root / "b" / "broken.jpg", b"not an image")
    return root


def _old_store(backend: str, folder: Path, tmp_path: Path, mongo_uri: str):  # type: ignore[no-untyped-def]
    if backend == "lmdb":
        store = tmp_path / "old.lmdb"
        write_first_lmdb(folder, store)
        return str(store), {}, []
    write_first_mongo(folder, database(mongo_uri), "old")
    return mongo_uri, {"collection": "old"}, ["-c", "old"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_command_reads_a_first_format_store(
    backend: str, folder: Path, tmp_path: Path, mongo_uri: str
) -> None:
    dst, kw, words = _old_store(backend, folder, tmp_path, mongo_uri)
    reader = open_store(dst, **kw)
    assert len(reader) == 6 and verify_store(reader).ok
    assert [(s.name, s.reason) for s in reader.skipped_files()] == [
        (s["name"], s["reason"]) for s in SKIPPED
    ]
    info = cli("info", dst, *words, "--skipped")
    assert info.returncode == 0, info.stderr
    assert "b/broken.jpg: not a recognised image format" in info.stdout
    assert cli("verify", dst, *words).returncode == 0
    out = tmp_path / "out"
    export_store(reader, out)
    assert snapshot(out) == {k: v for k, v in snapshot(folder).items() if k != "b/broken.jpg"}
    copy = tmp_path / "copy.lmdb"
    copy_store(dst, copy, source_collection=kw.get("collection"))
    copied = open_store(copy)
    assert verify_store(copied).ok and len(copied) == 6
    assert [s.name for s in copied.skipped_files()] == ["b/broken.jpg"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_append_to_a_first_format_store_keeps_readers_and_skipped_list(
    backend: str, folder: Path, tmp_path: Path, mongo_uri: str
) -> None:
    import pickle

    from fastdata import LMDBImageDataset, MongoImageDataset

    dst, kw, words = _old_store(backend, folder, tmp_path, mongo_uri)
    if backend == "lmdb":
        before = LMDBImageDataset(dst, output="bytes")
    else:
        before = MongoImageDataset(dst, kw["collection"], output="bytes")
    first = before[0][0]
    worker_view = pickle.dumps(before)  # a DataLoader worker's copy
    before.close()
    for i in range(2):
        write(folder / "c" / f"{i}.jpg", jpeg_bytes(seed=300 + i))
    report = convert(folder, dst, append=True, **kw)
    assert report.count == 8 and report.new_classes == ["c"]
    # readers opened before read on, as they opened it
    assert before[0][0] == first and len(before) == 6
    again = pickle.loads(worker_view)
    assert again[5][0] == (folder / "b" / "2.jpg").read_bytes() and len(again) == 6
    reader = open_store(dst, **kw)
    assert len(reader) == 8 and verify_store(reader).ok
    assert [s.name for s in reader.skipped_files()] == ["b/broken.jpg"]
    info = cli("info", dst, *words, "--skipped")
    assert info.returncode == 0 and "b/broken.jpg" in info.stdout
