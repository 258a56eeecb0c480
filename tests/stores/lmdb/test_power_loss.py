"""A power loss at any point of an append leaves the store as it was, or with some of the
append's batches, never damaged.

The append runs in a process into which ``tests/crash_log.c`` is preloaded: it logs every write
to the store's data file and every flush, in order. What a disk may hold after a power loss at
a given moment is then everything written before the last flush that completed, plus any part
of what was written since (the disk may have taken any of it, in any order). The test rebuilds
such files, many of them, and opens each one as a store."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from fastdata import convert
from fastdata.stores.lmdb.reader import LMDBStore

from ...conftest import jpeg_bytes, write
from ...procs import REPO

SHIM = Path(__file__).parents[2] / "crash_log.c"


@pytest.fixture(scope="module")
def crash_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the write logger")
    out = tmp_path_factory.mktemp("shim") / "crash_log.so"
    build = [compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"]
    subprocess.run(build, check=True)
    return out


def _ops(log: Path) -> list[tuple[int, bytes] | None]:
    """The logged writes ``(offset, bytes)`` and flushes (None), in order."""
    raw, at, out = log.read_bytes(), 0, []
    while at < len(raw):
        kind = raw[at : at + 1]
        at += 1
        if kind == b"S":
            out.append(None)
            continue
        offset, length = struct.unpack_from("=QQ", raw, at)
        at += 16
        out.append((offset, raw[at : at + length]))
        at += length
    return out


def _image(base: bytes, writes: list[tuple[int, bytes]]) -> bytes:
    data = bytearray(base)
    for offset, chunk in writes:
        if len(data) < offset + len(chunk):
            data.extend(b"\0" * (offset + len(chunk) - len(data)))
        data[offset : offset + len(chunk)] = chunk
    return bytes(data)


def _check(image: bytes, folder: Path, before: list[bytes], counts: set[int]) -> int:
    """Open the crash image as a store: it must be whole, with the records it had before."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "data.mdb").write_bytes(image)
    store = LMDBStore(folder)
    try:
        n = len(store)
        assert n in counts, f"{n} records"
        records = store.read_records(range(n))
        assert all(zlib.crc32(r.data) == r.header.crc32 for r in records)
        assert [r.data for r in records[: len(before)]] == before
        assert len(store.labels) == n and len(store.record_names()) == n
    finally:
        store.close()
    return n


def test_a_power_loss_during_an_append_never_damages_the_store(
    crash_log: Path, tmp_path: Path
) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(40):
        write(src / "a" / f"{i:03d}.jpg", jpeg_bytes(24, 24, seed=i))
    convert(src, dst)
    for i in range(20):  # an append before, so this one reuses pages it freed
        write(src / "b" / f"{i:03d}.jpg", jpeg_bytes(24, 24, seed=100 + i))
    convert(src, dst, append=True)
    base = (dst / "data.mdb").read_bytes()
    reader = LMDBStore(dst)
    before = [r.data for r in reader.read_records(range(len(reader)))]
    reader.close()
    for i in range(60):
        write(src / "c" / f"{i:03d}.jpg", jpeg_bytes(24, 24, seed=200 + i))
    log = tmp_path / "writes.log"
    env = {
        **os.environ,
        "LD_PRELOAD": str(crash_log),
        "FASTDATA_CRASH_TARGET": os.path.realpath(dst / "data.mdb"),
        "FASTDATA_CRASH_LOG": str(log),
        "PYTHONPATH": str(REPO),
    }
    code = (
        "import sys; from fastdata import convert; "
        "convert(sys.argv[1], sys.argv[2], append=True, commit_records=8, workers=1)"
    )
    subprocess.run([sys.executable, "-c", code, str(src), str(dst)], env=env, check=True)
    ops = _ops(log)
    flushes = [i for i, op in enumerate(ops) if op is None]
    assert len(flushes) >= 8, "every batch of an append is flushed before the next"
    rng = random.Random(0)
    counts = {60} | set(range(60, 121))  # as before, or with some of the append's batches
    seen: set[int] = set()
    durable: list[tuple[int, bytes]] = []
    start = 0
    for stop in [*flushes, len(ops)]:
        pending = [op for op in ops[start:stop] if op is not None]
        subsets = [[], pending, pending[-1:], pending[:-1]]
        subsets += [[op for op in pending if rng.random() < 0.5] for _ in range(4)]
        for subset in subsets:
            image = _image(base, durable + subset)
            seen.add(_check(image, tmp_path / "crash", before, counts))
        durable += pending
        start = stop + 1
    assert 60 in seen and 120 in seen  # the power went before, and after, the append
