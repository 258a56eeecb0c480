"""docs/cli.md's exit-code table, a case per kind of cause: 0 done, 1 a failure, 2 a usage
mistake, 130 Ctrl-C, each with one ``Error:`` line (1 and 2) and no traceback."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdata import convert

from .conftest import jpeg_bytes, tiny_store, write
from .procs import REPO, cli


@pytest.fixture
def world(good_folder: Path, tmp_path: Path) -> dict[str, Path]:
    store = tmp_path / "s.lmdb"
    convert(good_folder, store)
    damaged = tmp_path / "damaged.lmdb"
    convert(good_folder, damaged)
    data = damaged / "data.mdb"
    raw = bytearray(data.read_bytes())
    own = (good_folder / "cat" / "003.jpg").read_bytes()[-100:-40]  # inside its bytes alone
    at = raw.find(own)
    assert at > 0
    while at > 0:  # every copy: a page the last commit copied keeps the old one, left free
        raw[at : at + 8] = bytes(8)
        at = raw.find(own, at + 1)
    data.write_bytes(bytes(raw))
    manifest = tmp_path / "labels.csv"
    manifest.write_text("path,label\ngood/cat/000.jpg,cat\ngood/dog/000.jpg,dog\n")
    (tmp_path / "classes.txt").write_text("cat\n")
    return {"folder": good_folder, "store": store, "damaged": damaged, "tmp": tmp_path}


def check(result: subprocess.CompletedProcess[str], code: int, *, report: bool = False) -> None:
    """``report``: the command lists what failed (verify) rather than one error line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    if code in (1, 2) and not report:
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1, result.stderr


def test_zero_done(world: dict[str, Path]) -> None:
    check(cli("info", str(world["store"])), 0)
    check(cli("verify", str(world["store"]), "-q"), 0)
    check(cli("convert", str(world["folder"]), str(world["tmp"] / "new.lmdb"), "-q"), 0)


def test_one_failures(world: dict[str, Path]) -> None:
    tmp = world["tmp"]
    result = cli("verify", str(world["damaged"]), "-q")  # a damaged record
    check(result, 1, report=True)
    assert "cat/003.jpg: checksum mismatch" in result.stdout
    (tmp / "junk.lmdb").mkdir()
    (tmp / "junk.lmdb" / "data.mdb").write_bytes(b"not lmdb" * 1000)
    check(cli("info", str(tmp / "junk.lmdb")), 1)  # too damaged to open
    check(cli("info", "mongodb://127.0.0.1:1/db", "-c", "x", "--timeout", "0.5"), 1)  # away
    big = tmp / "big"
    for i in range(30):
        write(big / "c" / f"{i}.jpg", jpeg_bytes(200, 150, seed=i))
    check(cli("convert", str(big), str(tmp / "full.lmdb"), "-q", fsize=64 << 10), 1)  # disk full
    held = tmp / "held.lmdb"
    convert(world["folder"], held)
    with open(held / "writer.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer holds the store
        check(cli("convert", str(world["folder"]), str(held), "--append", "-q"), 1)


def test_two_usage_mistakes(world: dict[str, Path]) -> None:
    folder, store, tmp = str(world["folder"]), str(world["store"]), world["tmp"]
    check(cli("convert", "--workers", "0", folder, str(tmp / "x.lmdb")), 2)  # a bad value
    check(cli("convert", folder, store, "--no-such-option"), 2)  # an unknown option
    check(cli("convert", folder, store, "-q"), 2)  # exists, no --overwrite
    check(cli("info", str(tmp / "missing.lmdb")), 2)  # not there
    check(cli("convert", folder, str(tmp / "y.lmdb"), "--resume", "-q"), 2)  # nothing to resume
    check(cli("convert", folder, store, "--append", "--overwrite", "-q"), 2)
    check(cli("convert", folder, "mongodb://127.0.0.1:1", "-q"), 2)  # no database
    check(cli("verify", "mongodb://127.0.0.1:1/db"), 2)  # a MongoDB store without --collection
    listing = str(tmp / "classes.txt")  # leaves out "dog", which the manifest uses
    check(cli("convert", str(tmp / "labels.csv"), str(tmp / "m.lmdb"), "--classes", listing), 2)


def run_code(code: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -c code ARGS`` with this checkout importable."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def test_one_three_zero_interrupted(world: dict[str, Path]) -> None:
    """Ctrl-C in a command that reads (a writer's case is in test_store_integrity)."""
    code = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
from fastdata.stores.lmdb.reader import LMDBStore
def interrupted(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C
    return []
LMDBStore.read_records = interrupted  # (export reads records)
LMDBStore.scan_records = interrupted  # (verify reads the file)
from fastdata.cli import main
sys.argv = ["fastdata", *sys.argv[1:]]
main()
"""
    for args in (["verify", str(world["store"]), "-q"], ["export", str(world["store"]), "out"]):
        result = run_code(code, args, world["tmp"])
        check(result, 130)
        assert "interrupted" in result.stderr


def test_ctrl_c_in_a_verify_of_several_processes(tmp_path: Path) -> None:
    """Ctrl-C while forked processes check parts of the store: 130, and none of them is left."""
    store = tiny_store(tmp_path, 130)
    pids = tmp_path / "checking.pids"
    code = f"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
from fastdata.ops import verify
command = os.getpid()
def checking(reader, report, damage, index, start, *args):
    if os.getpid() == command:
        raise SystemExit("checked in one process")
    with open({str(pids)!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    if start == 0:  # once both processes are checking (a bound, should the other never start)
        deadline = time.monotonic() + 60
        while len(open({str(pids)!r}).read().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(command, signal.SIGINT)  # the user presses Ctrl-C
    signal.alarm(100)  # (a bound: a process nobody stops ends itself, after the check below)
    signal.pause()  # checking, until stopped
verify._check_range = checking
from fastdata.cli import main
sys.argv = ["fastdata", *sys.argv[1:]]
main()
"""
    result = run_code(code, ["verify", str(store), "-q", "-j", "2"], tmp_path)
    check(result, 130)
    assert "interrupted" in result.stderr
    children = [int(pid) for pid in pids.read_text().split()]
    assert len(children) == 2
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ctrl_c_while_the_checking_processes_start(tmp_path: Path) -> None:
    """Ctrl-C that comes in the middle of a fork (here from the fork's own hook) is not lost."""
    store = tiny_store(tmp_path, 130)
    code = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
pressed = []
def press():
    if not pressed:
        pressed.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the first child forks
os.register_at_fork(before=press)
from fastdata.cli import main
sys.argv = ["fastdata", *sys.argv[1:]]
main()
"""
    result = run_code(code, ["verify", str(store), "-q", "-j", "2"], tmp_path)
    check(result, 130)
    assert "interrupted" in result.stderr and "records OK" not in result.stdout
