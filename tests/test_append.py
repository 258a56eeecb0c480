"""``fastdata convert SRC STORE --append``: new images added in place, on LMDB and MongoDB;
labels keep their meaning, readers that were open read on, a kill resumes."""

from __future__ import annotations

import pickle
import signal
import textwrap
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, MongoImageDataset, convert, export_store, open_store
from fastdata.errors import StoreNotFoundError, StoreReplacedError, UsageError
from fastdata.stores.mongo.layout import META_COLLECTION

from .conftest import jpeg_bytes, snapshot, write
from .mongo_server import database
from .procs import HOLDING_CONVERT, KILLED_CONVERT, cli, run_script, script, wait_for


def folder(root: Path, classes: dict[str, range], seed: int = 0) -> Path:
    for cls, numbers in classes.items():
        for i in numbers:
            write(root / cls / f"{i:03d}.jpg", jpeg_bytes(seed=seed + 1000 * ord(cls[0]) + i))
    return root


def target(backend: str, tmp_path: Path, mongo_uri: str) -> tuple[str, dict[str, str]]:
    if backend == "lmdb":
        return str(tmp_path / "s.lmdb"), {}
    return mongo_uri, {"collection": "imgs"}


def dataset(dst: str, kw: dict[str, str]):  # type: ignore[no-untyped-def]
    if kw:
        return MongoImageDataset(dst, kw["collection"], output="bytes")
    return LMDBImageDataset(dst, output="bytes")


