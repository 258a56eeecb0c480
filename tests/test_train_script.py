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
    assert grown.returncode == 0, grown.stderr  # (the epoch not begun takes the grown store)
    assert "resuming epoch 2: 20 samples left" in grown.stdout and "epoch 2:" in grown.stdout

    other = tmp_path / "b.lmdb"
    convert(src, other)
    foreign = train(str(other), *common, "--resume", "--checkpoint", str(checkpoint), cwd=tmp_path)
    assert foreign.returncode == 2 and "another store" in foreign.stderr
    assert "Traceback" not in foreign.stderr
    missing = train(str(other), *common, "--resume", cwd=tmp_path)
    assert missing.returncode == 2 and "no checkpoint to resume from" in missing.stderr

    # an append that adds a class: the model cannot take it
    write(src / "c2" / "new.jpg", jpeg_bytes(40, 32, seed=999))
    convert(src, store, append=True)
    classes = train(str(store), *common[:-1], "4", "--resume", cwd=tmp_path)
    assert classes.returncode == 2, classes.stderr
    assert "saved for 2 classes and the store now has 3" in classes.stderr
    assert "Traceback" not in classes.stderr
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


# train.py as a user runs it, but its sixth step (epoch 1, batch 2 of 4) says so on stdout and
# waits for a signal (Ctrl-C) before it goes on: on a pipe that the signal writes to (whenever it
# comes), read once the handler has run
PAUSING_TRAIN = """
    import os, runpy, signal, sys
    from torch import nn

    forward, calls = nn.CrossEntropyLoss.forward, [0]

    def pausing(self, *args):
        calls[0] += 1
        if calls[0] == 6:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w)
            print("READY", flush=True)
            os.read(r, 1)
            signal.set_wakeup_fd(-1)
        return forward(self, *args)

    nn.CrossEntropyLoss.forward = pausing
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_saves_the_checkpoint_and_prints_a_resume_command_that_runs(
    tmp_path: Path,
) -> None:
    import shlex
    import signal
    import textwrap

    src, store = tmp_path / "src", tmp_path / "a.lmdb"
    images(src, 16, 0)
    convert(src, store)
    common = ["--workers", "2", "--batch-size", "4", "--image-size", "16", "--epochs", "3"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PAUSING_TRAIN),
         str(REPO / "scripts" / "train.py"), "a.lmdb", *common],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: Ctrl-C reaches it and its workers
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    checkpoint = tmp_path / "a.lmdb.checkpoint.pt"
    assert f"interrupted at epoch 1, sample 8 of 16: checkpoint saved to {checkpoint}" in err
    printed = err.split("resume with:\n", 1)[1].splitlines()[0].strip()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run(
        shlex.split(printed), capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint}: resuming epoch 1: 8 samples left" in resumed.stdout
    assert "epoch 1:" in resumed.stdout and "epoch 2:" in resumed.stdout
    assert not list(elsewhere.iterdir())


def test_a_store_without_classes_is_refused_in_one_line(tmp_path: Path) -> None:
    import json

    rows = []
    for i in range(8):
        write(tmp_path / "img" / f"{i}.jpg", jpeg_bytes(40, 32, seed=i))
        rows.append({"path": f"img/{i}.jpg", "caption": f"photo {i}"})
    manifest = tmp_path / "captions.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    convert(manifest, tmp_path / "c.lmdb")
    result = train(str(tmp_path / "c.lmdb"), "--workers", "0", "--batch-size", "4", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "has no classes" in lines[-1]
    assert not (tmp_path / "c.lmdb.checkpoint.pt").exists()


@pytest.mark.mongo
def test_a_mongodb_checkpoint_goes_to_the_state_folder_not_the_current_one(
    tmp_path: Path, mongo_uri: str
) -> None:
    src, home, work = tmp_path / "src", tmp_path / "home", tmp_path / "work"
    images(src, 8, 0)
    convert(src, mongo_uri, collection="train")
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_STATE_HOME"}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    common = ["--collection", "train", "--workers", "0", "--batch-size", "4", "--image-size", "16"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(REPO / "scripts" / "train.py"), mongo_uri, *common, *args],
            capture_output=True, text=True, timeout=300, cwd=work, env=env,
        )  # fmt: skip

    first = run("--epochs", "1")
    assert first.returncode == 0, first.stderr
    host = mongo_uri.split("://")[1].split("/")[0].replace(":", "%3A")
    database = mongo_uri.rsplit("/", 1)[1]
    checkpoint = (
        home / ".local/state/fastdata/checkpoints" / host / database / "train.checkpoint.pt"
    )
    assert f"checkpoint: {checkpoint}" in first.stdout and checkpoint.exists()
    assert not list(work.iterdir())  # nothing in the current folder
    again = run("--epochs", "2", "--resume")  # found again, from the same default
    assert again.returncode == 0, again.stderr
    assert f"resumed from {checkpoint}" in again.stdout and not list(work.iterdir())


def test_a_loader_state_it_cannot_resume_is_one_line_whose_way_out_runs(tmp_path: Path) -> None:
    """A checkpoint whose loader position was edited (or holds a tensor where it had an int) is
    refused in one line naming --restart-epoch, and that option, added, runs."""
    import torch

    src, store = tmp_path / "src", tmp_path / "a.lmdb"
    images(src, 16, 0)
    convert(src, store)
    common = ["--workers", "0", "--batch-size", "4", "--image-size", "16", "--epochs", "1"]
    assert train(str(store), *common, cwd=tmp_path).returncode == 0
    saved = torch.load(tmp_path / "a.lmdb.checkpoint.pt", weights_only=True)
    edited, tensor = tmp_path / "edited.pt", tmp_path / "tensor.pt"
    torch.save({**saved, "loader": dict(saved["loader"], position=4)}, edited)
    torch.save({**saved, "loader": dict(saved["loader"], samples=torch.tensor(16))}, tensor)
    more = [*common[:-1], "2"]
    for checkpoint in (edited, tensor):
        refused = train(
            str(store), *more, "--resume", "--checkpoint", str(checkpoint), cwd=tmp_path
        )
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith("Error: ") and line.endswith(
            "start the epoch again with --restart-epoch"
        )
        again = train(
            str(store),
            *more,
            "--resume",
            "--restart-epoch",
            "--checkpoint",
            str(checkpoint),
            cwd=tmp_path,
        )
        assert again.returncode == 0, again.stderr
        assert "starting epoch 1 again from its beginning" in again.stdout
        assert "epoch 1:" in again.stdout
