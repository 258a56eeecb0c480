"""LMDB environments, one owner per process: the registry every reader and writer goes through,
and the append epoch that readers check (NOTE [ Appends against readers ] in ``writer.py``). A
user's share is a :class:`~.lease.Lease`; an open environment an :class:`~.entry.Entry`."""

from __future__ import annotations

import errno
import mmap
import os
import shlex
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import lmdb

from ...errors import (
    StoreDamagedError,
    StoreError,
    StoreNotFoundError,
)
from ..files import open_regular
from ..names import DATA_FILE, EPOCH_FILE, epoch_temp
from . import file as lmdb_file
from .entry import Entry
from .layout import EPOCH_BYTES, OWN_KEYS
from .lease import Lease
from .leaves import Leaves

# --------------------------------------------------------------------------- environment registry
#
# The one owner of LMDB environments in a process. py-lmdb refuses to open a data file that this
# process has open already (it goes by the file, not the path), and a child forked from a process
# that opened it inherits that refusal. So every environment is opened here, once per process and
# data file (device and inode: a store replaced by rename is another file), shared by everyone
# who asks for it, counted, and closed when the last user lets go. A forked child closes the
# environments it inherited (never using them) before it opens its own.


_envs: dict[tuple[int, int], Entry] = {}
_envs_pid = os.getpid()
_envs_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _envs_lock
    _envs_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _forget_inherited() -> None:
    """In a forked child, close what the parent had open; apply queued releases (called under
    the registry lock)."""
    global _envs_pid
    if _envs_pid == os.getpid():
        _drain()
        return
    _pending.clear()
    for key, entry in _envs.items():
        if entry.leaves is not None and not entry.writable:  # (checked already: kept, NOTE
            _inherited[key] = entry.leaves  # [ Checked once ] below)
            entry.leaves = None
        entry.close()
    _envs.clear()
    _envs_pid = os.getpid()


# NOTE [ Checked once ]
# A forked child (a DataLoader worker) opens the environment again, as LMDB requires, but not
# the checks: the tree's branches and the leaves its parent checked before the fork are those of
# the same file at the same append epoch, so the child takes them over (``Leaves.adopt``) rather
# than reading every branch again (0.7 s at a million records, in every worker). Where an append
# began since (another epoch), or a thread of the parent was checking the tree at the fork (its
# checks half done), the child checks the file anew. The leaves the children check after the
# fork are marked in memory they share (a byte a page, ``Leaves._shared``): where a child wants a
# leaf a sibling marked, it takes over every leaf the siblings marked, in one pass over the
# marks. (Taking over only the leaves it wanted, each of two workers had gone on looking its
# keys up among the half of a million-record store's leaves the other had checked, batch after
# batch, through most of a first epoch.)
_inherited: dict[tuple[int, int], Leaves] = {}


