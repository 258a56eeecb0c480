"""Where a JPEG's first scan ends is found once, when its record is written, and kept in its
header (``scan_end``): reads that decode a window or the top rows look at two bytes instead of
searching the scan (NOTE [ Scan ends ] in fastdata/images/codec.py); verify checks it, a copy
adds it to records that lack it and refuses a wrong one, and stores without it read alike."""

from __future__ import annotations

import io
import json
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

from fastdata import (
    EvalPipeline,
    LMDBImageDataset,
    MongoImageDataset,
    TrainPipeline,
    convert,
    copy_store,
    export_store,
    open_store,
    records,
    verify_store,
)
from fastdata.errors import CorruptImageError, RecordError
from fastdata.images import codec, window
from fastdata.records import RecordHeader, first_mismatch, plain_headers

from .conftest import jpeg_bytes, png_bytes, write
from .earlier_formats import write_first_lmdb
from .mongo_server import database
from .procs import cli


def progressive(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    pixels = rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "JPEG", progressive=True, quality=80)
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for i in range(6):
        write(root / "a" / f"{i}.jpg", jpeg_bytes(120, 90, seed=i))
    write(root / "b" / "cut.jpg", jpeg_bytes(120, 90, seed=7)[:-2])  # repaired: FF D9 added
    write(root / "b" / "trailing.jpg", jpeg_bytes(120, 90, seed=8) + b"\0" * 40 + b"\xff\xd9")
    write(root / "b" / "progressive.jpg", progressive())
    write(root / "b" / "p.png", png_bytes(120, 90))
    return root


def headers(store: Path) -> dict[str, RecordHeader]:
    reader = open_store(store)
    return {r.header.name: r.header for r in reader.read_records(range(len(reader)))}


def search(data: bytes) -> int:
    """Where the first scan ends, found by the pattern alone (not the module's memchr)."""
    start = codec._first_scan(data)[0]
    found = codec._MARKER_AFTER_SCAN.search(data, start) if start >= 0 else None
    return -1 if found is None else found.start()


def test_scan_end_is_the_first_marker_after_the_first_scan() -> None:
    plain = jpeg_bytes(120, 90)
    assert codec.scan_end(plain) == len(plain) - 2 == search(plain)
    trailing = plain + b"\0" * 40 + b"\xff\xd9"
    assert codec.scan_end(trailing) == len(plain) - 2  # the first end, not the last
    prog = progressive()
    end = codec.scan_end(prog)
    assert 0 < end < len(prog) - 2 and prog[end + 1] != 0xD9  # a table or the next scan
    assert end == search(prog)
    assert codec.scan_end(memoryview(prog)) == end
    assert codec.scan_end(plain[:-2]) == -1  # the data ends inside the scan
    assert codec.scan_end(plain[:100]) == -1  # cut in its headers
    assert codec.scan_end(png_bytes()) == -1


def test_a_conversion_records_each_jpegs_scan_end(folder: Path, tmp_path: Path) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder, store)
    found = headers(store)
    reader = open_store(store)
    for i, record in enumerate(reader.read_records(range(len(reader)))):
        h = record.header
        if h.format == "jpeg":
            assert h.scan_end == search(record.data) >= 0, h.name
        else:
            assert h.scan_end == -1
        raw = reader._env().value_at(b"#%010d" % i)  # type: ignore[attr-defined]
        assert (b'"scan_end":' in raw) == (h.scan_end >= 0)
    assert found["b/cut.jpg"].repaired
    assert found["b/cut.jpg"].scan_end == found["b/cut.jpg"].size - 2  # the FF D9 added
    assert verify_store(reader).ok


