"""Per-image fields: captions, multi-labels, boxes and any JSON, from manifests and sidecars,
stored, read, selected, batched and moved exactly, on both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fastdata import LMDBImageDataset, convert
from fastdata.errors import QueryError, SourceError
from fastdata.loaders.collate import collate_fields, fast_collate

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
    # declared: a row without one of them is listed (a field inferred from some rows only makes
    # the whole source refused instead: see the test below)
    report = convert(manifest, tmp_path / "s.lmdb", fields="caption,n:int")
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
        convert(manifest, tmp_path / "strict.lmdb", strict=True, fields="caption,n:int")


def test_a_field_only_some_rows_have_is_refused_and_ints_widen_to_floats(tmp_path: Path) -> None:
    make_images(tmp_path, 4)
    rows = [
        {"path": "img/0.jpg", "score": 1, "box": [1, 2]},
        {"path": "img/1.jpg", "score": 2.5, "box": [1.5, 2], "note": "only here"},
        {"path": "img/2.jpg", "score": 3, "box": [3, 4]},
        {"path": "img/3.jpg", "score": 4, "box": [5, 6]},
    ]
    manifest = write_jsonl(tmp_path / "m.jsonl", [json.dumps(r) for r in rows])
    # 'note' is in one row of four: not a guess, a refusal naming it, a row without it, and
    # the flag that makes the rows without it unusable instead
    with pytest.raises(SourceError) as info:
        convert(manifest, tmp_path / "s.lmdb")
    text = str(info.value)
    assert "'note' is in 1 of 4 rows only (the first: line 2)" in text
    assert "remove it from the rows that give it" in text
    # most rows giving it: the rows without it are named, and the flag that lists them
    few = [{**r, "note": "n"} for r in rows]
    del few[0]["note"]
    with pytest.raises(
        SourceError, match="'note' is in 3 of 4 rows .line 1 has none.*fields='note:str'"
    ):
        convert(write_jsonl(tmp_path / "few.jsonl", few), tmp_path / "few.lmdb")
    assert not (tmp_path / "s.lmdb").exists()
    report = convert(manifest, tmp_path / "s.lmdb", fields="note")
    assert report.count == 1 and len(report.skipped) == 3
    assert all("'note' is missing" in s.reason for s in report.skipped)
    # without it, ints then a float make a float field: every row kept, the ints as floats
    del rows[1]["note"]
    manifest = write_jsonl(tmp_path / "m2.jsonl", [json.dumps(r) for r in rows])
    report = convert(manifest, tmp_path / "t.lmdb")
    assert report.count == 4 and not report.skipped
    ds = LMDBImageDataset(tmp_path / "t.lmdb", output="bytes", fields="*")
    assert ds.field_schema.describe() == "score:float, box:float[-1]"
    values = [v for _, _, v in ds.__getitems__(range(4))]
    assert [v["score"] for v in values] == [1.0, 2.5, 3.0, 4.0]
    assert type(values[0]["score"]) is float
    assert values[1]["box"].tolist() == [1.5, 2.0]


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
    # 64 lists around a number are 64 deep: kept
    at_limit: Any = 1
    for _ in range(64):
        at_limit = [at_limit]
    rows[1] = json.dumps({"path": "img/1.jpg", "label": "a", "meta": at_limit, "x": 2.5})
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "t.lmdb")
    assert report.count == 2


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
    assert values["score"].dtype == torch.float64 and values["score"].shape == (4,)
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
    # a manifest without the store's fields is refused as a whole (read with the store's)
    other = write_jsonl(tmp_path / "other.jsonl", [{"path": "img/5.jpg", "label": "cat", "x": 1}])
    with pytest.raises(SourceError, match="field 'caption' is missing"):
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
    # a field named without "fields.": refused, not an empty selection
    with pytest.raises(QueryError, match="use 'fields.boxes.2': the fields are under 'fields'"):
        MongoImageDataset(mongo_uri, "det", output="bytes", where={"boxes.2": {"$exists": True}})
    with pytest.raises(QueryError, match="no field 'captoin'; its fields: caption"):
        MongoImageDataset(mongo_uri, "det", output="bytes", where={"fields.captoin": "x"})
    # one language on every store: an operator outside it is refused here too, by name
    scored = {"$expr": {"$gt": [{"$cond": {"if": True, "then": "$fields.score", "else": 0}}, 1]}}
    with pytest.raises(QueryError, match=r"\$expr .*is not an operator fastdata's queries take"):
        MongoImageDataset(mongo_uri, "det", output="bytes", where=scored)
    # and back: the same headers, byte for byte
    copy_store(mongo_uri, str(tmp_path / "back.lmdb"), source_collection="det")
    a = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    b = LMDBImageDataset(tmp_path / "back.lmdb", output="bytes")
    assert [h.to_json() for h in all_headers(a)] == [h.to_json() for h in all_headers(b)]
    assert b.reader.meta.fields == a.reader.meta.fields
    for name in b.reader.meta.schema.names:  # the copy's columns, built as it finished
        there, here = a.reader.field_column(name), b.reader.field_column(name)
        assert there is not None and here is not None
        assert here.encoded(0, len(b)) == there.encoded(0, len(a)), name
    assert not b.reader.columns_problems()
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


def printed_command(text: str, prefix: str) -> list[str]:
    """The arguments of the ``fastdata ...`` command a message printed after ``prefix``."""
    import re
    import shlex

    line = next(line for line in text.splitlines() if prefix in line)
    command = line.split(prefix, 1)[1].strip()
    found = re.search(r"`(fastdata [^`]*)`", command)
    return shlex.split(found.group(1) if found else command)[1:]


def test_a_folder_export_converts_back_with_its_types_as_printed(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(3):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        # keys in the source's order (not sorted); values that would infer other types
        side = {"zone": [1.0, 2.0, 3.0, 4.0], "extra": [i, i], "b": 1.0}
        (root / "a" / f"{i}.json").write_text(json.dumps(side), encoding="utf-8")
        (root / "a" / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    done = cli(
        "convert", str(root), str(tmp_path / "s.lmdb"), "--sidecars", "json,txt",
        "--fields", "zone:float[4],extra:json", "-q",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    sidecar = (tmp_path / "out" / "a" / "1.json").read_text(encoding="utf-8")
    assert list(json.loads(sidecar)) == ["zone", "extra", "b"]
    again = cli(*printed_command(out.stdout, "convert back with:"), "-q")
    assert again.returncode == 0, again.stderr
    a = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes")
    b = LMDBImageDataset(tmp_path / "out.lmdb", output="bytes")
    assert b.reader.meta.schema == a.reader.meta.schema
    assert str(a.reader.meta.schema) == "Schema(zone:float[4], extra:json, b:float, txt:str)"
    assert [h.to_json() for h in all_headers(a)] == [h.to_json() for h in all_headers(b)]


def test_an_append_reads_the_source_with_the_stores_fields(tmp_path: Path) -> None:
    make_images(tmp_path, 5)
    (tmp_path / "m.csv").write_text(
        "path,label,caption,score\nimg/0.jpg,a,x,1\nimg/1.jpg,b,y,2\n", encoding="utf-8"
    )
    store = str(tmp_path / "s.lmdb")
    first = cli("convert", str(tmp_path / "m.csv"), store, "--fields", "caption,score:float")
    assert first.returncode == 0, first.stderr
    (tmp_path / "m.csv").write_text(
        "path,label,caption,score\nimg/0.jpg,a,x,1\nimg/1.jpg,b,y,2\nimg/2.jpg,a,z,3\n",
        encoding="utf-8",
    )
    # no --fields: the store's (its columns, its types)
    (tmp_path / "m.csv").write_text(
        (tmp_path / "m.csv").read_text(encoding="utf-8") + "img/9.jpg,a,gone,1\n",
        encoding="utf-8",
    )  # a row whose file is missing: listed, and not counted as appended
    done = cli("convert", str(tmp_path / "m.csv"), store, "--append")
    assert done.returncode == 0, done.stderr
    assert "appended 1 new image(s); 2 of the source's were in the store already" in done.stdout
    ds = LMDBImageDataset(store, output="bytes", fields="*")
    assert len(ds) == 3 and ds[2][2] == {"caption": "z", "score": 3.0}
    # other types than the store's: refused, with the flags that fit
    refused = cli("convert", str(tmp_path / "m.csv"), store, "--append", "--fields", "score:int")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "leave --fields out (or give --fields caption:str,score:float)" in refused.stderr
    flags = refused.stderr.split("(or give ")[1].split(")")[0].split()
    again = cli("convert", str(tmp_path / "m.csv"), store, "--append", *flags)
    assert again.returncode == 0, again.stderr
    # a store of ints: ints stay ints, a float in a new row is that row's problem only
    rows = [{"path": f"img/{i}.jpg", "n": i} for i in range(3)]
    manifest = write_jsonl(tmp_path / "n.jsonl", rows)
    convert(manifest, tmp_path / "n.lmdb")
    write_jsonl(manifest, [*rows, {"path": "img/3.jpg", "n": 0.5}, {"path": "img/4.jpg", "n": 4}])
    report = convert(manifest, tmp_path / "n.lmdb", append=True)
    assert report.count == 4 and not report.changed and not report.gone
    (skipped,) = report.skipped
    assert (
        "line 4" in skipped.reason and "0.5 is a float where the field is an int" in skipped.reason
    )
    n = LMDBImageDataset(tmp_path / "n.lmdb", output="bytes", fields="*")
    assert [v["n"] for _, _, v in n.__getitems__(range(4))] == [0, 1, 2, 4]
    assert all(type(v["n"]) is int for _, _, v in n.__getitems__(range(4)))
    # fields changed since they were stored: reported, the store keeps its own
    write_jsonl(manifest, [{**rows[0], "n": 100}, *rows[1:]])
    report = convert(manifest, tmp_path / "n.lmdb", append=True)
    assert [(c.name, c.reason) for c in report.changed] == [
        ("img/0.jpg", "its fields differ from the store's now (the store keeps its own)")
    ]
    # a key the store does not have: that row is unusable, the key named
    write_jsonl(manifest, [*rows, {"path": "img/3.jpg", "n": 3, "extra": "x"}])
    report = convert(manifest, tmp_path / "n.lmdb", append=True)
    assert [s.reason for s in report.skipped] == [
        "line 4: img/3.jpg: field 'extra' is not one of the fields (n)"
    ]


def test_csv_quotes_and_columns_are_read_by_the_rules(tmp_path: Path) -> None:
    make_images(tmp_path, 4)
    (tmp_path / "m.csv").write_text(
        "path,label,caption\n"
        'img/0.jpg,a,"two\nlines"\n'
        "img/1.jpg,a,fine\n"
        'img/2.jpg,a,"never closed\n'
        "img/3.jpg,a,swallowed\n",
        encoding="utf-8",
    )
    report = convert(tmp_path / "m.csv", tmp_path / "s.lmdb", fields="caption")
    assert report.count == 2
    (skipped,) = report.skipped
    assert skipped.reason.startswith("line 5: a quoted field opens on this line and never closes")
    assert "lines 5-6" in skipped.reason
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert ds[0][2] == {"caption": "two\nlines"}
    # a column named twice is refused, not half dropped
    (tmp_path / "d.csv").write_text("path,label,x,x\nimg/0.jpg,a,1,2\n", encoding="utf-8")
    with pytest.raises(SourceError, match="names the column 'x' twice"):
        convert(tmp_path / "d.csv", tmp_path / "d.lmdb", fields="*")
    for bad, why in [
        ("", "no field named"),
        ("x:float[100000000]", "at most"),
        ("légende", "ASCII letters"),
    ]:
        with pytest.raises(SourceError, match=why):
            convert(tmp_path / "m.csv", tmp_path / "e.lmdb", fields=bad)


def test_sidecar_conflicts_and_limits_are_named(tmp_path: Path) -> None:
    root = tmp_path / "src"
    write(root / "a" / "0.jpg", jpeg_bytes(seed=0))
    (root / "a" / "0.json").write_text('{"txt": "from json"}', encoding="utf-8")
    (root / "a" / "0.txt").write_text("from txt", encoding="utf-8")
    write(root / "a" / "1.jpg", jpeg_bytes(seed=1))
    (root / "a" / "1.json").mkdir()
    (root / "a" / "1.txt").write_text("x", encoding="utf-8")
    write(root / "a" / "2.jpg", jpeg_bytes(seed=2))
    (root / "a" / "2.json").write_bytes(b'{"k": "' + b"x" * (1 << 20) + b'"}')
    (root / "a" / "2.txt").write_text("x", encoding="utf-8")
    with pytest.raises(SourceError) as info:
        convert(root, tmp_path / "s.lmdb", sidecars="json,txt")
    text = str(info.value)
    assert "no usable image" in text
    assert "field 'txt' comes from 0.txt and from 0.json" in text
    assert "1.json is a folder" in text
    assert "a sidecar holds at most 1 MiB" in text and "--max-file-size" not in text


def test_float_lists_stay_inside_float32_and_where_errors_name_the_record(
    tmp_path: Path,
) -> None:
    make_images(tmp_path, 3)
    rows = [{"path": f"img/{i}.jpg", "box": [1.0, 2.0 if i != 1 else 1e300]} for i in range(3)]
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    assert report.count == 2 and "outside float32" in report.skipped[0].reason
    # as json, the value is kept exactly
    report = convert(
        write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "j.lmdb", fields="box:json"
    )
    ds = LMDBImageDataset(tmp_path / "j.lmdb", output="bytes", fields="*")
    assert report.count == 3 and ds[1][2]["box"] == [1.0, 1e300]
    with pytest.raises(KeyError) as info:
        LMDBImageDataset(tmp_path / "j.lmdb", output="bytes", where=lambda f: f["nope"])
    assert "record 0 (img/0.jpg; its fields: box)" in "".join(info.value.__notes__)


@pytest.mark.mongo
def test_append_and_export_carry_fields_exactly_on_mongodb(tmp_path: Path, mongo_uri: str) -> None:
    make_images(tmp_path, 6)
    rows = detection_rows(6)
    manifest = write_jsonl(tmp_path / "m.jsonl", rows[:4])
    convert(manifest, mongo_uri, collection="app")
    write_jsonl(manifest, [*rows[:4], {**rows[4], "score": 7}, rows[5]])
    report = convert(manifest, mongo_uri, collection="app", append=True)
    assert report.count == 6
    # the same rows into LMDB in one go: what the MongoDB store must export back to
    convert(manifest, tmp_path / "direct.lmdb")
    refused = cli(
        "convert", str(write_jsonl(tmp_path / "o.jsonl", [{"path": "img/5.jpg", "label": "cat"}])),
        mongo_uri, "--collection", "app", "--append",
    )  # fmt: skip
    assert refused.returncode != 0 and "field 'caption' is missing" in refused.stderr
    out = cli("export", mongo_uri, "--collection", "app", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    again = cli(*printed_command(out.stdout, "convert back with:"), "-q")
    assert again.returncode == 0, again.stderr
    a = LMDBImageDataset(tmp_path / "direct.lmdb", output="bytes", fields="*")
    b = LMDBImageDataset(tmp_path / "out.lmdb", output="bytes", fields="*")
    assert [h.fields for h in all_headers(b)] == [h.fields for h in all_headers(a)]
    assert [h.fields_crc32 for h in all_headers(b)] == [h.fields_crc32 for h in all_headers(a)]
    assert b.reader.meta.schema == a.reader.meta.schema
    assert b[4][2]["score"] == 7.0 and type(b[4][2]["score"]) is float
    assert cli("verify", mongo_uri, "--collection", "app").returncode == 0


def test_nothing_a_hostile_row_holds_is_kept_in_part(tmp_path: Path) -> None:
    make_images(tmp_path, 6)
    rows = [
        '{"path": "img/0.jpg", "caption": "a", "caption": "b", "n": 1}',  # a key twice
        '{"path": "img/1.jpg", "caption": "ok", "n": 9007199254740993}',  # over 2**53
        '{"path": "img/2.jpg", "caption": "ok", "n": 0.5}',  # a float: ints no float holds win
        '{"path": "img/3.jpg", "caption": "ok", "n": 3}',
    ]
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    reasons = sorted(s.reason for s in report.skipped)
    assert report.count == 2 and len(reasons) == 2
    assert "line 1" in reasons[0] and "'caption' is given twice" in reasons[0]
    assert "line 3" in reasons[1] and "0.5 is a float where the field is an int" in reasons[1]
    kept = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert kept[0][2]["n"] == 9007199254740993
    # CSV: a cell too many is the row's problem, not dropped; a cell over the csv module's
    # limit neither stops a row early nor turns the rest of its text into rows
    big = "x" * 150_000 + "\nimg/4.jpg,a,INJECTED\n" + "y" * 10
    (tmp_path / "m.csv").write_text(
        f'path,label,caption\nimg/0.jpg,a,hello, world\nimg/1.jpg,a,fine\nimg/2.jpg,a,"{big}"\n'
        "img/5.jpg,a,after\n",
        encoding="utf-8",
    )
    report = convert(tmp_path / "m.csv", tmp_path / "c.lmdb", fields="caption")
    ds = LMDBImageDataset(tmp_path / "c.lmdb", output="bytes", fields="*")
    captions = [v["caption"] for _, _, v in ds.__getitems__(range(len(ds)))]
    assert "INJECTED" not in captions and captions[0] == "fine" and big in captions
    assert "3 cells, the header names 3" not in report.skipped[0].reason
    assert report.skipped[0].reason.startswith("line 2: 4 cells, the header names 3")


def test_damaged_fields_are_never_copied_or_exported(tmp_path: Path) -> None:
    import lmdb

    make_images(tmp_path, 3)
    rows = [{"path": f"img/{i}.jpg", "s": f"v{i}", "b": [1.0, 2.0]} for i in range(3)]
    convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    env = lmdb.open(str(tmp_path / "s.lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        key = b"#0000000001"
        txn.put(key, txn.get(key).replace(b'"s":"v1"', b'"s":"EVIL"'))
        key = b"#0000000002"
        txn.put(key, txn.get(key).replace(b'"b":[1.0,2.0]', b'"b":[1e999,2.0]'))
    env.close()
    copied = cli("copy", str(tmp_path / "s.lmdb"), str(tmp_path / "c.lmdb"))
    assert copied.returncode != 0 and "Traceback" not in copied.stderr
    assert "record 1 (img/1.jpg) fails its fields check" in copied.stderr
    exported = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out"))
    assert exported.returncode != 0 and "Traceback" not in exported.stderr
    assert "fields checksum mismatch" in exported.stderr
    kept = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out2"), "--skip-damaged")
    assert kept.returncode != 0 or "left out 2" in kept.stdout + kept.stderr
    manifest = (tmp_path / "out2" / "manifest.jsonl").read_text(encoding="utf-8")
    assert "EVIL" not in manifest and "img/1.jpg" not in manifest and "img/0.jpg" in manifest
    # a header that is not one at all (its fields not an object): left out the same way
    env = lmdb.open(str(tmp_path / "s.lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        key = b"#0000000001"
        txn.put(key, txn.get(key).replace(b'"fields":{', b'"fields":5,"x":{'))
    env.close()
    kept = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out3"), "--skip-damaged")
    assert "Traceback" not in kept.stderr and "record 1" in kept.stdout + kept.stderr
    manifest = (tmp_path / "out3" / "manifest.jsonl").read_text(encoding="utf-8")
    assert "img/0.jpg" in manifest and "img/1.jpg" not in manifest


def test_sidecars_shared_by_two_images_and_mask_names(tmp_path: Path) -> None:
    root = tmp_path / "src"
    write(root / "a" / "x.jpg", jpeg_bytes(seed=1))
    write(root / "a" / "x.jpeg", jpeg_bytes(seed=2))
    (root / "a" / "x.json").write_text('{"boxes": [[1, 2, 3, 4]], "boxes_mask": 7}')
    convert(root, tmp_path / "s.lmdb", sidecars="json")
    out = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "wrote 2 files" in out.stdout and "(and 1 sidecar files)" in out.stdout
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    with pytest.raises(ValueError, match="boxes_mask, which is a field of the store too"):
        collate_fields([ds[0][2], ds[1][2]], schema=ds.field_schema, pad=True)
    from fastdata import create_loader

    with pytest.raises(ValueError, match="boxes_mask, which is a field of the store too"):
        create_loader(
            LMDBImageDataset(tmp_path / "s.lmdb", fields="*"),
            batch_size=2, image_size=32, num_workers=0, pad_fields=True,
        )  # fmt: skip


def test_device_decoding_refuses_fields_up_front(tmp_path: Path) -> None:
    from fastdata import create_loader

    make_images(tmp_path, 2)
    rows = [{"path": f"img/{i}.jpg", "boxes": [[1.0, 2.0, 3.0, 4.0]]} for i in range(2)]
    convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", fields=["boxes"])
    with pytest.raises(ValueError, match="reads the fields boxes: decode on the CPU"):
        create_loader(ds, batch_size=2, image_size=32, num_workers=0, decode="device")


def test_a_fields_type_is_the_one_most_rows_give(tmp_path: Path) -> None:
    make_images(tmp_path, 5)
    rows: list[dict[str, Any]] = [
        {"path": "img/9.jpg", "score": "n/a"},  # odd, first (and its file is missing)
        *({"path": f"img/{i}.jpg", "score": i} for i in range(4)),
        {"path": "img/4.jpg", "score": 4.5},
    ]
    report = convert(write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "s.lmdb")
    assert report.count == 5 and report.fields == ["score:float"]
    assert len(report.skipped) == 1 and "line 1" in report.skipped[0].reason
    # lists too: the kind most rows give (an odd first list, bools among ints); ids no float
    # holds stay ints whatever one float row says
    odd: list[dict[str, Any]] = [
        {"path": "img/0.jpg", "xs": [[1, 2]], "flags": [1, 0], "id": 2**60},
        *(
            {"path": f"img/{i}.jpg", "xs": [i, 2, 3], "flags": [True], "id": 2**60 + i}
            for i in (1, 2, 3)
        ),
        {"path": "img/4.jpg", "xs": [], "flags": [False], "id": 1.5},
    ]
    report = convert(write_jsonl(tmp_path / "o.jsonl", odd), tmp_path / "o.lmdb")
    assert report.fields == ["xs:int[-1]", "flags:bool[-1]", "id:int"]
    assert report.count == 3 and sorted(s.reason[:6] for s in report.skipped) == [
        "line 1",
        "line 5",
    ]
    # null is a value of json fields only: a key null in every row is one; an object or null
    nulls = [
        {"path": f"img/{i}.jpg", "note": None, "ann": {"k": i} if i else None} for i in range(2)
    ]
    report = convert(write_jsonl(tmp_path / "n.jsonl", nulls), tmp_path / "n.lmdb")
    assert report.count == 2 and report.fields == ["note:json", "ann:json"]
    ds = LMDBImageDataset(tmp_path / "n.lmdb", output="bytes", fields="*")
    assert [v for _, _, v in ds.__getitems__([0, 1])] == [
        {"note": None, "ann": None},
        {"note": None, "ann": {"k": 1}},
    ]
    # a key one row misspells: named as such
    typo = [{"path": f"img/{i}.jpg", "caption": "c"} for i in range(4)]
    typo[2] = {"path": "img/2.jpg", "captoin": "c"}
    with pytest.raises(SourceError, match="1 row.s. give the field 'captoin' and 3 give 'caption'"):
        convert(write_jsonl(tmp_path / "t.jsonl", typo), tmp_path / "t.lmdb")


def test_a_killed_conversion_with_fields_resumes_as_printed(tmp_path: Path) -> None:
    import shlex
    import signal

    from .procs import KILLED_CONVERT, run_script

    make_images(tmp_path, 8)
    (tmp_path / "m.csv").write_text(
        "path,label,score\n" + "".join(f"img/{i}.jpg,a,{i}\n" for i in range(8)), encoding="utf-8"
    )
    code = KILLED_CONVERT.replace("commit_records=2,", "commit_records=2, fields='score:float',")
    dst = tmp_path / "s.lmdb"
    result = run_script(code, tmp_path / "m.csv", dst, 2)
    assert result.returncode == -signal.SIGKILL, result.stderr
    info = cli("info", str(dst))
    printed = info.stderr.split("`")[1]
    assert "--fields score:float" in printed and "--resume" in printed
    done = cli(*shlex.split(printed)[1:], "-q")
    assert done.returncode == 0, done.stderr
    ds = LMDBImageDataset(dst, output="bytes", fields="*")
    assert [v["score"] for _, _, v in ds.__getitems__(range(8))] == [float(i) for i in range(8)]


def test_sidecars_that_are_all_empty_make_a_store_without_fields(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(2):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / "a" / f"{i}.json").write_text("{}", encoding="utf-8")
    report = convert(root, tmp_path / "s.lmdb", sidecars="json")
    assert report.count == 2 and report.fields == []
    assert cli("verify", str(tmp_path / "s.lmdb")).returncode == 0


@pytest.mark.mongo
def test_64_bit_ints_round_trip_through_mongodb(tmp_path: Path, mongo_uri: str) -> None:
    from fastdata import MongoImageDataset
    from fastdata.ops.copy import copy_store

    make_images(tmp_path, 2)
    rows = [
        {"path": "img/0.jpg", "id": 3_000_000_000, "ids": [1, -(2**40)], "m": {"k": 2**62}},
        {"path": "img/1.jpg", "id": 1, "ids": [], "m": {"k": 1}},
    ]
    convert(write_jsonl(tmp_path / "m.jsonl", rows), mongo_uri, collection="i64")
    assert cli("verify", mongo_uri, "--collection", "i64").returncode == 0
    ds = MongoImageDataset(mongo_uri, "i64", output="bytes", fields="*")
    values = ds[0][2]
    assert values["id"] == 3_000_000_000 and type(values["id"]) is int
    assert values["m"] == {"k": 2**62} and type(values["m"]["k"]) is int
    copy_store(mongo_uri, str(tmp_path / "back.lmdb"), source_collection="i64")
    convert(tmp_path / "m.jsonl", tmp_path / "direct.lmdb")
    a = LMDBImageDataset(tmp_path / "direct.lmdb", output="bytes")
    b = LMDBImageDataset(tmp_path / "back.lmdb", output="bytes")
    assert [h.to_json() for h in all_headers(a)] == [h.to_json() for h in all_headers(b)]


def test_typed_text_sidecars_big_csv_ints_and_names_of_other_bytes(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(2):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / "a" / f"{i}.cls").write_text(f"{i + 3}\n", encoding="utf-8")
    report = convert(root, tmp_path / "s.lmdb", sidecars="cls", fields="cls:int")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", output="bytes", fields="*")
    assert report.fields == ["cls:int"] and [ds[i][2]["cls"] for i in range(2)] == [3, 4]
    # a whole number too large for a float, in a float column: refused, not rounded
    make_images(tmp_path, 2)
    (tmp_path / "m.csv").write_text(
        "path,v\nimg/0.jpg,9007199254740993\nimg/1.jpg,2.5\n", encoding="utf-8"
    )
    report = convert(tmp_path / "m.csv", tmp_path / "c.lmdb", fields="v:float")
    assert report.count == 1 and "too large for a float" in report.skipped[0].reason
    # a manifest path of bytes that are not UTF-8: exported and converted back as they were
    odd = tmp_path.joinpath(os.fsdecode(b"img/\xff.jpg"))
    write(odd, jpeg_bytes(seed=9))
    (tmp_path / "o.jsonl").write_bytes(b'{"path": "img/\xff.jpg", "n": 1}\n')
    convert(tmp_path / "o.jsonl", tmp_path / "o.lmdb")
    out = cli("export", str(tmp_path / "o.lmdb"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    again = cli(*printed_command(out.stdout, "convert back with:"), "-q")
    assert again.returncode == 0, again.stderr
    a = LMDBImageDataset(tmp_path / "o.lmdb", output="bytes")
    b = LMDBImageDataset(tmp_path / "out.lmdb", output="bytes")
    assert [h.to_json() for h in all_headers(a)] == [h.to_json() for h in all_headers(b)]


def test_the_majority_rule_on_lists_nulls_and_empty_values(tmp_path: Path) -> None:
    n = 21
    make_images(tmp_path, n)

    def schema_of(rows: list[dict[str, Any]], name: str) -> tuple[list[str], int]:
        rows = [{"path": f"img/{i}.jpg", **r} for i, r in enumerate(rows)]
        report = convert(write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / f"{name}.lmdb")
        return report.fields, len(report.skipped)

    # one empty list among captions: a str field, the empty list's row unusable
    assert schema_of([{"c": []}, *({"c": "x"} for _ in range(n - 1))], "a") == (["c:str"], 1)
    # a ragged or bool first list among boxes: boxes, one row unusable
    boxes = [{"b": [[1.0, 2.0, 3.0, 4.0]]} for _ in range(n - 1)]
    assert schema_of([{"b": [[1, 2, 3, 4], [1, 2]]}, *boxes], "b") == (["b:float[-1,4]"], 1)
    assert schema_of([{"b": [[True, False, True, True]]}, *boxes], "c") == (["b:float[-1,4]"], 1)
    # ints no float holds, in lists: the field stays an int list
    ids = [{"ids": [2**60 + i]} for i in range(n - 1)]
    assert schema_of([*ids, {"ids": [0.5]}], "d") == (["ids:int[-1]"], 1)
    # nulls are a kind: most rows null make a json field that holds every row
    assert schema_of([*({"m": None} for _ in range(n - 1)), {"m": "x"}], "e") == (["m:json"], 0)
    # a field that some rows lack (not a misspelling: the rows overlap) names the row
    both = [{"s1": 1, "s2": 2} for _ in range(5)]
    with pytest.raises(SourceError, match="'s2' is in 5 of 6 rows .line 6 has none"):
        schema_of([*both, {"s1": 1}], "f")


def test_typed_text_sidecars_export_as_json_text(tmp_path: Path) -> None:
    root = tmp_path / "src"
    values = [{"a": "x"}, None, "hello", [True, False]]
    for i, v in enumerate(values):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / "a" / f"{i}.cls").write_text(json.dumps(v), encoding="utf-8")
    convert(root, tmp_path / "s.lmdb", sidecars="cls", fields="cls:json")
    out = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    again = cli(*printed_command(out.stdout, "convert back with:"), "-q")
    assert again.returncode == 0, again.stderr
    back = LMDBImageDataset(tmp_path / "out.lmdb", output="bytes", fields="*")
    assert [back[i][2]["cls"] for i in range(4)] == values
    # an append may give some of the store's fields again, as they are
    write(root / "a" / "9.jpg", jpeg_bytes(seed=9))
    (root / "a" / "9.cls").write_text("1", encoding="utf-8")
    done = cli("convert", str(root), str(tmp_path / "s.lmdb"), "--append", "--sidecars", "cls",
               "--fields", "cls:json")  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_an_append_to_a_store_without_fields_never_drops_some(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(2):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / "a" / f"{i}.json").write_text("{}", encoding="utf-8")
    convert(root, tmp_path / "s.lmdb", sidecars="json")
    write(root / "a" / "3.jpg", jpeg_bytes(seed=3))
    (root / "a" / "3.json").write_text('{"caption": "new"}', encoding="utf-8")
    report = convert(root, tmp_path / "s.lmdb", append=True)
    assert report.count == 2 and [s.name for s in report.skipped] == ["a/3.jpg"]
    assert "'caption' is not one of the fields (none)" in report.skipped[0].reason


def test_json_kinds_together_and_int_lists_float32_cannot_hold(tmp_path: Path) -> None:
    n = 10
    make_images(tmp_path, n)
    attrs: list[Any] = ["red", "blue", "green", "red", {"c": "r"}, {"c": "x"}, {"c": "y"}]
    attrs += [["a", "b"], ["c"], None]
    rows = [{"path": f"img/{i}.jpg", "attrs": a} for i, a in enumerate(attrs)]
    report = convert(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "a.lmdb")
    assert report.fields == ["attrs:json"] and report.count == n
    ids = [[16777217, 123456789], [2, 3], [0.5]]
    rows = [{"path": f"img/{i}.jpg", "ids": v} for i, v in enumerate(ids)]
    report = convert(write_jsonl(tmp_path / "i.jsonl", rows), tmp_path / "i.lmdb")
    assert report.fields == ["ids:int[-1]"] and report.count == 2
    ds = LMDBImageDataset(tmp_path / "i.lmdb", output="bytes", fields="*")
    assert ds[0][2]["ids"].tolist() == [16777217, 123456789]


def test_the_csv_hint_runs_as_printed(tmp_path: Path) -> None:
    import shlex

    make_images(tmp_path, 2)
    (tmp_path / "m.csv").write_text(
        "path,label,cap,score,Bad Name\nimg/0.jpg,a,x,1,q\nimg/1.jpg,b,y,2,r\n", encoding="utf-8"
    )
    out = cli("convert", str(tmp_path / "m.csv"), str(tmp_path / "s.lmdb"), "--fields", "cap")
    assert out.returncode == 0, out.stderr
    assert "CSV columns not stored: score, Bad Name" in out.stdout
    hint = out.stdout.split("keep them with --fields ")[1].split(", a type each")[0]
    again = cli("convert", str(tmp_path / "m.csv"), str(tmp_path / "t.lmdb"), "--fields",
                *shlex.split(hint))  # fmt: skip
    assert again.returncode == 0, again.stderr
    ds = LMDBImageDataset(tmp_path / "t.lmdb", output="bytes", fields="*")
    assert ds[0][2] == {"cap": "x", "score": "1"}


def test_the_sidecar_hint_runs_as_printed(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(2):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
        (root / "a" / f"{i}.json").write_text(json.dumps({"n": i}), encoding="utf-8")
    (root / "a" / "LICENSE.txt").write_text("not a sidecar", encoding="utf-8")
    out = cli("convert", str(root), str(tmp_path / "s.lmdb"))
    assert out.returncode == 0, out.stderr
    flags = out.stdout.split("? ")[1].split(" stores them")[0].split()
    assert flags == ["--sidecars", "json"]
    again = cli("convert", str(root), str(tmp_path / "t.lmdb"), *flags, "-q")
    assert again.returncode == 0, again.stderr
    ds = LMDBImageDataset(tmp_path / "t.lmdb", output="bytes", fields="*")
    assert [ds[i][2]["n"] for i in range(2)] == [0, 1]


BACKENDS = ["lmdb", pytest.param("mongo", marks=pytest.mark.mongo)]


def field_store(request: pytest.FixtureRequest, tmp_path: Path, source: Path, **kw: Any) -> Any:
    """``source`` converted into a store of the backend the test is given; returns a function
    that opens a dataset over it."""
    from fastdata import MongoImageDataset

    if request.node.callspec.params["backend"] == "lmdb":
        convert(source, tmp_path / "s.lmdb", **kw)
        return lambda **opts: LMDBImageDataset(tmp_path / "s.lmdb", **opts)
    uri = request.getfixturevalue("mongo_uri")
    convert(source, uri, collection="s", **kw)
    return lambda **opts: MongoImageDataset(uri, "s", **opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fields_star_gives_three_parts_on_a_store_without_fields(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    from fastdata import create_loader

    for i in range(4):
        write(tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(seed=i))
    dataset = field_store(request, tmp_path, tmp_path / "src")
    ds = dataset(output="numpy", fields="*")
    assert ds.fields == [] and len(ds[0]) == 3 and ds[0][2] == {}
    assert all(len(s) == 3 for s in ds.__getitems__([0, 1, 2]))
    images, _, values = fast_collate([ds[i] for i in range(4)])
    assert images.shape[0] == 4 and values == {}
    batch = next(iter(create_loader(dataset(fields="*"), 2, image_size=16, num_workers=0)))
    assert len(batch) == 3 and batch[2] == {}
    assert len(dataset(output="numpy")[0]) == 2  # without fields=, as before


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_fields_batch_as_the_values_stored_and_alike_for_every_worker_count(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    from torch.utils.data import DataLoader

    from fastdata import create_loader

    make_images(tmp_path, 4)
    scores = [1e300, 1700000000.25, 0.5, -2.0]
    rows = [
        {"path": f"img/{i}.jpg", "label": "ab"[i % 2], "score": scores[i],
         "box": [0.5, 1.0, 2.0, 3.0 + i], "quad": [1.0, 2.0, 3.0, 4.0]}
        for i in range(4)
    ]  # fmt: skip
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    dataset = field_store(request, tmp_path, manifest, fields="quad:float[4]")
    # box: a list of 4 in every row, of the type float[-1] (inferred: its length may vary)
    assert (
        dataset(fields="*").field_schema.describe() == "quad:float[4], score:float, box:float[-1]"
    )

    def resized(image: Any) -> np.ndarray:
        return np.array(image.resize((16, 16)))

    batches = []
    for workers in (0, 2):
        loader = create_loader(
            dataset(fields="*"), 4, image_size=16, num_workers=workers, train=False
        )
        batches.append(("create_loader", workers, next(iter(loader))[2]))
        plain = DataLoader(
            dataset(fields="*", transform=resized), 4, num_workers=workers, collate_fn=fast_collate
        )
        batches.append(("DataLoader", workers, next(iter(plain))[2]))
    ds = dataset(fields="*", transform=resized)
    batches.append(("fast_collate", 0, fast_collate([ds[i] for i in range(4)])[2]))
    as_dict = dataset(fields="*", transform=resized, as_dict=True)
    batches.append(("as_dict", 0, fast_collate([as_dict[i] for i in range(4)])))
    for how, workers, values in batches:
        where = f"{how}, {workers} workers"
        score = values["score"]
        assert score.dtype == torch.float64 and score.tolist() == scores, where  # exact, finite
        assert isinstance(values["quad"], torch.Tensor) and values["quad"].shape == (4, 4), where
        assert isinstance(values["box"], list) and len(values["box"]) == 4, where


@pytest.mark.mongo
def test_a_float_field_a_document_holds_as_an_int_reads_as_a_float(
    tmp_path: Path, mongo_uri: str
) -> None:
    from fastdata import MongoImageDataset

    from .mongo_server import database

    make_images(tmp_path, 2)
    rows = [{"path": f"img/{i}.jpg", "label": "a", "score": 3.0 + i / 2} for i in range(2)]
    convert(write_jsonl(tmp_path / "m.jsonl", rows), mongo_uri, collection="s")
    # another tool rewrote the value 3.0 as the int 3: the same number, so its checksum holds
    database(mongo_uri)["s"].update_one({"_id": 0}, {"$set": {"fields.score": 3}})
    assert type(database(mongo_uri)["s"].find_one({"_id": 0})["fields"]["score"]) is int
    assert cli("verify", mongo_uri, "--collection", "s").returncode == 0
    ds = MongoImageDataset(mongo_uri, "s", output="bytes", fields="*")
    value = ds[0][2]["score"]
    assert value == 3.0 and type(value) is float
    assert fast_collate([(np.zeros((2, 2, 3), np.uint8), 0, ds[0][2])])[2]["score"].dtype == (
        torch.float64
    )


def test_the_convert_back_an_export_prints_never_names_a_store_that_exists(tmp_path: Path) -> None:
    """Exported to ``out`` beside a store ``out.lmdb`` of other images: the printed command
    converted into out.lmdb (refused; and the --overwrite that refusal advises would have
    replaced that store). It names a free store path now, and runs as printed."""
    root = tmp_path / "src"
    for i in range(3):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(seed=i))
    other = tmp_path / "other"
    write(other / "b" / "0.jpg", jpeg_bytes(seed=9))
    assert cli("convert", str(root), str(tmp_path / "s.lmdb"), "-q").returncode == 0
    assert cli("convert", str(other), str(tmp_path / "out.lmdb"), "-q").returncode == 0
    before = (tmp_path / "out.lmdb" / "data.mdb").read_bytes()
    out = cli("export", str(tmp_path / "s.lmdb"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    command = printed_command(out.stdout, "convert back with:")
    assert str(tmp_path / "out.lmdb") not in command
    again = cli(*command, "-q")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "out.lmdb" / "data.mdb").read_bytes() == before
    assert len(LMDBImageDataset(command[-1])) == 3
