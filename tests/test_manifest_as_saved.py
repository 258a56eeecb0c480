"""Manifests as users save them: spreadsheet byte-order marks, spaces after commas, numbered
labels, one file named two ways, the store beside the manifest, long rows, exports that never
put two images in one file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, convert, export_store, open_store
from fastdata.sources.export_layout import export_name
from fastdata.sources.manifest import scan_manifest

from .conftest import jpeg_bytes, snapshot, write
from .procs import cli


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for i in range(12):
        write(root / "img" / f"{i:02d}.jpg", jpeg_bytes(seed=i))
    return root


def test_a_byte_order_mark_is_not_part_of_the_first_line(data: Path, tmp_path: Path) -> None:
    csv = data / "excel.csv"
    csv.write_bytes(b"\xef\xbb\xbfpath,label\r\nimg/00.jpg,cat\r\nimg/01.jpg,dog\r\n")
    assert LMDBImageDataset(_convert(csv, tmp_path)).classes == ["cat", "dog"]
    jsonl = data / "ordered.jsonl"
    rows = [{"classes": ["dog", "cat"]}, {"path": "img/00.jpg", "label": "cat"}]
    jsonl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    ds = LMDBImageDataset(_convert(jsonl, tmp_path))
    assert ds.classes == ["dog", "cat"] and list(ds.targets) == [1]  # the order given is kept


def _convert(manifest: Path, tmp_path: Path) -> Path:
    dst = tmp_path / f"{manifest.name}.lmdb"
    convert(manifest, dst)
    return dst


def test_spaces_around_csv_fields_are_trimmed(data: Path, tmp_path: Path) -> None:
    csv = data / "spaced.csv"
    csv.write_text("path, label\nimg/00.jpg, cat\n img/01.jpg ,cat\nimg/02.jpg,dog \n")
    ds = LMDBImageDataset(_convert(csv, tmp_path))
    assert ds.classes == ["cat", "dog"] and list(ds.targets) == [0, 0, 1]


def test_numbered_labels_mean_the_same_in_csv_and_json_lines(data: Path, tmp_path: Path) -> None:
    labels = list(range(12))
    csv = data / "numbers.csv"
    csv.write_text("path,label\n" + "".join(f"img/{i:02d}.jpg,{i}\n" for i in labels))
    jsonl = data / "numbers.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"path": f"img/{i:02d}.jpg", "label": i}) + "\n" for i in labels)
    )
    for manifest in (csv, jsonl):
        ds = LMDBImageDataset(_convert(manifest, tmp_path))
        assert list(ds.targets) == labels  # label 2 is target 2, not the 5th of a string sort
        assert ds.classes == [str(i) for i in labels]
    given = data / "given.csv"
    given.write_text("path,label\nimg/00.jpg,2\nimg/01.jpg,b\n")
    dst = tmp_path / "given.lmdb"
    convert(given, dst, classes=["a", "b", "c"])
    assert list(LMDBImageDataset(dst).targets) == [2, 1]


def test_one_file_named_two_ways_is_one_record(data: Path, tmp_path: Path) -> None:
    csv = data / "twice.csv"
    absolute = data / "img" / "03.jpg"
    os.symlink(data / "img" / "04.jpg", data / "img" / "alias.jpg")
    csv.write_text(
        "path,label\n"
        f"img/03.jpg,cat\n{absolute},cat\n./img/../img/03.jpg,dog\n"
        "img/04.jpg,dog\nimg/alias.jpg,dog\n"
    )
    dst = tmp_path / "twice.lmdb"
    report = convert(csv, dst)
    assert report.count == 2
    assert sorted(s.name for s in report.skipped) == ["twice.csv:3", "twice.csv:4", "twice.csv:6"]
    assert all("the same file as line" in s.reason for s in report.skipped)


def test_the_store_may_sit_beside_the_manifest(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (data / "labels.csv").write_text("path,label\nimg/00.jpg,cat\nimg/01.jpg,dog\n")
    monkeypatch.chdir(data)
    result = cli("convert", "labels.csv", "labels.lmdb", "-q")
    assert result.returncode == 0, result.stderr
    assert len(open_store(data / "labels.lmdb")) == 2
    # where the images are, it may not
    inside = cli("convert", "labels.csv", "img", "-q", "--overwrite")
    assert inside.returncode == 2 and "where the manifest's images are" in inside.stderr
    assert sorted(p.name for p in (data / "img").iterdir())[:2] == ["00.jpg", "01.jpg"]


def test_duplicates_are_found_in_one_sort(data: Path, tmp_path: Path) -> None:
    csv = data / "many.csv"
    csv.write_text("path,label\n" + "img/00.jpg,cat\n" * 12000)
    began = time.perf_counter()
    scan = scan_manifest(csv)
    many = time.perf_counter() - began
    assert len(scan.samples) == 1 and len(scan.unusable) == 11999
    # the work grows with the rows, not their square: 10x the rows cost about 10x (a quadratic
    # search cost 100x); measured against a tenth of the rows, in the same run
    csv.write_text("path,label\n" + "img/00.jpg,cat\n" * 1200)
    began = time.perf_counter()
    scan_manifest(csv)
    few = time.perf_counter() - began
    assert many < 40 * few + 0.5


def test_a_json_lines_row_over_the_limit_is_listed(data: Path, tmp_path: Path) -> None:
    from fastdata.sources.rows import MAX_ROW_BYTES

    jsonl = data / "long.jsonl"
    long_row = json.dumps({"path": "img/01.jpg", "label": "cat", "x": "y" * MAX_ROW_BYTES})
    jsonl.write_text(json.dumps({"path": "img/00.jpg", "label": "cat"}) + "\n" + long_row + "\n")
    scan = scan_manifest(jsonl)
    assert len(scan.samples) == 1
    assert [s.reason for s in scan.unusable] == [f"line 2: longer than {MAX_ROW_BYTES} bytes"]


def test_export_never_puts_two_images_in_one_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(tmp_path / "x.jpg", jpeg_bytes(seed=1))
    write(root / "_up" / "x.jpg", jpeg_bytes(seed=2))
    write(root / "_" / "y.jpg", jpeg_bytes(seed=3))
    write(root / "manifest.jsonl", jpeg_bytes(seed=4))
    csv = root / "m.csv"
    csv.write_text("path,label\n../x.jpg,a\n_up/x.jpg,b\n_/y.jpg,a\nmanifest.jsonl,b\n")
    dst = tmp_path / "m.lmdb"
    convert(csv, dst)
    out = tmp_path / "out"
    report = export_store(open_store(dst), out, overwrite=True)
    files = snapshot(out)
    assert report.files == 4 and len(files) == 5  # four images and the manifest
    assert files["_up/x.jpg"] == (tmp_path / "x.jpg").read_bytes()
    assert files["_/_up/x.jpg"] == (root / "_up" / "x.jpg").read_bytes()
    names = ["a", "/a", "../a", "../../a", "_up/a", "_/a", "_root/a", "/_root/a", "../_up/a"]
    mapped = [export_name(n) for n in names]
    assert len(set(mapped)) == len(names)
    # and the exported manifest converts back to the same images
    again = tmp_path / "again.lmdb"
    convert(out / "manifest.jsonl", again)
    assert sorted(bytes(d) for d, _ in open_store(again).read_samples(range(4))) == sorted(
        bytes(d) for d, _ in open_store(dst).read_samples(range(4))
    )


def test_a_class_list_that_leaves_out_used_classes_is_refused_unless_asked(
    data: Path, tmp_path: Path
) -> None:
    csv = data / "four.csv"
    rows = ["a", "b", "c", "d", "c", "d", "d"]
    csv.write_text("path,label\n" + "".join(f"img/{i:02d}.jpg,{k}\n" for i, k in enumerate(rows)))
    listing = data / "classes.txt"
    listing.write_text("a\nb\n")
    result = cli("convert", str(csv), str(tmp_path / "r.lmdb"), "--classes", str(listing), "-q")
    assert result.returncode == 2
    assert "leaves out 2 class(es) the manifest uses: 'd' (3 rows), 'c' (2 rows)" in result.stderr
    assert not (tmp_path / "r.lmdb").exists()
    dropped = cli(
        "convert",
        str(csv),
        str(tmp_path / "d.lmdb"),
        "--classes",
        str(listing),
        "--drop-unlisted-classes",
        "-q",
    )
    assert dropped.returncode == 0, dropped.stderr
    assert len(open_store(tmp_path / "d.lmdb")) == 2 and "unknown class 'd'" in dropped.stdout