def test_headers_with_and_without_a_scan_end_read_alike() -> None:
    with_end = RecordHeader("a/x.jpg", 3, 500, 77, "jpeg", scan_end=498)
    without = RecordHeader("a/y.jpg", 3, 500, 78, "jpeg")
    for h in (with_end, without):
        assert RecordHeader.from_json(h.to_json()) == h
        assert RecordHeader.from_dict(h.to_dict()) == h
    assert "scan_end" not in without.to_dict()
    heads = [with_end.to_json(), without.to_json()]
    parsed = plain_headers(list(heads))
    assert parsed is not None and parsed[4].tolist() == [498, -1]
    bad, ends = first_mismatch(heads, [b"x" * 500, b"x" * 500], str)
    assert bad is not None and bad[0] == 0 and ends == []  # (checksums of other bytes)
    for wrong in ('"498"', "500", "-2", "true", "4.5"):
        raw = with_end.to_json().replace(b"498", wrong.encode())
        # read as none (fastdata's own hint: the record is whole without it); verify names it
        assert RecordHeader.from_json(raw).scan_end == records.DAMAGED_SCAN_END
    assert plain_headers([with_end.to_json().replace(b"498", b"500")]) is None


def test_a_checked_read_gives_each_records_scan_end(folder: Path, tmp_path: Path) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder, store)
    reader = open_store(store)
    every = list(range(len(reader)))
    samples, ends = reader.read_samples_ends(every)
    assert samples == reader.read_samples(every)
    assert ends == [r.header.scan_end for r in reader.read_records(every)]
    data, view_ends = open_store(store).read_data_ends([3, 0])
    assert view_ends == [ends[3], ends[0]] and data == [samples[3][0], samples[0][0]]


@pytest.mark.parametrize("window_decoder", [True, False])
def test_a_decoding_read_looks_at_the_scan_end_and_gives_the_same_pixels(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_decoder: bool
) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder, store)
    before = window.set_enabled(window_decoder)
    try:
        pipelines = [TrainPipeline(48, scale=(0.05, 0.2)), EvalPipeline(48)]
        reads = {}
        for pipeline in pipelines:
            ds = LMDBImageDataset(store, pipeline=pipeline)
            keys = [(i, 1000 + i) for i in range(len(ds))]
            reads[pipeline] = [image for image, _ in ds.__getitems__(keys)]
        searched = []
        real = codec.marker_after
        monkeypatch.setattr(codec, "marker_after", lambda d, s: searched.append(s) or real(d, s))
        for pipeline in pipelines:
            ds = LMDBImageDataset(store, pipeline=pipeline)
            keys = [(i, 1000 + i) for i in range(len(ds))]
            again = [image for image, _ in ds.__getitems__(keys)]
            assert all(np.array_equal(a, b) for a, b in zip(reads[pipeline], again, strict=True))
            # the same pixels as the pipeline gives the bytes alone (searching the scan)
            for (data, _), seed, image in zip(
                open_store(store).read_samples(range(len(ds))),
                range(1000, 1000 + len(ds)),
                again,
                strict=True,
            ):
                assert np.array_equal(pipeline(data, seed), image)
        searched.clear()
        for pipeline in pipelines:
            ds = LMDBImageDataset(store, pipeline=pipeline)
            ds.__getitems__([(i, 1000 + i) for i in range(len(ds))])
        assert searched == []  # every JPEG's end came from its header
    finally:
        window.set_enabled(before)


def test_a_wrong_scan_end_is_never_trusted_for_more_than_its_two_bytes() -> None:
    data = jpeg_bytes(120, 90)
    end = len(data) - 2
    start = codec._first_scan(data)[0]
    assert codec.first_rows(data, 8, end) == codec.first_rows(data, 8)
    for wrong in (end - 1, start - 2, len(data), len(data) + 10**6):
        assert codec.first_rows(data, 8, wrong) is None  # (the whole image is decoded then)
    if window.available():
        shrink, box = 1, (10, 10, 40, 50)
        whole = window.decode_window(data, shrink, box, False)
        assert whole is not None
        assert np.array_equal(window.decode_window(data, shrink, box, False, end), whole)
        for wrong in (end - 1, start - 2, len(data), len(data) + 10**6, 2**62):
            assert window.decode_window(data, shrink, box, False, wrong) is None


