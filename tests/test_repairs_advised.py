"""What ``verify`` advises for a damaged store repairs it: each command it prints runs as
printed (in a shell, from where verify ran) and leaves out what verify named, on LMDB and on
MongoDB; and it never advises a conversion that would give a store other than the one it had."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastdata import convert, export_store, open_store
from fastdata.errors import RecordError
from fastdata.images.decode import has_turbo

from .conftest import jpeg_bytes, snapshot, write
from .procs import REPO, cli
from .test_damaged_stores import flip_a_byte

# (damaged pixel data is found by libjpeg-turbo's strict decode; Pillow decodes it leniently)
pytestmark = pytest.mark.skipif(not has_turbo(), reason="needs libjpeg-turbo (simplejpeg)")


def undecodable_jpeg(seed: int) -> bytes:
    """A JPEG whose every marker is in place (so it is stored as it is) but whose scan data is
    damaged: restart markers where none belong, halfway through."""
    data = bytearray(jpeg_bytes(seed=seed))
    middle = (data.find(b"\xff\xda") + len(data)) // 2
    data[middle : middle + 6] = b"\xff\xd3\xff\xd5\xff\xd1"
    return bytes(data)


def folder(root: Path, classes: tuple[str, ...], bad: str | None = None) -> Path:
    for k, cls in enumerate(classes):
        for i in range(3):
            write(root / cls / f"{i}.jpg", jpeg_bytes(seed=10 * k + i))
    if bad is not None:
        write(root / bad, undecodable_jpeg(99))
    return root


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` run in a shell as a user would paste it, `fastdata` being this checkout's."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        command, shell=True, capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def verify_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return shell(" ".join(["fastdata", "verify", *args, "-q"]), cwd)


def commands(advice: str) -> dict[str, str]:
    """The commands an advice prints, by verb."""
    return {c.split()[1]: c for c in re.findall(r"`(fastdata [^`]+)`", advice)}


def check_repairs(store_words: str, source: Path, cwd: Path, count: int) -> None:
    """verify --decode of the store (``store_words``: as command-line words) names the record
    that does not decode; the export it advises leaves it out and says so (exit 1); the
    conversion it advises gives a store without it, which passes verify --decode."""
    found = verify_in(cwd, store_words, "--decode")
    assert found.returncode == 1, found.stdout + found.stderr
    assert "cat/bad.jpg: damaged JPEG data" in found.stdout
    advised = commands(found.stdout)
    elsewhere = cwd / "elsewhere"  # the commands run from any folder (absolute paths)
    elsewhere.mkdir(exist_ok=True)

    exported = shell(advised["export"], elsewhere)
    assert exported.returncode == 1, exported.stdout + exported.stderr
    assert "left out 1 record(s) that do not decode:" in exported.stdout
    assert "(cat/bad.jpg): damaged JPEG data" in exported.stdout
    words = shlex.split(advised["export"])
    out = Path(words[words.index("--skip-damaged") - 1])
    assert out.is_absolute() and out.parent == cwd
    files = snapshot(out)
    assert "cat/bad.jpg" not in files and len(files) == count
    assert files == {name: (source / name).read_bytes() for name in files}

    assert set(advised) == {"export", "convert"}, found.stdout
    assert "--verify-decode" in advised["convert"]
    converted = shell(advised["convert"], elsewhere)
    assert converted.returncode == 0, converted.stdout + converted.stderr
    assert "cat/bad.jpg: damaged JPEG data" in converted.stdout  # skipped, and said so
    again = verify_in(cwd, store_words, "--decode")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{count} records OK (sizes, checksums, fields and scan ends, decoding)" in again.stdout


def test_both_repairs_verify_advises_work_on_lmdb(tmp_path: Path) -> None:
    source = folder(tmp_path / "src", ("cat", "dog"), bad="cat/bad.jpg")
    convert(source, tmp_path / "my store.lmdb")  # (a name the shell must be given quoted)
    check_repairs("'my store.lmdb'", source, tmp_path, 6)


@pytest.mark.mongo
def test_both_repairs_verify_advises_work_on_mongodb(tmp_path: Path, mongo_uri: str) -> None:
    source = folder(tmp_path / "src", ("cat", "dog"), bad="cat/bad.jpg")
    uri = f"{mongo_uri}?appName=fastdata&connectTimeoutMS=20000"  # (an & for the shell)
    convert(source, uri, collection="big coll")
    check_repairs(f"'{uri}' --collection 'big coll'", source, tmp_path, 6)


def test_an_appended_store_is_never_advised_a_conversion_that_renumbers_it(
    tmp_path: Path,
) -> None:
    """The store grew by an append that added a class at the end of its list: converting its
    first source again would give other labels (and lack what the append added)."""
    store = tmp_path / "s.lmdb"
    convert(folder(tmp_path / "first", ("cat", "dog"), bad="cat/bad.jpg"), store)
    report = convert(folder(tmp_path / "more", ("ant",)), store, append=True)
    assert report.classes == ["cat", "dog", "ant"]
    found = verify_in(tmp_path, "s.lmdb", "--decode")
    assert found.returncode == 1
    assert "--overwrite" not in found.stdout and "fastdata convert" not in found.stdout
    assert "it grew by --append" in found.stdout and "numbered in sorted order" in found.stdout
    advised = commands(found.stdout)
    assert set(advised) == {"export"}
    exported = shell(advised["export"], tmp_path)
    assert exported.returncode == 1 and "that do not decode" in exported.stdout
    # converted back, the export's folder would number the classes in sorted order: said
    assert "sorted order" in exported.stdout and "labels would change" in exported.stdout


def test_export_decode_refuses_an_undecodable_record_unless_told_to_skip(tmp_path: Path) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder(tmp_path / "src", ("cat",), bad="cat/bad.jpg"), store)
    with pytest.raises(RecordError, match=r"cat/bad.jpg\) does not decode.*skip_damaged=True"):
        export_store(open_store(store), tmp_path / "out", decode=True)
    report = export_store(open_store(store), tmp_path / "out2", decode=True, skip_damaged=True)
    index = [r.header.name for r in open_store(store).read_records(range(4))].index("cat/bad.jpg")
    assert report.files == 3 and [u.split(":")[0] for u in report.undecodable] == [
        f"record {index} (cat/bad.jpg)"
    ]
    plain = cli("export", str(store), str(tmp_path / "out3"), "--skip-damaged", "-q")
    assert plain.returncode == 0  # (without --decode, what is whole is copied: its checksum holds)


def test_an_export_stopped_by_a_damaged_record_finishes_as_its_message_says(
    tmp_path: Path,
) -> None:
    # the export stops at the damaged record with files already written: the options it names
    # (--skip-damaged and --resume) finish it; --skip-damaged alone was refused there
    src = folder(tmp_path / "src", ("a", "b"))
    store = tmp_path / "s.lmdb"
    convert(src, store)
    flip_a_byte(store, b"%010d" % 4)  # b/1.jpg
    out = tmp_path / "out"
    first = cli("export", str(store), str(out))
    assert first.returncode == 1, first.stderr
    assert "--skip-damaged" in first.stderr and "--resume" in first.stderr, first.stderr
    assert "skip_damaged=True" not in first.stderr
    written = snapshot(out)
    assert written  # it stopped part-way
    again = cli("export", str(store), str(out), "--skip-damaged", "--resume")
    assert again.returncode == 1, again.stderr  # a record left out: exit 1, as verify's repair
    assert "b/1.jpg" in again.stdout + again.stderr
    assert sorted(snapshot(out)) == ["a/0.jpg", "a/1.jpg", "a/2.jpg", "b/0.jpg", "b/2.jpg"]
    with pytest.raises(RecordError, match=r"skip_damaged=True and resume=True"):
        export_store(open_store(store), tmp_path / "api")


def test_an_export_removes_what_a_killed_export_left_only_when_resuming_one(tmp_path: Path) -> None:
    # ".fastdata-<pid>.tmp" of a process no longer running: a killed export's file, which
    # --resume removes; in a folder an export merely writes into, a user's own file of that name
    src = folder(tmp_path / "src", ("a",))
    store = tmp_path / "s.lmdb"
    convert(src, store)
    out = tmp_path / "out"
    mine = write(out / "a" / ".fastdata-4000000.tmp", b"my own file")
    result = cli("export", str(store), str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert mine.read_bytes() == b"my own file"
    result = cli("export", str(store), str(out), "--resume", "-q")
    assert result.returncode == 0, result.stderr
    assert not mine.exists()  # a resume continues an export: what a killed one left goes


def test_the_python_api_is_advised_arguments_for_a_manifest_it_did_not_write(
    tmp_path: Path,
) -> None:
    rows = tmp_path / "src" / "manifest.csv"
    write(tmp_path / "src" / "x.jpg", jpeg_bytes(seed=1))
    rows.write_text("path,label\nx.jpg,a\n", encoding="utf-8")
    store = tmp_path / "s.lmdb"
    convert(rows, store)
    out = tmp_path / "out"
    write(out / "manifest.jsonl", b"my own notes\n")
    with pytest.raises(Exception, match=r"pass overwrite=True to replace it") as info:
        export_store(open_store(store), out)
    assert "--overwrite" not in str(info.value)
    assert (out / "manifest.jsonl").read_bytes() == b"my own notes\n"


def test_the_export_verify_advises_for_a_page_lmdb_calls_corrupted_leaves_out_that_record(
    tmp_path: Path,
) -> None:
    """The first page of one record's value overwritten with noise: LMDB's lookup of that key
    fails (MDB_CORRUPTED, "page was wrong type"). verify named the record and advised
    `export --skip-damaged`, which stopped at that record with nothing written ("reading
    failed ... run fastdata verify"): the two commands sent the user to each other. The
    export now leaves that record out and writes every other; a dataset names the record."""
    import numpy as np
    from PIL import Image

    from fastdata import LMDBImageDataset

    source = tmp_path / "src"
    rng = np.random.default_rng(7)
    for i in range(12):  # noise: values of several pages each (overflow pages)
        pixels = rng.integers(0, 255, (96, 96, 3), dtype=np.uint8)
        (source / "c").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(source / "c" / f"{i:02d}.jpg", quality=95)
    store = tmp_path / "s.lmdb"
    convert(source, store)
    victim = 5
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    value = (source / "c" / f"{victim:02d}.jpg").read_bytes()
    at = raw.find(value)
    assert at > 0 and (at - 16) % 4096 == 0  # an overflow value: its page's header before it
    with open(data_file, "r+b") as f:
        f.seek(at - 16)
        f.write(np.random.default_rng(13).integers(0, 256, 4096, dtype=np.uint8).tobytes())

    ds = LMDBImageDataset(store, output="bytes")
    with pytest.raises(RecordError, match=f"record {victim}"):
        ds[victim]
    assert ds[victim + 1][0] == (source / "c" / f"{victim + 1:02d}.jpg").read_bytes()
    found = verify_in(tmp_path, shlex.quote(str(store)))
    assert found.returncode == 1, found.stdout + found.stderr
    advised = commands(found.stdout)
    exported = shell(advised["export"], tmp_path)
    assert exported.returncode == 1 and "Traceback" not in exported.stderr, exported.stderr
    assert "left out 1 damaged record(s)" in exported.stdout, exported.stdout + exported.stderr
    words = shlex.split(advised["export"])
    files = snapshot(Path(words[words.index("--skip-damaged") - 1]))
    assert sorted(files) == [f"c/{i:02d}.jpg" for i in range(12) if i != victim]
    assert files == {name: (source / name).read_bytes() for name in files}


class _Stop(Exception):
    pass


def _stopped_after(writer: type, commits: int, run: Callable[[], object]) -> None:
    """``run`` a write that dies after ``commits`` committed batches of ``writer``."""
    real, calls = writer.write, [0]

    def write(self, records, progress):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > commits:
            raise _Stop()
        real(self, records, progress)

    writer.write = write  # type: ignore[attr-defined]
    try:
        with pytest.raises(_Stop):
            run()
    finally:
        writer.write = real  # type: ignore[attr-defined]


def _with_unusable_files_first(root: Path, seeds: range) -> Path:
    for i in seeds:  # ("0..." sorts before the images: left out in the first batches)
        write(root / "cat" / f"{i}.jpg", jpeg_bytes(seed=i))
        write(root / "cat" / f"0bad{i}.jpg", b"not an image")
    return root


def _damage_lmdb_skipped_entry(store: Path, n: int) -> None:
    import lmdb

    from fastdata.stores.lmdb.layout import skipped_key

    env = lmdb.open(str(store), subdir=store.is_dir(), lock=False)
    with env.begin(write=True) as txn:
        assert txn.get(skipped_key(n)) is not None
        txn.put(skipped_key(n), b"{not json")
    env.close()


def _finishes_as_printed(said: str, cwd: Path, store_words: str, images: int) -> None:
    """The one command ``said`` advises runs as printed, and leaves a store that verifies with
    ``images`` records (the files left out listed again)."""
    assert "cannot resume" in said and "list of the files it left out is damaged" in said, said
    (command,) = re.findall(r"`(fastdata [^`]+)`", said)
    done = shell(command, cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0bad" in done.stdout  # the files it left out, listed again
    checked = verify_in(cwd, store_words)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{images} records OK" in checked.stdout


def test_an_interrupted_conversion_whose_skipped_list_is_damaged_is_started_over_as_said(
    tmp_path: Path,
) -> None:
    # info and verify said to resume; the resume said the store was damaged and to run verify,
    # which said to resume: now each names the way out that works (--overwrite), at once
    from fastdata.stores.lmdb.writer import LMDBWriter

    source = _with_unusable_files_first(tmp_path / "src", range(6))
    store = tmp_path / "s.lmdb"
    _stopped_after(LMDBWriter, 2, lambda: convert(source, store, commit_records=2))
    _damage_lmdb_skipped_entry(store, 1)
    resumed = cli("convert", str(source), str(store), "--resume")
    assert resumed.returncode == 2 and "verify" not in resumed.stderr, resumed.stderr
    assert "--overwrite instead of --resume" in resumed.stderr
    plain = cli("convert", str(source), str(store))
    assert plain.returncode == 2 and "cannot resume" in plain.stderr, plain.stderr
    for verb in ("verify", "info"):
        said = cli(verb, str(store))
        assert said.returncode == 1
        assert "--overwrite`" in said.stderr and "`fastdata verify" not in said.stderr, said.stderr
    _finishes_as_printed(cli("info", str(store)).stderr, tmp_path, "s.lmdb", 6)


def test_an_interrupted_append_whose_skipped_list_is_damaged_is_started_over_as_said(
    tmp_path: Path,
) -> None:
    from fastdata.stores.lmdb.writer import LMDBWriter

    source = _with_unusable_files_first(tmp_path / "src", range(3))
    store = tmp_path / "s.lmdb"
    convert(source, store)
    _with_unusable_files_first(source, range(3, 9))
    _stopped_after(LMDBWriter, 2, lambda: convert(source, store, append=True, commit_records=2))
    _damage_lmdb_skipped_entry(store, 3)  # (the first the append left out)
    resumed = cli("convert", str(source), str(store), "--append", "--resume")
    assert resumed.returncode == 2 and "run without --resume to discard it" in resumed.stderr
    info = cli("info", str(store))
    assert info.returncode == 0, info.stderr
    assert "an append was interrupted" in info.stdout and "--resume" not in info.stdout
    _finishes_as_printed(info.stdout, tmp_path, "s.lmdb", 9)


@pytest.mark.mongo
def test_an_interrupted_mongo_conversion_whose_skipped_list_is_damaged_is_started_over_as_said(
    tmp_path: Path, mongo_uri: str
) -> None:
    from fastdata.stores.mongo.layout import skipped_ids
    from fastdata.stores.mongo.writer import MongoWriter
    from fastdata.stores.names import META_COLLECTION, progress_id

    from .mongo_server import database

    source = _with_unusable_files_first(tmp_path / "src", range(6))
    _stopped_after(
        MongoWriter, 2, lambda: convert(source, mongo_uri, collection="c", commit_records=2)
    )
    meta = database(mongo_uri)[META_COLLECTION]
    store_id = meta.find_one({"_id": progress_id("c")})["store_id"]
    assert meta.update_many(skipped_ids(store_id), {"$set": {"items": [7]}}).modified_count
    said = cli("info", mongo_uri, "--collection", "c")
    assert said.returncode == 1
    _finishes_as_printed(said.stderr, tmp_path, f"'{mongo_uri}' --collection c", 6)


def _edit_lmdb_progress(store: Path, edit: Callable[[dict], object]) -> None:
    import json

    import lmdb

    env = lmdb.open(str(store), subdir=store.is_dir(), lock=False)
    with env.begin(write=True) as txn:
        saved = json.loads(bytes(txn.get(b"#progress")))
        edit(saved)
        txn.put(b"#progress", json.dumps(saved).encode())
    env.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.update(skipped_count=0),  # the list's entries no longer counted
        lambda p: p.update(next_sample=p["next_sample"] + 1),
        lambda p: p.update(count=p["count"] - 1),
        lambda p: p.update(first_index=5),  # (a conversion's first record is record 0)
    ],
    ids=["skipped-count", "next-sample", "count", "first-index"],
)
def test_an_interrupted_conversion_whose_counts_do_not_add_up_is_started_over_as_said(
    tmp_path: Path, damage: Callable[[dict], object]
) -> None:
    # info and verify said to resume; the resume stored the rest and then refused to finish
    # ("a fault in fastdata"), and info and verify said to resume again: a dead end
    from fastdata.stores.lmdb.writer import LMDBWriter

    source = _with_unusable_files_first(tmp_path / "src", range(6))
    store = tmp_path / "s.lmdb"
    _stopped_after(LMDBWriter, 2, lambda: convert(source, store, commit_records=2))
    _edit_lmdb_progress(store, damage)
    said = cli("info", str(store))
    assert said.returncode == 1 and "Traceback" not in said.stderr, said.stderr
    assert "--resume`" not in said.stderr and "fault in fastdata" not in said.stderr, said.stderr
    # the command that starts it over, or (where the progress no longer says its source) the
    # option that does
    printed = re.findall(r"`(fastdata [^`]+)`", said.stderr)
    assert printed or "convert again with --overwrite" in said.stderr, said.stderr
    command = printed[0] if printed else f"fastdata convert {source} {store} --overwrite"
    assert command.endswith("--overwrite")
    resumed = cli("convert", str(source), str(store), "--resume")
    assert resumed.returncode == 2 and "fault in fastdata" not in resumed.stderr, resumed.stderr
    done = shell(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    checked = verify_in(tmp_path, "s.lmdb")
    assert checked.returncode == 0 and "6 records OK" in checked.stdout, checked.stdout


def _stopped_with_skipped_entry(tmp_path: Path, n: int, entry: Callable[[bytes], Any]) -> Path:
    """A conversion of ``tmp_path/src`` into ``s.lmdb`` stopped after two batches, its skipped
    entry ``n`` then replaced by ``entry(first entry)``."""
    import lmdb

    from fastdata.stores.lmdb.layout import skipped_key
    from fastdata.stores.lmdb.writer import LMDBWriter

    source = _with_unusable_files_first(tmp_path / "src", range(6))
    store = tmp_path / "s.lmdb"
    _stopped_after(LMDBWriter, 2, lambda: convert(source, store, commit_records=2))
    env = lmdb.open(str(store), lock=False)
    with env.begin(write=True) as txn:
        value = entry(txn.get(skipped_key(0)))
        txn.put(skipped_key(n), value.encode() if isinstance(value, str) else value)
    env.close()
    return store


def test_an_interrupted_conversion_whose_skipped_list_names_a_file_twice_is_started_over(
    tmp_path: Path,
) -> None:
    store = _stopped_with_skipped_entry(tmp_path, 1, lambda first: first)
    said = cli("verify", str(store))
    assert said.returncode == 1 and "names a file twice" in said.stderr, said.stderr
    (command,) = re.findall(r"`(fastdata [^`]+)`", said.stderr)
    assert command.endswith("--overwrite")
    assert shell(command, tmp_path).returncode == 0
    assert "6 records OK" in verify_in(tmp_path, "s.lmdb").stdout


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("cat/elsewhere.jpg", "names cat/elsewhere.jpg, which it did not handle"),
        ("cat/0.jpg", "names files it stored"),
    ],
    ids=["a file it never handled", "a file it stored"],
)
def test_an_interrupted_conversion_whose_skipped_list_names_another_file_starts_over(
    tmp_path: Path, name: str, said: str
) -> None:
    # the store's names and labels are the scan's less the list: the resume stored the rest,
    # then refused to finish as "a fault in fastdata", or finished with the index of names of
    # other files than its records
    store = _stopped_with_skipped_entry(
        tmp_path, 0, lambda first: json.dumps({**json.loads(first), "name": name})
    )
    resumed = cli("convert", str(tmp_path / "src"), str(store), "--resume")
    assert resumed.returncode == 1, resumed.stderr
    assert said in resumed.stderr and "fault in fastdata" not in resumed.stderr, resumed.stderr
    (command,) = re.findall(r"`(fastdata [^`]+)`", resumed.stderr)
    assert command.endswith("--overwrite")
    assert shell(command, tmp_path).returncode == 0
    assert "6 records OK" in verify_in(tmp_path, "s.lmdb").stdout


@pytest.mark.parametrize("damage", ["negative-repairs", "nested-deep"])
def test_a_damaged_progress_is_never_resumed_into_a_store_verify_fails(
    tmp_path: Path, damage: str
) -> None:
    # repairs=-5 resumed to "repaired: -5", exit 0, and a store whose metadata verify called
    # damaged; JSON nested past Python's recursion limit printed a traceback
    import lmdb

    from fastdata.stores.lmdb.writer import LMDBWriter

    source = _with_unusable_files_first(tmp_path / "src", range(6))
    store = tmp_path / "s.lmdb"
    _stopped_after(LMDBWriter, 2, lambda: convert(source, store, commit_records=2))
    if damage == "negative-repairs":
        _edit_lmdb_progress(store, lambda p: p.update(repairs=-5))
    else:
        env = lmdb.open(str(store), lock=False)
        with env.begin(write=True) as txn:
            txn.put(b"#progress", b"[" * 100_000 + b"]" * 100_000)
        env.close()
    for verb in ("info", "verify"):
        said = cli(verb, str(store))
        assert said.returncode == 1 and "Traceback" not in said.stderr, said.stderr
        assert "damaged conversion progress" in said.stderr or "unreadable" in said.stderr
    resumed = cli("convert", str(source), str(store), "--resume")
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr, resumed.stdout
    over = cli("convert", str(source), str(store), "--overwrite")
    assert over.returncode == 0, over.stderr
    assert "6 records OK" in verify_in(tmp_path, "s.lmdb").stdout
