"""A Mongo store is never mixed, half-replaced or silently wrong, against a real wire-protocol
server (SecantusDB, or FASTDATA_TEST_MONGO_URI): a second conversion into a collection, two
writers, a killed writer's claim, an overwrite while a reader reads, a kill during it, and
documents damaged with plain pymongo."""

from __future__ import annotations

import re
import shlex
import signal
import time
from pathlib import Path

import pymongo
import pytest
from bson import Binary

from fastdata import MongoImageDataset, convert, export_store, open_store, verify_store
from fastdata.errors import (
    IncompleteStoreError,
    RecordError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreReplacedError,
)
from fastdata.stores.mongo.layout import META_COLLECTION
from fastdata.stores.mongo.connection import MongoOptions
from fastdata.stores.mongo.writer import MongoWriter

from ...conftest import snapshot
from ...mongo_server import database
from ...procs import HOLDING_CONVERT, KILLED_CONVERT, cli, run_script, script, wait_for
from ...test_store_integrity import sized_folder

pytestmark = pytest.mark.mongo


@pytest.fixture
def folder_a(tmp_path: Path) -> Path:
    return sized_folder(tmp_path / "A", ("a0", "a1"), 12, swap=False)


@pytest.fixture
def folder_b(tmp_path: Path) -> Path:
    return sized_folder(tmp_path / "B", ("b0", "b1"), 9, swap=True)


def db(uri: str) -> pymongo.database.Database:
    return database(uri)


def exported(uri: str, collection: str, tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / f"export-{time.monotonic_ns()}"
    export_store(open_store(uri, collection=collection), out)
    return snapshot(out)


def test_a_second_conversion_never_mixes_two_folders(
    folder_a: Path, folder_b: Path, mongo_uri: str, tmp_path: Path
) -> None:
    convert(folder_a, mongo_uri, collection="c")
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        convert(folder_b, mongo_uri, collection="c")
    with pytest.raises(StoreExistsError, match=r"complete store converted from .*A"):
        convert(folder_b, mongo_uri, collection="c", resume=True)
    assert db(mongo_uri)["c"].count_documents({}) == 24
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_a)


def test_killed_before_its_first_commit_says_resume(folder_a: Path, mongo_uri: str) -> None:
    result = run_script(KILLED_CONVERT, folder_a, mongo_uri, 0, "-c", "c")
    assert result.returncode == -signal.SIGKILL, result.stderr
    with pytest.raises(IncompleteStoreError, match=r"stopped after 0 of 24 images.*--resume"):
        MongoImageDataset(mongo_uri, "c")
    # a claim left by a killed writer: a resume waits for it to expire (60 s by default), so the
    # test takes it over with a writer whose claims are short
    db(mongo_uri)[META_COLLECTION].update_one({"_id": "c:writer"}, {"$set": {"expires": 0}})
    assert convert(folder_a, mongo_uri, collection="c", resume=True).count == 24


def test_two_conversions_racing_on_one_collection(
    folder_a: Path, folder_b: Path, mongo_uri: str, tmp_path: Path
) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, mongo_uri, started, go, "-c", "c")
    wait_for(started, first)
    for extra in ([], ["--overwrite"], ["--resume"]):
        second = cli("convert", str(folder_b), mongo_uri, "-c", "c", "-q", *extra)
        assert second.returncode == 1, second.stderr
        assert "another conversion is writing this collection" in second.stderr
        assert f"pid {first.pid} on host" in second.stderr and "Traceback" not in second.stderr
    go.touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_a)
    assert db(mongo_uri)[META_COLLECTION].find_one({"_id": "c:writer"}) is None  # released