def test_verify_names_a_record_whose_scan_end_is_wrong(folder: Path, tmp_path: Path) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder, store)
    reader = open_store(store)
    name = "a/2.jpg"
    i = next(r.index for r in reader.read_records(range(len(reader))) if r.header.name == name)
    reader.close()
    env = lmdb.open(str(store), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        head = json.loads(txn.get(b"#%010d" % i))
        head["scan_end"] -= 7
        txn.put(b"#%010d" % i, json.dumps(head, separators=(",", ":")).encode())
    env.close()
    report = verify_store(open_store(store))
    assert not report.ok
    assert [(f.name, f.reason) for f in report.failures] == [
        (
            name,
            f"its header says its first scan ends at byte {head['scan_end']}; it ends at "
            f"byte {head['scan_end'] + 7}",
        )
    ]
    run = cli("verify", str(store))
    assert run.returncode != 0 and name in run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    with pytest.raises(RecordError, match=f"{name}.*scan end.*nothing damaged is copied"):
        copy_store(store, tmp_path / "copy.lmdb")


def test_a_copy_gives_records_of_an_earlier_store_their_scan_end(
    folder: Path, tmp_path: Path
) -> None:
    old = tmp_path / "old.lmdb"
    write_first_lmdb(folder, old)
    assert all(h.scan_end == -1 for h in headers(old).values())
    copy = tmp_path / "copy.lmdb"
    copy_store(old, copy)
    copied = open_store(copy)
    for record in copied.read_records(range(len(copied))):
        want = search(record.data) if record.header.format == "jpeg" else -1
        assert record.header.scan_end == want, record.header.name
    assert verify_store(copied).ok
    # and the earlier store reads as the copy does
    pipeline = TrainPipeline(48)
    a, b = LMDBImageDataset(old, pipeline=pipeline), LMDBImageDataset(copy, pipeline=pipeline)
    keys = [(i, i) for i in range(len(a))]
    assert all(
        np.array_equal(x, y) and s == t
        for (x, s), (y, t) in zip(a.__getitems__(keys), b.__getitems__(keys), strict=True)
    )


def test_mongo_records_keep_their_scan_end(folder: Path, mongo_uri: str) -> None:
    convert(folder, mongo_uri, collection="se")
    docs = {d["name"]: d for d in database(mongo_uri)["se"].find({}, {"data": 0})}
    reader = open_store(mongo_uri, collection="se")
    every = list(range(len(reader)))
    records = reader.read_records(every)
    for r in records:
        assert r.header.scan_end == (search(r.data) if r.header.format == "jpeg" else -1)
        assert docs[r.header.name].get("scan_end", -1) == r.header.scan_end
    _, ends = reader.read_samples_ends(every)
    assert ends == [r.header.scan_end for r in records]
    ds = MongoImageDataset(mongo_uri, collection="se", pipeline=EvalPipeline(48))
    images = [image for image, _ in ds.__getitems__(every)]
    assert all(
        np.array_equal(EvalPipeline(48)(r.data), image)
        for r, image in zip(records, images, strict=True)
    )
    assert verify_store(reader).ok


def second_scan_after_the_first() -> bytes:
    """A JPEG whose first scan is followed by another start of scan, then the end of the image:
    a whole decode fails there, so a read that decodes a window or the top rows must not."""
    plain = jpeg_bytes(96, 480, seed=5)
    start = codec._first_scan(plain)[0]
    sos = plain.rfind(b"\xff\xda", 0, start)
    return plain[:-2] + plain[sos:start] + bytes(200) + codec.EOI


@pytest.mark.parametrize("window_decoder", [True, False])
def test_a_header_that_gives_its_scan_end_twice_is_read_as_verify_reads_it(
    tmp_path: Path, window_decoder: bool
) -> None:
    data = second_scan_after_the_first()
    write(tmp_path / "src" / "a" / "x.jpg", data)
    store = tmp_path / "s.lmdb"
    convert(tmp_path / "src", store)
    true_end = codec.scan_end(data)
    assert data[true_end + 1] == 0xDA  # (the second scan's start)
    env = lmdb.open(str(store), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        head = txn.get(b"#0000000000")
        assert head.endswith(b',"scan_end":%d}' % true_end)
        # the end of the image first, the true end last: JSON reads the last
        twice = head[:-1].replace(b'"scan_end":', b'"scan_end":%d,"scan_end":' % (len(data) - 2))
        txn.put(b"#0000000000", twice + b"}")
    env.close()
    assert verify_store(open_store(store)).ok  # (the end it checks is the true one)
    pipeline = TrainPipeline(32, scale=(0.02, 0.05))
    before = window.set_enabled(window_decoder)
    try:
        for seed in range(8):
            with pytest.raises(CorruptImageError):
                pipeline(data, seed)  # the bytes alone: the whole decode fails
            ds = LMDBImageDataset(store, pipeline=pipeline)
            with pytest.raises(CorruptImageError, match=r"a/x\.jpg"):
                ds.__getitems__([(0, seed)])
    finally:
        window.set_enabled(before)


def test_a_scan_end_that_is_no_offset_costs_its_record_nothing_and_verify_names_it(
    folder: Path, tmp_path: Path
) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder, store)
    reader = open_store(store)
    name = "a/2.jpg"
    record = next(r for r in reader.read_records(range(len(reader))) if r.header.name == name)
    reader.close()
    env = lmdb.open(str(store), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        head = json.loads(txn.get(b"#%010d" % record.index))
        head["scan_end"] = str(head["scan_end"])  # (a string: no offset)
        txn.put(b"#%010d" % record.index, json.dumps(head, separators=(",", ":")).encode())
    env.close()
    report = verify_store(open_store(store))
    assert [(f.name, f.reason) for f in report.failures] == [
        (
            name,
            "its header gives a scan_end that is not an offset in its bytes; it ends at byte "
            f"{record.header.scan_end}",
        )
    ]
    # the salvage verify advises keeps the image: its bytes and the rest of its header are sound
    out = tmp_path / "sound"
    export_store(open_store(store), out, skip_damaged=True)
    assert (out / name).read_bytes() == (folder / name).read_bytes()
    # reads search its scan, whichever path they take
    pipeline = EvalPipeline(48)
    for as_dict in (False, True):
        ds = LMDBImageDataset(store, pipeline=pipeline, as_dict=as_dict)
        got = ds.__getitems__([record.index])[0]
        image = got["image"] if as_dict else got[0]
        assert np.array_equal(image, pipeline(record.data))
    with pytest.raises(RecordError, match=f"{name}.*scan end.*nothing damaged is copied"):
        copy_store(store, tmp_path / "copy.lmdb")


def test_a_mongo_scan_end_that_is_no_offset_costs_its_record_nothing(
    folder: Path, tmp_path: Path, mongo_uri: str
) -> None:
    convert(folder, mongo_uri, collection="se")
    name = "a/3.jpg"
    doc = database(mongo_uri)["se"].find_one({"name": name})
    database(mongo_uri)["se"].update_one({"_id": doc["_id"]}, {"$set": {"scan_end": 12.0}})
    report = verify_store(open_store(mongo_uri, collection="se"))
    assert [(f.name, f.reason) for f in report.failures] == [
        (
            name,
            "its header gives a scan_end that is not an offset in its bytes; it ends at byte "
            f"{doc['scan_end']}",
        )
    ]
    out = tmp_path / "sound"
    export_store(open_store(mongo_uri, collection="se"), out, skip_damaged=True)
    assert (out / name).read_bytes() == (folder / name).read_bytes()
    pipeline = EvalPipeline(48)
    ds = MongoImageDataset(mongo_uri, collection="se", pipeline=pipeline, as_dict=True)
    assert np.array_equal(ds.__getitems__([doc["_id"]])[0]["image"], pipeline(bytes(doc["data"])))
