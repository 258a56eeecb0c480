"""Cases found by trying the store promises as a hostile user would: each one a store reported
good that was not, a printed command that did something else, or a refusal that left debris."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from fastdata import convert, copy_store, open_store, verify_store
from fastdata.errors import StoreExistsError

from .conftest import converted_an_hour_ago, jpeg_bytes, set_times, write
from .mongo_server import database
from .procs import KILLED_CONVERT, cli, run_script


def _images(root: Path, n: int = 3, seed: int = 0) -> None:
    for i in range(n):
        write(root / "img" / f"{i:03d}.jpg", jpeg_bytes(seed=seed + i))


def test_an_append_does_not_store_a_file_again_under_another_name(tmp_path: Path) -> None:
    root = tmp_path / "m"
    _images(root)
    os.symlink("img", root / "link")
    manifest = root / "a.csv"
    manifest.write_text("path,label\nimg/000.jpg,a\nimg/001.jpg,b\n")
    dst = tmp_path / "a.lmdb"
    convert(manifest, dst)
    manifest.write_text(f"path,label\n{root}/img/001.jpg,b\nlink/000.jpg,a\nimg/002.jpg,b\n")
    report = convert(manifest, dst, append=True)
    assert report.count == 3  # only img/002.jpg is new
    reasons = {s.name: s.reason for s in report.skipped}
    assert "the same file as the stored img/001.jpg" in reasons[f"{root}/img/001.jpg"]
    assert "the same file as the stored img/000.jpg" in reasons["link/000.jpg"]
    assert verify_store(open_store(dst)).ok


def test_a_changed_label_and_a_stored_file_turned_fifo_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "m"
    _images(root)
    manifest = root / "l.csv"
    manifest.write_text("path,label\nimg/000.jpg,a\nimg/001.jpg,a\n")
    dst = tmp_path / "l.lmdb"
    convert(manifest, dst)
    (root / "img" / "001.jpg").unlink()
    os.mkfifo(root / "img" / "001.jpg")
    manifest.write_text("path,label\nimg/000.jpg,b\nimg/001.jpg,a\nimg/002.jpg,a\n")
    report = convert(manifest, dst, append=True)  # used to fail: "a skipped file is stored"
    changed = {c.name: c.reason for c in report.changed}
    assert "labelled 'b' now, 'a' in the store" in changed["img/000.jpg"]
    assert "not a regular file" in changed["img/001.jpg"]
    assert report.count == 3 and verify_store(open_store(dst)).ok


def test_a_change_is_reported_at_every_append_until_it_is_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(3):
        write(src / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
    converted = converted_an_hour_ago(monkeypatch)
    set_times(src, converted - 60)  # the images, older than the store
    convert(src, dst)
    target = src / "a" / "1.jpg"
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF
    target.write_bytes(bytes(data))  # same size, other bytes,
    os.utime(target, (converted + 1800,) * 2)  # changed after the store, before the appends
    for k in range(2):  # each append adds an image (and so rewrites the store's times)
        write(src / "b" / f"{k}.jpg", jpeg_bytes(seed=100 + k))
        report = convert(src, dst, append=True)
        assert [c.name for c in report.changed] == ["a/1.jpg"], k


@pytest.mark.parametrize(
    "label, why",
    [
        ("10000000000", "too large"),
        ("\u00b2", "unknown class"),
        ("9" * 5000, "too large"),
        ("\u0663", "unknown class"),
        ("2.5", "not a whole number"),
    ],
)
def test_a_hostile_label_is_a_bad_row(tmp_path: Path, label: str, why: str) -> None:
    root = tmp_path / "m"
    _images(root, 2)
    manifest = root / "h.csv"
    manifest.write_text(f"path,label\nimg/000.jpg,0\nimg/001.jpg,{label}\n", encoding="utf-8")
    result = cli("convert", str(manifest), str(tmp_path / "h.lmdb"), "-q")
    assert "Traceback" not in result.stderr
    if why == "unknown class":  # a name among numbers: the manifest needs a class list
        assert result.returncode == 2 and "mix class names and numbers" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert why in result.stdout


def test_json_nested_too_deep_and_float_labels(tmp_path: Path) -> None:
    root = tmp_path / "m"
    _images(root, 3)
    deep = root / "deep.jsonl"
    deep.write_text(json.dumps({"path": "img/000.jpg", "label": 0}) + "\n" + "[" * 200000 + "\n")
    result = cli("convert", str(deep), str(tmp_path / "d.lmdb"), "-q")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "not valid JSON" in result.stdout
    rows = [("img/000.jpg", "0.0"), ("img/001.jpg", "2.0"), ("img/002.jpg", "1")]
    csv = root / "f.csv"
    csv.write_text("path,label\n" + "".join(f"{p},{k}\n" for p, k in rows))
    jsonl = root / "f.jsonl"
    jsonl.write_text("".join(json.dumps({"path": p, "label": float(k)}) + "\n" for p, k in rows))
    for manifest in (csv, jsonl):
        dst = tmp_path / f"{manifest.name}.lmdb"
        convert(manifest, dst)
        assert open_store(dst).labels.tolist() == [0, 2, 1]


def test_printed_mongo_commands_are_quoted_for_the_shell(tmp_path: Path, mongo_uri: str) -> None:
    src = tmp_path / "src"
    for i in range(12):
        write(src / f"c{i % 2}" / f"{i:02d}.jpg", jpeg_bytes(seed=i))
    uri = f"{mongo_uri}?appname=x&connectTimeoutMS=5000"
    result = run_script(KILLED_CONVERT, src, uri, 2, "-c", "sp ace")
    assert result.returncode == -signal.SIGKILL, result.stderr
    info = cli("info", uri, "-c", "sp ace")
    printed = info.stderr.split("`")[1]
    assert "'sp ace'" in printed and f"'{uri}'" in printed
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent.parent),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(["bash", "-c", printed], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert len(open_store(mongo_uri, collection="sp ace")) == 12
    assert database(mongo_uri).list_collection_names().count("src") == 0  # nothing else written


def test_info_names_an_interrupted_append_and_an_interrupted_replacement(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(6):
        write(src / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
    convert(src, dst)
    for i in range(8):
        write(src / "b" / f"{i}.jpg", jpeg_bytes(seed=50 + i))
    assert run_script(KILLED_CONVERT, src, dst, 1, "--append").returncode == -signal.SIGKILL
    info = cli("info", str(dst))
    assert info.returncode == 0 and "an append was interrupted" in info.stdout
    printed = info.stdout.split("`")[1]
    assert "--append" in printed and "--resume" in printed
    # a plain --resume (without --append) names the command that finishes it
    with pytest.raises(StoreExistsError, match="an append to this store was interrupted"):
        convert(src, dst, resume=True)
    done = cli(*shlex.split(printed)[1:], "-q")
    assert done.returncode == 0, done.stderr
    assert len(open_store(dst)) == 14
    other = tmp_path / "other"
    for i in range(8):
        write(other / "z" / f"{i}.jpg", jpeg_bytes(seed=90 + i))
    result = run_script(KILLED_CONVERT, other, dst, 1, "--overwrite")
    assert result.returncode == -signal.SIGKILL
    info = cli("info", str(dst))
    assert "a replacement (--overwrite) was interrupted" in info.stdout
    done = cli(*shlex.split(info.stdout.split("`")[1])[1:], "-q")
    assert done.returncode == 0, done.stderr
    assert open_store(dst).meta.classes == ["z"]


def test_a_plain_append_continues_an_interrupted_one(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(4):
        write(src / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
    convert(src, dst)
    for i in range(10):
        write(src / "b" / f"{i}.jpg", jpeg_bytes(seed=60 + i))
    code = KILLED_CONVERT.replace("commit_records=2,", "commit_records=2, verify_decode=True,")
    assert run_script(code, src, dst, 2, "--append").returncode == -signal.SIGKILL
    out = cli("convert", str(src), str(dst), "--append", "-q")
    assert out.returncode == 0, out.stderr
    assert "resumed after" in out.stdout and "--verify-decode" in out.stdout
    assert len(open_store(dst)) == 14


def test_a_resume_keeps_the_file_size_limit(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(12):
        write(src / "a" / f"{i:02d}.jpg", jpeg_bytes(seed=i))
    code = KILLED_CONVERT.replace("commit_records=2,", "commit_records=2, max_file_bytes=1 << 20,")
    assert run_script(code, src, dst, 2).returncode == -signal.SIGKILL
    refused = cli("convert", str(src), str(dst), "--resume", "--max-file-size", "10", "-q")
    assert refused.returncode == 2 and "--max-file-size 1048576" in refused.stderr
    done = cli("convert", str(src), str(dst), "--resume", "-q")
    assert done.returncode == 0 and len(open_store(dst)) == 12


def test_refusals_leave_an_empty_folder_and_a_new_database_alone(
    tmp_path: Path, mongo_uri: str
) -> None:
    src = tmp_path / "src"
    _images(src)
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["--append"], ["--resume"]):
        result = cli("convert", str(src), str(empty), "-q", *args)
        assert result.returncode == 2 and list(empty.iterdir()) == []
    result = cli("copy", str(tmp_path / "nothing.lmdb"), str(empty), "-q", "--resume")
    assert list(empty.iterdir()) == []
    db = database(mongo_uri)
    result = cli("convert", str(src), mongo_uri, "-c", "z", "--resume", "-q")
    assert result.returncode == 2 and db.list_collection_names() == []


@pytest.mark.parametrize(
    "uri",
    [
        "mongodb://127.0.0.1:1/db/x",
        "mongodb://127.0.0.1:99999/db",
        "mongodb://127.0.0.1:1/db?foo=bar",
        "mongodb://u:p@ss@127.0.0.1:1/db",
        "mongodb+srv://127.0.0.1/db",
    ],
)
def test_a_malformed_mongo_uri_is_one_line(uri: str) -> None:
    result = cli("info", uri, "-c", "x", "--timeout", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a usable MongoDB URI" in result.stderr and "p@ss" not in result.stderr


def test_verify_names_a_missing_record(good_folder: Path, tmp_path: Path) -> None:
    import lmdb

    dst = tmp_path / "s.lmdb"
    convert(good_folder, dst)
    env = lmdb.open(str(dst))
    with env.begin(write=True) as txn:
        txn.delete(b"%010d" % 7)
    env.close()
    result = cli("verify", str(dst))
    assert result.returncode == 1
    assert "the records are 0 .. count-1, each once" in result.stdout


def test_a_copy_of_a_store_that_grew_since_is_refused_without_a_false_hint(
    good_folder: Path, tmp_path: Path
) -> None:
    from .procs import KILLED_COPY

    src = tmp_path / "b.lmdb"
    convert(good_folder, src)
    assert run_script(KILLED_COPY, src, tmp_path / "c.lmdb", 1).returncode == -signal.SIGKILL
    write(good_folder / "fox" / "0.jpg", jpeg_bytes(seed=99))
    convert(good_folder, src, append=True)
    with pytest.raises(StoreExistsError) as refused:
        copy_store(src, tmp_path / "c.lmdb", resume=True)
    assert "changed since" in str(refused.value) and "finish it with" not in str(refused.value)
    assert copy_store(src, tmp_path / "c.lmdb", overwrite=True).count == 13


def test_subset_indices_are_one_sequence(good_folder: Path, tmp_path: Path) -> None:
    import numpy as np

    from fastdata import LMDBImageDataset

    dst = tmp_path / "s.lmdb"
    convert(good_folder, dst)
    ds = LMDBImageDataset(dst)
    for bad in (3, np.array(3), np.array([[1, 2], [3, 4]])):
        with pytest.raises(TypeError, match="one sequence"):
            ds.subset(indices=bad)
    with pytest.raises(IndexError, match="index 9223372036854775808 out of range"):
        ds.subset(indices=np.array([2**63], dtype=np.uint64))
