"""A write that fails part-way (a full disk, here a limit on the size of the files a command may
write) keeps the store the user had, and its one line names a command that runs as printed and
finishes the work, for every command that writes a store."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from fastdata import convert, open_store

from .conftest import jpeg_bytes, write
from .procs import cli


def images(root: Path, n: int, seed: int) -> Path:
    for i in range(n):
        write(root / f"c{i % 2}" / f"{i:04d}.jpg", jpeg_bytes(40, 30, seed=seed + i))
    return root


def with_fields(tmp_path: Path) -> Path:
    """A manifest of 40 images with a caption each (a store of fields has columns to build)."""
    folder = images(tmp_path / "m", 40, seed=500)
    manifest = tmp_path / "m.jsonl"
    rows = [
        {"path": str(p), "label": p.parent.name, "caption": f"image {p.stem}"}
        for p in sorted(folder.rglob("*.jpg"))
    ]
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return manifest


def held(store: Path) -> list[tuple[object, bytes]]:
    reader = open_store(store)
    try:
        return [(r.header, r.data) for r in reader.iter_records()]
    finally:
        reader.close()


# (the command's words after its store paths, the file-size limit): 8 KiB fails the commit
# that saves the run's progress, before any record; 64 KiB fails a later batch of records
CASES = {
    "convert, new, nothing committed": ("convert", [], 8 << 10),
    "convert, new, some committed": ("convert", [], 64 << 10),
    "convert --overwrite, nothing committed": ("convert", ["--overwrite"], 8 << 10),
    "convert --overwrite, some committed": ("convert", ["--overwrite"], 64 << 10),
    "copy --overwrite, nothing committed": ("copy", ["--overwrite"], 8 << 10),
    "copy --overwrite, some committed": ("copy", ["--overwrite"], 64 << 10),
    "columns": ("columns", [], 8 << 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_full_disk_keeps_the_store_and_names_a_command_that_runs(
    tmp_path: Path, case: str
) -> None:
    command, options, fsize = CASES[case]
    src = images(tmp_path / "src", 60, seed=0)
    dst = tmp_path / "s.lmdb"
    if command == "columns":
        convert(with_fields(tmp_path), dst)
        args, want = ["columns", str(dst)], held(dst)
    else:
        source = src if command == "convert" else tmp_path / "source.lmdb"
        if command == "copy":
            convert(src, source)
        if "--overwrite" in options:
            convert(images(tmp_path / "old", 30, seed=1000), dst)  # the store the user has
        args = [command, str(source), str(dst), "-q", *options]
        convert(src, tmp_path / "fresh.lmdb")
        want = held(tmp_path / "fresh.lmdb")
    before = held(dst) if dst.exists() else None

    failed = cli(*args, fsize=fsize)
    assert failed.returncode == 1, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "writing the store failed" in lines[0], failed.stderr
    if before is not None:
        assert held(dst) == before  # the store the user had reads as before

    printed = [c for c in re.findall(r"`(fastdata [^`]+)`", lines[0]) if " verify " not in c]
    if printed:
        (again,) = printed
        words = shlex.split(again)[1:]
    elif "the same command with --resume" in lines[0]:
        words = [*args, "--resume"]
    else:
        assert "run the same command again" in lines[0], lines[0]
        words = args
    result = cli(*words)
    assert result.returncode == 0, f"{lines[0]}\n{result.stderr}"
    assert held(dst) == want
    assert cli("verify", str(dst)).returncode == 0


@pytest.mark.parametrize("free_bytes", [0, 1 << 30])
def test_an_io_error_on_a_full_file_system_is_said_to_be_a_full_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free_bytes: int
) -> None:
    """LMDB meets a full tmpfs mostly as an I/O error: the line said "Input/output error",
    which sends the user to look for a failing disk rather than free space."""
    import os

    import lmdb

    from fastdata.stores.lmdb import writer  # (its _write_failed asks stores.files)

    real = os.statvfs
    full = os.statvfs_result((4096, 4096, 100, 0, free_bytes // 4096, 10, 0, 0, 0, 255))
    store = tmp_path / "new" / "s.lmdb"  # (not there yet: its folder's file system is asked)
    monkeypatch.setattr(os, "statvfs", lambda p: full if p == str(tmp_path) else real(p))
    said = str(writer._write_failed(str(store), lmdb.Error("mdb_txn_commit: Input/output error")))
    assert said.startswith(f"{store}: writing the store failed: mdb_txn_commit: Input/output")
    assert ("has no space left" in said) == (free_bytes == 0), said
