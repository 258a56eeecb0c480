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
from .procs import HOLDING_CONVERT, cli, run_script, script, wait_for
from .stores.lmdb.test_append_readers import STOPPED_READER

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


def _link(kind: str, data_file: Path, into: Path) -> None:
    """``into/data.mdb`` made a link (``kind``) to ``data_file``: another store reached through
    it."""
    into.mkdir()
    if kind == "symlink":
        (into / "data.mdb").symlink_to(data_file)
    else:
        os.link(data_file, into / "data.mdb")


def _refused_as_linked(result: subprocess.CompletedProcess, data_file: Path, kind: str) -> None:
    message = result.stderr.strip()
    assert result.returncode == 1 and message.count("\n") == 0, message
    assert f"{data_file}: " in message, message
    assert ("symbolic link" if kind == "symlink" else "hard links") in message, message
    assert "--overwrite" not in message and "--resume" not in message, message


def _run_as_printed(message: str) -> None:
    command = message.split("`")[1]
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_store_whose_data_file_is_a_link_into_another_is_not_written(tmp_path: Path) -> None:
    """Two appends, to a store and to another folder whose data.mdb links to its data file, ran
    at once on one file, each under its own writer.lock; one append through the link changed
    the other store; and the append that lost was told to convert again with --overwrite."""
    a = tiny_store(tmp_path, 20)
    b = tmp_path / "b.lmdb"
    _link("symlink", a / "data.mdb", b)
    for i in range(20, 30):
        write(tmp_path / "src" / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))
    started, go = tmp_path / "started", tmp_path / "go"
    writer = script(HOLDING_CONVERT, tmp_path / "src", a, started, go, "--append")
    wait_for(started, writer)  # the append to a holds a's lock, mid-append
    through = cli("convert", str(tmp_path / "src"), str(b), "--append", "-q", timeout=60)
    _refused_as_linked(through, b / "data.mdb", "symlink")
    assert sorted(os.listdir(b)) == ["data.mdb"]  # nothing written beside it either
    go.touch()
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert len(open_store(a)) == 30 and cli("verify", str(a), "-q").returncode == 0
    # the copy it advises, run as printed, is b's own: b grows, a stays as it is
    before = (a / "data.mdb").read_bytes()
    _run_as_printed(through.stderr)
    for i in range(30, 33):
        write(tmp_path / "src" / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))
    assert convert(tmp_path / "src", b, append=True, workers=1).count == 33
    assert (a / "data.mdb").read_bytes() == before and len(open_store(a)) == 30


def test_a_data_file_with_two_names_is_written_under_neither(tmp_path: Path) -> None:
    a = tiny_store(tmp_path, 20)
    b = tmp_path / "b.lmdb"
    _link("hardlink", a / "data.mdb", b)
    write(tmp_path / "src" / "c" / "0020.jpg", jpeg_bytes(16, 16, seed=20))
    before = (a / "data.mdb").read_bytes()
    for store in (a, b):
        result = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q", timeout=60)
        _refused_as_linked(result, store / "data.mdb", "hardlink")
    assert (a / "data.mdb").read_bytes() == before and sorted(os.listdir(b)) == ["data.mdb"]
    _run_as_printed(result.stderr)  # b gets a copy of its own: each store is written alone
    for store in (a, b):
        assert convert(tmp_path / "src", store, append=True, workers=1).count == 21
        assert cli("verify", str(store), "-q").returncode == 0


PUT_KEY = """
    import lmdb, sys
    env = lmdb.open(sys.argv[1])
    with env.begin(write=True) as txn:
        txn.put(sys.argv[2].encode(), b"theirs")
    env.close()
"""


def test_records_that_another_program_writes_during_an_append_are_not_met_with_overwrite(
    tmp_path: Path,
) -> None:
    """It said "the store is not the one this conversion started, convert again with
    --overwrite", which replaces a store that appends grew (and another store's records, where
    the data file is shared)."""
    store = tiny_store(tmp_path, 20)
    for i in range(20, 30):
        write(tmp_path / "src" / "c" / f"{i:04d}.jpg", jpeg_bytes(16, 16, seed=i))
    started, go = tmp_path / "started", tmp_path / "go"
    writer = script(HOLDING_CONVERT, tmp_path / "src", store, started, go, "--append")
    wait_for(started, writer)  # records 20 and 21 committed; 22 and 23 are next
    put = run_script(PUT_KEY, store, "0000000022", timeout=60)
    assert put.returncode == 0, put.stderr
    go.touch()
    _, err = writer.communicate(timeout=120)
    assert writer.returncode != 0
    assert "records from 22 on are in the store, which this append did not write" in err, err
    assert "resume=True" in err and "overwrite" not in err, err
    again = cli("convert", str(tmp_path / "src"), str(store), "--append", "--resume", "-q")
    assert again.returncode == 1 and "'0000000022'" in again.stderr, again.stderr
    assert "--overwrite" not in again.stderr and len(open_store(store)) == 20


