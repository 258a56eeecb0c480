"""Manifest sources: a CSV or JSON Lines file listing images and labels, into LMDB or MongoDB,
and back out by export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, MongoImageDataset, convert, export_store, open_store
from fastdata.errors import SourceError, UsageError
from fastdata.sources.manifest import scan_manifest

from .conftest import jpeg_bytes, png_bytes, snapshot, write
from .procs import cli, run_script


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """A flat folder (ImageNet's validation layout): images with no class folders."""
    root = tmp_path / "val"
    for i in range(6):
        write(root / f"img_{i:02d}.jpg", jpeg_bytes(seed=i))
    write(root / "sub" / "p.png", png_bytes())
    return root


def test_a_csv_manifest_converts_with_sorted_classes(images: Path, tmp_path: Path) -> None:
    manifest = images / "labels.csv"
    manifest.write_text(
        "id,label,path\n"  # columns in any order, others ignored
        "0,zebra,img_00.jpg\n"
        "1,ant,img_01.jpg\n"
        '2,"ant",sub/p.png\n'
        "3,zebra,img_03.jpg\n"
    )
    dst = tmp_path / "val.lmdb"
    report = convert(manifest, dst)
    assert report.count == 4 and not report.skipped
    ds = LMDBImageDataset(dst, output="bytes")
    assert ds.classes == ["ant", "zebra"]  # sorted like ImageFolder
    assert [n for n, _ in ds.samples] == ["img_00.jpg", "img_01.jpg", "sub/p.png", "img_03.jpg"]
    assert list(ds.targets) == [1, 0, 0, 1]  # the manifest's row order
    assert ds[2][0] == (images / "sub" / "p.png").read_bytes()
    assert open_store(dst).meta.layout == "manifest"


def test_jsonl_with_integer_labels_a_class_order_and_absolute_paths(
    images: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere" / "x.jpg"
    write(elsewhere, jpeg_bytes(seed=40))
    lines = [
        {"classes": ["n01", "n00"]},  # the order: label 0 is n01
        {"path": "img_00.jpg", "label": 1},
        {"path": str(elsewhere), "label": 0},
        {"path": "img_02.jpg", "label": "n00"},
    ]
    manifest = images / "val.jsonl"
    manifest.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "val.lmdb"
    convert(manifest, dst)
    ds = LMDBImageDataset(dst, output="bytes")
    assert ds.classes == ["n01", "n00"] and list(ds.targets) == [1, 0, 1]
    assert ds[1][0] == elsewhere.read_bytes()
    # a class list given by the caller, for a CSV of integers
    csv = images / "ints.csv"
    csv.write_text("path,label\nimg_03.jpg,2\nimg_04.jpg,0\n")
    convert(csv, tmp_path / "ints.lmdb", classes=["a", "b", "c"])
    ints = LMDBImageDataset(tmp_path / "ints.lmdb")
    assert ints.classes == ["a", "b", "c"] and list(ints.targets) == [2, 0]
    # without a class list, whole-number labels name classes "0".."N-1": a label is its target
    plain = images / "noclasses.jsonl"
    plain.write_text(json.dumps({"path": "img_00.jpg", "label": 3}) + "\n")
    convert(plain, tmp_path / "x.lmdb")
    numbered = LMDBImageDataset(tmp_path / "x.lmdb")
    assert numbered.classes == ["0", "1", "2", "3"] and list(numbered.targets) == [3]
    with pytest.raises(SourceError, match="mix class names and numbers"):
        mixed = images / "mixed.jsonl"
        mixed.write_text(
            json.dumps({"path": "img_00.jpg", "label": 3})
            + "\n"
            + json.dumps({"path": "img_01.jpg", "label": "cat"})
            + "\n"
        )
        convert(mixed, tmp_path / "x2.lmdb")
    with pytest.raises(UsageError, match="applies to manifests"):
        convert(images.parent / "val", tmp_path / "y.lmdb", classes=["a"])


def test_bad_rows_duplicates_and_missing_files_are_listed_by_line(
    images: Path, tmp_path: Path
) -> None:
    manifest = images / "m.csv"
    manifest.write_text(
        "path,label\n"
        "img_00.jpg,cat\n"
        "img_01.jpg\n"  # line 3: a column short
        "missing.jpg,cat\n"  # line 4
        "./img_00.jpg,dog\n"  # line 5: the same file as line 2
        ",cat\n"  # line 6: empty path
        "img_02.jpg,cat\n"
        "sub,dog\n"  # line 8: a folder
    )
    report = convert(manifest, tmp_path / "m.lmdb")
    assert report.count == 2
    reasons = {s.reason for s in report.skipped}
    assert "line 3: 1 column(s), the header names 2" in reasons
    assert "line 4: no such file" in reasons
    assert (
        "line 5: img_00.jpg: the same file as line 2 (img_00.jpg), labelled 'dog' here and 'cat' "
        "there: stored once, as line 2 says" in reasons
    )
    assert [int(s.reason.split(":")[0][5:]) for s in report.skipped] == [3, 4, 5, 6, 8]
    assert "line 6: empty path" in reasons
    assert "line 8: not a regular file (a folder)" in reasons
    result = cli("convert", str(manifest), str(tmp_path / "strict.lmdb"), "--strict", "-q")
    assert result.returncode == 2 and "line 3" in result.stderr
    assert "Traceback" not in result.stderr
    no_header = images / "nohead.csv"
    no_header.write_text("img_00.jpg,cat\n")
    with pytest.raises(SourceError, match="header row naming a 'path' and a 'label'"):
        scan_manifest(no_header)
    fifo = images / "pipe.csv"
    os.mkfifo(fifo)
    result = cli("convert", str(fifo), str(tmp_path / "f.lmdb"), "-q", timeout=30)
    assert result.returncode == 2 and "not a regular file" in result.stderr


def test_export_writes_the_images_and_a_manifest_that_converts_back(
    images: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.jpg"
    write(outside, jpeg_bytes(seed=50))
    absolute = tmp_path / "far" / "abs.jpg"
    write(absolute, jpeg_bytes(seed=51))
    manifest = images / "m.jsonl"
    rows = [
        {"path": "img_00.jpg", "label": "b"},
        {"path": "sub/p.png", "label": "a"},
        {"path": "../outside.jpg", "label": "b"},
        {"path": str(absolute), "label": "a"},
    ]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "m.lmdb"
    convert(manifest, store)
    out = tmp_path / "out"
    report = export_store(open_store(store), out)
    assert report.files == 4 and report.manifest == str(out / "manifest.jsonl")
    files = snapshot(out)
    assert files["img_00.jpg"] == (images / "img_00.jpg").read_bytes()
    assert files["_up/outside.jpg"] == outside.read_bytes()  # kept inside the export folder
    assert files["_root" + str(absolute)] == absolute.read_bytes()
    again = tmp_path / "again.lmdb"
    convert(out / "manifest.jsonl", again)
    a, b = LMDBImageDataset(store, output="bytes"), LMDBImageDataset(again, output="bytes")
    assert a.classes == b.classes == ["a", "b"]
    assert list(a.targets) == list(b.targets)
    assert [a[i][0] for i in range(4)] == [b[i][0] for i in range(4)]


def test_a_manifest_into_mongo_and_append_to_it(
    images: Path, tmp_path: Path, mongo_uri: str
) -> None:
    manifest = images / "m.csv"
    manifest.write_text("path,label\nimg_00.jpg,x\nimg_01.jpg,y\n")
    result = cli("convert", str(manifest), mongo_uri, "-c", "val", "-q")
    assert result.returncode == 0, result.stderr
    with manifest.open("a") as f:
        f.write("img_02.jpg,w\n")
    report = convert(manifest, mongo_uri, collection="val", append=True)
    assert report.count == 3 and report.new_classes == ["w"]
    ds = MongoImageDataset(mongo_uri, "val", output="bytes")
    assert ds.classes == ["x", "y", "w"] and list(ds.targets) == [0, 1, 2]
    with pytest.raises(SourceError, match="cannot be appended to a store converted from a"):
        folder = tmp_path / "folder"
        write(folder / "c" / "1.jpg", jpeg_bytes())
        convert(folder, mongo_uri, collection="val", append=True)


def store_args(
    request: pytest.FixtureRequest, backend: str, manifest: Path, tmp_path: Path
) -> list[str]:
    """``manifest`` converted into a store of ``backend``; the words that name it to the CLI."""
    if backend == "lmdb":
        convert(manifest, tmp_path / "m.lmdb")
        return [str(tmp_path / "m.lmdb")]
    uri = request.getfixturevalue("mongo_uri")
    convert(manifest, uri, collection="m")
    return [uri, "--collection", "m"]


KILLED_IN_THE_MANIFEST = """
    import os, signal, sys
    import fastdata.ops.export_files as export_files
    from fastdata import export_store, open_store

    write_all = export_files._write_all

    def dying(fd, data):  # the manifest (written last): half of it, then the process is killed
        if data.startswith(b'{"classes"'):
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write_all(fd, data)

    export_files._write_all = dying
    export_store(open_store(sys.argv[1], collection=sys.argv[3] or None), sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("mongo", marks=pytest.mark.mongo)])
def test_export_never_replaces_a_manifest_it_did_not_write(
    request: pytest.FixtureRequest, images: Path, tmp_path: Path, backend: str
) -> None:
    manifest = images / "manifest.jsonl"
    rows = [{"path": f"img_{i:02d}.jpg", "label": "ab"[i % 2], "note": "mine"} for i in range(6)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = store_args(request, backend, manifest, tmp_path)
    before = snapshot(images)
    # into the folder the store came from: as it is, and as a resume (all the images match)
    for extra in ([], ["--resume"]):
        result = cli("export", *store, str(images), *extra)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"{manifest}: exists already" in lines[0] and "--overwrite" in lines[0]
        assert snapshot(images) == before  # nothing written, not even a mark
    lone = tmp_path / "notes"  # a folder of the user's with a manifest.jsonl, and no image
    write(lone / "manifest.jsonl", b"my own notes\n")
    result = cli("export", *store, str(lone))
    assert result.returncode == 2 and f"{lone / 'manifest.jsonl'}: exists already" in result.stderr
    assert snapshot(lone) == {"manifest.jsonl": b"my own notes\n"}
    # an export killed while writing its manifest: a resume knows that manifest for its own
    out = tmp_path / "out"
    killed = run_script(KILLED_IN_THE_MANIFEST, store[0], out, store[-1] if len(store) > 1 else "")
    assert killed.returncode == -9, killed.stderr
    assert not (out / "manifest.jsonl").exists()  # half of it lies under a temporary name only
    result = cli("export", *store, str(out), "--resume", "-q")
    assert result.returncode == 0, result.stderr
    exported = snapshot(out)  # the manifest whole, the export's mark and the half gone
    assert exported["manifest.jsonl"].startswith(b'{"classes"')
    assert sorted(exported) == ["img_00.jpg", "img_01.jpg", "img_02.jpg", "img_03.jpg",
                                "img_04.jpg", "img_05.jpg", "manifest.jsonl"]  # fmt: skip
    again = tmp_path / "again.lmdb"
    convert(out / "manifest.jsonl", again)
    assert LMDBImageDataset(again).classes == ["a", "b"] and len(LMDBImageDataset(again)) == 6
    # an export into another folder is no export of this one: a resume here still refuses
    result = cli("export", *store, str(images), "--resume")
    assert result.returncode == 2 and snapshot(images) == before
    # asked for, it is replaced
    result = cli("export", *store, str(images), "--overwrite", "-q")
    assert result.returncode == 0, result.stderr
    assert snapshot(images) == {**before, "manifest.jsonl": exported["manifest.jsonl"]}