def _open_fd(path: str, key: tuple[int, int]) -> int | None:
    """The data file opened for reading (read-ahead requests, the append epoch), if it is still
    the file ``key`` names (a regular file: :func:`~.file.check_file` checked that one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != key:
        os.close(fd)
        return None
    return fd


# --------------------------------------------------------------------------- the append epoch
#
# The counter that an append advances before its first write (NOTE [ Appends against readers ]
# in ``writer.py``) lies in the data file itself: the last 8 bytes (a native-endian counter) of
# its first page, LMDB's meta page 0, of which LMDB writes only the first 152 bytes (a new
# file's page is zeros past them, and so is a store written before the counter moved there).
# Readers map that page and read the counter from memory around every read. A file of its own
# beside the store, as ``readers.epoch`` was, is one that a user, another tool or a crash can
# cut short (a mapped page past the end of its file kills the reading process with SIGBUS),
# replace (its readers would go on watching the old file while appends advance the new one) or
# make a FIFO (opening it waits for a writer forever). The data file is the file whose pages an
# append reuses: readers watch the very file that matters, and a store replaced by --overwrite
# is another data file, with a counter of its own. ``readers.epoch`` is still advanced, for the
# readers of earlier versions, which watch it; only writers open it, and only as a regular file
# of its size (otherwise it is written anew).


def epoch_offset(psize: int) -> int:
    """Where the append epoch lies in a data file of pages of ``psize`` bytes."""
    return psize - 8


def _map_epoch(fd: int, psize: int) -> tuple[mmap.mmap, memoryview]:
    """The append epoch of the data file open at ``fd`` (pages of ``psize`` bytes), mapped
    read-only: its first page, viewed as the one 64-bit counter at its end."""
    mapped = mmap.mmap(fd, psize, access=mmap.ACCESS_READ)
    at = epoch_offset(psize)
    return mapped, memoryview(mapped)[at : at + 8].cast("Q")


def bump_epoch(lease: Lease) -> None:
    """Advance the append epoch of the store that ``lease`` (a writer's) has open: readers that
    began a read before this go through it again (see "the append epoch").

    Raises:
        StoreError: the data file is no longer the one open (replaced), or cannot be written.
    """
    import struct

    entry = lease.entry
    data_file = os.path.join(entry.path, DATA_FILE)
    try:
        fd = os.open(data_file, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StoreError(f"{data_file}: cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != entry.key:
            raise StoreError(
                f"{data_file}: replaced while this append had the store open; run the same "
                "command again"
            )
        at = epoch_offset(int(entry.env.stat()["psize"]))
        (now,) = struct.unpack("=Q", os.pread(fd, 8, at))
        os.pwrite(fd, struct.pack("=Q", (now + 1) & (2**64 - 1)), at)
    finally:
        os.close(fd)
    _bump_epoch_file(entry.path)


def _bump_epoch_file(folder: str) -> None:
    """Advance ``readers.epoch`` in ``folder`` for readers of earlier versions: in place where
    it is a regular file of its size (opened without following a link or blocking), otherwise
    written anew at 1."""
    import struct

    path = os.path.join(folder, EPOCH_FILE)
    try:
        fd: int | str | None = open_regular(path, os.O_RDWR)
    except OSError:  # (missing, or unreadable)
        fd = None
    if not isinstance(fd, int):  # (missing, a link, a FIFO, ...: replaced; a folder is named)
        _new_epoch_file(path, 1)
        return
    try:
        if os.fstat(fd).st_size != EPOCH_BYTES:
            _new_epoch_file(path, 1)
            return
        (now,) = struct.unpack("=Q", os.pread(fd, 8, 0))
        os.pwrite(fd, struct.pack("=Q", (now + 1) & (2**64 - 1)), 0)
    finally:
        os.close(fd)


def ensure_epoch(folder: str) -> None:
    """Give the store in ``folder`` its ``readers.epoch`` (at 0) if it has none, for readers of
    earlier versions, which map it when they open the store."""
    path = os.path.join(folder, EPOCH_FILE)
    if not os.path.lexists(path):
        _new_epoch_file(path, 0)


def _new_epoch_file(path: str, value: int) -> None:
    """``readers.epoch`` at ``path``, written whole aside and renamed into place (over whatever
    was there: a link is replaced, not followed).

    Raises:
        StoreError: it cannot be (a folder in the way, a read-only folder, a full disk).
    """
    import struct

    tmp = epoch_temp(os.path.dirname(path), os.getpid())
    try:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o666)  # (as data.mdb: rw-r--r-- under the usual umask)
        try:
            os.write(fd, struct.pack("=Q", value).ljust(EPOCH_BYTES, b"\0"))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with suppress(OSError):
            os.unlink(tmp)
        raise StoreError(
            f"{path}: cannot write it: {exc.strerror or exc} (fastdata keeps the append epoch "
            "there; move whatever is in the way out of the store folder)"
        ) from None


def data_path(path: str) -> str:
    return os.path.join(path, DATA_FILE) if os.path.isdir(path) else path


def _file_key(path: str) -> tuple[tuple[int, int], int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino), st.st_size


def _span(key: tuple[int, int], size: int) -> tuple[int, int] | None:
    """Where this process mapped the data file with inode ``key`` (from /proc/self/maps)."""
    dev, ino = key
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) < 6 or int(fields[4]) != ino or int(fields[2], 16) != 0:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if (major, minor) != (os.major(dev), os.minor(dev)):
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                return lo, lo + min(size, hi - lo)
    except (OSError, ValueError):
        pass
    return None


_pending: deque[tuple[int, int]] = deque()
"""Releases made by garbage collection, applied under the registry lock."""


def _release(key: tuple[int, int], pid: int) -> None:
    # Also called by the garbage collector, which may run while this very thread holds the
    # registry lock: the release is queued, and applied now only if the lock is free.
    if os.getpid() != pid:
        return
    _pending.append(key)
    if _envs_lock.acquire(blocking=False):
        try:
            _drain()
        finally:
            _envs_lock.release()


def _drain() -> None:
    """Apply queued releases (called with the registry lock held)."""
    while _pending:
        key = _pending.popleft()
        entry = _envs.get(key)
        if entry is None or _envs_pid != os.getpid():
            continue
        entry.refs -= 1
        if entry.refs <= 0:
            del _envs[key]
            entry.close()


def _lease(entry: Entry) -> Lease:
    entry.refs += 1
    _envs[entry.key] = entry
    return Lease(entry, _release)


def _refuse_a_link_to_nothing(data_file: str) -> None:
    """A data file that is a symbolic link leading nowhere (to nothing, or round in a loop)
    is named as such, not as an OS error or as "no store here"."""
    if not os.path.islink(data_file) or os.path.exists(data_file):
        return
    target = os.readlink(data_file)
    try:
        os.stat(data_file)
    except OSError as exc:
        why = "which loops" if exc.errno == errno.ELOOP else "which does not exist"
    else:  # (it appeared meanwhile)
        return
    link = shlex.quote(os.path.abspath(data_file))
    raise StoreError(
        f"{data_file}: a symbolic link to {target}, {why}: no data file is there; put the "
        f"store's data file back there, or remove the link (`rm {link}`)"
    )


def open_reader(path: str) -> Lease:
    """A share of this process's read-only environment for the store at ``path``.

    The data file's header is checked against its size before LMDB maps it.

    Raises:
        StoreNotFoundError: no LMDB store at ``path``.
        StoreError: the file is damaged or cannot be opened.
    """
    _refuse_a_link_to_nothing(os.path.join(path, DATA_FILE) if os.path.isdir(path) else path)
    if not os.path.exists(path) or (
        os.path.isdir(path) and not os.path.exists(os.path.join(path, DATA_FILE))
    ):
        if os.path.isdir(path):
            with os.scandir(path) as entries:  # (closed, however soon ``any`` stops)
                folders = any(e.is_dir() for e in entries)
            if folders:
                store = os.path.normpath(path) + ".lmdb"
                raise StoreNotFoundError(
                    f"{path}: an image folder, not a store; convert it first: "
                    f"`fastdata convert {shlex.quote(path)} {shlex.quote(store)}`, then use {store}"
                )
        raise StoreNotFoundError(
            f"{path}: no LMDB store here; fastdata convert makes one, from an image folder into "
            f"{shlex.quote(path)}"
        )
    data_file = data_path(path)
    for _ in range(5):
        key, size = _file_key(data_file)
        with _envs_lock:
            _forget_inherited()
            entry = _envs.get(key)
            if entry is not None:
                return _lease(entry)
            head = lmdb_file.check_file(data_file, for_lmdb=True)
            # The data file itself is opened (py-lmdb refuses a folder it has open already, even
            # when the file in it was replaced). lock=False: readers of a finished store need no
            # lock file (and may lack write access); read-ahead off (see "read-ahead" above).
            env, reserved = _open_for_reading(path, data_file)
            if _file_key(data_file)[0] != key:  # replaced between the check and the open
                env.close()
                continue
            fd = _open_fd(data_file, key)
            if fd is None:  # (replaced since, or gone)
                env.close()
                continue
            entry = Entry(key, path, env, False, _span(key, size), size, fd)
            try:
                entry.epoch_map, entry.epoch_view = _map_epoch(fd, head.psize)
            except (OSError, ValueError) as exc:
                entry.close()
                raise StoreError(f"{data_file}: cannot map its first page: {exc}") from None
            entry.cover()
            kept = _inherited.pop(key, None)
            if (
                kept is not None
                and kept.epoch == entry.epoch()
                and (reserved or kept.all_sound)
                and kept.adopt(f"/proc/self/fd/{entry.fd}")
            ):
                entry.leaves = kept
            else:
                if kept is not None:
                    kept.close()
                entry.leaves = _leaves(entry, data_file, whole=not reserved)  # (at this epoch)
            return _lease(entry)
    raise StoreError(f"{path}: the store kept being replaced while it was opened; try again")


def _leaves(entry: Entry, data_file: str, *, whole: bool) -> Leaves:
    """The checked tree of the file ``entry`` opened (``leaves.Leaves``: its branches checked,
    and with ``whole`` every leaf too, where the map has no room past the file for the guard,
    NOTE [ Damaged branches ] in ``lease.py``), read through the entry's own descriptor (the
    file it mapped, whatever stands at its path later); the entry closed and a
    StoreDamagedError raised where the store's own keys lie under a damaged page."""
    own = f"/proc/self/fd/{entry.fd}"
    try:
        path = own if entry.fd is not None and os.path.exists(own) else data_file
        leaves = Leaves(path, entry.epoch())
        if whole:
            leaves.check_all()
        damage = next((d for d in leaves.damage_of(sorted(OWN_KEYS)) if d is not None), None)
        if damage is not None:
            leaves.close()
            raise StoreDamagedError(
                f"{entry.path}: damaged {damage}: the store's metadata lies under it",
                store=shlex.quote(entry.path),
            )
    except BaseException:
        entry.close()
        raise
    return leaves