def test_a_collection_being_written_is_said_to_be_written_not_stopped(
    folder_a: Path, mongo_uri: str, tmp_path: Path
) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, mongo_uri, started, go, "-c", "c")
    wait_for(started, first)
    shown = cli("info", mongo_uri, "-c", "c")
    assert shown.returncode == 1 and "Traceback" not in shown.stderr
    assert f"being written now (pid {first.pid} on host" in shown.stderr, shown.stderr
    assert "--resume" not in shown.stderr
    first.send_signal(signal.SIGKILL)
    first.communicate()
    stopped = cli("info", mongo_uri, "-c", "c")  # (the holder is gone: its claim counts no more)
    assert "its conversion stopped after" in stopped.stderr and "--resume" in stopped.stderr


def test_a_killed_writers_claim_on_this_host_is_taken_over_at_once(
    folder_a: Path, mongo_uri: str, tmp_path: Path
) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, mongo_uri, started, go, "-c", "c")  # a 60 s claim
    wait_for(started, first)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    began = time.monotonic()
    report = convert(folder_a, mongo_uri, collection="c", resume=True)
    assert time.monotonic() - began < 30  # not the claim's 60 s
    assert report.count == 24 and report.resumed_from > 0
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_a)


def test_another_hosts_claim_expires_by_the_servers_clock(
    folder_a: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import UTC

    hello = db(mongo_uri).client.admin.command("hello")
    server_now = hello["localTime"].replace(tzinfo=UTC).timestamp()
    claims = db(mongo_uri)[META_COLLECTION]
    claim = {"_id": "c:writer", "token": "t", "host": "elsewhere", "pid": 1, "since": 0.0}
    claims.insert_one({**claim, "expires": server_now + 3600})
    # this host's clock is a day ahead: by it the claim has expired, by the server's it has not
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400)
    with pytest.raises(StoreLockedError, match=r"pid 1 on host elsewhere.*expires in \d+ s"):
        convert(folder_a, mongo_uri, collection="c")
    monkeypatch.setattr(time, "time", real_time)
    claims.update_one({"_id": "c:writer"}, {"$set": {"expires": server_now - 1}})
    assert convert(folder_a, mongo_uri, collection="c").count == 24


def test_the_claim_is_renewed_while_the_conversion_runs(folder_a: Path, mongo_uri: str) -> None:
    writer = MongoWriter(mongo_uri, "c", options=MongoOptions(claim_ttl_s=0.8))
    real = MongoWriter.write

    def slow(self, records, progress):  # type: ignore[no-untyped-def]
        time.sleep(0.3)  # the whole conversion outlasts the claim's lifetime several times
        real(self, records, progress)

    MongoWriter.write = slow  # type: ignore[method-assign]
    try:
        convert(folder_a, writer, commit_records=2, workers=1)
    finally:
        MongoWriter.write = real  # type: ignore[method-assign]
    assert len(open_store(mongo_uri, collection="c")) == 24


def test_overwrite_while_a_reader_reads(
    folder_a: Path, folder_b: Path, mongo_uri: str, tmp_path: Path
) -> None:
    convert(folder_a, mongo_uri, collection="c")
    reader = MongoImageDataset(mongo_uri, "c", output="bytes")
    assert reader[0][1] == 0
    result = cli("convert", str(folder_b), mongo_uri, "-c", "c", "--overwrite", "-q")
    assert result.returncode == 0, result.stderr
    with pytest.raises(StoreReplacedError, match="create the dataset"):
        reader.__getitems__([0, 1])  # never B's images with A's labels
    fresh = MongoImageDataset(mongo_uri, "c", output="bytes")
    assert fresh.classes == ["b0", "b1"] and len(fresh) == 18
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_b)
    names = db(mongo_uri).list_collection_names()
    assert not [n for n in names if "__replacement__" in n]


