"""The files beside an LMDB store's data file are files a user, another tool or a crash can
change: cut short, replaced, or made a FIFO or a link. None of that stops a process (SIGBUS),
hangs one, lets a stopped reader read reused pages, or makes fastdata write through a link.
Each case runs in processes of its own with a hard timeout, so that a regression fails the test
instead of killing or hanging the run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fastdata import convert, open_store

from .conftest import jpeg_bytes, tiny_store, write
from .procs import cli, run_script, script, wait_for
from .test_append_readers import STOPPED_READER

READ_AROUND = """
    import os, sys
    from fastdata import LMDBImageDataset
    store, what = sys.argv[1:3]
    ds = LMDBImageDataset(store, output="bytes")
    before = [ds[i][0] for i in range(len(ds))]
    epoch = os.path.join(store, "readers.epoch")
    if what == "truncate":
        os.truncate(epoch, 0)
    print(all(ds[i][0] == before[i] for i in range(len(ds))),
          [d for d, _ in ds.__getitems__(list(range(len(ds))))] == before)
"""


def test_an_epoch_file_cut_short_under_an_open_dataset_stops_nothing(tmp_path: Path) -> None:
    """The file was mapped by every reader: a read after it was cut short was a SIGBUS."""
    store = tiny_store(tmp_path, 20)
    result = run_script(READ_AROUND, store, "truncate", timeout=60)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert result.stdout.split() == ["True", "True"]


def test_a_fifo_for_the_epoch_file_hangs_nothing(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: info, verify, export and every dataset
    waited forever. An append writes a regular file in its place."""
    store = tiny_store(tmp_path, 20)
    (store / "readers.epoch").unlink()
    os.mkfifo(store / "readers.epoch")
    read = run_script(READ_AROUND, store, "read", timeout=60)
    assert read.returncode == 0 and read.stdout.split() == ["True", "True"], read.stderr
    for args in (["info"], ["verify", "-q"], ["export", "-q", str(tmp_path / "out")]):
        result = cli(args[0], str(store), *args[1:], timeout=60)
        assert result.returncode == 0, f"{args}: {result.stderr}"
    assert len(list((tmp_path / "out").rglob("*.jpg"))) == 20
    for i in range(20, 25):
        write(tmp_path / "src" / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))
    appended = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q", timeout=60)
    assert appended.returncode == 0, appended.stderr
    assert (store / "readers.epoch").is_file() and len(open_store(store)) == 25


def test_a_stopped_reader_reads_right_when_the_epoch_file_is_replaced(tmp_path: Path) -> None:
    """A reader that watched the file it opened went on watching it once another took its
    name, while appends advanced the new one: it read pages they reused (I7 lapsed)."""
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    for i in range(300):
        write(src / "a" / f"{i:04d}.jpg", jpeg_bytes(8, 8, seed=i))
    convert(src, dst)
    started, go = tmp_path / "started", tmp_path / "go"
    reader = script(STOPPED_READER, dst, started, go)
    try:
        wait_for(started, reader)
        epoch = dst / "readers.epoch"
        copy = tmp_path / "epoch.copy"
        copy.write_bytes(epoch.read_bytes())
        os.replace(copy, epoch)  # (as an editor or a restore from a backup writes it)
        for k, cls in enumerate(("b", "c", "d")):  # every append frees pages the next reuses
            for i in range(200):
                write(src / cls / f"{i:04d}.jpg", jpeg_bytes(8, 8, seed=1000 * (k + 1) + i))
            convert(src, dst, append=True, commit_records=8, workers=1)
        go.touch()
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, err
    seen = json.loads(out)
    assert seen["bad"] == [] and seen["names"] == [f"a/{i:04d}.jpg" for i in range(300)]
    assert seen["calls"] > 2 * 300  # (a record and a header each) begun again: a new transaction


def test_a_writer_lock_that_is_a_link_is_not_written_through(tmp_path: Path) -> None:
    """The writer lock is written with the writer's host and PID: through a link, that
    truncated the file the link names. The refusal's command removes the link, not the file,
    and then the same command runs."""
    store = tiny_store(tmp_path, 4)
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    (store / "writer.lock").unlink()
    (store / "writer.lock").symlink_to(mine)
    write(tmp_path / "src" / "c" / "0004.jpg", jpeg_bytes(16, 16, seed=4))
    append = ("convert", str(tmp_path / "src"), str(store), "--append", "-q")
    refused = cli(*append, timeout=60)
    assert mine.read_text() == "my notes\n"
    assert refused.returncode == 1 and "writer.lock: a link, not the lock file" in refused.stderr
    assert len(open_store(store)) == 4
    command = refused.stderr.split("`")[1]
    assert command.startswith("rm ")
    subprocess.run(command, shell=True, check=True)
    assert mine.read_text() == "my notes\n"
    result = cli(*append, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(open_store(store)) == 5
