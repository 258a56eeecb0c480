"""Per-image fields: captions, multi-labels, boxes and any JSON, from manifests and sidecars,
stored, read, selected, batched and moved exactly, on both backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastdata import LMDBImageDataset, convert
from fastdata.errors import SourceError
from fastdata.loaders.collate import fast_collate

from .conftest import jpeg_bytes, write


def make_images(root: Path, n: int) -> list[str]:
    names = []
    for i in range(n):
        write(root / "img" / f"{i}.jpg", jpeg_bytes(seed=i))
        names.append(f"img/{i}.jpg")
    return names


def detection_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "path": f"img/{i}.jpg",
            "label": ["cat", "dog"][i % 2],
            "caption": f"a photo of thing {i} — ünïcode",
            "boxes": [[1.5 * k, 2.0, 3.0, 4.0 + i] for k in range(i % 4)],
            "score": 0.25 * i,
            "tags": [i, i + 1],
            "meta": {"source": "web", "ok": True, "nested": [1, {"a": None}]},
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[Any], head: dict[str, Any] | None = None) -> Path:
    lines = ([json.dumps(head)] if head else []) + [
        r if isinstance(r, str) else json.dumps(r) for r in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastdata", *args], capture_output=True, text=True, timeout=120
    )


def all_headers(ds: LMDBImageDataset | Any) -> list[Any]:
    return [r.header for r in ds.reader.read_records(range(len(ds)))]


def test_jsonl_fields_are_stored_with_their_schema_and_read_back(tmp_path: Path) -> None:
    make_images(tmp_path, 8)
    manifest = write_jsonl(tmp_path / "m.jsonl", detection_rows(8))
    report = convert(manifest, tmp_path / "s.lmdb")
    assert report.count == 8 and not report.skipped
    assert report.fields == [
        "caption:str",
        "boxes:float[-1,4]",
        "score:float",
        "tags:int[-1]",
        "meta:json",
    ]
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="numpy", fields="*")
    image, target, values = ds[3]
    assert image.shape == (48, 64, 3) and target == 1
    assert values["caption"] == "a photo of thing 3 — ünïcode"
    assert values["boxes"].dtype == np.float32 and values["boxes"].shape == (3, 4)
    assert values["boxes"][2].tolist() == [3.0, 2.0, 3.0, 7.0]
    assert values["score"] == 0.75 and isinstance(values["score"], float)
    assert values["tags"].tolist() == [3, 4] and values["tags"].dtype == np.int64
    assert values["meta"] == {"source": "web", "ok": True, "nested": [1, {"a": None}]}
    empty = ds[0][2]["boxes"]  # no boxes: an empty array of the right shape
    assert empty.shape == (0, 4)
    # without fields=: today's samples, no field read
    plain = LMDBImageDataset(tmp_path / "s.lmdb", output="numpy")
    assert len(plain[3]) == 2
    as_dict = LMDBImageDataset(
        tmp_path / "s.lmdb", output="bytes", fields=["caption"], as_dict=True
    )
    sample = as_dict[5]
    assert set(sample) == {"image", "target", "caption"} and sample["target"] == 1
    with pytest.raises(ValueError, match="no field 'nope'.*caption:str"):
        LMDBImageDataset(tmp_path / "s.lmdb", fields=["nope"])


def test_bad_rows_are_listed_by_line_and_nothing_is_coerced(tmp_path: Path) -> None:
    make_images(tmp_path, 9)
    rows: list[Any] = [
        {"path": f"img/{i}.jpg", "label": "a", "caption": f"c{i}", "n": i} for i in range(9)
    ]
    rows[1]["n"] = "seven"  # a type change
    rows[2]["n"] = float("nan")  # NaN where a number is declared (inferred int: refused)
    del rows[3]["caption"]  # a missing field
    rows[4]["caption"] = "\udc80"  # invalid UTF-8 (an escaped lone surrogate)
    text = [json.dumps(r) for r in rows]
    text[5] = json.dumps({**rows[5], "caption": "x" * (2 << 20)})  # a string of MBs
    raw = "\n".join(text).encode("utf-8")
    raw += b'\n{"path": "img/7.jpg", "label": "a", "caption": "\xff\xfe", "n": 7}'
    raw = raw.replace(
        json.dumps(rows[7]).encode(), b'{"path": "img/70.jpg", "label": "a", "caption": "x"}'
    )
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(raw + b"\n")
    report = convert(manifest, tmp_path / "s.lmdb")
    reasons = {s.reason.split(":")[0]: s.reason for s in report.skipped}
    assert "line 2" in reasons and "'n'" in reasons["line 2"] and "string" in reasons["line 2"]
    assert "nan" in reasons["line 3"].lower()
    assert "missing" in reasons["line 4"]
    assert "UTF-8" in reasons["line 5"]
    assert "longer than" in reasons["line 6"]
    assert "UTF-8" in reasons["line 10"]
    kept = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert [v["caption"] for _, _, v in kept.__getitems__(range(len(kept)))] == ["c0", "c6", "c8"]
    with pytest.raises(SourceError, match="line 2"):
        convert(manifest, tmp_path / "strict.lmdb", strict=True)


def test_deep_json_and_infinity_in_a_json_field(tmp_path: Path) -> None:
    make_images(tmp_path, 3)
    deep: Any = {}
    for _ in range(65):
        deep = {"k": deep}
    rows = [
        '{"path": "img/0.jpg", "label": "a", "meta": {"ok": 1}, "x": 1.5}',
        json.dumps({"path": "img/1.jpg", "label": "a", "meta": deep, "x": 2.5}),
        '{"path": "img/2.jpg", "label": "a", "meta": {"ok": 2}, "x": Infinity}',
    ]
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    reasons = [s.reason for s in report.skipped]
    assert any("line 2" in r and "deeper than 64" in r for r in reasons)
    assert any("line 3" in r and "inf" in r for r in reasons)
    assert report.count == 1


def test_csv_columns_opt_in_with_types(tmp_path: Path) -> None:
    make_images(tmp_path, 4)
    (tmp_path / "m.csv").write_text(
        "path,label,caption,score,boxes,note\n"
        'img/0.jpg,a,"a cat, sitting",0.5,"[[1,2,3,4]]",n0\n'
        "img/1.jpg,b,a dog,2,[],n1\n"
        "img/2.jpg,a,bad score,nan,[],n2\n"
        'img/3.jpg,b,bad boxes,1,"[[1,2]]",n3\n',
        encoding="utf-8",
    )
    report = convert(
        tmp_path / "m.csv", tmp_path / "s.lmdb", fields="caption,score:float,boxes:float[-1,4]"
    )
    assert report.fields == ["caption:str", "score:float", "boxes:float[-1,4]"]
    assert sorted(s.reason.split(":")[0] for s in report.skipped) == ["line 4", "line 5"]
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert ds[0][2]["caption"] == "a cat, sitting" and ds[1][2]["score"] == 2.0
    assert ds[0][2]["boxes"].tolist() == [[1, 2, 3, 4]]
    everything = convert(tmp_path / "m.csv", tmp_path / "all.lmdb", fields="*")
    assert everything.fields == ["caption:str", "score:str", "boxes:str", "note:str"]
    with pytest.raises(SourceError, match="not a column"):
        convert(tmp_path / "m.csv", tmp_path / "x.lmdb", fields="missing")
    with pytest.raises(SourceError, match="unknown type"):
        convert(tmp_path / "m.csv", tmp_path / "x.lmdb", fields="score:decimal")


def test_a_manifest_without_labels_makes_a_store_without_classes(tmp_path: Path) -> None:
    make_images(tmp_path, 3)
    rows = [{"path": f"img/{i}.jpg", "caption": f"caption {i}"} for i in range(3)]
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    assert report.count == 3 and report.classes == [] and not report.labelled
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields=["caption"])
    assert ds.classes == [] and ds.targets.tolist() == [-1, -1, -1]
    assert ds[2][1] == -1 and ds[2][2] == {"caption": "caption 2"}
    out = cli("info", str(tmp_path / "s.lmdb"))
    assert out.returncode == 0 and "classes:    none" in out.stdout
    assert "caption" in out.stdout and "str" in out.stdout
    assert cli("verify", str(tmp_path / "s.lmdb")).returncode == 0


def test_sidecars_beside_folder_images(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(4):
        cls = "ab"[i % 2]
        write(root / cls / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / cls / f"{i}.txt").write_text(f"text {i}\n", encoding="utf-8")
        if i != 3:
            (root / cls / f"{i}.json").write_text(json.dumps({"boxes": [[i, 0, 1, 1]]}))
    report = convert(root, tmp_path / "s.lmdb", sidecars="json,txt")
    assert report.count == 3 and report.fields == ["boxes:int[-1,4]", "txt:str"]
    assert "3.json is missing" in report.skipped[0].reason
    assert not report.non_image_files  # the sidecars are not counted as stray files
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert ds[0][2]["txt"] == "text 0\n" and ds[0][2]["boxes"].tolist() == [[0, 0, 1, 1]]
    # export writes the sidecars back; converting that gives the same records
    assert cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out")).returncode == 0
    assert (tmp_path / "out" / "a" / "0.txt").read_text(encoding="utf-8") == "text 0\n"
    again = convert(tmp_path / "out", tmp_path / "again.lmdb", sidecars="json,txt")
    assert again.fields == report.fields
    back = LMDBImageDataset(tmp_path / "again.lmdb", output="bytes")
    assert [h.fields for h in all_headers(back)] == [h.fields for h in all_headers(ds)]


def test_views_by_field_and_batches(tmp_path: Path) -> None:
    make_images(tmp_path, 8)
    convert(write_jsonl(tmp_path / "m.jsonl", detection_rows(8)), tmp_path / "s.lmdb")
    ds = LMDBImageDataset(
        tmp_path / "s.lmdb",
        output="numpy",
        fields=["boxes", "score", "caption"],
        where=lambda f: len(f["boxes"]) >= 2,
    )
    assert len(ds) == 4  # rows 2, 3, 6, 7
    assert [v["score"] for _, _, v in ds.__getitems__(range(4))] == [0.5, 0.75, 1.5, 1.75]
    assert ds.subset(where=lambda f: f["score"] > 1).__len__() == 2
    batch = [ds[i] for i in range(4)]
    images, labels, values = fast_collate(batch, schema=ds.field_schema)
    assert images.shape == (4, 3, 48, 64) and labels.tolist() == [0, 1, 0, 1]
    assert values["score"].dtype == torch.float32 and values["score"].shape == (4,)
    assert isinstance(values["boxes"], list) and values["boxes"][1].shape == (3, 4)
    assert values["caption"][0].startswith("a photo of thing 2")
    padded = fast_collate(batch, schema=ds.field_schema, pad=True)[2]
    assert padded["boxes"].shape == (4, 3, 4)
    assert padded["boxes_mask"].sum(dim=1).tolist() == [2, 3, 2, 3]
    from fastdata import create_loader

    loader = create_loader(
        ds.with_pipeline(None), batch_size=2, num_workers=2, device="cpu", mean=None, std=None
    )
    seen = [b for b in loader]
    assert len(seen) == 2 and all(len(b) == 3 and "boxes" in b[2] for b in seen)


def test_fields_are_covered_by_the_checksum(tmp_path: Path) -> None:
    import lmdb

    make_images(tmp_path, 2)
    convert(write_jsonl(tmp_path / "m.jsonl", detection_rows(2)), tmp_path / "s.lmdb")
    env = lmdb.open(str(tmp_path / "s.lmdb"), subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        key = b"#0000000001"
        header = bytes(txn.get(key))
        txn.put(key, header.replace(b"thing 1", b"thing 9"))
    env.close()
    out = cli("verify", str(tmp_path / "s.lmdb"))
    assert out.returncode == 1 and "fields checksum mismatch" in out.stdout + out.stderr


def test_append_and_export_carry_fields_exactly(tmp_path: Path) -> None:
    make_images(tmp_path, 6)
    rows = detection_rows(6)
    manifest = write_jsonl(tmp_path / "m.jsonl", rows[:4])
    convert(manifest, tmp_path / "s.lmdb")
    # the new rows give an int where the store has float: read as the store's type
    write_jsonl(manifest, [*rows[:4], {**rows[4], "score": 7}, rows[5]])
    report = convert(manifest, tmp_path / "s.lmdb", append=True)
    assert report.count == 6
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert ds[4][2]["score"] == 7.0 and isinstance(ds[4][2]["score"], float)
    write_jsonl(manifest, [*rows[:6], {"path": "img/0.jpg", "label": "cat"}])
    # a manifest with other fields than the store's is refused as a whole
    other = write_jsonl(tmp_path / "other.jsonl", [{"path": "img/5.jpg", "label": "cat", "x": 1}])
    with pytest.raises(SourceError, match="the store's fields are"):
        convert(other, tmp_path / "s.lmdb", append=True)
    # export writes every field and the types; converting it back gives the same store
    assert cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out")).returncode == 0
    exported = tmp_path / "out" / "manifest.jsonl"
    again = convert(exported, tmp_path / "again.lmdb")
    assert again.fields == report.fields or again.fields == ds.field_schema.describe().split(", ")
    back = LMDBImageDataset(tmp_path / "again.lmdb", output="bytes")
    assert [h.fields for h in all_headers(back)] == [h.fields for h in all_headers(ds)]
    assert [(h.fields_crc32) for h in all_headers(back)] == [
        h.fields_crc32 for h in all_headers(ds)
    ]
    assert back.reader.meta.fields == ds.reader.meta.fields


@pytest.mark.mongo
def test_fields_on_mongodb_are_queryable_and_copy_round_trips(
    tmp_path: Path, mongo_uri: str
) -> None:
    from fastdata import MongoImageDataset
    from fastdata.ops.copy import copy_store

    from .mongo_server import database

    make_images(tmp_path, 8)
    convert(write_jsonl(tmp_path / "m.jsonl", detection_rows(8)), tmp_path / "s.lmdb")
    copy_store(str(tmp_path / "s.lmdb"), mongo_uri, collection="det")
    docs = database(mongo_uri)["det"]
    doc = docs.find_one({"_id": 3})
    assert doc["fields"]["caption"].startswith("a photo of thing 3")
    assert doc["fields"]["boxes"][0] == [0.0, 2.0, 3.0, 7.0]
    # the server runs the filter: captions that mention "thing 5", more than 2 boxes
    ds = MongoImageDataset(
        mongo_uri,
        "det",
        output="bytes",
        fields=["caption", "boxes"],
        where={"fields.boxes.2": {"$exists": True}},
    )
    assert len(ds) == 2 and [len(v["boxes"]) for _, _, v in ds.__getitems__([0, 1])] == [3, 3]
    text = MongoImageDataset(
        mongo_uri, "det", output="bytes", where={"fields.caption": {"$regex": "thing 5"}}
    )
    assert len(text) == 1
    # and back: the same headers, byte for byte
    copy_store(mongo_uri, str(tmp_path / "back.lmdb"), source_collection="det")
    a = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    b = LMDBImageDataset(tmp_path / "back.lmdb", output="bytes")
    assert [h.to_json() for h in all_headers(a)] == [h.to_json() for h in all_headers(b)]
    assert b.reader.meta.fields == a.reader.meta.fields
    assert cli("verify", mongo_uri, "--collection", "det").returncode == 0
    assert "fields.<name>" in cli("info", mongo_uri, "--collection", "det").stdout


@pytest.mark.mongo
def test_converting_fields_straight_into_mongodb(tmp_path: Path, mongo_uri: str) -> None:
    from fastdata import MongoImageDataset

    make_images(tmp_path, 4)
    rows = [{"path": f"img/{i}.jpg", "caption": f"c {i}", "labels": [i, 2]} for i in range(4)]
    convert(write_jsonl(tmp_path / "m.jsonl", rows), mongo_uri, collection="caps")
    ds = MongoImageDataset(mongo_uri, "caps", output="bytes", fields="*", as_dict=True)
    assert ds[1]["caption"] == "c 1" and ds[1]["labels"].tolist() == [1, 2]
    assert ds[1]["target"] == -1 and ds.classes == []
