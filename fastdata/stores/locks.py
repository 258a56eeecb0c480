"""Who holds a writer lock, and whether that holder is gone.

Both backends record the same holder (host, PID, start time, the machine's boot, the process's
start) with their lock: ``writer.lock`` beside an LMDB store, the claim document of a Mongo
collection. A refusal names the holder; a Mongo writer takes over a claim whose process on its
own host no longer runs (see NOTE [ The Mongo writer claim ] in ``stores/mongo/writer.py``)."""

from __future__ import annotations

import os

__all__ = ["boot_id", "describe_holder", "flock_holder", "holder", "holder_gone", "process_start"]


def holder() -> dict[str, object]:
    """Who takes a writer lock: host, PID and the time, for the refusal a second writer gets;
    the machine's boot and the process's start time, so that a writer on the same host can tell
    that the holder is gone (see :func:`holder_gone`)."""
    import socket
    import time

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
        "boot": boot_id(),
        "started": process_start(os.getpid()),
    }


def boot_id() -> str:
    """An id of the running kernel's boot (Linux), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since the boot (Linux), or -1."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name (in parentheses) may hold spaces: the fields follow the last ')'
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def holder_gone(info: object) -> bool:
    """Whether the holder :func:`holder` described is a process of this host that no longer
    runs: the machine restarted since, or no process of its PID runs with its start time.
    False whenever that cannot be known (another host, a holder without those details)."""
    import socket

    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    boot, pid, started = info.get("boot"), info.get("pid"), info.get("started")
    if not isinstance(boot, str) or not boot or not isinstance(pid, int) or pid <= 0:
        return False
    if boot != boot_id():
        return True  # the machine restarted: every process of the holder's boot is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # it exists (another user's): compare start times
    return isinstance(started, int) and started >= 0 and process_start(pid) != started


def describe_holder(info: object) -> str:
    """``pid 123 on host h since 2026-11-23 10:00:00 UTC`` from what :func:`holder` gave."""
    import time

    if not isinstance(info, dict):
        return "a process that left no details"
    since = info.get("since")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        if isinstance(since, (int, float))
        else ""
    )
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


def flock_holder(path: str) -> dict[str, object] | None:
    """The holder (:func:`holder`'s details, as the lock file keeps them) of the ``flock`` on
    the lock file at ``path``, while one is held now; None where none is, or where that cannot
    be known without taking the lock (no ``/proc/locks``: taking it, even for a moment, could
    turn a writer starting then away). Reads only."""
    import json
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        place = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        try:
            with open("/proc/locks", encoding="ascii", errors="replace") as table:
                held = any(
                    len(f := line.split()) > 5 and f[1] == "FLOCK" and f[5] == place
                    for line in table
                )
        except OSError:
            return None
        if not held:
            return None
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            info = None
        return info if isinstance(info, dict) else {}
    finally:
        os.close(fd)
