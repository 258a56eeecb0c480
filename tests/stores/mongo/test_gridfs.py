"""GridFS buckets in a store's database: fastdata drops only the buckets it can show are its own
(NOTE [ Whose GridFS bucket ] in ``stores/mongo/buckets.py``), against a real SecantusDB server.
Another tool's bucket named like a store's is kept; a killed conversion's bucket and a replaced
store's bucket are still removed."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import gridfs
import pytest

from fastdata import MongoImageDataset, convert, export_store, open_store
from fastdata.stores.mongo.layout import META_COLLECTION

from ...conftest import jpeg_bytes, snapshot, write
from ...earlier_formats import write_first_mongo
from ...mongo_server import database
from ...procs import KILLED_CONVERT, cli, run_script
from ...test_store_integrity import sized_folder

pytestmark = pytest.mark.mongo

USERS = {"photos.gridfs": b"precious user data", f"photos.gridfs.{'ab' * 16}": b"more of it"}
"""Another tool's buckets in the store's database, named like a store's, and what they hold."""

# Every image goes to GridFS (it is over 100 bytes), as only images over 15 MiB do otherwise.
SMALL_THRESHOLD = "import fastdata.stores.mongo.writer as w; w.GRIDFS_THRESHOLD = 100\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return sized_folder(tmp_path / "src", ("a0", "a1"), 4, swap=False)


def add_user_buckets(uri: str) -> None:
    for name, data in USERS.items():
        gridfs.GridFSBucket(database(uri), name).upload_from_stream("mine.bin", data)


def user_buckets_left(uri: str) -> dict[str, list[bytes]]:
    out = {}
    for name in USERS:
        bucket = gridfs.GridFSBucket(database(uri), name)
        out[name] = [bucket.open_download_stream(f._id).read() for f in bucket.find()]
    return out


def buckets(uri: str) -> set[str]:
    return {
        n.rsplit(".", 1)[0]
        for n in database(uri).list_collection_names()
        if n.endswith(".files") and n.rsplit(".", 1)[0] not in USERS
    }


def exported(uri: str, tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / f"export-{time.monotonic_ns()}"
    export_store(open_store(uri, collection="photos"), out)
    return snapshot(out)


def test_another_tools_buckets_named_like_a_stores_are_kept(
    folder: Path, mongo_uri: str, tmp_path: Path
) -> None:
    add_user_buckets(mongo_uri)
    for extra in ([], ["--overwrite"]):
        result = cli("convert", str(folder), mongo_uri, "--collection", "photos", *extra)
        assert result.returncode == 0, result.stderr
        assert user_buckets_left(mongo_uri) == {name: [data] for name, data in USERS.items()}
    assert exported(mongo_uri, tmp_path) == snapshot(folder)


def test_a_killed_conversions_bucket_and_a_replaced_stores_are_removed(
    folder: Path, mongo_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_user_buckets(mongo_uri)
    code = "    " + SMALL_THRESHOLD + KILLED_CONVERT
    killed = run_script(code, folder, mongo_uri, 2, "-c", "photos")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    meta = database(mongo_uri)[META_COLLECTION]
    killed_id = meta.find_one({"_id": "photos:progress"})["store_id"]
    assert buckets(mongo_uri) == {f"photos.gridfs.{killed_id}"}  # its first images are there
    meta.update_one({"_id": "photos:writer"}, {"$set": {"expires": 0}})

    monkeypatch.setattr("fastdata.stores.mongo.writer.GRIDFS_THRESHOLD", 100)
    for _ in range(2):  # over the killed conversion, then over the store it made
        convert(folder, mongo_uri, collection="photos", overwrite=True)
        store_id = meta.find_one({"_id": "photos"})["id"]
        assert buckets(mongo_uri) == {f"photos.gridfs.{store_id}"}
    assert exported(mongo_uri, tmp_path) == snapshot(folder)
    assert user_buckets_left(mongo_uri) == {name: [data] for name, data in USERS.items()}


def first_format_store_in_gridfs(folder: Path, uri: str) -> None:
    """A store of the first format in ``photos``, record 0's image in ``photos.gridfs`` as
    that format kept images over 15 MiB (file ``"photos:0"``)."""
    db = database(uri)
    write_first_mongo(folder, db, "photos")
    doc = db["photos"].find_one({"_id": 0})
    bucket = gridfs.GridFSBucket(db, "photos.gridfs")
    bucket.upload_from_stream_with_id("photos:0", "photos:0", bytes(doc["data"]))
    db["photos"].update_one({"_id": 0}, {"$unset": {"data": 1}, "$set": {"gridfs_id": "photos:0"}})


def test_an_append_to_a_first_format_store_keeps_its_gridfs_images(
    folder: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_format_store_in_gridfs(folder, mongo_uri)
    write(folder / "a1" / "new.jpg", jpeg_bytes(seed=99))
    monkeypatch.setattr("fastdata.stores.mongo.writer.GRIDFS_THRESHOLD", 100)
    assert convert(folder, mongo_uri, collection="photos", append=True).added == 1
    ds = MongoImageDataset(mongo_uri, "photos", output="bytes")
    assert ds[0][0] == (folder / "a0" / "0000.jpg").read_bytes()
    assert ds[len(ds) - 1][0] == jpeg_bytes(seed=99)


def test_a_bucket_of_the_first_formats_name_holding_another_tools_files_is_kept(
    folder: Path, mongo_uri: str, tmp_path: Path
) -> None:
    first_format_store_in_gridfs(folder, mongo_uri)
    bucket = gridfs.GridFSBucket(database(mongo_uri), "photos.gridfs")
    bucket.upload_from_stream("mine.bin", b"precious user data")  # another tool's, beside it
    result = cli("convert", str(folder), mongo_uri, "--collection", "photos", "--overwrite")
    assert result.returncode == 0, result.stderr
    assert exported(mongo_uri, tmp_path) == snapshot(folder)
    left = {f.filename for f in bucket.find()}
    assert left == {"photos:0", "mine.bin"}