READER_SETTINGS: dict[str, Any] = {
    "subdir": False,
    "readonly": True,
    "lock": False,
    "readahead": False,
    "meminit": False,
    "max_readers": 1024,
}
WRITER_SETTINGS: dict[str, Any] = {
    "subdir": True,
    "meminit": False,
    "sync": False,
    "metasync": False,
    "max_dbs": 0,
}


READER_MAP_SIZE = 1 << 40
"""Readers map this much address space (not memory): a store that grows by an append while they
read stays inside their map, so they never have to remap it under other threads' reads."""


def _open_for_reading(store: str, data_file: str) -> tuple[Any, bool]:
    """The environment, and whether its map has :data:`READER_MAP_SIZE` of room (where a limit
    on address space leaves none, it maps the file's own size)."""
    try:
        return lmdb.open(data_file, map_size=READER_MAP_SIZE, **READER_SETTINGS), True
    except lmdb.Error:  # no room for the map (a limit on address space): the file's own size
        return _lmdb_open(store, data_file, READER_SETTINGS), False


def _lmdb_open(store: str, path: str, settings: dict[str, Any]) -> Any:
    try:
        return lmdb.open(path, **settings)
    except lmdb.Error as exc:
        writing = "" if settings.get("readonly") else " for writing"
        raise StoreError(f"{store}: cannot open the LMDB store{writing}: {exc}") from None


