from pathlib import Path

import lmdb
import pytest

from fastdata import convert, export_store, open_store
from fastdata.errors import (
    CorruptImageError,
    IncompleteStoreError,
    SourceError,
    StoreError,
    StoreExistsError,
)
from fastdata.stores.lmdb.writer import LMDBWriter

from .conftest import jpeg_bytes, snapshot, write
from .procs import cli

CORRUPT = {"a_class/truncated.jpg", "a_class/empty.jpg", "a_class/text.jpg"}


def test_round_trip_is_byte_identical(mixed_folder: Path, tmp_path: Path) -> None:
    before = snapshot(mixed_folder)
    report = convert(mixed_folder, tmp_path / "s.lmdb", workers=3)
    assert snapshot(mixed_folder) == before  # the source folder is never written to
    assert {s.name for s in report.skipped} == CORRUPT
    assert report.repaired == 1
    assert report.non_image_files == 1
    out = tmp_path / "out"
    export_store(open_store(tmp_path / "s.lmdb"), out)
    exported = snapshot(out)
    expected = {
        name: data
        for name, data in before.items()
        if name not in CORRUPT and not name.endswith(".txt") and "/." not in "/" + name
    }
    assert exported == expected


def test_repairs_and_formats_recorded_per_record(mixed_folder: Path, tmp_path: Path) -> None:
    convert(mixed_folder, tmp_path / "s.lmdb")
    store = open_store(tmp_path / "s.lmdb")
    records = {r.header.name: r for r in store.iter_records()}
    fixed = records["a_class/missing_eoi.jpg"]
    assert fixed.header.repaired and fixed.data.endswith(b"\xff\xd9")
    assert not records["a_class/trailing.jpg"].header.repaired
    assert records["a_class/trailing.jpg"].data.endswith(b"appended data")
    assert records["a_class/png_named.jpg"].header.format == "png"
    assert store.meta.repairs == 1
    assert sorted(s.name for s in store.skipped_files()) == sorted(CORRUPT)


def test_skipped_reasons_say_what_is_wrong(mixed_folder: Path, tmp_path: Path) -> None:
    report = convert(mixed_folder, tmp_path / "s.lmdb")
    reasons = {s.name: s.reason for s in report.skipped}
    assert "empty" in reasons["a_class/empty.jpg"]
    assert "not a recognised image format" in reasons["a_class/text.jpg"]
    assert "truncated" in reasons["a_class/truncated.jpg"]


