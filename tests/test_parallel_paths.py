"""Every parallel path, in a fresh process, on a folder as users have them.

A path that runs on threads or processes is only tested for real in a process that has not
imported anything yet: the first image each thread opens then imports Pillow and its plugins
while the others use them. So each command here runs in a new process (the CLI, or the README's
one Python call), with 1, 2 and 4 workers, on one folder that mixes RGB, grayscale and RGBA
JPEGs and PNGs, a JPEG missing its end-of-image marker, and junk (text under an image's name, a
PNG signature followed by nothing an image holds, a JPEG cut inside its headers, and a PNG cut
inside its pixels: stored with --verify-decode off, skipped with it on). Every store must hold
exactly the records the folder gives, the same with any worker count, and each command must end
with its exit status and its summary, never a traceback.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fastdata import convert, open_store

from .conftest import jpeg_bytes, snapshot, write
from .procs import cli, run_script

CLASSES = ("c0", "c1", "c2")
CYCLES = 43
"""Cycles of the ten kinds of file below: 258 records with --verify-decode (6 a cycle; 7
without it), enough for `verify --workers 4` to check in four processes (64 records each at
least)."""


def _png(seed: int, mode: str) -> bytes:
    rng = np.random.default_rng(seed)
    shape = {"RGB": (9, 11, 3), "RGBA": (9, 11, 4), "L": (9, 11)}[mode]
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode).save(buf, "PNG")
    return buf.getvalue()


def _kinds(seed: int) -> list[tuple[str, bytes, str]]:
    """The ten files of one cycle: (extension, bytes, what becomes of them), the last one of
    ``stored`` (as they are), ``repaired`` (stored with an end-of-image marker appended),
    ``skipped``, and ``no-decode`` (stored without --verify-decode, skipped with it)."""
    good = jpeg_bytes(10, 8, seed=seed)
    return [
        ("jpg", good, "stored"),
        ("png", _png(seed, "RGB"), "stored"),
        ("jpg", jpeg_bytes(10, 8, mode="L", seed=seed), "stored"),
        ("png", _png(seed, "RGBA"), "stored"),
        ("png", _png(seed, "L"), "stored"),
        ("jpg", jpeg_bytes(10, 8, seed=seed + 1)[:-2], "repaired"),
        ("jpg", b"not an image, only named like one\n", "skipped"),
        ("png", b"\x89PNG\r\n\x1a\n" + b"but nothing Pillow can read", "skipped"),
        ("jpg", good[:100], "skipped"),  # cut inside its headers
        ("png", _png(seed, "RGB")[:-40], "no-decode"),  # cut inside its pixels
    ]


class Folder:
    """The folder, and what a store converted from it must hold."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, tuple[bytes, str]] = {}
        for i in range(CYCLES):
            for k, (ext, data, fate) in enumerate(_kinds(seed=i)):
                name = f"{CLASSES[(i + k) % 3]}/{i:03d}-{k}.{ext}"
                write(root / name, data)
                self.files[name] = (data, fate)

    def expected(self, decode: bool) -> dict[str, tuple[str, bytes, bool]]:
        """Each record a store holds, by name: its class, stored bytes and repair flag."""
        kept = {"stored", "repaired"} if decode else {"stored", "repaired", "no-decode"}
        out = {}
        for name, (data, fate) in self.files.items():
            if fate in kept:
                repaired = fate == "repaired"
                out[name] = (name.split("/")[0], data + b"\xff\xd9" * repaired, repaired)
        return out

    def skipped(self, decode: bool) -> set[str]:
        return set(self.files) - set(self.expected(decode))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return Folder(tmp_path_factory.mktemp("parallel") / "mixed folder")


@pytest.fixture(scope="module")
def reference(folder: Folder, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Any]:
    """What a conversion with one worker stores, with --verify-decode off and on."""
    out = {}
    for decode in (False, True):
        dst = tmp_path_factory.mktemp("reference") / "s.lmdb"
        convert(folder.root, dst, workers=1, verify_decode=decode)
        out[decode] = contents(dst)
    return out


def contents(store: Path | str, collection: str | None = None) -> dict[str, Any]:
    """Everything a store holds that a conversion decides: classes, every record (index, name,
    label, bytes, header) and the skipped files with their reasons."""
    reader = open_store(store, collection=collection)
    try:
        records = reader.read_records(range(len(reader)))
        return {
            "classes": list(reader.meta.classes),
            "records": [
                (r.index, r.header.name, r.header.label, r.data, r.header.format, r.header.repaired)
                for r in records
            ],
            "labels": reader.labels.tolist(),
            "skipped": sorted((s.name, s.reason) for s in reader.skipped_files()),
        }
    finally:
        reader.close()


