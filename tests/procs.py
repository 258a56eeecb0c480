"""Run fastdata in other processes, as users do: the CLI, or a short Python script."""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def cli(*args: str, fsize: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``fastdata ARGS`` in a new process; ``fsize`` limits the size of files it may write."""
    limit: Callable[[], None] | None = None
    if fsize is not None:

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "fastdata", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        preexec_fn=limit,
    )


def script(code: str, *args: Any) -> subprocess.Popen:
    """Start ``code`` (a Python script, dedented; ``sys.argv[1:]`` are ``args``)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def run_script(code: str, *args: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` (see :func:`script`) to its end; past ``timeout`` seconds it is killed
    (nothing hung is left behind) and ``subprocess.TimeoutExpired`` raised."""
    proc = script(code, *args)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for(path: Path, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    """Wait until ``path`` exists (a process signalling that it got somewhere)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


# A conversion that signals (touches argv[3]) after its first committed batch and then waits
# until argv[4] exists, so that another process can act while it holds the store.
HOLDING_CONVERT = """
    import os, sys, time
    from pathlib import Path
    from fastdata import convert
    from fastdata.stores import open_writer

    src, dst, started, go = sys.argv[1:5]
    overwrite = "--overwrite" in sys.argv
    args = sys.argv[1:]  # sys.argv[0] is "-c"
    collection = args[args.index("-c") + 1] if "-c" in args else None
    ttl = {"claim_ttl_s": float(args[args.index("--ttl") + 1])} if "--ttl" in args else {}
    writer = open_writer(dst, collection=collection, **ttl)
    real = type(writer).write
    def write(self, records, progress):
        real(self, records, progress)
        if hasattr(self, "_wait"):
            self._wait()  # the Mongo writer sends in the background: let the batch land
        if not os.path.exists(started):
            Path(started).touch()
            while not os.path.exists(go):
                time.sleep(0.02)
    type(writer).write = write
    report = convert(src, writer, overwrite=overwrite, commit_records=2, workers=1,
                     append="--append" in args)
    print("converted", report.count)
"""

# Patches the writer of the store argv[2] so that it kills its process (SIGKILL) once it has
# committed argv[3] batches, for the scripts below.
_KILLED_WRITER = """
    import os, signal, sys
    from fastdata.stores import open_writer

    args = sys.argv[1:]  # sys.argv[0] is "-c"
    collection = args[args.index("-c") + 1] if "-c" in args else None
    writer = open_writer(sys.argv[2], collection=collection)
    real = type(writer).write
    calls, commits = [0], int(sys.argv[3])
    def write(self, records, progress):
        if calls[0] >= commits:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        real(self, records, progress)
        if hasattr(self, "_wait"):
            self._wait()  # the Mongo writer sends in the background: let the batch land
    type(writer).write = write
"""

# A conversion that kills itself (SIGKILL) after argv[3] committed batches.
KILLED_CONVERT = (
    _KILLED_WRITER
    + """
    from fastdata import convert
    convert(sys.argv[1], writer, overwrite="--overwrite" in args, resume="--resume" in args,
            commit_records=2, workers=1, append="--append" in args)
    print("finished")
"""
)

# A copy that kills itself (SIGKILL) after argv[3] committed batches (of 8 records).
KILLED_COPY = (
    _KILLED_WRITER
    + """
    from fastdata import copy_store
    source_collection = args[args.index("-s") + 1] if "-s" in args else None
    copy_store(sys.argv[1], writer, source_collection=source_collection, batch_size=2,
               resume="--resume" in args)
    print("finished")
"""
)


# The CLI, with a point where it stops: before the (N+1)-th commit of records (write:N), before
# the metadata (write_meta), or before a replacement built aside is moved into place (promote).
# There it writes a byte to the inherited descriptor FASTDATA_KILL_FD and waits to be killed.
# Commits are small (2 records a conversion, 4 a copy) so that a kill can fall between them.
KILLABLE_CLI = """
import os, sys, threading
point, fd = os.environ["FASTDATA_KILL_POINT"], int(os.environ["FASTDATA_KILL_FD"])
from fastdata.ops import convert, copy
convert.convert.__kwdefaults__["commit_records"] = 2
copy.copy_store.__kwdefaults__["batch_size"] = 1
from fastdata.stores.lmdb.writer import LMDBWriter
from fastdata.stores.mongo.writer import MongoWriter

def reached(writer):
    wait = getattr(writer, "_wait", None)
    if wait is not None:
        wait()  # the Mongo writer sends in the background: the batches before land first
    os.write(fd, b"!")
    threading.Event().wait()  # until the test kills this process

commits = [0]
def stopping(method, real):
    def run(self, *args, **kwargs):
        if method == "write":
            if point == f"write:{commits[0]}":
                reached(self)
            commits[0] += 1
        elif point == method.strip("_"):
            reached(self)
        return real(self, *args, **kwargs)
    return run

for cls in (LMDBWriter, MongoWriter):
    for method in ("write", "_write_meta", "_promote"):
        setattr(cls, method, stopping(method, getattr(cls, method)))
from fastdata.cli import main
sys.argv = ["fastdata", *sys.argv[1:]]
main()
"""


@dataclass
class Ended:
    """How a CLI run ended: ``killed`` at its point, or with ``code``."""

    killed: bool
    code: int
    out: str
    err: str


def run_killable(args: list[str], point: str, logs: Path, timeout: float = 120) -> Ended:
    """``fastdata ARGS`` in a new process, killed (SIGKILL) if it reaches ``point``."""
    r, w = os.pipe()
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    with open(out, "w") as o, open(err, "w") as e:
        env = {**child_env(), "FASTDATA_KILL_POINT": point, "FASTDATA_KILL_FD": str(w)}
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLABLE_CLI, *args],
            stdout=o,
            stderr=e,
            env=env,
            pass_fds=(w,),
            stdin=subprocess.DEVNULL,
        )
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        got = os.read(r, 1) if ready else None
    finally:
        os.close(r)
    if got is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"fastdata {args} neither reached {point} nor ended in {timeout} s")
    if got:
        os.kill(proc.pid, signal.SIGKILL)
    code = proc.wait(timeout)
    return Ended(bool(got), code, out.read_text(), err.read_text())