def test_strict_stops_at_first_unusable_file(mixed_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(CorruptImageError, match=r"empty.jpg: empty file"):
        convert(mixed_folder, tmp_path / "s.lmdb", strict=True)


def test_verify_decode_skips_undecodable(tmp_path: Path) -> None:
    root = tmp_path / "src"
    write(root / "c" / "ok.jpg", jpeg_bytes())
    # a valid PNG signature and header, cut short: passes the sniff, fails the decode
    from .conftest import png_bytes

    write(root / "c" / "cut.png", png_bytes()[:60])
    assert convert(root, tmp_path / "a.lmdb").count == 2
    report = convert(root, tmp_path / "b.lmdb", verify_decode=True)
    assert report.count == 1 and [s.name for s in report.skipped] == ["c/cut.png"]


def test_existing_store_needs_overwrite(good_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    convert(good_folder, dst)
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        convert(good_folder, dst)
    write(good_folder / "cat" / "extra.jpg", jpeg_bytes(seed=99))
    assert convert(good_folder, dst, overwrite=True).count == 13
    assert len(open_store(dst)) == 13


def test_refuses_foreign_folder_and_inside_source(good_folder: Path, tmp_path: Path) -> None:
    write(tmp_path / "busy" / "keep.txt", b"user data")
    with pytest.raises(StoreExistsError, match="not empty"):
        convert(good_folder, tmp_path / "busy", overwrite=True)
    assert (tmp_path / "busy" / "keep.txt").read_bytes() == b"user data"
    with pytest.raises(SourceError, match="inside the source folder"):
        convert(good_folder, good_folder / "store.lmdb")
    assert not (good_folder / "store.lmdb").exists()


class Interrupt(Exception):
    pass


def interrupt_after(monkeypatch: pytest.MonkeyPatch, commits: int) -> None:
    real = LMDBWriter.write
    calls = {"n": 0}

    def write(self, records, progress):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > commits:
            raise Interrupt()
        real(self, records, progress)

    monkeypatch.setattr(LMDBWriter, "write", write)


def convert_interrupted(
    monkeypatch: pytest.MonkeyPatch, source: Path, dst: Path, *, commits: int
) -> None:
    """Convert, dying after ``commits`` committed batches of 2 records."""
    interrupt_after(monkeypatch, commits=commits)
    with pytest.raises(Interrupt):
        convert(source, dst, commit_records=2)
    monkeypatch.undo()


def test_interrupted_conversion_resumes_without_loss_or_duplicates(
    mixed_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    convert_interrupted(monkeypatch, mixed_folder, dst, commits=2)
    with pytest.raises(IncompleteStoreError, match="--resume"):
        open_store(dst)
    with pytest.raises(StoreExistsError, match="resume=True"):
        convert(mixed_folder, dst)
    report = convert(mixed_folder, dst, resume=True, commit_records=2)
    assert report.resumed_from > 0
    fresh = convert(mixed_folder, tmp_path / "fresh.lmdb")
    resumed, whole = open_store(dst), open_store(tmp_path / "fresh.lmdb")
    assert len(resumed) == len(whole) == fresh.count
    assert [(r.header, r.data) for r in resumed.iter_records()] == [
        (r.header, r.data) for r in whole.iter_records()
    ]
    assert list(resumed.labels) == list(whole.labels)
    assert resumed.meta.repairs == whole.meta.repairs
    assert sorted(s.name for s in resumed.skipped_files()) == sorted(CORRUPT)


def test_resume_refuses_changed_source(
    good_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    convert_interrupted(monkeypatch, good_folder, dst, commits=1)
    write(good_folder / "cat" / "000a.jpg", jpeg_bytes(seed=50))
    with pytest.raises(StoreError, match="changed since"):
        convert(good_folder, dst, resume=True)


def test_resume_of_complete_store_is_a_no_op(good_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    convert(good_folder, dst)
    report = convert(good_folder, dst, resume=True)
    assert report.converted == 0 and report.count == 12
    assert len(open_store(dst)) == 12


def test_map_grows_when_full(good_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    writer = LMDBWriter(dst, map_size=64 * 1024)  # far too small for 12 images
    report = convert(good_folder, writer)
    assert report.count == 12
    env = lmdb.open(str(dst), readonly=True, lock=False)
    assert env.info()["map_size"] > 64 * 1024
    env.close()
    assert len(open_store(dst).read_data(range(12))) == 12


def test_all_images_unusable_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "src" / "c" / "a.jpg", b"")
    with pytest.raises(SourceError, match="none of its 1 images"):
        convert(tmp_path / "src", tmp_path / "s.lmdb")


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("mongodb", marks=pytest.mark.mongo)])
@pytest.mark.parametrize("source", ["folder", "csv", "jsonl"])
def test_a_source_with_no_usable_image_converts_as_advised_once_fixed(
    tmp_path: Path, request: pytest.FixtureRequest, source: str, backend: str
) -> None:
    image = write(tmp_path / "src" / "c" / "a.jpg", b"not an image")
    src = tmp_path / "src"
    if source == "csv":
        src = write(src / "list.csv", b"path,label\nc/a.jpg,c\n")
    elif source == "jsonl":
        src = write(src / "list.jsonl", b'{"path": "c/a.jpg", "label": "c"}\n')
    if backend == "lmdb":
        dst, where = tmp_path / "s.lmdb", []
    else:
        dst, where = request.getfixturevalue("mongo_uri"), ["-c", "imgs"]
    result = cli("convert", str(src), str(dst), *where, "-q")
    assert result.returncode == 2, result.stderr
    assert "none of its 1 images could be used" in result.stderr
    assert "fix or remove them and convert again" in result.stderr
    if backend == "lmdb":
        assert not Path(dst).exists()  # nothing left behind to resume or overwrite
    image.write_bytes(jpeg_bytes())  # fixed, and converted again: the same command
    result = cli("convert", str(src), str(dst), *where, "-q")
    assert result.returncode == 0, result.stderr
    reader = open_store(dst, collection="imgs" if where else None)
    assert [r.header.name for r in reader.iter_records()] == ["c/a.jpg"]
    reader.close()


def test_a_failed_overwrite_leaves_the_old_store_and_nothing_aside(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    write(src / "c" / "a.jpg", jpeg_bytes())
    convert(src, dst)
    write(tmp_path / "bad" / "c" / "a.jpg", b"")
    with pytest.raises(SourceError, match="none of its 1 images"):
        convert(tmp_path / "bad", dst, overwrite=True)
    assert not (dst / ".replacement").exists()
    assert [r.header.name for r in open_store(dst).iter_records()] == ["c/a.jpg"]
    with pytest.raises(StoreExistsError, match="a store exists already"):
        convert(src, dst)  # (no interrupted replacement to finish)


def test_progress_callback_reaches_total(good_folder: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    convert(good_folder, tmp_path / "s.lmdb", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (12, 12)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_plain_lmdb_client_reads_the_store(good_folder: Path, tmp_path: Path) -> None:
    import json

    import numpy as np

    dst = tmp_path / "s.lmdb"
    report = convert(good_folder, dst)
    # the file holds its content, not the (sparse) map it was written through
    assert (dst / "data.mdb").stat().st_size < 2 * report.total_bytes + (1 << 20)
    env = lmdb.open(str(dst), readonly=True, lock=False)
    with env.begin() as txn:
        meta = json.loads(txn.get(b"__fastdata__"))
        assert meta["format"] == "fastdata" and meta["version"] == 1 and meta["count"] == 12
        assert meta["class_to_idx"] == {"cat": 0, "dog": 1, "eel": 2}
        labels = np.frombuffer(txn.get(b"__labels__"), dtype="<i4")
        assert labels.tolist() == [0] * 5 + [1] * 4 + [2] * 3
        assert int(txn.get(b"__len__")) == 12
        keys = txn.get(b"__keys__").split(b"\n")
        assert keys[0] == b"0000000000" and len(keys) == 12
        assert txn.get(b"0000000006") == (good_folder / "dog" / "001.jpg").read_bytes()
        header = json.loads(txn.get(b"#0000000006"))
        assert header["name"] == "dog/001.jpg" and header["label"] == 1
        cursor = txn.cursor()
        assert cursor.set_range(b"0")
        walked = [k for k, _ in cursor][:12]
    env.close()
    assert walked == keys  # a cursor walks the records in index order


def test_resume_after_machine_restart_is_refused(
    good_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastdata.stores.lmdb.writer as lmdb_writer

    dst = tmp_path / "s.lmdb"
    convert_interrupted(monkeypatch, good_folder, dst, commits=1)
    monkeypatch.setattr(lmdb_writer, "boot_id", lambda: "another-boot")
    with pytest.raises(StoreError, match="machine restarted"):
        convert(good_folder, dst, resume=True)
    assert convert(good_folder, dst, overwrite=True).count == 12


def test_skipped_files_are_saved_once_outside_the_progress_and_the_metadata(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    write(src / "c" / "ok.jpg", jpeg_bytes())
    for i in range(300):
        (src / "c" / f"{'n' * 100}{i:04d}.jpg").touch()  # empty: skipped
    dst = tmp_path / "s.lmdb"
    report = convert(src, dst, commit_records=1)
    assert report.count == 1 and len(report.skipped) == 300
    env = lmdb.open(str(dst), readonly=True, lock=False)
    with env.begin() as txn:
        progress, meta = txn.get(b"#progress"), txn.get(b"__fastdata__")
        entries = [k for k, _ in txn.cursor() if k.startswith(b"#skipped/")]
    env.close()
    assert len(progress) < 1024 and len(meta) < 2048  # a count, not 300 names
    assert len(entries) == 300
    store = open_store(dst)
    assert store.meta.skipped_count == 300
    assert [s.name for s in store.skipped_files()] == [s.name for s in report.skipped]


def test_info_counts_skipped_files_and_lists_them_on_request(
    mixed_folder: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from fastdata.cli import cli

    convert(mixed_folder, tmp_path / "s.lmdb")
    plain = CliRunner().invoke(cli, ["info", str(tmp_path / "s.lmdb")])
    assert plain.exit_code == 0 and "skipped:    3" in plain.output
    assert "a_class/empty.jpg" not in plain.output and "--skipped" in plain.output
    listed = CliRunner().invoke(cli, ["info", str(tmp_path / "s.lmdb"), "--skipped"])
    assert listed.exit_code == 0
    assert all(name in listed.output for name in CORRUPT)


def test_reader_threads_are_chosen_by_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that wait (a cold disk, a network file system) get threads; order is kept."""
    import time

    import importlib

    threads = importlib.import_module("fastdata.ops.threads")

    monkeypatch.setattr(threads, "PROBE_CHUNKS", 12)
    monkeypatch.setattr(threads, "RETUNE_CHUNKS", 40)

    def waits(x: int) -> int:
        time.sleep(0.004)
        return x * 2

    chosen: list[int] = []
    out = list(threads.tuned_map(waits, range(300), 8, chosen))
    assert out == [x * 2 for x in range(300)]
    assert chosen and all(k >= 4 for k in chosen)  # waiting reads overlap in threads
    busy: list[int] = []
    assert list(threads.tuned_map(lambda x: x, range(5), 8, busy)) == list(range(5))