def check_store(found: dict[str, Any], folder: Folder, decode: bool) -> None:
    """``found`` (see :func:`contents`) holds exactly the records the folder gives."""
    expected = folder.expected(decode)
    held = {
        name: (found["classes"][label], data, repaired)
        for _, name, label, data, _, repaired in found["records"]
    }
    assert held == expected
    assert len(found["records"]) == len(expected)  # (each once)
    assert {name for name, _ in found["skipped"]} == folder.skipped(decode)


def check_summary(result: Any, folder: Folder, decode: bool, workers: int) -> None:
    """The convert command's exit status and summary: the counts, the worker count."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    count, skipped = len(folder.expected(decode)), len(folder.skipped(decode))
    assert f": {count} images in 3 classes" in result.stdout
    assert f"reader threads: {workers}\n" in result.stdout
    assert f"skipped {skipped} unusable file(s):" in result.stdout


@pytest.mark.parametrize("decode", [False, True], ids=["", "verify-decode"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_convert_stores_the_same_records_with_any_worker_count(
    folder: Folder, reference: dict[bool, Any], tmp_path: Path, workers: int, decode: bool
) -> None:
    dst = tmp_path / "s.lmdb"
    flags = ["--verify-decode"] if decode else []
    result = cli("convert", str(folder.root), str(dst), "--workers", str(workers), *flags)
    check_summary(result, folder, decode, workers)
    found = contents(dst)
    check_store(found, folder, decode)
    assert found == reference[decode]


@pytest.mark.mongo
@pytest.mark.parametrize("decode", [False, True], ids=["", "verify-decode"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_convert_to_mongodb_stores_the_same_records_with_any_worker_count(
    folder: Folder, reference: dict[bool, Any], mongo_uri: str, workers: int, decode: bool
) -> None:
    flags = ["--verify-decode"] if decode else []
    args = ("convert", str(folder.root), mongo_uri, "-c", "imgs", "--workers", str(workers))
    result = cli(*args, *flags)
    check_summary(result, folder, decode, workers)
    found = contents(mongo_uri, "imgs")
    check_store(found, folder, decode)
    assert found == reference[decode]


README_CALL = """
    import sys
    from fastdata import convert

    src, dst, workers, collection = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    report = convert(src, dst, workers=workers, progress=lambda done, total: None,
                     collection=collection[0] if collection else None)
    print(report.count, report.repaired, len(report.skipped))
