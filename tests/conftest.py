"""Shared fixtures: tiny image folders built in tmp_path, good and corrupt."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# pytest-xdist's workers ignore SIGINT, and a process that ignores it passes that on to every
# process it starts: their Ctrl-C (the tests that press it) would do nothing. A worker takes
# Python's own handler back, which its children do not inherit (theirs is the default again).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def jpeg_bytes(width: int = 64, height: int = 48, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth gradients plus a little noise: realistic sizes, decodes to known-ish pixels
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1
    )
    arr = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png_bytes(width: int = 32, height: int = 32, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def evicted(path: Path) -> None:
    """Drop the file ``path`` from the page cache (its pages this process maps stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def tiny_store(tmp_path: Path, n: int) -> Path:
    """A store of ``n`` tiny JPEGs in one class, converted from ``tmp_path/src``."""
    from fastdata import convert

    for i in range(n):
        write(tmp_path / "src" / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))
    store = tmp_path / "s.lmdb"
    convert(tmp_path / "src", store)
    return store


def converted_an_hour_ago(monkeypatch: pytest.MonkeyPatch) -> float:
    """Conversions in this process record their time an hour early (appends and copies keep the
    real time), so that a test sets a file's time between a conversion and what follows with
    ``os.utime`` instead of sleeping past the second that store times are kept to. Returns
    the time a conversion records."""
    from datetime import datetime, timedelta

    import fastdata.ops.convert as convert_module

    class AnHourAgo(datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def,override]
            return datetime.now(tz) - timedelta(hours=1)

    monkeypatch.setattr(convert_module, "datetime", AnHourAgo)
    return AnHourAgo.now().timestamp()


def set_times(root: Path, when: float) -> None:
    """Every file under ``root`` modified at ``when`` (seconds since the epoch)."""
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (when, when))


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root, by relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def good_folder(tmp_path: Path) -> Path:
    """Three classes of small, valid images (all the same size, so batches stack)."""
    root = tmp_path / "good"
    seed = 0
    for cls, n in (("cat", 5), ("dog", 4), ("eel", 3)):
        for i in range(n):
            write(root / cls / f"{i:03d}.jpg", jpeg_bytes(seed=seed))
            seed += 1
    return root


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    """A folder with every kind of good, repairable and corrupt file the converter must handle."""
    root = tmp_path / "mixed"
    good = jpeg_bytes(seed=1)
    assert good.endswith(b"\xff\xd9")
    a = root / "a_class"
    write(a / "good.jpg", good)
    write(a / "missing_eoi.jpg", jpeg_bytes(seed=2)[:-2])
    write(a / "trailing.jpg", jpeg_bytes(seed=3) + b"\x00" * 64 + b"appended data")
    write(a / "truncated.jpg", good[:120])  # cut inside its headers
    write(a / "empty.jpg", b"")
    write(a / "text.jpg", b"this is not an image at all\n")
    write(a / "png_named.jpg", png_bytes())
    write(a / "cmyk.jpg", jpeg_bytes(seed=4, mode="CMYK"))
    write(a / "gray.JPG", jpeg_bytes(seed=5, mode="L"))
    write(a / "nested" / "deep.jpeg", jpeg_bytes(seed=6))
    b = root / "b_class"
    write(b / "chat_é.jpg", jpeg_bytes(seed=7))
    write(b / "猫.png", png_bytes(seed=8))
    write(b / "notes.txt", b"not an image, ignored")
    write(b / ".hidden.jpg", jpeg_bytes(seed=9))
    write(root / ".cache" / "x.jpg", jpeg_bytes(seed=10))
    return root


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip gpu-marked tests where there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mongo_base_uri(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``mongodb://host:port`` of a server for the whole session (started here when needed)."""
    import os

    from .mongo_server import URI_ENV, SecantusServer

    if os.environ.get(URI_ENV):
        from .mongo_server import close_clients

        yield os.environ[URI_ENV].rstrip("/")
        close_clients()
        return
    # on disk: the in-memory mode's cache fills up with a few hundred MB of images
    from .mongo_server import close_clients

    server = SecantusServer(tmp_path_factory.mktemp("secantus")).start()
    try:
        yield server.uri
    finally:
        close_clients()
        server.stop()


@pytest.fixture
def mongo_uri(mongo_base_uri: str):  # type: ignore[no-untyped-def]
    """A URI naming a fresh database, dropped after the test."""
    import uuid

    import pymongo

    name = f"fastdata_test_{uuid.uuid4().hex[:12]}"
    yield f"{mongo_base_uri}/{name}"
    from .mongo_server import database

    try:
        database(f"{mongo_base_uri}/{name}").client.drop_database(name)
    except pymongo.errors.PyMongoError:
        pass
