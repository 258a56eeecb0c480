"""A store appended to by another process while this one has it open opens again here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastdata import LMDBImageDataset, convert

from .conftest import jpeg_bytes, write
from .procs import child_env


def test_a_store_appended_to_while_open_opens_again_in_the_same_process(tmp_path: Path) -> None:
    for i in range(1500):
        write(tmp_path / "a" / "c" / f"{i:05d}.jpg", jpeg_bytes(24, 16 + i % 9, seed=i))
        write(tmp_path / "b" / "c" / f"n{i:05d}.jpg", jpeg_bytes(24, 16 + i % 7, seed=9000 + i))
    dst = tmp_path / "s.lmdb"
    convert(tmp_path / "a", dst)
    ds = LMDBImageDataset(dst, output="bytes")
    ds.__getitems__([0, 700, 1499])
    subprocess.run(
        [sys.executable, "-m", "fastdata", "convert", str(tmp_path / "b"), str(dst), "--append"],
        check=True,
        capture_output=True,
        env=child_env(),
    )
    again = LMDBImageDataset(dst, output="bytes")  # (was: "the store is damaged", MDB_CORRUPTED)
    assert len(again) == 3000
    assert len(again.__getitems__(list(range(3000)))) == 3000
    assert len(ds.__getitems__(list(range(1500)))) == 1500