"""


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("mongodb", marks=pytest.mark.mongo)])
@pytest.mark.parametrize("workers", [2, 4])
def test_the_readme_call_converts_with_workers_in_a_fresh_process(
    folder: Folder,
    reference: dict[bool, Any],
    tmp_path: Path,
    request: Any,
    backend: str,
    workers: int,
) -> None:
    if backend == "lmdb":
        dst, extra = str(tmp_path / "s.lmdb"), []
    else:
        dst, extra = request.getfixturevalue("mongo_uri"), ["imgs"]
    result = run_script(README_CALL, folder.root, dst, workers, *extra)
    assert result.returncode == 0, result.stderr
    expected = folder.expected(decode=False)
    repaired = sum(r for _, _, r in expected.values())
    skipped = len(folder.skipped(decode=False))
    assert result.stdout.split() == [str(len(expected)), str(repaired), str(skipped)]
    assert contents(dst, *extra) == reference[False]


def _reference_store(folder: Folder, tmp_path: Path, workers: int) -> Path:
    store = tmp_path / f"w{workers}.lmdb"
    convert(folder.root, store, workers=workers)
    return store


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_verify_checks_every_record_with_any_worker_count(
    folder: Folder, tmp_path: Path, workers: int
) -> None:
    store = _reference_store(folder, tmp_path, workers)
    count = len(folder.expected(decode=False))
    result = cli("verify", str(store), "--decode", "--workers", str(workers), "-q")
    # (the PNGs cut inside their pixels were stored without --verify-decode: they fail to
    # decode, and are named, the same however many processes check)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    cut = sorted(n for n, (_, fate) in folder.files.items() if fate == "no-decode")
    named = sorted(re.findall(r"^ +\d+ (\S+): cannot decode image", result.stdout, flags=re.M))
    assert named == cut, result.stdout
    # a store converted with --verify-decode passes
    good = tmp_path / "decoded.lmdb"
    convert(folder.root, good, workers=workers, verify_decode=True)
    result = cli("verify", str(good), "--decode", "--workers", str(workers), "-q")
    assert result.returncode == 0, result.stderr
    decoded = len(folder.expected(decode=True))
    assert result.stdout.strip().endswith(f"{decoded} records OK (sizes, checksums, fields and scan ends, decoding)")
    assert count > decoded >= 4 * 64  # (enough records for four processes)


def test_verify_names_the_same_damage_with_any_worker_count(folder: Folder, tmp_path: Path) -> None:
    store = tmp_path / "s.lmdb"
    convert(folder.root, store, workers=1, verify_decode=True)
    reader = open_store(store)
    victim = reader.read_records([200])[0]
    reader.close()
    data_file = store / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    places = [m.start() for m in re.finditer(re.escape(victim.data), raw)]
    assert places  # (and maybe a copy on a page LMDB freed)
    for at in places:
        raw[at + len(victim.data) // 2] ^= 0xFF  # one flipped byte in one record's image
    data_file.write_bytes(bytes(raw))
    reports = {}
    for workers in (1, 2, 4):
        result = cli("verify", str(store), "--workers", str(workers), "-q")
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
        reports[workers] = result.stdout
    assert victim.header.name in reports[1]
    assert reports[1] == reports[2] == reports[4]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_export_writes_the_folder_back_from_a_store_converted_with_any_worker_count(
    folder: Folder, tmp_path: Path, workers: int
) -> None:
    store = _reference_store(folder, tmp_path, workers)
    out = tmp_path / "exported"
    result = cli("export", str(store), str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    stored = folder.expected(decode=False)
    assert snapshot(out) == {name: folder.files[name][0] for name in stored}  # original bytes


def test_copy_lmdb_to_lmdb_keeps_every_record(
    folder: Folder, reference: dict[bool, Any], tmp_path: Path
) -> None:
    store = _reference_store(folder, tmp_path, 4)
    result = cli("copy", str(store), str(tmp_path / "copy.lmdb"), "-q")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert contents(tmp_path / "copy.lmdb") == reference[False]


@pytest.mark.mongo
def test_copy_to_mongodb_and_back_export_and_verify_there(
    folder: Folder, reference: dict[bool, Any], tmp_path: Path, mongo_uri: str
) -> None:
    store = _reference_store(folder, tmp_path, 2)
    steps = [
        ("copy", str(store), mongo_uri, "-c", "imgs", "-q"),
        ("verify", mongo_uri, "-c", "imgs", "--workers", "4", "-q"),
        ("export", mongo_uri, "-c", "imgs", str(tmp_path / "exported"), "-q"),
        ("copy", mongo_uri, "-c", "imgs", str(tmp_path / "back.lmdb"), "-q"),
    ]
    for args in steps:
        result = cli(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout
    assert contents(mongo_uri, "imgs") == reference[False]
    assert contents(tmp_path / "back.lmdb") == reference[False]
    stored = folder.expected(decode=False)
    assert snapshot(tmp_path / "exported") == {name: folder.files[name][0] for name in stored}


PAUSED_IMPORT = """
    import sys, threading

    hit, go = threading.Event(), threading.Event()

    class Pause:  # holds PIL.Image's import half-way, before it defines MAX_IMAGE_PIXELS
        def find_spec(self, name, path=None, target=None):
            if name == "PIL.ExifTags":
                hit.set()
                go.wait()

    sys.meta_path.insert(0, Pause())
    from fastdata.images.validate import validate_image

    other = threading.Thread(target=__import__, args=("PIL.Image",))
    other.start()
    hit.wait()
    try:
        checked = validate_image(open(sys.argv[1], "rb").read(), "x.jpg")
        print(checked.format, checked.repaired)
    finally:
        go.set()
        other.join()
"""


def test_a_jpeg_is_checked_while_another_thread_imports_pillow(tmp_path: Path) -> None:
    """The cause of `partially initialized module 'PIL.Image'`: a JPEG's header is checked
    against Pillow's pixel limit while another thread is still importing Pillow."""
    pytest.importorskip("simplejpeg")  # (without it a JPEG's header is read by Pillow itself)
    image = write(tmp_path / "x.jpg", jpeg_bytes(16, 16))
    result = run_script(PAUSED_IMPORT, image)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jpeg", "False"]


def test_the_folder_has_every_kind_of_file(folder: Folder) -> None:
    """(The folder the tests above convert: nothing in it is left out by accident.)"""
    fates = [fate for _, fate in folder.files.values()]
    assert {fate: fates.count(fate) for fate in set(fates)} == {
        "stored": 5 * CYCLES,
        "repaired": CYCLES,
        "skipped": 3 * CYCLES,
        "no-decode": CYCLES,
    }
    modes = set()
    for name, (_, fate) in folder.files.items():
        if fate == "stored":
            with Image.open(folder.root / name) as image:
                modes.add((image.format, image.mode))
    assert modes == {(f, m) for f in ("JPEG", "PNG") for m in ("RGB", "L")} | {("PNG", "RGBA")}