def test_kill_during_overwrite_leaves_the_old_store_whole(
    folder_a: Path, folder_b: Path, mongo_uri: str, tmp_path: Path
) -> None:
    convert(folder_a, mongo_uri, collection="c")
    result = run_script(KILLED_CONVERT, folder_b, mongo_uri, 3, "-c", "c", "--overwrite")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_a)
    assert verify_store(open_store(mongo_uri, collection="c")).ok
    db(mongo_uri)[META_COLLECTION].update_one({"_id": "c:writer"}, {"$set": {"expires": 0}})
    with pytest.raises(StoreExistsError, match="replacement of it was interrupted"):
        convert(folder_b, mongo_uri, collection="c")
    report = convert(folder_b, mongo_uri, collection="c", resume=True)
    assert report.resumed_from > 0
    assert exported(mongo_uri, "c", tmp_path) == snapshot(folder_b)
    assert db(mongo_uri)["c"].count_documents({}) == 18


def test_damaged_documents_are_errors_not_crashes(folder_a: Path, mongo_uri: str) -> None:
    convert(folder_a, mongo_uri, collection="c")
    coll = db(mongo_uri)["c"]
    coll.update_one({"_id": 3}, {"$set": {"data": 10**12}})  # an int where the bytes were
    coll.update_one({"_id": 4}, {"$unset": {"data": "", "label": ""}})
    coll.update_one({"_id": 5}, {"$set": {"crc32": "x"}})
    ds = MongoImageDataset(mongo_uri, "c", output="bytes")
    with pytest.raises(
        RecordError, match=r"record 3: its image \('data'\) is a number, not binary"
    ):
        ds[3]  # and not a terabyte of zeros
    with pytest.raises(RecordError, match=r"record 4: its image \('data'\) is missing"):
        ds[4]
    with pytest.raises(RecordError, match=r"record 5: damaged \('size' or 'crc32'\)"):
        ds[5]  # its image cannot be checked: a checked read refuses it
    unchecked = MongoImageDataset(mongo_uri, "c", output="bytes", check=False)
    assert unchecked[5][1] == 0  # its image is intact
    report = verify_store(open_store(mongo_uri, collection="c"))
    assert sorted(f.index for f in report.failures) == [3, 4, 5]
    result = cli("verify", mongo_uri, "-c", "c", "-q")
    assert result.returncode == 1 and "Traceback" not in result.stderr


def test_damaged_metadata_is_an_error(folder_a: Path, mongo_uri: str) -> None:
    convert(folder_a, mongo_uri, collection="c")
    meta = db(mongo_uri)[META_COLLECTION]
    labels = bytes(meta.find_one({"_id": "c"})["labels"])
    meta.update_one(
        {"_id": "c"}, {"$set": {"labels": Binary(labels[:-4] + (1000).to_bytes(4, "little"))}}
    )
    with pytest.raises(StoreError, match="label 1000, outside the 2 classes"):
        MongoImageDataset(mongo_uri, "c")
    meta.update_one({"_id": "c"}, {"$set": {"count": "24"}})
    result = cli("info", mongo_uri, "-c", "c")
    assert result.returncode == 1 and "'count'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_writer_finding_damaged_metadata_prints_a_verify_that_runs(
    folder_a: Path, mongo_uri: str
) -> None:
    """An append into a collection whose metadata is damaged names the collection in the
    hint's ``fastdata verify`` (URI ``--collection`` C), which runs as printed (it said
    "`fastdata verify` on it", which runs nothing)."""
    convert(folder_a, mongo_uri, collection="d c")
    db(mongo_uri)[META_COLLECTION].update_one({"_id": "d c"}, {"$set": {"count": "twelve"}})
    appended = cli("convert", str(folder_a), mongo_uri, "-c", "d c", "--append", "-q")
    assert appended.returncode == 1 and "Traceback" not in appended.stderr, appended.stderr
    printed = re.findall(r"`(fastdata verify [^`]*)`", appended.stderr)
    assert printed, appended.stderr
    verified = cli(*shlex.split(printed[0])[1:])
    assert verified.returncode == 1, verified.stderr  # (damage, not a usage error: 2)
    assert "'count'" in verified.stderr, verified.stderr