def open_writable(folder: str, map_size: int, *, durable: bool = False) -> Lease:
    """This process's writable environment for the store folder ``folder``; ``durable``: every
    commit flushed to the disk before the next begins (for writes into a complete store).

    Raises:
        StoreError: the store is open for reading in this process, or cannot be opened.
    """
    data_file = os.path.join(folder, DATA_FILE)
    with _envs_lock:
        _forget_inherited()
        if os.path.exists(data_file):
            entry = _envs.get(_file_key(data_file)[0])
            if entry is not None:
                raise StoreError(
                    f"{folder}: the store is open in this process ({entry.refs} user(s)); close "
                    "the datasets over it (dataset.close()) before writing to it"
                )
            lmdb_file.check_file(data_file, for_lmdb=True)
            checked = Leaves(data_file, 0)  # (LMDB's writes go down the tree as its reads do,
            try:  # and a store is completed only where every page of it is sound)
                damaged = checked.check_all()
            finally:
                checked.close()
            if damaged:
                raise StoreDamagedError(
                    f"{folder}: damaged {damaged[0]}: fastdata writes nothing into a damaged store",
                    store=shlex.quote(folder),
                )
        # Batches are committed without fsync and the store is flushed once, before its metadata
        # is written: an fsync per batch costs a journal commit each and, measured, as much again
        # as the whole conversion. A killed process loses nothing committed (the page cache holds
        # it); a machine that restarts mid-conversion may, which is why a resume after a restart
        # is refused (see LMDBWriter._check_resumable).
        settings = {**WRITER_SETTINGS, "map_size": map_size}
        if durable:
            settings.update(sync=True, metasync=True)
        env = _lmdb_open(folder, folder, settings)
        key, size = _file_key(data_file)
        return _lease(Entry(key, folder, env, True, None, size))


@contextmanager
def reading(where: str, store: str = "") -> Iterator[None]:
    """LMDB's own errors on a damaged file, as a StoreError naming the store (``store``: its
    path, for the command the error's hint prints; ``where`` by default)."""
    try:
        yield
    except lmdb.Error as exc:
        target = shlex.quote(store or where)
        raise StoreDamagedError(f"{where}: reading failed: {exc}", store=target) from None