BACKENDS = ["lmdb", "mongo"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_adds_new_images_and_keeps_every_label(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    src = folder(tmp_path / "src", {"bee": range(4), "dog": range(3)})
    dst, kw = target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    before = dataset(dst, kw)
    old_targets, old_id = list(before.targets), before.reader.meta.id
    before.close()
    folder(src, {"ant": range(2), "dog": range(3, 5)})  # a new class that sorts first
    write(src / "bee" / "000.jpg", jpeg_bytes(seed=424242))  # changed since it was stored
    report = convert(src, dst, append=True, **kw)
    assert report.appended and report.count == 11 and report.already_stored == 7
    assert report.new_classes == ["ant"] and report.class_order == "appended"
    assert [c.name for c in report.changed] == ["bee/000.jpg"]
    ds = dataset(dst, kw)
    assert ds.classes == ["bee", "dog", "ant"]  # every label given before keeps its meaning
    assert list(ds.targets[:7]) == old_targets
    assert list(ds.targets[7:]) == [2, 2, 1, 1]
    names = [name for name, _ in ds.samples]
    assert names[7:] == ["ant/000.jpg", "ant/001.jpg", "dog/003.jpg", "dog/004.jpg"]
    for i in range(7, 11):
        assert ds[i][0] == (src / names[i]).read_bytes()
    meta = ds.reader.meta
    assert meta.id != old_id and meta.appended_from == [old_id]
    assert len(set(names)) == len(names)  # nothing stored twice
    # nothing new: nothing written, the store keeps its id
    again = convert(src, dst, append=True, **kw)
    assert again.count == 11 and again.converted == 0
    assert dataset(dst, kw).reader.meta.id == meta.id
    info = cli("info", dst, *(["-c", "imgs"] if kw else []))
    assert "not sorted: --append added some" in info.stdout and "appends:    1" in info.stdout


def test_append_from_the_command_line_says_what_it_did(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"b": range(3)})
    dst = tmp_path / "s.lmdb"
    assert cli("convert", str(src), str(dst), "-q").returncode == 0
    folder(src, {"a": range(2), "c": range(1)})
    write(src / "b" / "001.jpg", jpeg_bytes(seed=77, width=90))
    result = cli("convert", str(src), str(dst), "--append", "-q")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "appended 3 new image(s); 3 of the source's were in the store already" in out
    assert "new classes, added at the end: a, c" in out
    assert "class order is no longer ImageFolder's" in out
    assert "b/001.jpg:" in out and "changed since they were stored" in out
    missing = cli("convert", str(src), str(tmp_path / "none.lmdb"), "--append", "-q")
    assert missing.returncode == 2 and "no store to append to" in missing.stderr
    both = cli("convert", str(src), str(dst), "--append", "--overwrite", "-q")
    assert both.returncode == 2 and "choose one" in both.stderr


def test_classes_that_sort_after_keep_the_imagefolder_order(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"a": range(2)})
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    folder(src, {"b": range(2)})
    report = convert(src, dst, append=True)
    assert report.class_order == "sorted" and open_store(dst).meta.class_order == "sorted"
    with pytest.raises(StoreNotFoundError, match="no store to append to"):
        convert(src, tmp_path / "other.lmdb", append=True)
    with pytest.raises(UsageError, match="choose one"):
        convert(src, dst, append=True, overwrite=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_open_during_an_append_reads_on(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    """A training process keeps reading the store it opened, in its main process and in new
    workers, while another process appends; then sees the new records when it opens again."""
    src = folder(tmp_path / "src", {"a": range(6), "b": range(6)})
    dst, kw = target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    folder(src, {"a": range(6, 40), "c": range(20)})
    ready, go, started, done = (tmp_path / n for n in ("ready", "go", "started", "done"))
    reader = script(
        """
        import os, pickle, sys, time
        from pathlib import Path
        from fastdata import LMDBImageDataset, MongoImageDataset


        dst, src, ready, done = sys.argv[1:5]
        coll = sys.argv[5] if len(sys.argv) > 5 else None
        def open_ds():
            if coll:
                return MongoImageDataset(dst, coll, output="bytes")
            return LMDBImageDataset(dst, output="bytes")
        ds = open_ds()
        n, classes = len(ds), ds.classes
        want = [(Path(src) / name).read_bytes() for name, _ in ds.samples]
        labels = list(ds.targets)
        Path(ready).touch()
        rounds = 0
        while not os.path.exists(done) or rounds < 3:
            worker = pickle.loads(pickle.dumps(ds))  # what a new DataLoader worker gets
            for view in (ds, worker):
                got = view.__getitems__(list(range(n)))
                assert [d for d, _ in got] == want, "different bytes"
                assert [l for _, l in got] == labels, "different labels"
                assert len(view) == n and view.classes == classes
            rounds += 1
        fresh = open_ds()
        last = fresh[len(fresh) - 1]
        print("rounds", rounds, "then", len(fresh), fresh.classes, last[1])
        """,
        dst,
        src,
        ready,
        done,
        *([kw["collection"]] if kw else []),
    )
    wait_for(ready, reader)
    args = ["-c", kw["collection"]] if kw else []
    writer = script(HOLDING_CONVERT, src, dst, started, go, "--append", *args)
    wait_for(started, writer)  # the first new records are committed; the store is mid-append
    go.touch()
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    done.touch()
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    _, rounds, _, n, *_ = out.split()
    assert int(rounds) >= 3 and int(n) == 12 + 34 + 20
    assert "['a', 'b', 'c'] 2" in out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_append_resumes_and_the_store_stays_readable(
    backend: str, tmp_path: Path, mongo_uri: str
) -> None:
    src = folder(tmp_path / "src", {"a": range(5)})
    dst, kw = target(backend, tmp_path, mongo_uri)
    convert(src, dst, **kw)
    snap_before = snapshot(src)
    folder(src, {"a": range(5, 15), "b": range(6)})
    args = ["-c", kw["collection"]] if kw else []
    result = run_script(
        textwrap.dedent(KILLED_CONVERT),
        src,
        dst,
        3,
        "--append",
        *args,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    # the store is still the complete store it was: 5 records, readable, exportable
    ds = dataset(dst, kw)
    assert len(ds) == 5 and ds.classes == ["a"]
    out = tmp_path / "mid"
    export_store(ds.reader, out)
    assert snapshot(out) == snap_before
    ds.close()
    if kw:
        database(mongo_uri)[META_COLLECTION].update_one(
            {"_id": "imgs:writer"}, {"$set": {"expires": 0}}
        )
    report = convert(src, dst, append=True, resume=True, **kw)
    assert report.resumed_from > 0 and report.count == 21
    full = tmp_path / "full"
    export_store(dataset(dst, kw).reader, full)
    assert snapshot(full) == snapshot(src)
    assert list(dataset(dst, kw).targets) == [0] * 15 + [1] * 6


def test_an_interrupted_append_is_started_over_without_resume(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"a": range(3)})
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    folder(src, {"a": range(3, 12)})
    code = textwrap.dedent(KILLED_CONVERT)
    assert run_script(code, src, dst, 2, "--append").returncode == -signal.SIGKILL
    # the folder changed meanwhile: the interrupted append cannot resume; a new one replaces it
    folder(src, {"z": range(2)})
    report = convert(src, dst, append=True)
    assert report.resumed_from == 0 and report.count == 14
    out = tmp_path / "out"
    export_store(open_store(dst), out)
    assert snapshot(out) == snapshot(src)


def test_an_overwrite_after_an_append_is_still_a_replacement(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"a": range(3)})
    other = folder(tmp_path / "other", {"x": range(2)}, seed=5)
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    ds = LMDBImageDataset(dst, output="bytes")
    worker_view = pickle.dumps(ds)
    ds.close()
    folder(src, {"a": range(3, 5)})
    convert(src, dst, append=True)
    assert len(pickle.loads(worker_view)) == 3  # appended: read as it was opened
    convert(other, dst, overwrite=True)
    with pytest.raises(StoreReplacedError):
        pickle.loads(worker_view)[0]


def test_names_are_matched_by_their_bytes_when_hashes_meet(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from fastdata.packed import PackedStrings

    joined = PackedStrings.from_joined(b"a/1.jpg\0b/2.jpg\0c/3.jpg")
    assert list(joined) == [b"a/1.jpg", b"b/2.jpg", b"c/3.jpg"]
    assert (
        joined.joined() == b"a/1.jpg\0b/2.jpg\0c/3.jpg" and len(PackedStrings.from_joined(b"")) == 0
    )
    wanted = PackedStrings([b"c/3.jpg", b"z.jpg", b"a/1.jpg"])
    assert joined.find(wanted).tolist() == [2, -1, 0]
    repeated = PackedStrings([b"x", b"y", b"x", b"z", b"y", b"x"])
    assert repeated.repeats().tolist() == [0, 1, 0, 3, 1, 0]
    # every hash the same: the bytes decide
    monkeypatch.setattr(PackedStrings, "hashes", lambda self: np.zeros(len(self), np.int64))
    assert joined.find(wanted).tolist() == [2, -1, 0]
    assert repeated.repeats().tolist() == [0, 1, 0, 3, 1, 0]