def test_a_link_to_what_is_no_store_data_file_is_refused_with_advice_that_works(
    tmp_path: Path,
) -> None:
    """``data.mdb`` a link to a text file, to nothing, or to itself: the refusal advises removing
    the link (copying what it leads to into the store, or writing to its folder, would turn a
    user's file into a store, or fail), and that advice, run as printed, lets the same command
    write the store. The file the link led to is as it was."""
    src = tmp_path / "src"
    for i in range(3):
        write(src / "c" / f"{i}.jpg", jpeg_bytes(16, 16, seed=i))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    for n, target in enumerate([notes, tmp_path / "gone.bin", Path("data.mdb")]):
        store = tmp_path / f"s{n}.lmdb"
        store.mkdir()
        (store / "data.mdb").symlink_to(target)
        refused = cli("convert", str(src), str(store), "-q", timeout=60)
        message = refused.stderr.strip()
        assert refused.returncode == 1 and "Traceback" not in message, message
        assert "remove the link" in message and "cp " not in message, message
        _run_as_printed(message)
        done = cli("convert", str(src), str(store), "-q", timeout=60)
        assert done.returncode == 0, done.stderr
        assert len(open_store(store)) == 3
    assert notes.read_text() == "mine\n"


def test_an_export_never_writes_into_a_store_folder_even_with_overwrite(tmp_path: Path) -> None:
    """A store whose records are named like another store's files (``outer/data.mdb``),
    exported with --overwrite into the folder that holds that store: refused, naming the store
    folder; the store there is as it was."""
    src = tmp_path / "src"
    for i in range(4):
        write(src / "c" / f"{i}.jpg", jpeg_bytes(16, 16, seed=i))
    outer = tmp_path / "nest" / "outer"
    convert(src, outer)
    before = (outer / "data.mdb").read_bytes()
    rows = tmp_path / "man"
    write(rows / "outer" / "data.mdb", jpeg_bytes(16, 16, seed=9))
    write(rows / "outer" / "writer.lock", jpeg_bytes(16, 16, seed=8))
    (rows / "m.jsonl").write_text(
        '{"path": "outer/data.mdb", "label": "x"}\n{"path": "outer/writer.lock", "label": "x"}\n'
    )
    convert(rows / "m.jsonl", tmp_path / "man.lmdb")
    for flags in ([], ["--overwrite"], ["--resume"]):
        refused = cli("export", str(tmp_path / "man.lmdb"), str(tmp_path / "nest"), *flags)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
        assert "the folder of an LMDB store" in refused.stderr, refused.stderr
        assert "--overwrite" not in refused.stderr.split("Error:")[-1], refused.stderr
        assert (outer / "data.mdb").read_bytes() == before
        assert len(open_store(outer)) == 4


def test_a_data_file_linked_to_nothing_is_named_as_such_by_every_reading_command(
    tmp_path: Path,
) -> None:
    """``data.mdb`` a symbolic link round in a loop, or to a file that is gone: info, verify
    and export printed a bare OS error ("[Errno 40] Too many levels of symbolic links"), or
    "no LMDB store here". They name the link and where it leads now, and the `rm` they print
    runs as printed."""
    for n, target in enumerate([Path("data.mdb"), tmp_path / "gone.bin"]):
        store = tmp_path / f"s{n}.lmdb"
        store.mkdir()
        (store / "data.mdb").symlink_to(target)
        for words in (
            ["info", str(store)],
            ["verify", str(store)],
            ["export", str(store), str(tmp_path / "o")],
        ):
            result = cli(*words)
            message = result.stderr.strip()
            assert result.returncode == 1 and "Traceback" not in message, message
            assert "a symbolic link to" in message and "Errno" not in message, message
        _run_as_printed(message)
        assert not (store / "data.mdb").is_symlink()


def test_the_epoch_file_is_not_executable(tmp_path: Path) -> None:
    """readers.epoch was created rwxr-xr-x (os.open's default mode); it is a data file."""
    store = tmp_path / "s.lmdb"
    src = tmp_path / "src"
    write(src / "c" / "0.jpg", jpeg_bytes(16, 16, seed=1))
    convert(src, store)
    assert (store / "readers.epoch").stat().st_mode & 0o111 == 0
    assert (store / "data.mdb").stat().st_mode & 0o111 == 0
