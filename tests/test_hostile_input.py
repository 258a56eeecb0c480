"""Hostile folders and files: nothing hangs, explodes, crashes or is silently dropped.

Every case is built in tmp_path; conversions that could hang run in a child process under a
timeout (a hang fails the test instead of stalling the run)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from fastdata import LMDBImageDataset, convert, export_store, open_store, verify_store
from fastdata.errors import CorruptImageError, SourceError
from fastdata.images import decode as decode_module
from fastdata.images.pipelines import EvalPipeline, TrainPipeline
from fastdata.packed import PackedStrings
from fastdata.records import SkippedFile
from fastdata.sources.folder import scan_folder

from .conftest import jpeg_bytes, snapshot, write
from .mongo_server import database
from .procs import cli


@pytest.fixture(autouse=True)
def deadline():  # type: ignore[no-untyped-def]
    """Each test fails after 120 s instead of hanging the run (SIGALRM interrupts a blocked
    system call, such as an open() waiting on a FIFO)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("the test ran past its 120 s deadline: something hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def reasons(skipped: list[SkippedFile]) -> dict[str, str]:
    return {s.name: s.reason for s in skipped}


def converted(store: Path) -> list[str]:
    reader = open_store(store)
    try:
        return [r.header.name for r in reader.iter_records()]
    finally:
        reader.close()


# -------------------------------------------------------------- what the scan touches


def test_fifos_sockets_devices_and_broken_links_are_skipped_not_read(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "c" / "good.jpg", jpeg_bytes())
    os.mkfifo(src / "c" / "fifo.jpg")  # reading it would wait forever for a writer
    (src / "c" / "zero.jpg").symlink_to("/dev/zero")  # reading it would never end
    (src / "c" / "gone.jpg").symlink_to(src / "c" / "nothing-here")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(src / "c" / "sock.jpg"))
    dst = tmp_path / "s.lmdb"
    result = cli("convert", str(src), str(dst), "-q", timeout=60)
    server.close()
    assert result.returncode == 0, result.stderr
    assert "skipped 4 unusable file(s)" in result.stdout
    store = open_store(dst)
    assert store.meta.skipped_count == 4
    assert reasons(store.skipped_files()) == {
        "c/fifo.jpg": "not a regular file (a FIFO)",
        "c/zero.jpg": "not a regular file (a character device)",
        "c/gone.jpg": "vanished, or a broken link",
        "c/sock.jpg": "not a regular file (a socket)",
    }
    assert converted(dst) == ["c/good.jpg"]


def test_a_fifo_that_appears_after_the_scan_is_not_waited_for(tmp_path: Path) -> None:
    from fastdata.sources.reading import read_file

    os.mkfifo(tmp_path / "late.jpg")
    assert read_file(str(tmp_path / "late.jpg"), 1 << 20) == "not a regular file (a FIFO)"


