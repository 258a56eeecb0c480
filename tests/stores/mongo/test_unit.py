"""Fast unit tests of the Mongo backend's logic, on mongomock (no server)."""

from pathlib import Path

import mongomock
import pymongo
import numpy as np
import pytest

from fastdata import convert, open_store
from fastdata.errors import RecordError, StoreDamagedError, StoreError, UsageError
from fastdata.stores.foreign import _legacy_classes
from fastdata.stores.mongo.connection import MongoOptions
from fastdata.stores.uri import is_mongo_uri, mask_uri
from fastdata.stores.mongo.layout import INSERT_BYTES, META_COLLECTION, insert_groups
from fastdata.stores.mongo.reader import MongoStore
from fastdata.stores.mongo.writer import MongoWriter


def _on(client: mongomock.MongoClient) -> MongoOptions:
    """Options whose client is ``client`` (shared: not closed with a store)."""
    return MongoOptions(client_factory=lambda uri, options: client, close_client=False)


@pytest.mark.parametrize(
    "uri, masked",
    [
        ("mongodb://u:p@h:1/db", "mongodb://u:***@h:1/db"),
        (
            "mongodb+srv://user:p%40ss@cluster.x.net/db?tls=true",
            "mongodb+srv://user:***@cluster.x.net/db?tls=true",
        ),
        ("mongodb://h:1/db", "mongodb://h:1/db"),
        ("mongodb://onlyuser@h/db", "mongodb://onlyuser@h/db"),
    ],
)
def test_mask_uri(uri: str, masked: str) -> None:
    assert mask_uri(uri) == masked


def test_is_mongo_uri() -> None:
    assert is_mongo_uri("mongodb://h/db") and is_mongo_uri("mongodb+srv://h/db")
    assert not is_mongo_uri("train.lmdb") and not is_mongo_uri(Path("mongodb:"))


def test_legacy_classes_from_paths_or_numbers() -> None:
    labels = np.array([0, 0, 1])
    assert _legacy_classes(["cat/a.jpg", "cat/b.jpg", "dog/c.jpg"], labels, "i") == ["cat", "dog"]
    assert _legacy_classes(["a.jpg", "b.jpg", "c.jpg"], labels, "i") == ["0", "1"]
    assert _legacy_classes(["cat/a", "dog/b", "dog/c"], labels, "i") == ["0", "1"]  # inconsistent
    with pytest.raises(StoreError, match="index.json: label 4294967296 is out of range"):
        _legacy_classes(["a.jpg"], np.array([2**32]), "index.json")


def test_collection_and_database_are_required() -> None:
    with pytest.raises(UsageError, match="name the collection"):
        open_store("mongodb://h:1/db")
    with pytest.raises(UsageError, match="no database named"):
        open_store("mongodb://h:1", collection="c")


def test_convert_and_read_on_mongomock(good_folder: Path) -> None:
    client = mongomock.MongoClient()
    writer = MongoWriter("mongodb://mock/db", "g", options=_on(client))
    report = convert(good_folder, writer, workers=1)
    assert report.count == 12
    store = MongoStore("mongodb://mock/db", "g", options=_on(client))
    assert store.read_samples([3])[0] == ((good_folder / "cat" / "003.jpg").read_bytes(), 0)
    assert [r.header.name for r in store.read_records([11, 0])] == ["eel/002.jpg", "cat/000.jpg"]


def test_damage_found_in_a_document_names_the_collection_for_verify(good_folder: Path) -> None:
    """A header or metadata that only a parse of the document finds damaged names the store as
    a command's words (``URI --collection C``), so that the hint's ``fastdata verify`` runs as
    printed (it said "`fastdata verify` on it")."""
    client = mongomock.MongoClient()
    convert(good_folder, MongoWriter("mongodb://mock/db", "g", options=_on(client)), workers=1)
    client["db"]["g"].update_one({"_id": 4}, {"$set": {"label": "cat"}})
    store = MongoStore("mongodb://mock/db", "g", options=_on(client))
    for read in (lambda: store.read_records([4]), lambda: list(store.iter_headers())):
        with pytest.raises(RecordError) as found:
            read()
        assert found.value.store == "mongodb://mock/db --collection g"
        assert "run `fastdata verify mongodb://mock/db --collection g`" in str(found.value)
    client["db"][META_COLLECTION].update_one({"_id": "g"}, {"$set": {"count": "twelve"}})
    with pytest.raises(StoreDamagedError) as damaged:
        MongoStore("mongodb://mock/db", "g", options=_on(client))
    assert damaged.value.store == "mongodb://mock/db --collection g"


def test_insert_groups_respect_count_and_bytes() -> None:
    docs = [{"_id": i, "data": b"x" * 6} for i in range(300)]
    groups = list(insert_groups(docs))
    assert [len(g) for g in groups] == [128, 128, 44]
    assert [d["_id"] for g in groups for d in g] == list(range(300))
    big = [{"_id": i, "data": b"x" * (INSERT_BYTES // 2 + 1)} for i in range(3)]
    assert [len(g) for g in insert_groups(big)] == [1, 1, 1]


def test_a_failed_insert_in_the_background_stops_the_conversion(
    good_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pymongo.errors import BulkWriteError

    client = mongomock.MongoClient()

    def refuse(self, docs, ordered=True):  # type: ignore[no-untyped-def]
        raise BulkWriteError({"writeErrors": [{"code": 121, "errmsg": "validation failed"}]})

    monkeypatch.setattr(mongomock.collection.Collection, "insert_many", refuse)
    with pytest.raises(StoreError, match="writing records failed: validation failed"):
        writer = MongoWriter("mongodb://mock/db", "g", options=_on(client))
        convert(good_folder, writer, workers=1, commit_records=4)
    # the store is not marked complete; its progress, saved before the first record, stays at 0
    meta = client["db"][META_COLLECTION]
    assert meta.find_one({"_id": "g"}) is None
    assert meta.find_one({"_id": "g:progress"})["next_sample"] == 0


def test_the_dataset_takes_every_mongo_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdata import MongoImageDataset
    from fastdata.errors import UsageError

    seen = []

    def fake(uri, options):  # type: ignore[no-untyped-def]
        seen.append(options)
        raise pymongo.errors.ServerSelectionTimeoutError("no server")

    with pytest.raises(StoreError):
        MongoImageDataset(
            "mongodb://h:1/db", "c", socket_timeout_s=7.0, timeout_s=0.5, client_factory=fake
        )
    assert seen[0].socket_timeout_s == 7.0 and seen[0].timeout_s == 0.5
    assert seen[0].retry_budget_s == MongoOptions().retry_budget_s  # the default
    with pytest.raises(UsageError, match="unknown MongoDB option.*sockettimeout"):
        MongoImageDataset("mongodb://h:1/db", "c", sockettimeout=3)
