"""scripts/train.py as a user runs it: where its checkpoint goes, and resumes that cannot apply
refused in one line that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdata import convert

from .conftest import jpeg_bytes, write
from .procs import REPO

pytestmark = pytest.mark.slow


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def images(root: Path, n: int, seed: int) -> None:
    for i in range(n):
        write(root / f"c{i % 2}" / f"{seed}-{i:03d}.jpg", jpeg_bytes(40, 32, seed=seed + i))


def test_checkpoint_beside_the_store_and_resumes_that_cannot_apply(tmp_path: Path) -> None:
    src, store = tmp_path / "src", tmp_path / "a.lmdb"
    images(src, 16, 0)
    convert(src, store)
    common = ["--workers", "0", "--batch-size", "4", "--image-size", "16", "--epochs", "1"]
    first = train(str(store), *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "a.lmdb.checkpoint.pt"
    assert f"checkpoint: {checkpoint}" in first.stdout and checkpoint.exists()

    again = train(str(store), *common[:-1], "2", "--resume", cwd=tmp_path)  # one epoch more
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "epoch 1:" in again.stdout

    images(src, 4, 100)  # the store grows
    convert(src, store, append=True)
    grown = train(str(store), *common[:-1], "3", "--resume", cwd=tmp_path)
    assert grown.returncode == 2  # a resume that cannot continue: a usage mistake
    assert "grew by an append" in grown.stderr and "--allow-grown" in grown.stderr
    assert "Traceback" not in grown.stderr
    assert grown.stderr.strip().splitlines()[-1].startswith("Error: ")  # one line, last
    allowed = train(str(store), *common[:-1], "3", "--resume", "--allow-grown", cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr
    assert "grew from 16 to 20 samples" in allowed.stdout and "epoch 2:" in allowed.stdout

    other = tmp_path / "b.lmdb"
    convert(src, other)
    foreign = train(str(other), *common, "--resume", "--checkpoint", str(checkpoint), cwd=tmp_path)
    assert foreign.returncode == 2 and "another store" in foreign.stderr
    assert "Traceback" not in foreign.stderr
    missing = train(str(other), *common, "--resume", cwd=tmp_path)
    assert missing.returncode == 2 and "no checkpoint to resume from" in missing.stderr

    # an append that adds a class: the model cannot take it, and --allow-grown is not offered
    write(src / "c2" / "new.jpg", jpeg_bytes(40, 32, seed=999))
    convert(src, store, append=True)
    for extra in ([], ["--allow-grown"]):
        classes = train(str(store), *common[:-1], "4", "--resume", *extra, cwd=tmp_path)
        assert classes.returncode == 2, classes.stderr
        assert "saved for 2 classes and the store now has 3" in classes.stderr
        assert "--allow-grown" not in classes.stderr and "Traceback" not in classes.stderr
        assert classes.stderr.strip().splitlines()[-1].startswith("Error: ")


def test_a_checkpoint_it_cannot_read_is_one_line(tmp_path: Path) -> None:
    src, store = tmp_path / "src", tmp_path / "a.lmdb"
    images(src, 8, 0)
    convert(src, store)
    common = ["--workers", "0", "--batch-size", "4", "--image-size", "16", "--epochs", "1"]
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    for checkpoint in (tmp_path, junk):  # a folder, a damaged file
        result = train(
            str(store), *common, "--resume", "--checkpoint", str(checkpoint), cwd=tmp_path
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert "not a checkpoint this script can resume from" in result.stderr
    missing_val = train(str(store), *common, "--val", str(tmp_path / "nope.lmdb"), cwd=tmp_path)
    assert missing_val.returncode == 2 and "Traceback" not in missing_val.stderr
