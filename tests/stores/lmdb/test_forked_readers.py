"""A forked reader (a DataLoader worker) takes over the checks its parent made of the store's
tree (NOTE [ Checked once ] in ``env.py``), not the trust: a leaf its parent never read is still
checked before LMDB is sent there, so damage to it is the record's error in the child, not the
end of the process."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ...conftest import tiny_store
from ...test_damaged_stores import _leaves, smash

SCRIPT = """
import os, sys, time
from fastdata import LMDBImageDataset
ds = LMDBImageDataset(sys.argv[1], output="bytes")
ds.__getitems__([0])  # opened here: its branches checked, a leaf read
open(sys.argv[3], "w").write("opened")
while not os.path.exists(sys.argv[4]):
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    try:
        ds.__getitems__(list(range(int(sys.argv[2]))))
    except Exception as exc:
        print(f"child: {type(exc).__name__}: {exc}", flush=True)
        os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_reader_checks_a_leaf_its_parent_never_read(tmp_path: Path) -> None:
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    leaves = [p for p, keys in _leaves(data_file) if keys and keys[0][:1].isdigit()]
    page = leaves[len(leaves) // 2]  # (records' bytes, far from record 0)
    opened, go = tmp_path / "opened", tmp_path / "go"
    run = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(store), "3000", str(opened), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not opened.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    smash(data_file, page, 10, struct.pack("<H", 0))  # its flags: no kind of page
    go.write_text("go")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "child exit 3" in out, (out, err)
    assert f"page {page}" in out and "RecordError" in out, out


SIBLINGS = """
import os, sys
from fastdata import LMDBImageDataset
from fastdata.stores.lmdb.pages import tree

ds = LMDBImageDataset(sys.argv[1], output="bytes")
n = int(sys.argv[2])
ds.__getitems__([0])  # opened here: its branches checked

def child(count_checks):
    pid = os.fork()
    if pid == 0:
        checks = []
        if count_checks:
            check = tree.Tree.check
            def counted(self, pages, seen, *args, **kw):
                checks.append(len(pages))
                return check(self, pages, seen, *args, **kw)
            tree.Tree.check = counted
        failed = []
        for i in range(0, n, 64):
            try:
                ds.__getitems__(list(range(i, min(n, i + 64))))
            except Exception as exc:
                failed.append(type(exc).__name__)
        print(f"checked {sum(checks)} pages, failed {failed}", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)

child(False)  # a worker reads every record: every leaf checked, and marked sound
child(True)   # its sibling, forked from the same parent afterwards
"""


def run_script(script: str, store: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run over the store's 3,000 records in a process of its own, which ended
    well."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(store), "3000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run


def test_a_leaf_one_worker_found_sound_is_not_checked_again_by_its_sibling(
    tmp_path: Path,
) -> None:
    store = tiny_store(tmp_path, 3000)
    run = run_script(SIBLINGS, store)
    first, second = run.stdout.splitlines()
    assert first.startswith("checked 0 pages, failed []")  # (not counted in the first)
    assert second == "checked 0 pages, failed []", run.stdout


TAKEN_OVER = """
import os, sys
from fastdata import LMDBImageDataset

ds = LMDBImageDataset(sys.argv[1], output="bytes")
n = int(sys.argv[2])
ds.__getitems__([0])  # opened here: its branches checked
leaves = ds.reader._env().entry.leaves
pid = os.fork()
if pid == 0:  # a worker reads every record: every leaf checked, and marked sound
    for i in range(0, n, 64):
        ds.__getitems__(list(range(i, min(n, i + 64))))
    print(f"first: all sound {leaves.all_sound}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
pid = os.fork()
if pid == 0:  # its sibling reads one batch
    before = len(leaves._unread)
    got = ds.__getitems__([n // 2, n - 1])
    print(f"second: all sound {leaves.all_sound}, {before} unread before", flush=True)
    os._exit(0 if got[1][0] else 1)
os.waitpid(pid, 0)
"""


def test_a_worker_takes_over_at_once_every_leaf_its_sibling_found_sound(tmp_path: Path) -> None:
    """The first batch of a worker that wants a leaf its sibling checked takes over every leaf
    the sibling checked, in one pass over their marks, not only the leaves it wants: before,
    each worker of two kept looking its keys up among the leaves the other had checked (half
    of a million-record store's) batch after batch, most of a first epoch."""
    store = tiny_store(tmp_path, 3000)
    run = run_script(TAKEN_OVER, store)
    first, second = run.stdout.splitlines()
    assert first == "first: all sound True", run.stdout
    assert second.startswith("second: all sound True, "), run.stdout
    assert int(second.split(", ")[1].split()[0]) > 100, run.stdout  # (leaves it had not read)


def test_a_damaged_leaf_is_found_by_every_worker_however_many_read_it(tmp_path: Path) -> None:
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    leaves = [p for p, keys in _leaves(data_file) if keys and keys[0][:1].isdigit()]
    smash(data_file, leaves[len(leaves) // 2], 10, struct.pack("<H", 0))
    run = run_script(SIBLINGS, store)
    first, second = run.stdout.splitlines()
    assert "RecordError" in first and "RecordError" in second, run.stdout


MID_CHECK = """
import os, sys, threading
from fastdata import LMDBImageDataset
from fastdata.stores.lmdb.pages import tree

ds = LMDBImageDataset(sys.argv[1], output="bytes")
n = int(sys.argv[2])
ds.__getitems__([0])  # opened here: its branches checked
check = tree.Tree._checked_level
inside, forked = threading.Event(), threading.Event()
def paused(self, *args, **kw):  # a thread's check has read its leaves, not yet counted them
    out = check(self, *args, **kw)
    if threading.current_thread() is not threading.main_thread() and not inside.is_set():
        inside.set()
        forked.wait()
    return out
tree.Tree._checked_level = paused
reading = threading.Thread(target=ds.__getitems__, args=(list(range(n // 2, n // 2 + 100)),))
reading.start()
inside.wait()
pid = os.fork()
if pid == 0:
    failed = []
    for i in range(0, n, 64):
        try:
            ds.__getitems__(list(range(i, min(n, i + 64))))
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
    print(f"failed {failed}", flush=True)
    os._exit(0)
forked.set()
reading.join()
os.waitpid(pid, 0)
"""


def test_a_reader_forked_while_a_thread_checks_leaves_finds_no_damage_in_a_sound_store(
    tmp_path: Path,
) -> None:
    """A worker forked while a thread of its parent was checking leaves (a batch read in the
    background): the leaves that check had read but not yet counted were taken, in the worker,
    for pages reached twice (a loop in the tree), and a sound store's records for damaged ones.
    Every record reads."""
    store = tiny_store(tmp_path, 3000)
    run = run_script(MID_CHECK, store)
    assert run.stdout.strip() == "failed []", run.stdout


KILLED_MID_CHECK = """
import os, random, signal, sys
from fastdata import LMDBImageDataset
from fastdata.stores.lmdb.pages import tree

ds = LMDBImageDataset(sys.argv[1], output="bytes")
n = int(sys.argv[2])
ds.__getitems__([0])  # opened here: its branches checked
inside, never = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:  # a worker stopped in a pass over the leaves beside its reads
    check = tree.Tree._checked_level
    def stopped(self, level, *args, **kw):
        if len(level) > 200:  # (its leaves marked as being checked, their checks not done)
            os.write(inside[1], b"x")
            os.read(never[0], 1)
        return check(self, level, *args, **kw)
    tree.Tree._checked_level = stopped
    rng = random.Random(0)
    for _ in range(100):  # (it stops in its first batch's pass; never a worker left reading)
        ds.__getitems__(rng.sample(range(n), 64))
    os._exit(5)
os.close(inside[1])  # (a worker that never stopped there: EOF, not a wait)
if os.read(inside[0], 1) != b"x":
    sys.exit("the worker was never stopped in a pass")
os.kill(pid, signal.SIGKILL)  # (killed there: by the OOM killer, say)
if sys.argv[4] == "reaped":
    os.waitpid(pid, 0)
else:  # (ended, and not yet waited for by its parent: a zombie, which answers a signal 0)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
pid = os.fork()
if pid == 0:  # a sibling reads batches of the first tenth of the records
    leaves = ds.reader._env().entry.leaves
    rng = random.Random(1)
    wrong = 0
    for batches in range(1, 21):
        batch = rng.sample(range(n // 10), 64)
        got = ds.__getitems__(batch)
        wrong += sum(
            data != open(f"{sys.argv[3]}/c/{i:04d}.jpg", "rb").read()
            for i, (data, _) in zip(batch, got)
        )
        if leaves.all_sound:
            break
    print(f"all sound {leaves.all_sound} after {batches} batches, {wrong} wrong", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("parent", ["reaped", "not yet waited for"])
def test_leaves_a_killed_worker_was_checking_are_checked_by_its_siblings(
    tmp_path: Path, parent: str
) -> None:
    """A worker killed in the middle of a pass over leaves leaves them marked as being checked,
    for good: its siblings check them beside their reads once no process is checking any (they
    had left them to it forever, each checking one only where a read of its own wanted it, and
    never took the shortest path); also before its parent has waited for it (a zombie was taken
    for a live sibling until the next epoch's workers)."""
    store = tiny_store(tmp_path, 3000)
    run = subprocess.run(
        [sys.executable, "-c", KILLED_MID_CHECK, str(store), "3000", str(tmp_path / "src"), parent],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("all sound True after "), run.stdout
    assert run.stdout.endswith(" batches, 0 wrong\n"), run.stdout
    assert int(run.stdout.split()[4]) <= 3, run.stdout