def test_link_loops_neither_repeat_images_nor_hang(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for cls in ("a", "b"):
        for i in range(5):
            write(src / cls / f"{i}.jpg", jpeg_bytes(seed=i))
    write(src / "a" / "sub" / "x.jpg", jpeg_bytes(seed=9))
    (src / "a" / "loop").symlink_to("..")  # back to the root
    (src / "a" / "sub" / "self1").symlink_to(".")  # two links to their own folder: exponential
    (src / "a" / "sub" / "self2").symlink_to(".")
    (src / "b" / "to-a").symlink_to("../a")  # into another class
    result = cli("convert", str(src), str(tmp_path / "s.lmdb"), "-q", timeout=60)
    assert result.returncode == 0, result.stderr
    names = converted(tmp_path / "s.lmdb")
    assert len(names) == 11 and len(set(names)) == 11
    assert "b/to-a/0.jpg" not in names  # a's images stay a's
    skipped = reasons(open_store(tmp_path / "s.lmdb").skipped_files())
    assert "scanned already" in skipped["a/loop/"] and "scanned already" in skipped["b/to-a/"]
    assert "scanned already (a/sub)" in skipped["a/sub/self1/"]


def chain(top: Path, name: str, depth: int, image: bytes) -> None:
    """``top/name/name/.../far.jpg``, ``depth`` folders deep, made one level at a time (the
    full path may be longer than the system accepts)."""
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        fd, old = os.open(name, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    out = os.open("far.jpg", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
    os.write(out, image)
    os.close(out)
    os.close(fd)


def remove_chain(top: Path, name: str) -> None:
    """Remove what :func:`chain` made, bottom-up, one level at a time (a recursive removal, such
    as pytest's own clean-up, would exceed Python's recursion limit)."""
    fds = [os.open(top, os.O_RDONLY)]
    while name in os.listdir(fds[-1]):
        fds.append(os.open(name, os.O_RDONLY, dir_fd=fds[-1]))
    os.unlink("far.jpg", dir_fd=fds[-1])
    while len(fds) > 1:
        os.close(fds.pop())
        os.rmdir(name, dir_fd=fds[-1])
    os.close(fds[0])


def test_a_tree_1200_folders_deep(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "c" / "top.jpg", jpeg_bytes(seed=1))
    chain(src / "c", "d", 1200, jpeg_bytes())
    try:
        report = convert(src, tmp_path / "s.lmdb")
        assert report.count == 2 and not report.skipped
    finally:
        remove_chain(src / "c", "d")


def test_paths_longer_than_the_system_allows_are_listed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "c" / "ok.jpg", jpeg_bytes())
    chain(src / "c", "x" * 250, 20, jpeg_bytes())  # its full path passes PATH_MAX (4096)
    report = convert(src, tmp_path / "s.lmdb")
    assert report.count == 1
    assert any(
        "path too long" in s.reason and s.name.startswith("c/xxx") for s in report.skipped
    ), report.skipped


def test_unreadable_folders_and_files_are_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    write(src / "c" / "ok.jpg", jpeg_bytes())
    write(src / "c" / "secret" / "x.jpg", jpeg_bytes(seed=1))
    write(src / "c" / "locked.jpg", jpeg_bytes(seed=2))
    real_scandir, real_open = os.scandir, os.open

    def scandir(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("secret"):  # the tests run as root, which permissions don't stop
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    def open_(path, flags, *args, **kw):  # type: ignore[no-untyped-def]
        if str(path).endswith("locked.jpg"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "open", open_)
    report = convert(src, tmp_path / "s.lmdb")
    assert report.count == 1
    assert reasons(report.skipped) == {
        "c/secret/": "unreadable folder: Permission denied",
        "c/locked.jpg": "unreadable: Permission denied",
    }
    with pytest.raises(SourceError, match=r"secret: unreadable folder.*strict=True"):
        convert(src, tmp_path / "t.lmdb", strict=True)


def test_files_over_the_size_limit_are_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "c" / "small.jpg", jpeg_bytes())
    write(src / "c" / "big.jpg", jpeg_bytes(400, 400))
    limit = len(jpeg_bytes()) + 10
    report = convert(src, tmp_path / "s.lmdb", max_file_bytes=limit)
    assert report.count == 1
    assert reasons(report.skipped)["c/big.jpg"].startswith("too large (")
    result = cli("convert", str(src), str(tmp_path / "t.lmdb"), "-q", "--max-file-size", "4K")
    assert result.returncode == 0 and "too large" in result.stdout
    bad = cli("convert", str(src), str(tmp_path / "u.lmdb"), "--max-file-size", "lots")
    assert bad.returncode == 2 and "is not a size" in bad.stderr


# -------------------------------------------------------------- bounded decodes


def pixel_bomb() -> bytes:
    """A small JPEG whose header declares 60000 x 60000 pixels (10.8 GB decoded)."""
    data = bytearray(jpeg_bytes(64, 48))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, 60000, 60000)
    return bytes(data)


def write_store_with(dst: Path, images: list[bytes]) -> None:
    """A store of ``images`` written record by record, as another tool could."""
    from fastdata.records import Progress, Record, RecordHeader, StoreMeta, checksum
    from fastdata.stores.lmdb.writer import LMDBWriter

    with LMDBWriter(dst) as writer:
        progress = Progress(source="elsewhere", fingerprint="f", total=len(images))
        writer.start(progress, overwrite=False, resume=False)
        records = [
            Record(i, RecordHeader(f"c/{i}.jpg", 0, len(d), checksum(d), "jpeg"), d)
            for i, d in enumerate(images)
        ]
        writer.write(records, progress)
        meta = StoreMeta(count=len(images), classes=["c"], id=progress.store_id)
        writer.finish(meta, np.zeros(len(images), dtype=np.int64))


def test_a_pixel_bomb_is_refused_on_every_path(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "c" / "bomb.jpg", pixel_bomb())
    write(src / "c" / "fine.jpg", jpeg_bytes())
    for verify_decode in (False, True):  # the header is checked at convert either way
        report = convert(src, tmp_path / f"{verify_decode}.lmdb", verify_decode=verify_decode)
        assert "over the limit" in reasons(report.skipped)["c/bomb.jpg"] and report.count == 1
    # a store written elsewhere (or before the limit was lowered) holds it: refused when decoded
    dst = tmp_path / "s.lmdb"
    write_store_with(dst, [pixel_bomb(), jpeg_bytes()])
    for output in ("pil", "numpy"):
        with pytest.raises(CorruptImageError, match=r"record 0 \(c/0.jpg\).*(over|than) the limit"):
            LMDBImageDataset(dst, output=output)[0]  # type: ignore[arg-type]
    for pipeline in (TrainPipeline(32), EvalPipeline(32)):
        with pytest.raises(CorruptImageError, match="over the limit"):
            LMDBImageDataset(dst, pipeline=pipeline)[0]
    assert LMDBImageDataset(dst, output="numpy")[1][0].shape == (48, 64, 3)
    report = verify_store(open_store(dst), decode=True)
    assert [f.name for f in report.failures] == ["c/0.jpg"]
    result = cli("verify", str(dst), "--decode", "-q")
    assert result.returncode == 1 and "over the limit" in result.stdout


def test_the_pixel_limit_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    image = jpeg_bytes(64, 48)
    assert decode_module.decode_numpy(image).shape == (48, 64, 3)
    before = decode_module.set_pixel_limit(1000)
    with pytest.raises(CorruptImageError, match="64 x 48 pixels, over the limit of 1000"):
        decode_module.decode_numpy(image)
    decode_module.set_pixel_limit(before)
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # None follows Pillow's setting
    with pytest.raises(CorruptImageError, match="over the limit of 2000"):
        decode_module.decode_pil(image)


@pytest.mark.skipif(not decode_module.has_turbo(), reason="needs libjpeg-turbo (simplejpeg)")
def test_strict_decode_catches_a_cut_scan_but_passes_a_repaired_end_marker(
    tmp_path: Path,
) -> None:
    whole = jpeg_bytes(200, 150)
    src = tmp_path / "src"
    write(src / "c" / "cut.jpg", whole[: len(whole) // 10])  # 10% of its scan data
    write(src / "c" / "no-eoi.jpg", whole[:-2])  # complete scan, only the marker missing
    report = convert(src, tmp_path / "checked.lmdb", verify_decode=True)
    assert reasons(report.skipped) == {"c/cut.jpg": "truncated JPEG: scan data ends early"}
    assert report.repaired == 1 and report.count == 1
    dst = tmp_path / "s.lmdb"
    report = convert(src, dst)  # without --verify-decode: the same (a file cut short is no repair)
    assert reasons(report.skipped) == {"c/cut.jpg": "truncated JPEG: scan data ends early"}
    assert report.repaired == 1 and report.count == 1
    assert not verify_store(open_store(dst), decode=True).failures


# -------------------------------------------------------------- names of any shape

ODD_NAMES = [
    "4:3",  # a class with a colon
    "line\nbreak",  # a newline
    "é-ü",  # non-ASCII UTF-8
    "x" * 250,  # close to the 255-byte limit of a name
]


def odd_folder(root: Path) -> Path:
    for i, name in enumerate(ODD_NAMES):
        write(root / name / f"{name[:40]}-{i}.jpg", jpeg_bytes(seed=i))
    raw = os.fsdecode(b"latin1-\xe9t\xe9")  # not valid UTF-8
    write(root / raw / (os.fsdecode(b"\xff\xfe") + ".jpg"), jpeg_bytes(seed=9))
    return root


def test_any_posix_name_round_trips_through_lmdb(tmp_path: Path) -> None:
    src = odd_folder(tmp_path / "src")
    report = convert(src, tmp_path / "s.lmdb")
    assert report.count == 5 and not report.skipped
    ds = LMDBImageDataset(tmp_path / "s.lmdb")
    assert ds.classes == scan_folder(src).classes  # kept exactly
    export_store(open_store(tmp_path / "s.lmdb"), tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(src)
    raw_names = {p.name for p in (tmp_path / "out").iterdir()}
    assert os.fsdecode(b"latin1-\xe9t\xe9") in raw_names


@pytest.mark.mongo
def test_any_posix_name_round_trips_through_mongo(tmp_path: Path, mongo_uri: str) -> None:
    src = odd_folder(tmp_path / "src")
    report = convert(src, mongo_uri, collection="odd")
    assert report.count == 5 and not report.skipped
    store = open_store(mongo_uri, collection="odd")
    assert store.meta.classes == scan_folder(src).classes
    assert verify_store(store).ok
    export_store(store, tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(src)
    result = cli("info", mongo_uri, "-c", "odd", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["count"] == 5


@pytest.mark.mongo
def test_many_skipped_files_keep_mongo_documents_small(tmp_path: Path, mongo_uri: str) -> None:
    from bson import BSON

    src = tmp_path / "src"
    write(src / "c" / "ok.jpg", jpeg_bytes())
    long = "n" * 200
    for i in range(2500):
        (src / "c" / f"{long}{i:05d}.jpg").touch()  # empty: skipped
    report = convert(src, mongo_uri, collection="many", commit_records=1)
    assert report.count == 1 and len(report.skipped) == 2500
    db = database(mongo_uri)
    meta = db["__fastdata__"].find_one({"_id": "many"})
    assert meta["skipped_count"] == 2500 and len(BSON.encode(meta)) < 64 << 10
    chunks = list(db["__fastdata__"].find({"_id": {"$regex": "^skipped:"}}))
    assert len(chunks) == 3 and all(len(BSON.encode(c)) < 1 << 20 for c in chunks)
    store = open_store(mongo_uri, collection="many")
    assert store.meta.skipped_count == 2500 and len(store.skipped_files()) == 2500


# -------------------------------------------------------------- legacy stores


def test_a_legacy_index_costs_what_it_holds() -> None:
    paths = [f"c/{i}.jpg".encode() for i in range(10000)] + [b"x" * 1_000_000]
    packed = PackedStrings(paths)
    assert packed[3] == b"c/3.jpg" and packed[-1] == b"x" * 1_000_000
    assert packed.nbytes < 1_200_000  # a fixed-width array would take 10 GB
    with pytest.raises(IndexError):
        packed[len(paths)]
    assert np.array(paths[:2], dtype=np.bytes_).itemsize == 7  # (the old layout's width)


@pytest.mark.mongo
def test_a_legacy_collection_with_one_absurd_path(tmp_path: Path, mongo_uri: str) -> None:
    from bson import Binary

    from fastdata import MongoImageDataset

    coll = database(mongo_uri)["legacy"]
    coll.insert_many(
        [{"img_name": f"c/{i}.jpg", "bson_img": Binary(jpeg_bytes())} for i in range(3)]
    )
    index = tmp_path / "index.json"
    paths = [f"c/{i}.jpg" for i in range(3)] + ["y" * 2_000_000]
    index.write_text(json.dumps({"path_list": paths, "label_list": [0, 0, 0, 0]}))
    ds = MongoImageDataset(mongo_uri, "legacy", index_file=index, output="bytes")
    import pickle

    # what every spawned worker receives: the paths as they are, not 4 x 2 MB fixed-width slots
    assert len(pickle.dumps(ds)) < 2_200_000
    assert ds[1][0] == jpeg_bytes()


def _headers_one_at_a_time(heads: list[bytes]) -> list[object]:
    from fastdata.errors import RecordError
    from fastdata.records import RecordHeader, name_bytes

    out: list[object] = []
    for head in heads:
        try:
            h = RecordHeader.from_json(head)
            out.append((name_bytes(h.name), h.label, h.size, h.crc32, h.fields, h.scan_end))
        except (RecordError, UnicodeEncodeError):
            out.append(None)
    return out


HOSTILE_HEADERS = [
    b'{"name":"c/1.jpg","label":0,"size":3,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"c/\\u00e9\\udcff \\"q\\" \\\\ \\/","label":-0,"size":0,"crc32":0,"format":"png",'
    b'"repaired":false}',
    b'{"name":"a","label":1,"size":01,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a","label":1,"size":-1,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a","label":1,"size":1,"crc32":4294967296,"format":"jpeg","repaired":false}',
    b'{"name":"a","label":99999999999,"size":1,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a\\ud800","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a\\u0000b","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false,"fields":{}}',
    b'{"name":"a","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}\n{"x":1}',
    b'{"name":"\xc3\xa9","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}',
    b'{"name":"a","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false} ',
    b'{"label":1,"name":"a","size":1,"crc32":7,"format":"jpeg","repaired":false}',
    # two headers that are whole only together, beside one that is two
    b'{"name":"a","label":1,"size":1,"crc32":7,"format":"',
    b'","repaired":false}',
    b'{"name":"a","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}\n'
    b'{"name":"b","label":1,"size":1,"crc32":7,"format":"jpeg","repaired":false}',
    # scan ends: one in its bytes, one past them, malformed ones
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":2}',
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":3}',
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":01}',
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":-1}',
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":"2"}',
    b'{"name":"a","label":1,"size":3,"crc32":7,"format":"jpeg","repaired":false,"scan_end":2,'
    b'"scan_end":5}',
]


@pytest.mark.parametrize(
    "picked", [[0], [0, 1], [0, 1, 0], [16, 0], *([0, k] for k in range(2, len(HOSTILE_HEADERS)))]
)
def test_headers_read_at_once_are_read_as_one_at_a_time(picked: list[int]) -> None:
    """The headers a check reads many at once: every one read alike, or the whole lot left to
    be read one at a time (where each is accepted or named)."""
    import numpy as np

    from fastdata.records import plain_headers

    heads = [HOSTILE_HEADERS[k] for k in picked]
    single = _headers_one_at_a_time(heads)
    together = plain_headers(list(heads))
    if together is None:
        assert picked not in ([0], [0, 1, 0], [16, 0])  # (the plain ones are read at once)
        return
    assert all(h is not None and h[4] is None for h in single), picked
    names, labels, sizes, crcs, ends = together
    assert names == b"\0".join(h[0] for h in single)  # type: ignore[index]
    assert np.array_equal(labels, [h[1] for h in single])  # type: ignore[index]
    assert np.array_equal(sizes, [h[2] for h in single])  # type: ignore[index]
    assert np.array_equal(crcs, [h[3] for h in single])  # type: ignore[index]
    assert np.array_equal(ends, [h[5] for h in single])  # type: ignore[index]


_HEAD = b'{"name":"a","label":1,"size":8,"crc32":%d,"format":"jpeg","repaired":false' % (
    zlib.crc32(b"x" * 8)
)
SCAN_END_HEADERS = [
    _HEAD + b',"scan_end":2}',
    _HEAD + b',"scan_end":2,"fields":{"a":1},"fields_crc32":9}',
    _HEAD + b',"scan_end":2,"fields":{"scan_end":5},"fields_crc32":9}',
    # given twice: JSON reads the last
    _HEAD + b',"scan_end":2,"scan_end":5}',
    _HEAD + b',"scan_end":2,"fields":{"a":1},"fields_crc32":9,"scan_end":5}',
    _HEAD + b',"scan_end":2,"fields":{"a":1},"fields_crc32":9,"scan\\u005fend":5}',
    _HEAD + b',"scan_end":2,"scan_end":-1}',
    # not a plain offset
    _HEAD + b',"scan_end":2.0}',
    _HEAD + b',"scan_end":2e0}',
]


@pytest.mark.parametrize("head", SCAN_END_HEADERS)
def test_a_checked_read_passes_on_only_the_scan_end_a_header_read_whole_gives(head: bytes) -> None:
    """The scan end a checked read passes to a decode (which trusts the two bytes there) is the
    one the header gives read whole, which ``fastdata verify`` checks, or none (then the scan is
    searched): never one that a second key overrides."""
    from fastdata.errors import RecordError
    from fastdata.records import RecordHeader, first_mismatch

    try:
        whole = RecordHeader.from_json(head).scan_end
    except RecordError:
        whole = -1  # (verify names it; a read that takes it searches)
    bad, ends = first_mismatch([head], [b"x" * 8], str)
    assert bad is None and ends[0] in (whole, -1)
    heads = [SCAN_END_HEADERS[0], head, SCAN_END_HEADERS[1]]
    bad, ends = first_mismatch(heads, [b"x" * 8] * 3, str)
    assert bad is None and ends[1] in (whole, -1)
    assert ends[0] == ends[2] == 2  # (headers as fastdata writes them: taken as they are)
