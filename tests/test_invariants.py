"""What a command reports as written opens, with every record exactly once: the invariants are
checked before success is reported, on every path (convert, append, copy, resume), and every
command a message prints runs as printed."""

from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path

import numpy as np
import pytest

from fastdata import convert, copy_store, open_store, verify_store
from fastdata.errors import IncompleteStoreError, StoreError, StoreExistsError, UsageError
from fastdata.records import StoreMeta
from fastdata.stores.invariants import invariant_failures
from fastdata.stores.mongo.layout import META_COLLECTION

from .conftest import jpeg_bytes, write
from .mongo_server import database
from .procs import KILLED_CONVERT, KILLED_COPY, cli, run_script

BACKENDS = ["lmdb", "mongo"]


def _target(backend: str, tmp_path: Path, mongo_uri: str) -> tuple[str, dict[str, str], list[str]]:
    """The store's address, the library's keywords and the CLI's words for it."""
    if backend == "lmdb":
        return str(tmp_path / "s.lmdb"), {}, []
    return mongo_uri, {"collection": "imgs"}, ["-c", "imgs"]


def _manifest_with_a_repeat_and_junk(root: Path) -> Path:
    """Item 1 of the report: one repeated row plus files that are not images."""
    for i in range(3):
        write(root / "img" / f"{i}.jpg", jpeg_bytes(seed=i))
    write(root / "img" / "empty.jpg", b"")
    write(root / "img" / "junk.jpg", b"\x07")
    manifest = root / "labels.csv"
    manifest.write_text(
        "path,label\n"
        "img/0.jpg,cat\n"
        "img/1.jpg,dog\n"
        "img/0.jpg,cat\n"  # the repeated row
        "img/empty.jpg,dog\n"
        "img/junk.jpg,cat\n"
        "img/2.jpg,dog\n"
    )
    return manifest


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_row_and_a_non_image_make_a_store_that_opens(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    manifest = _manifest_with_a_repeat_and_junk(tmp_path / "data")
    dst, kw, words = _target(backend, tmp_path, mongo_uri)
    report = convert(manifest, dst, **kw)
    assert report.count == 3
    reader = open_store(dst, **kw)
    assert len(reader.labels) == 3 and reader.labels.tolist() == [0, 1, 1]
    assert verify_store(reader).ok
    skipped = [s.name for s in reader.skipped_files()]
    assert len(skipped) == len(set(skipped)) == 3  # the repeat (by its line) and the two files
    assert "img/0.jpg" not in skipped
    for command in (["info"], ["verify"]):
        result = cli(*command, dst, *words)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_rows_appended_keep_the_store_readable(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    root = tmp_path / "data"
    for i in range(2):
        write(root / "img" / f"{i}.jpg", jpeg_bytes(seed=i))
    first = root / "first.csv"
    first.write_text("path,label\nimg/0.jpg,cat\nimg/1.jpg,dog\n")
    dst, kw, words = _target(backend, tmp_path, mongo_uri)
    convert(first, dst, **kw)
    before = [bytes(d) for d, _ in open_store(dst, **kw).read_samples([0, 1])]
    manifest = _manifest_with_a_repeat_and_junk(root)
    manifest.rename(first)  # an append reads the same manifest, now with more rows
    report = convert(first, dst, append=True, **kw)
    assert report.count == 3 and report.already_stored == 2
    reader = open_store(dst, **kw)
    assert [bytes(d) for d, _ in reader.read_samples([0, 1])] == before
    assert verify_store(reader).ok
    assert cli("verify", dst, *words).returncode == 0


def test_a_store_that_would_break_an_invariant_is_not_marked_complete(
    good_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    convert_module = importlib.import_module("fastdata.ops.convert")

    dst = tmp_path / "s.lmdb"
    real = convert_module._stored

    def one_label_short(scan, count, skipped):  # type: ignore[no-untyped-def]
        labels, names = real(scan, count, skipped)
        return labels[:-1], names

    monkeypatch.setattr(convert_module, "_stored", one_label_short)
    with pytest.raises(StoreError, match="one label per record: 11 labels for 12 records"):
        convert(good_folder, dst)
    with pytest.raises(IncompleteStoreError):  # no reader takes it for a whole store
        open_store(dst)
    monkeypatch.undo()
    # what the message says to do works
    assert convert(good_folder, dst, overwrite=True).count == 12
    # an append that would break one leaves the store as it was
    write(good_folder / "cat" / "new.jpg", jpeg_bytes(seed=99))
    monkeypatch.setattr(convert_module, "_stored", one_label_short)
    before = open_store(dst).meta
    with pytest.raises(StoreError, match="reads as it did before the append"):
        convert(good_folder, dst, append=True)
    assert open_store(dst).meta == before


def test_the_invariants_are_named() -> None:
    from fastdata.records import SkippedFile

    meta = StoreMeta(count=3, classes=["a", "b"], skipped_count=2)
    labels = np.array([0, 1, 1])
    names = b"a/1.jpg\0b/2.jpg\0b/2.jpg"
    skipped = [SkippedFile("a/1.jpg", "bad"), SkippedFile("a/1.jpg", "bad")]
    broken = invariant_failures(meta, labels, names, skipped)
    assert any(b.startswith("every image stored once") for b in broken)
    assert any(b.startswith("each skipped file listed once") for b in broken)
    assert any(b.startswith("a skipped file is not stored") for b in broken)
    assert invariant_failures(meta, np.array([0, 5, 1]), None, None)[0].startswith(
        "every label a class index"
    )
    assert invariant_failures(meta, labels, b"x\0y\0z", [])[0].startswith(
        "the metadata counts the skipped files"
    )


def test_verify_names_a_broken_invariant(good_folder: Path, tmp_path: Path) -> None:
    import lmdb

    dst = tmp_path / "s.lmdb"
    convert(good_folder, dst)
    env = lmdb.open(str(dst))
    with env.begin(write=True) as txn:  # record 2's name given to record 3 as well, in its
        names = txn.get(b"__names__").split(b"\0")  # header and in the index of names
        names[3] = names[2]
        txn.put(b"__names__", b"\0".join(names))
        header = json.loads(txn.get(b"#0000000003"))
        txn.put(b"#0000000003", json.dumps({**header, "name": names[2].decode()}).encode())
    env.close()
    result = cli("verify", str(dst))
    assert result.returncode == 1
    assert "every image stored once: records 2 and 3" in result.stdout


def test_a_resume_continues_with_the_options_it_began_with(tmp_path: Path) -> None:
    folder = tmp_path / "src"
    for i in range(12):
        write(folder / f"c{i % 2}" / f"{i:02d}.jpg", jpeg_bytes(seed=i))
    dst = tmp_path / "s.lmdb"
    code = KILLED_CONVERT.replace("commit_records=2,", "commit_records=2, verify_decode=True,")
    result = run_script(code, folder, dst, 2)
    assert result.returncode == -signal.SIGKILL, result.stderr
    info = cli("info", str(dst))
    assert info.returncode != 0
    printed = info.stderr.split("`")[1]
    assert "--verify-decode" in printed and "--resume" in printed
    # the command as printed finishes it, and says with which options
    done = cli(*shlex.split(printed)[1:], "-q")
    assert done.returncode == 0, done.stderr
    assert "with the options it began with: --verify-decode" in done.stdout
    assert len(open_store(dst)) == 12
    # an option that conflicts is refused, and the refusal names what works
    result = run_script(code, folder, tmp_path / "t.lmdb", 1)
    assert result.returncode == -signal.SIGKILL
    with pytest.raises(StoreExistsError, match="started with --verify-decode.*--resume"):
        convert(folder, tmp_path / "t.lmdb", resume=True, verify_decode=False)


def test_a_copy_resumes_from_any_folder_and_spelling(
    good_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "store.lmdb"
    convert(good_folder, src)
    monkeypatch.chdir(tmp_path)
    result = run_script(KILLED_COPY, "store.lmdb", "copy.lmdb", 1)
    assert result.returncode == -signal.SIGKILL, result.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    report = copy_store(src, tmp_path / "copy.lmdb", resume=True)  # absolute paths now
    assert report.resumed_from > 0 and report.count == 12
    # the printed command of an interrupted copy runs as printed
    result = run_script(KILLED_COPY, src, tmp_path / "again.lmdb", 1)
    assert result.returncode == -signal.SIGKILL
    with pytest.raises(IncompleteStoreError) as refused:
        open_store(tmp_path / "again.lmdb")
    printed = str(refused.value).split("`")[1]
    done = cli(*shlex.split(printed)[1:], "-q")
    assert done.returncode == 0, done.stderr


def test_copy_collection_names_the_one_mongo_side(
    good_folder: Path, tmp_path: Path, mongo_uri: str
) -> None:
    convert(good_folder, mongo_uri, collection="imgs")
    back = tmp_path / "back.lmdb"
    result = cli("copy", mongo_uri, "--collection", "imgs", str(back), "-q")
    assert result.returncode == 0, result.stderr
    assert len(open_store(back)) == 12
    lost = cli("copy", mongo_uri, str(tmp_path / "x.lmdb"), "-q")
    assert lost.returncode == 2 and "(--collection NAME)" in lost.stderr
    both = cli("copy", mongo_uri, mongo_uri, "-c", "other", "-q")
    assert both.returncode == 2 and "(--source-collection NAME)" in both.stderr


def test_refused_commands_leave_nothing_behind(
    good_folder: Path, tmp_path: Path, mongo_uri: str
) -> None:
    new = tmp_path / "deep" / "new.lmdb"
    for extra in (["--resume"], ["--append"]):
        result = cli("convert", str(good_folder), str(new), "-q", *extra)
        assert result.returncode == 2, result.stderr
        assert not (tmp_path / "deep").exists()
    store = tmp_path / "s.lmdb"
    convert(good_folder, store)
    files = sorted(p.name for p in store.iterdir())
    for extra in ([], ["--resume", "--overwrite"]):
        result = cli("convert", str(tmp_path), str(store), "-q", *extra)
        assert result.returncode == 2
        assert sorted(p.name for p in store.iterdir()) == files
    db = database(mongo_uri)
    result = cli("convert", str(good_folder), mongo_uri, "-c", "imgs", "-q", "--resume")
    assert result.returncode == 2, result.stderr
    assert "imgs" not in db.list_collection_names()
    assert list(db[META_COLLECTION].find({})) == []  # no claim, no progress left


def test_a_resume_with_nothing_to_resume_says_what_to_run(
    good_folder: Path, tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match="run the same call without resume=True"):
        convert(good_folder, tmp_path / "n.lmdb", resume=True)
    assert not (tmp_path / "n.lmdb").exists()


def test_the_commands_printed_for_an_interrupted_mongo_store_run_as_printed(
    good_folder: Path, mongo_uri: str
) -> None:
    result = run_script(KILLED_CONVERT, good_folder, mongo_uri, 2, "-c", "imgs")
    assert result.returncode == -signal.SIGKILL, result.stderr
    with pytest.raises(IncompleteStoreError) as refused:
        open_store(mongo_uri, collection="imgs")
    printed = str(refused.value).split("`")[1]
    assert "--collection imgs" in printed
    info = cli("info", mongo_uri, "-c", "imgs")
    assert info.returncode != 0 and printed in info.stderr
    # the killed writer's claim is this host's and its process is gone: no wait
    done = cli(*shlex.split(printed)[1:], "-q")
    assert done.returncode == 0, done.stderr
    assert len(open_store(mongo_uri, collection="imgs")) == 12
