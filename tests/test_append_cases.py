"""``--append``, case by case (docs/growing.md's table), on LMDB and MongoDB."""

from __future__ import annotations

import importlib
import os
import signal
import time
from pathlib import Path

import pytest

from fastdata import convert, copy_store, open_store
from fastdata.errors import StoreExistsError

from .conftest import converted_an_hour_ago, jpeg_bytes, set_times, write
from .procs import KILLED_CONVERT, cli, run_script

BACKENDS = ["lmdb", "mongo"]
LONG_AGO = 1_000_000_000  # 2001: a modification time older than any store


def _src(root: Path) -> Path:
    for cls in ("cat", "dog"):
        for i in range(3):
            write(root / cls / f"{i}.jpg", jpeg_bytes(seed=ord(cls[0]) * 10 + i))
    return root


def _target(backend: str, tmp_path: Path, mongo_uri: str) -> tuple[str, dict[str, str]]:
    if backend == "lmdb":
        return str(tmp_path / "s.lmdb"), {}
    return mongo_uri, {"collection": "imgs"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_changed_files_are_reported_by_size_whatever_their_time(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    src = _src(tmp_path / "src")
    dst, kw = _target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    grown = src / "cat" / "0.jpg"
    write(grown, jpeg_bytes(width=80, seed=5))  # another size ...
    os.utime(grown, (LONG_AGO, LONG_AGO))  # ... and an old time (rsync -a, cp -p)
    same_size = src / "dog" / "1.jpg"
    other = jpeg_bytes(seed=6)
    old = same_size.read_bytes()
    assert len(other) != len(old) or other != old
    same = bytearray(old)
    same[-10] ^= 0xFF  # same size, other bytes, old time: only a content check sees it
    same_size.write_bytes(bytes(same))
    os.utime(same_size, (LONG_AGO, LONG_AGO))
    report = convert(src, dst, append=True, **kw)
    assert [c.name for c in report.changed] == ["cat/0.jpg"]
    assert "bytes now" in report.changed[0].reason
    checked = convert(src, dst, append=True, check_content=True, **kw)
    assert sorted(c.name for c in checked.changed) == ["cat/0.jpg", "dog/1.jpg"]
    assert len(open_store(dst, **kw)) == 6  # reported, never stored twice


@pytest.mark.parametrize("backend", BACKENDS)
def test_gone_and_moved_images_are_reported(backend: str, tmp_path: Path, mongo_uri: str) -> None:
    src = _src(tmp_path / "src")
    dst, kw = _target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    (src / "cat" / "2.jpg").unlink()
    (src / "cat" / "1.jpg").rename(src / "cat" / "1b.jpg")  # renamed: gone + new
    (src / "bird").mkdir()
    (src / "dog" / "0.jpg").rename(src / "bird" / "0.jpg")  # same file name, another class
    report = convert(src, dst, append=True, **kw)
    assert report.gone_count == 3
    assert sorted(report.gone) == ["cat/1.jpg", "cat/2.jpg", "dog/0.jpg"]
    assert report.moved == [("dog/0.jpg", "bird/0.jpg")]
    assert report.count == 6 + 2  # the new paths are new records; the old ones are kept
    out = cli("convert", str(src), *_words(dst, kw), "--append")
    assert out.returncode == 0, out.stderr
    assert "nothing to add" in out.stdout and "no longer in the source" in out.stdout


def _words(dst: str, kw: dict[str, str]) -> list[str]:
    return [dst, *(["-c", kw["collection"]] if kw else [])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_files_are_read_again_only_when_they_change(
    backend: str, tmp_path: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _src(tmp_path / "src")
    write(src / "cat" / "broken.jpg", b"\xff\xd8 not really")
    write(src / "dog" / "empty.jpg", b"")
    dst, kw = _target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    store = open_store(dst, **kw)
    first_id = store.meta.id
    assert sorted(s.name for s in store.skipped_files()) == ["cat/broken.jpg", "dog/empty.jpg"]
    store.close()
    ingest = importlib.import_module("fastdata.ops.ingest")
    reads: list[str] = []
    real = ingest.read_file
    monkeypatch.setattr(
        ingest, "read_file", lambda path, limit: reads.append(path) or real(path, limit)
    )
    report = convert(src, dst, append=True, **kw)
    # nothing new: not read, not listed again, the store exactly as it was
    assert reads == [] and report.skipped == [] and report.skipped_unchanged == 2
    store = open_store(dst, **kw)
    assert store.meta.id == first_id and len(store) == 6
    store.close()
    # a skipped file fixed since: stored, and taken off the list
    write(src / "cat" / "broken.jpg", jpeg_bytes(seed=77))
    report = convert(src, dst, append=True, **kw)
    assert reads == [str(src / "cat" / "broken.jpg")]
    store = open_store(dst, **kw)
    assert len(store) == 7 and store.meta.id != first_id
    assert [s.name for s in store.skipped_files()] == ["dog/empty.jpg"]
    assert store.meta.skipped_count == 1
    assert store.read_named([6])[0][0] == "cat/broken.jpg"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_change_made_before_a_copy_is_still_reported(
    backend: str, tmp_path: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _src(tmp_path / "src")
    first = tmp_path / "first.lmdb"
    converted = converted_an_hour_ago(monkeypatch)
    set_times(src, converted - 60)  # the images, older than the store
    convert(src, first)
    changed = src / "dog" / "2.jpg"
    data = bytearray(changed.read_bytes())
    data[-10] ^= 0xFF
    changed.write_bytes(bytes(data))  # same size,
    os.utime(changed, (converted + 1800,) * 2)  # newer than the store and older than the copy
    dst, kw = _target(backend, tmp_path, mongo_uri)
    copy_store(first, dst, **kw)
    report = convert(src, dst, append=True, **kw)
    assert [c.name for c in report.changed] == ["dog/2.jpg"]


def test_resuming_an_append_from_another_folder_is_refused(tmp_path: Path) -> None:
    src = _src(tmp_path / "src")
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    for i in range(6):
        write(src / "eel" / f"{i}.jpg", jpeg_bytes(seed=500 + i))
    result = run_script(KILLED_CONVERT, src, dst, 1, "--append")
    assert result.returncode == -signal.SIGKILL, result.stderr
    other = _src(tmp_path / "other")
    with pytest.raises(StoreExistsError, match=r"cannot resume the interrupted append"):
        convert(other, dst, append=True, resume=True)
    refused = cli("convert", str(other), str(dst), "--append", "--resume", "-q")
    assert refused.returncode == 2 and "fastdata convert" in refused.stderr
    # the command it names finishes the append
    printed = refused.stderr.split("`")[1].split()
    done = cli(*printed[1:], "-q")
    assert done.returncode == 0, done.stderr
    assert len(open_store(dst)) == 12


def test_appends_one_after_another_do_not_wait(tmp_path: Path) -> None:
    src = _src(tmp_path / "src")
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    began = time.monotonic()
    for n in range(3):
        write(src / "eel" / f"{n}.jpg", jpeg_bytes(seed=900 + n))
        assert convert(src, dst, append=True).count == 7 + n
    assert time.monotonic() - began < 10  # (appends used to wait 10 s for each other)


@pytest.mark.mongo
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_command_an_append_prints_for_files_skipped_before_runs_as_printed(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    """It printed `fastdata info --skipped`, without the store: refused for a missing argument."""
    import shlex

    src = _src(tmp_path / "src")
    write(src / "cat" / "broken.jpg", b"\xff\xd8 not really")
    dst, kw = _target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    flags = ["--collection", kw["collection"]] if kw else []
    result = cli("convert", str(src), dst, *flags, "--append")
    assert result.returncode == 0, result.stderr
    printed = result.stdout.split("`")[1]
    listed = cli(*shlex.split(printed)[1:])
    assert listed.returncode == 0, listed.stderr
    assert "cat/broken.jpg" in listed.stdout


def test_a_resume_or_a_second_conversion_of_a_folder_that_grew_names_append(
    tmp_path: Path,
) -> None:
    """A folder that gained an image since its store was made: `convert --resume` said "holds a
    complete store converted from <the same folder>; --resume continues only an interrupted
    conversion of the same folder", and a plain convert only "pass --overwrite". Both name
    --append now, which adds the image."""
    src = _src(tmp_path / "src")
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    write(src / "cat" / "new.jpg", jpeg_bytes(seed=99))
    for flags in (["--resume"], []):
        refused = cli("convert", str(src), str(dst), *flags)
        assert refused.returncode == 2 and "--append" in refused.stderr, refused.stderr
    assert cli("convert", str(src), str(dst), "--append").returncode == 0
    assert len(open_store(dst)) == 7


@pytest.mark.parametrize(
    ("backend", "damage"),
    [
        ("lmdb", {"total": "abc"}),
        ("lmdb", {"count": 40}),
        ("lmdb", "not JSON"),
        ("mongo", {"source": "--help"}),
        ("mongo", {"fields": 5}),
    ],
    ids=repr,
)
def test_an_interrupted_append_whose_progress_is_damaged_is_discarded_by_the_next_append(
    backend: str, tmp_path: Path, mongo_uri: str, damage: dict[str, object] | str
) -> None:
    """An append into a complete store killed part-way, its saved progress then damaged:
    MongoDB's info printed a traceback or a command from it (`fastdata convert --help ...`),
    and both backends then refused info, the append and its resume with "convert again with
    --overwrite", which names no source and would replace the store with the appended folder
    alone. Now the store reads as it was, info says the append cannot resume, and the append
    run again discards what the interrupted one wrote."""
    import json

    import lmdb

    from .mongo_server import database

    src = _src(tmp_path / "src")
    dst, kw = _target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    for i in range(6):
        write(src / "eel" / f"{i}.jpg", jpeg_bytes(seed=500 + i))
    words = [dst, *(["-c", "imgs"] if kw else [])]
    killed = run_script(KILLED_CONVERT, src, dst, 1, *words[1:], "--append")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if backend == "mongo":
        meta = database(mongo_uri)["__fastdata__"]
        meta.update_one({"_id": "imgs:writer"}, {"$set": {"expires": 0}})
        change = damage if isinstance(damage, dict) else {"source": {"x": 1}}
        assert meta.update_one({"_id": "imgs:progress"}, {"$set": change}).matched_count
    else:
        with lmdb.open(dst, lock=False) as env, env.begin(write=True) as txn:
            saved = json.loads(txn.get(b"#progress"))
            raw = json.dumps({**saved, **damage}) if isinstance(damage, dict) else "{not"
            txn.put(b"#progress", raw.encode())
    said = cli("info", *words)
    assert said.returncode == 0, said.stderr
    assert "an append was interrupted; its saved progress is damaged" in said.stdout
    assert "`" not in said.stdout.split("note:")[1] and "images:     6" in said.stdout
    resumed = cli("convert", str(src), *words, "--append", "--resume")
    assert resumed.returncode == 2 and "run without --resume" in resumed.stderr, resumed.stderr
    appended = cli("convert", str(src), *words, "--append")
    assert appended.returncode == 0, appended.stderr
    checked = cli("verify", *words)
    assert checked.returncode == 0 and "12 records OK" in checked.stdout, checked.stdout
    assert "another tool" not in checked.stdout
    assert len(open_store(dst, **kw)) == 12


def _killed_append(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A store of 6 images, an append of 6 more killed after its first batch (2 records), and
    the names and bytes of the store's images before it."""
    import hashlib

    src = _src(tmp_path / "src")
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    store = open_store(dst)
    before = {n: hashlib.sha1(d).hexdigest() for n, d, _ in store.read_named(range(6))}
    store.close()
    for i in range(6):
        write(src / "eel" / f"{i}.jpg", jpeg_bytes(seed=500 + i))
    killed = run_script(KILLED_CONVERT, src, dst, 1, "--append")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return src, dst, before


def _progress(dst: Path, change: dict[str, object] | str) -> None:
    import json

    import lmdb

    with lmdb.open(str(dst), lock=False) as env, env.begin(write=True) as txn:
        saved = json.loads(txn.get(b"#progress"))
        raw = json.dumps({**saved, **change}) if isinstance(change, dict) else change
        txn.put(b"#progress", raw.encode())


def test_an_interrupted_append_whose_counts_disagree_with_its_records_is_discarded(
    tmp_path: Path,
) -> None:
    """An interrupted append's progress changed to count more records than it wrote (it wrote
    2): info printed its resume, which stopped as "a fault in fastdata" (a gap), and the plain
    append resumed it the same way, so the store could not grow. Now such progress is
    damaged: the resume refuses, the plain append discards what the interrupted one wrote and
    finishes a store that verifies with every image once. (Fewer: a record past those it
    counts may be another program's, written meanwhile; the resume names it and nothing
    discards it: tests/test_files_beside_a_store.py.)"""
    import hashlib

    src, dst, before = _killed_append(tmp_path)
    _progress(dst, {"count": 4, "next_sample": 4})
    said = cli("info", str(dst))
    assert said.returncode == 0 and "its saved progress is damaged" in said.stdout, said.stdout
    resumed = cli("convert", str(src), str(dst), "--append", "--resume")
    assert resumed.returncode == 2 and "run without --resume" in resumed.stderr, resumed.stderr
    appended = cli("convert", str(src), str(dst), "--append")
    assert appended.returncode == 0, appended.stderr
    checked = cli("verify", str(dst))
    assert checked.returncode == 0 and "12 records OK" in checked.stdout, checked.stdout
    store = open_store(dst)
    after = {n: hashlib.sha1(d).hexdigest() for n, d, _ in store.read_named(range(len(store)))}
    assert len(after) == 12 and all(after[n] == h for n, h in before.items())


def test_the_discard_of_a_damaged_append_leaves_another_tools_keys_past_a_gap(
    tmp_path: Path,
) -> None:
    """Another tool's keys shaped like a record and its header (``0000000099``) past an
    interrupted append whose progress is damaged: the plain append deleted them with the
    append's records (every such key past the store). An append writes its indices one after
    another: only those up to the first gap are discarded now, and the append then refuses
    the other tool's key, as it does without an interrupted append."""
    import lmdb

    src, dst, _ = _killed_append(tmp_path)
    with lmdb.open(str(dst), lock=False) as env, env.begin(write=True) as txn:
        txn.put(b"0000000099", b"another tool's")
        txn.put(b"#0000000099", b"and its header")
    _progress(dst, "{not JSON")
    appended = cli("convert", str(src), str(dst), "--append")
    assert "Traceback" not in appended.stderr
    assert appended.returncode == 0 or "'0000000099'" in appended.stderr, appended.stderr
    with lmdb.open(str(dst), lock=False, readonly=True) as env, env.begin() as txn:
        assert txn.get(b"0000000099") == b"another tool's"
        assert txn.get(b"#0000000099") == b"and its header"
    assert len(open_store(dst)) in (6, 12)
