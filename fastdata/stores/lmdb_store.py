"""The LMDB backend: the handle registry, the writer, and the readers (fastdata stores and the
pickle recipes').

Layout of a store folder, documented in ``docs/format.md``: ``data.mdb`` (the store),
``lock.mdb`` (LMDB's own), ``writer.lock`` (the writer lock) and, while a replacement is being
built, ``.replacement/``. Keys in ``data.mdb``:

- ``0000000000`` ... ``NNNNNNNNNN``: the image bytes of each record, as they are (plus a JPEG
  end-of-image repair), keys zero-padded so a cursor walks them in index order;
- ``#0000000000`` ...: each record's header (JSON: name, label, size, crc32, format, repaired);
- ``__labels__``: the labels, one little-endian int32 per record;
- ``__len__``: the record count as ASCII decimal; ``__keys__``: the record keys, newline-separated;
- ``__names__``: every record's name, in index order, joined by NUL bytes (what ``--append``
  compares a folder with);
- ``#progress``: conversion progress (JSON), saved with every committed batch;
- ``#skipped/0000000000`` ...: each source file the conversion left out (JSON: name, reason),
  written once, with the batch during which it was skipped;
- ``__fastdata__``: the metadata (JSON), written last: a store without it is incomplete.

Environments are owned by a per-process registry (below); readers hold a share of one.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import logging
import mmap
import os
import pickle
import shlex
import shutil
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from ..errors import (
    FastdataError,
    IncompleteStoreError,
    PickleNotAllowedError,
    RecordError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    StoreReplacedError,
)
from ..packed import PackedStrings
from ..records import (
    Progress,
    Record,
    RecordHeader,
    SkippedFile,
    StoreMeta,
    check_labels,
    class_count,
    record_key,
    skipped_file,
)
from . import lmdb_file
from .locks import boot_id, describe_holder, holder
from .policy import Completion, Existing, StoreWriter
from .reader import StoreReader

__all__ = ["LMDBStore", "LMDBWriter", "Lease", "PickleLMDBStore", "open_lmdb", "open_reader"]

log = logging.getLogger(__name__)
T = TypeVar("T")

META_KEY = b"__fastdata__"
LABELS_KEY = b"__labels__"
NAMES_KEY = b"__names__"
PROGRESS_KEY = b"#progress"
SKIPPED_PREFIX = b"#skipped/"
LEN_KEY = b"__len__"
KEYS_KEY = b"__keys__"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
WRITER_LOCK = "writer.lock"
ASIDE_DIR = ".replacement"
OWN_FILES = frozenset({DATA_FILE, LOCK_FILE, WRITER_LOCK, ASIDE_DIR, "readers.epoch"})
EPOCH_FILE = "readers.epoch"
"""Beside ``data.mdb``: the append epoch, which readers check around every read (see "appends")."""
EPOCH_BYTES = 4096
INITIAL_MAP_SIZE = 1 << 30
READ_ATTEMPTS = 64
"""Reads begun again at most this often when appends keep beginning while they read."""
LABEL_DTYPE = np.dtype("<i4")


def header_key(index: int) -> bytes:
    """The key of record ``index``'s header: ``#`` + its record key.

    Headers and progress sort before the records (``#`` < ``0``) and the metadata after them
    (``_`` > ``9``), so every record can be appended at the end of the B-tree (``MDB_APPEND``),
    which writes at the speed of a plain file append.
    """
    return b"#" + record_key(index)


def skipped_key(n: int) -> bytes:
    """The key of the ``n``-th skipped file's entry."""
    return SKIPPED_PREFIX + record_key(n)


def _skipped_items(skipped: Sequence[SkippedFile], start: int) -> list[tuple[bytes, bytes]]:
    """The ``(key, JSON)`` items of ``skipped[start:]``."""
    return [
        (skipped_key(n), json.dumps(f.to_dict()).encode("ascii"))
        for n, f in enumerate(skipped[start:], start)
    ]


def _read_skipped(lease: Lease, txn: Any, count: int, where: str) -> list[SkippedFile]:
    """The first ``count`` skipped-file entries (read in the caller's transaction)."""
    out = []
    for n in range(count):
        raw = lease.value(txn.get(skipped_key(n)), f"{where}: skipped-file entry {n}")
        try:
            item = json.loads(raw) if raw is not None else None
        except ValueError:
            item = None
        out.append(skipped_file(item, where))
    return out


# --------------------------------------------------------------------------- environment registry
#
# The one owner of LMDB environments in a process. py-lmdb refuses to open a data file that this
# process has open already (it goes by the file, not the path), and a child forked from a process
# that opened it inherits that refusal. So every environment is opened here, once per process and
# data file (device and inode: a store replaced by rename is another file), shared by everyone
# who asks for it, counted, and closed when the last user lets go. A forked child closes the
# environments it inherited (never using them) before it opens its own.


@dataclass(eq=False)
class _Env:
    key: tuple[int, int]
    path: str
    env: Any
    writable: bool
    span: tuple[int, int] | None
    """Addresses of the data file's bytes in this process's map (Linux), for value checks."""
    size: int
    fd: int | None = None
    """The data file, open for read-ahead requests (readers only)."""
    refs: int = 0
    epoch_path: str = ""
    epoch_map: mmap.mmap | None = None
    epoch_view: memoryview | None = None
    """The append epoch (see "appends"), mapped; None while the store has no epoch file."""

    def epoch(self) -> int:
        """The append epoch now: -1 while there is no epoch file (an older store never
        appended to), which it stops being once an append creates one."""
        view = self.epoch_view
        if view is not None:
            return int(view[0])
        if not self.epoch_path or not os.path.exists(self.epoch_path):
            return -1
        self.epoch_map, self.epoch_view = _map_epoch(self.epoch_path)
        if self.epoch_view is None:
            return -3  # there, but damaged (too short): the next append writes it anew
        return -2  # the file appeared: an append began, whatever it says

    def grown(self) -> bool:
        """Whether the data file grew since it was opened (an append); if so, the bounds that
        values are checked against are updated."""
        if self.fd is None:
            return False
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return False
        if size <= self.size:
            return False
        if self.span is not None:
            self.span = (self.span[0], self.span[0] + min(size, self.map_length))
        self.size = size
        return True

    @property
    def map_length(self) -> int:
        info = self.env.info()
        return int(info["map_size"])

    def close(self) -> None:
        with suppress(lmdb.Error):
            self.env.close()
        if self.epoch_view is not None:
            self.epoch_view.release()
            self.epoch_view = None
        if self.epoch_map is not None:
            self.epoch_map.close()
            self.epoch_map = None
        if self.fd is not None:
            with suppress(OSError):
                os.close(self.fd)
            self.fd = None


_envs: dict[tuple[int, int], _Env] = {}
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
    for entry in _envs.values():
        entry.close()
    _envs.clear()
    _envs_pid = os.getpid()


def _open_fd(path: str, key: tuple[int, int]) -> int | None:
    """The data file opened for read-ahead requests, if it is still the file ``key`` names."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != key:
        os.close(fd)
        return None
    return fd


def _map_epoch(path: str) -> tuple[mmap.mmap | None, memoryview | None]:
    """The epoch file at ``path`` mapped read-only, as one native 64-bit counter (None, None
    when it cannot be: then reads check for it again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        if os.fstat(fd).st_size < EPOCH_BYTES:
            return None, None
        mapped = mmap.mmap(fd, EPOCH_BYTES, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None, None
    finally:
        os.close(fd)
    return mapped, memoryview(mapped).cast("Q")


def bump_epoch(folder: str) -> None:
    """Advance the append epoch of the store in ``folder`` (creating its file at 1): readers
    that began a read before this go through it again (see "appends")."""
    import struct

    path = os.path.join(folder, EPOCH_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        _new_epoch_file(path, 1)
        return
    try:
        if os.fstat(fd).st_size < EPOCH_BYTES:  # damaged: no reader could map it; anew
            _new_epoch_file(path, 1)
            return
        (now,) = struct.unpack("=Q", os.pread(fd, 8, 0))
        os.pwrite(fd, struct.pack("=Q", now + 1), 0)
    finally:
        os.close(fd)


def ensure_epoch(folder: str) -> None:
    """Give the store in ``folder`` its epoch file (at 0) if it has none, so that its readers
    map it when they open it."""
    path = os.path.join(folder, EPOCH_FILE)
    if not os.path.exists(path):
        _new_epoch_file(path, 0)


def _new_epoch_file(path: str, value: int) -> None:
    import struct

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:  # whole before it appears: renamed into place
        f.write(struct.pack("=Q", value).ljust(EPOCH_BYTES, b"\0"))
    os.replace(tmp, path)


def _data_file(path: str) -> str:
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


# ----------------------------------------------------------------------------------- read-ahead
#
# Readers map the store with the kernel's read-ahead off (LMDB's MDB_NORDAHEAD: MADV_RANDOM on
# the whole map): with it on, a cold random read of a 2 kB record pulled about 0.5-1.5 MB from
# the disk, and a store larger than the page cache spent its reads evicting useful pages. With it
# off a record is read a page at a time as it is copied, so a value spanning several pages is
# announced first (POSIX_FADV_WILLNEED on its byte range: one request for its pages), and a scan
# in index order (verify, export) asks for sequential read-ahead (MADV_SEQUENTIAL) while it
# runs. ``scripts/bench_readahead.py`` measures all three against a bare lmdb loop.

ADVISE_MIN_BYTES = 3 * mmap.PAGESIZE
"""Values at least this long are announced to the kernel before they are copied."""
SCAN_WINDOW = 32 << 20
"""How far ahead of a scan its pages are requested."""

_libc: Any = None


def _madvise(address: int, length: int, advice: int) -> None:
    """Give the kernel ``advice`` about a range of this process's map; a no-op where it cannot."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return
    start = address - address % mmap.PAGESIZE
    _libc.madvise(start, address + length - start, advice)  # advice only: its failure is harmless


class Lease:
    """One user's share of an environment; let go by :meth:`release` or garbage collection."""

    def __init__(self, entry: _Env) -> None:
        self.entry = entry
        self.pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, entry.key, self.pid)
        self._finalizer.atexit = False

    @property
    def env(self) -> Any:
        return self.entry.env

    @property
    def usable(self) -> bool:
        """Held by this process and not released."""
        return self.pid == os.getpid() and self._finalizer.alive

    def release(self) -> None:
        self._finalizer()

    @contextmanager
    def sequential(self) -> Iterator[None]:
        """Read-ahead for a scan in index order while the block runs (see above)."""
        span = self.entry.span
        if span is None or self.entry.writable:
            yield
            return
        _madvise(span[0], span[1] - span[0], mmap.MADV_SEQUENTIAL)
        self._ahead = 0
        try:
            yield
        finally:
            self._ahead = None
            _madvise(span[0], span[1] - span[0], mmap.MADV_RANDOM)

    _ahead: int | None = None
    """In a scan: the file offset up to which read-ahead was requested."""

    def _advise(self, offset: int, n: int) -> None:
        """Ask for a large value's pages in one request; in a scan, keep a window of the file
        past the last value read on its way in (records are stored in index order)."""
        fd = self.entry.fd
        if fd is None:
            return
        with suppress(OSError):  # advice only
            end = offset + n
            if self._ahead is None:
                if n >= ADVISE_MIN_BYTES:
                    os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
            elif end + SCAN_WINDOW // 2 > self._ahead:
                start = max(end, self._ahead)
                self._ahead = end + SCAN_WINDOW
                os.posix_fadvise(fd, start, self._ahead - start, os.POSIX_FADV_WILLNEED)

    def read(self, fn: Callable[[Any], T], where: str) -> T:
        """``fn(txn)`` in a read transaction (``buffers=True``), begun again in a new one when
        an append began while it read: then the pages it read may have been reused, and what
        it copied is not trusted, nor an error it met (see "appends"). ``fn`` copies what it
        keeps out of the transaction."""
        entry = self.entry
        for _ in range(READ_ATTEMPTS):
            before = entry.epoch()
            try:
                with _reading(where), self.env.begin(buffers=True) as txn:
                    out = fn(txn)
            except FastdataError:
                if entry.epoch() != before:
                    continue
                raise
            if entry.epoch() == before:
                return out
        raise StoreError(
            f"{where}: appends kept beginning while it was read ({READ_ATTEMPTS} times); try again"
        )

    def value(self, raw: memoryview | None, where: str) -> bytes | None:
        """The bytes of a value read with ``buffers=True``, after checking they lie inside the
        file: a damaged page can give a value a size or place that would fault on copying."""
        if raw is None:
            return None
        n = len(raw)
        entry = self.entry
        if n and entry.span is not None:
            address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
            while address < entry.span[0] or address + n > entry.span[1]:
                if not entry.grown():
                    raise _damage(where, f"its value ({n} bytes) lies outside the file")
            self._advise(address - entry.span[0], n)
        elif not entry.writable and n > entry.size and not entry.grown():
            raise _damage(where, f"its value ({n} bytes) is larger than the file")
        return bytes(raw)


def _damage(where: str, what: str) -> RecordError:
    return RecordError(
        f"{where}: {what}; the store is damaged, run `fastdata verify` on it and convert it again"
    )


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


def _lease(entry: _Env) -> Lease:
    entry.refs += 1
    _envs[entry.key] = entry
    return Lease(entry)


def open_reader(path: str) -> Lease:
    """A share of this process's read-only environment for the store at ``path``.

    The data file's header is checked against its size before LMDB maps it.

    Raises:
        StoreNotFoundError: no LMDB store at ``path``.
        StoreError: the file is damaged or cannot be opened.
    """
    if not os.path.exists(path) or (
        os.path.isdir(path) and not os.path.exists(os.path.join(path, DATA_FILE))
    ):
        if os.path.isdir(path) and any(e.is_dir() for e in os.scandir(path)):
            store = os.path.normpath(path) + ".lmdb"
            raise StoreNotFoundError(
                f"{path}: an image folder, not a store; convert it first: "
                f"`fastdata convert {path} {store}`, then use {store}"
            )
        raise StoreNotFoundError(
            f"{path}: no LMDB store here; create one with `fastdata convert IMAGE_FOLDER {path}`"
        )
    data_file = _data_file(path)
    for _ in range(5):
        key, size = _file_key(data_file)
        with _envs_lock:
            _forget_inherited()
            entry = _envs.get(key)
            if entry is not None:
                return _lease(entry)
            lmdb_file.check_file(data_file)
            # The data file itself is opened (py-lmdb refuses a folder it has open already, even
            # when the file in it was replaced). lock=False: readers of a finished store need no
            # lock file (and may lack write access); read-ahead off (see "read-ahead" above).
            env = _open_for_reading(path, data_file)
            if _file_key(data_file)[0] != key:  # replaced between the check and the open
                env.close()
                continue
            entry = _Env(key, path, env, False, _span(key, size), size, _open_fd(data_file, key))
            entry.epoch_path = os.path.join(os.path.dirname(data_file), EPOCH_FILE)
            entry.epoch_map, entry.epoch_view = _map_epoch(entry.epoch_path)
            return _lease(entry)
    raise StoreError(f"{path}: the store kept being replaced while it was opened; try again")


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


def _open_for_reading(store: str, data_file: str) -> Any:
    try:
        return lmdb.open(data_file, map_size=READER_MAP_SIZE, **READER_SETTINGS)
    except lmdb.Error:  # no room for the map (a limit on address space): the file's own size
        return _lmdb_open(store, data_file, READER_SETTINGS)


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
            lmdb_file.check_file(data_file)
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
        return _lease(_Env(key, folder, env, True, None, size))


def _peek(path: str) -> tuple[StoreMeta | None, Progress | None, bool | None]:
    """The metadata, the progress of an unfinished run (a conversion, or an append to the store
    the metadata describes) and whether there is a pickle-recipe key list, of ``path``; None for
    the last when the environment holds nothing at all (a writer stopped right after creating
    it)."""
    lease = open_reader(path)
    try:
        if lease.env.stat()["entries"] == 0:
            return None, None, None
        with _reading(path), lease.env.begin(buffers=True) as txn:
            raw_meta = lease.value(txn.get(META_KEY), f"{path}: the metadata")
            raw_progress = lease.value(txn.get(PROGRESS_KEY), f"{path}: the progress")
            has_keys = txn.get(KEYS_KEY) is not None
            meta = StoreMeta.from_json(raw_meta, path) if raw_meta is not None else None
            progress = None
            if raw_progress is not None:
                # a complete store keeps the progress of its last run: it matters only when it
                # is an append to this very store that did not finish
                progress = Progress.from_json(raw_progress, path)
                if meta is None or _appends_to(progress, meta):
                    progress = Progress.from_json(
                        raw_progress, path, lambda n: _read_skipped(lease, txn, n, path)
                    )
                else:
                    progress = None
    finally:
        lease.release()
    return meta, progress, has_keys


def _appends_to(progress: Progress, meta: StoreMeta) -> bool:
    """Whether a progress found beside a complete store is an unfinished append to it (and not
    what its own conversion, or an earlier append, left)."""
    return progress.base_id == meta.id and 0 < progress.first_index == meta.count


@contextmanager
def _reading(where: str) -> Iterator[None]:
    """LMDB's own errors on a damaged file, as a StoreError naming the store."""
    try:
        yield
    except lmdb.Error as exc:
        raise StoreError(
            f"{where}: reading failed: {exc}; the store is damaged, run `fastdata verify` on it"
        ) from None


# --------------------------------------------------------------------------- writer


class LMDBWriter(StoreWriter):
    """Writes a fastdata store into an LMDB folder.

    The writer lock is ``writer.lock`` in the store folder (``flock``: the kernel releases it if
    the process dies). A fresh store is written in place; a store that replaces another is built
    in ``.replacement/`` inside the folder and its ``data.mdb`` renamed over the old one when
    complete, so readers see either store whole, never a mix. Each batch and its progress are
    committed in one transaction. The map grows (doubling) when LMDB reports it full, so no size
    needs guessing.

    Args:
        path: the store folder (created if missing; must be empty or hold an LMDB store).
        map_size: the initial map size in bytes.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = INITIAL_MAP_SIZE) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._map_size = map_size
        self._lease: Lease | None = None
        self._lock_fd: int | None = None

    @property
    def _aside_path(self) -> str:
        return os.path.join(self.path, ASIDE_DIR)

    def _target(self) -> str:
        return self._aside_path if self._aside else self.path

    # -- the policy's steps (see StoreWriter.start)

    def _lock(self) -> None:
        folder = Path(self.path)
        if folder.exists() and not folder.is_dir():
            raise StoreExistsError(
                f"{folder}: a file is in the way; give a new or empty folder for the store"
            )
        if folder.is_dir() and not (folder / DATA_FILE).exists():
            foreign = sorted(p.name for p in folder.iterdir() if p.name not in OWN_FILES)
            if foreign:
                raise StoreExistsError(
                    f"{folder}: the folder is not empty ({foreign[0]}, ...) and holds no LMDB "
                    "store; give a new or empty folder for the store"
                )
        # the folders this writer creates: removed again if it ends without writing a store (a
        # refused command leaves nothing behind)
        self._created = tuple(p for p in [folder, *folder.parents] if not p.exists())
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"{folder}: cannot create the store: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                info = json.loads(os.pread(fd, 4096, 0) or b"null")
            except ValueError:
                info = None
            os.close(fd)
            raise StoreLockedError(
                f"{self.path}: another conversion is writing this store "
                f"({describe_holder(info)}); wait for it to finish, or stop it and run the same "
                "command with --resume"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder()).encode("ascii"), 0)
        self._lock_fd = fd

    def _inspect(self) -> Existing:
        meta = progress = aside = None
        aside_complete = False
        other = ""
        if os.path.exists(os.path.join(self.path, DATA_FILE)):
            try:
                meta, progress, has_keys = _peek(self.path)
            except StoreError as exc:
                other = f"holds a damaged LMDB store ({exc})"
            else:
                if meta is None and progress is None and has_keys is not None:
                    other = (
                        "holds an LMDB store written by another tool"
                        if has_keys
                        else "holds an LMDB store without fastdata metadata"
                    )
        appending = None
        if meta is not None and progress is not None:
            appending, progress = progress, None
        if os.path.exists(os.path.join(self._aside_path, DATA_FILE)):
            try:
                aside_meta, aside, _ = _peek(self._aside_path)
                aside_complete = aside_meta is not None
            except StoreError as exc:
                log.warning("%s: discarding a damaged replacement: %s", self.path, exc)
                self._discard_aside()
        return Existing(meta, progress, aside, aside_complete, other, appending)

    def _check_resumable(self, saved: Progress) -> None:
        if saved.boot_id and saved.boot_id != boot_id():
            raise StoreError(
                f"{self.path}: the machine restarted while this conversion was running, and "
                "its last batches may not have reached the disk intact; convert again with "
                "--overwrite"
            )

    def _open(self, progress: Progress, *, new: bool) -> None:
        target = self._target()
        if new and self._aside:
            self._discard_aside()
        os.makedirs(target, exist_ok=True)
        if self._lease is None:  # (a discarded append left it open, and pinned)
            self._lease = open_writable(target, self._map_size, durable=self._appending)
        if self._appending and self._pin is None:
            self._pin_readers()
        if new:
            progress.boot_id = boot_id()
            state = progress.to_json()
            self._commit(lambda txn: txn.put(PROGRESS_KEY, state))

    def _discard_aside(self) -> None:
        shutil.rmtree(self._aside_path, ignore_errors=True)

    # -- appends in place
    #
    # NOTE [ Appends against readers ]
    #
    # Readers map the store without LMDB's lock table (they may not be able to write its lock
    # file), so LMDB cannot see them, and a commit may reuse pages that a reader is still
    # reading. Two rules keep every reader's bytes right, without a time margin:
    #
    # 1. An append holds a read transaction of the store as it found it (version V) for as long
    #    as it writes. LMDB reuses no page freed after its oldest reader began, so every version
    #    from V on stays intact while the append runs: a reader that began at V or later reads
    #    what it would have read.
    # 2. Pages freed before V (by an earlier append) may be reused. A reader that began before V
    #    may be on them, however long ago it began (a stopped process, a debugger). So, after
    #    taking its read transaction and before its first write, an append advances the append
    #    epoch (``readers.epoch`` beside ``data.mdb``, mapped by every reader). A reader reads
    #    the epoch, begins its transaction, copies what it reads, and reads the epoch again
    #    (``Lease.read``): if it moved, an append may have begun writing while it read, and the
    #    read is done again in a new transaction (it sees V or later: rule 1). If it did not
    #    move, no append began: any append writing then began before the reader's transaction,
    #    so the reader is at its V or later.
    #
    # The first append to a store never reuses a page a reader needs (pages freed before the
    # store was complete belong to versions without metadata, which readers never read), so a
    # store without an epoch file (an older one) gets one from its first append; its readers
    # look for it until it appears. Pages freed by a conversion or a replacement belong to such
    # versions too. The epoch is a live signal between processes of one machine (one page
    # cache), as LMDB itself is.
    #
    # Power loss: an append writes into the complete store, so its commits are durable (LMDB's
    # sync: the pages, then the meta page that points at them, each flushed): a crash at any
    # point leaves the store as it was, or with some of the append's batches (unseen by readers
    # until the metadata is written), never damaged. Conversions and replacements write stores
    # that readers do not read until they are complete, and are flushed once, before their
    # metadata (see ``open_writable``).

    _pin: Any = None

    def _pin_readers(self) -> None:
        assert self._lease is not None, "_open() opens the store"
        self._pin = self._lease.env.begin()
        bump_epoch(self.path)  # after the pin, before any write (see the note above)

    def _kept_skipped(self, base: StoreMeta) -> int:
        """The store's skipped entries are kept as keys, except in stores of the first format,
        which kept the list in their metadata: an append writes it out as keys."""
        if not base.skipped_count:
            return 0
        lease = open_reader(self.path)
        try:
            with _reading(self.path), lease.env.begin() as txn:
                return base.skipped_count if txn.get(skipped_key(0)) is not None else 0
        finally:
            lease.release()

    def _discard_append(self, base: StoreMeta, pending: Progress) -> None:
        self._lease = open_writable(self.path, self._map_size, durable=True)
        self._pin_readers()
        keys = [
            key
            for i in range(base.count, pending.next_index)
            for key in (record_key(i), header_key(i))
        ]
        keys += [skipped_key(n) for n in range(base.skipped_count, len(pending.skipped))]

        def fill(txn: Any) -> None:
            for key in keys:
                txn.delete(key)
            txn.delete(PROGRESS_KEY)

        # the pin stays for the append that follows: the pages freed here stay untouched too
        self._commit(fill)

    def open_reader(self) -> StoreReader:
        return LMDBStore(self.path)

    def _promote(self) -> None:
        self._close_env()
        source = os.path.join(self._aside_path, DATA_FILE)
        try:
            _fsync(source)
            # One rename: a reader opening the store gets the old file or the new one, whole;
            # readers that have the old one mapped keep reading it.
            os.replace(source, os.path.join(self.path, DATA_FILE))
            _fsync(self.path)
        except OSError as exc:
            raise StoreError(
                f"{self.path}: could not move the new store into place: {exc.strerror or exc}; "
                "the old store is unchanged: fix the cause and run the same command with --resume"
            ) from None
        self._discard_aside()
        self._aside = False

    def _commit(self, fill: Callable[[Any], None]) -> None:
        assert self._lease is not None, "start() opens the store"
        env = self._lease.env
        while True:
            try:
                with env.begin(write=True) as txn:
                    fill(txn)
                return
            except lmdb.MapFullError:
                size = env.info()["map_size"] * 2
                log.info("%s: map full, growing it to %d MiB", self.path, size >> 20)
                env.set_mapsize(size)
            except lmdb.Error as exc:
                raise _write_failed(self._target(), exc) from None

    def write(self, records: Sequence[Record], progress: Progress) -> None:
        data = [(record_key(r.index), r.data) for r in records]
        headers = [(header_key(r.index), r.header.to_json()) for r in records]
        skipped = _skipped_items(progress.skipped, self._take_skipped(progress.skipped))
        progress.boot_id = boot_id()
        state = progress.to_json()

        def fill(txn: Any) -> None:
            # One call per batch: a put per record would hand the GIL back and forth with the
            # reader threads for every image, and wait out the switch interval each time.
            cursor = txn.cursor()
            # at the end of the B-tree (MDB_APPEND) in a new store; an append goes before the
            # metadata keys, which sort after the records
            _, added = cursor.putmulti(data, overwrite=False, append=not self._appending)
            if added != len(data):
                raise StoreError(
                    f"{self.path}: records from {records[0].index} on exist already; the store "
                    "is not the one this conversion started, convert again with --overwrite"
                )
            cursor.putmulti(headers + skipped)
            txn.put(PROGRESS_KEY, state)

        self._commit(fill)

    def _count_records(self, count: int) -> str | None:
        """Records and headers are exactly the keys of ``0 .. count-1``: the last ones are
        there, nothing lies past them, and the entries add up (every other key counted)."""
        assert self._lease is not None, "start() opens the store"
        lease = self._lease
        with _reading(self.path), lease.env.begin() as txn:
            if count and (
                txn.get(record_key(count - 1)) is None or txn.get(header_key(count - 1)) is None
            ):
                return f"record {count - 1} (the last) is missing"
            cursor = txn.cursor()
            for first in (record_key(count), header_key(count)):
                if cursor.set_range(first):
                    key = bytes(cursor.key())
                    if key[:1].isdigit() or (key[:1] == b"#" and key[1:2].isdigit()):
                        return f"a record past the last ({key.decode('ascii', 'replace')})"
            skipped = 0
            if cursor.set_range(SKIPPED_PREFIX):
                for key in cursor.iternext(keys=True, values=False):
                    if not bytes(key).startswith(SKIPPED_PREFIX):
                        break
                    skipped += 1
            fixed = sum(
                txn.get(k) is not None
                for k in (PROGRESS_KEY, LABELS_KEY, NAMES_KEY, LEN_KEY, KEYS_KEY, META_KEY)
            )
        entries = int(lease.env.stat()["entries"])
        if entries - skipped - fixed != 2 * count:
            return (
                f"{(entries - skipped - fixed) / 2:g} records and headers for {count} records "
                "(a record stored twice or keys of another kind)"
            )
        return None

    def _write_meta(self, done: Completion) -> None:
        meta, labels, skipped, names = done.meta, done.labels, done.skipped, done.names
        assert self._lease is not None, "start() opens the store"
        skipped_items = _skipped_items(skipped, self._take_skipped(skipped))
        try:
            self._lease.env.sync(True)  # every record on disk before the metadata says it's whole
        except lmdb.Error as exc:
            raise _write_failed(self._target(), exc) from None
        count = meta.count
        keys = _record_keys(count)
        label_bytes = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()

        whole = names is not None and (names.count(b"\0") + 1 if names else 0) == count
        names_value = names if whole else None

        stale = [skipped_key(n) for n in range(len(skipped), self._skipped_stale)]

        def fill(txn: Any) -> None:
            txn.cursor().putmulti(skipped_items)
            for key in stale:
                txn.delete(key)
            if names_value is not None:
                txn.put(NAMES_KEY, names_value)
            else:
                txn.delete(NAMES_KEY)  # an index of other records would mislead
            txn.put(LABELS_KEY, label_bytes)
            txn.put(LEN_KEY, str(count).encode("ascii"))
            txn.put(KEYS_KEY, keys)
            txn.put(META_KEY, meta.to_json())

        self._commit(fill)
        try:
            ensure_epoch(self.path)  # readers map it when they open the store
        except OSError as exc:
            raise _write_failed(self.path, exc) from None

    def _close_env(self) -> None:
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.abort()
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            lease.env.sync(True)
        except lmdb.Error as exc:
            raise _write_failed(self._target(), exc) from None
        finally:
            lease.release()
        with suppress(OSError, StoreError):
            lmdb_file.pad(os.path.join(self._target(), DATA_FILE))

    _created: tuple[Path, ...] = ()

    def close(self) -> None:
        """Flush and close the store, then release the writer lock (even if flushing fails);
        a folder this writer created and wrote no store into is removed."""
        try:
            self._close_env()
        finally:
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                if self._created and not os.path.exists(os.path.join(self.path, DATA_FILE)):
                    with suppress(OSError):
                        os.unlink(os.path.join(self.path, WRITER_LOCK))
                    for folder in self._created:  # deepest first; only while empty
                        with suppress(OSError):
                            os.rmdir(folder)
                os.close(fd)  # releases the flock


def _write_failed(where: str, exc: BaseException) -> StoreError:
    return StoreError(
        f"{where}: writing the store failed: {exc}; free space (or fix the disk) and run the same "
        "command with --resume: what was committed is kept"
    )


def _record_keys(count: int) -> bytes:
    """``record_key(0) + b"\\n" + ... + record_key(count - 1)``, digit by digit in one array
    (11 bytes a record; no object per key)."""
    if count <= 0:
        return b""
    if count > 10**10:
        raise StoreError(f"{count} records: more than 10-digit keys can number")
    out = np.empty((count, 11), dtype=np.uint8)
    out[:, 10] = ord("\n")
    rest = np.arange(count, dtype=np.int64)
    digit = np.empty(count, dtype=np.int64)
    for column in range(9, -1, -1):
        np.remainder(rest, 10, out=digit)
        out[:, column] = digit
        rest //= 10
    out[:, :10] += ord("0")
    return out.reshape(-1)[:-1].tobytes()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- readers


class _Leased(StoreReader):
    """A reader that holds a share of this process's environment, taken on first use in each
    process, dropped when pickled, given back when closed or garbage-collected."""

    path: str
    _lease: Lease | None

    @contextmanager
    def sequential(self) -> Iterator[None]:
        with self._env().sequential():
            yield

    def _env(self) -> Lease:
        lease = self._lease
        if lease is None or not lease.usable:
            lease = open_reader(self.path)
            try:
                self._check_identity(lease)
            except BaseException:
                lease.release()
                raise
            self._lease = lease
        return lease

    def _check_identity(self, lease: Lease) -> None:
        """Raise StoreReplacedError when ``lease`` is not the store this reader opened."""

    def close(self) -> None:
        """Release this process's share of the environment; the next read takes it again."""
        lease, self._lease = self._lease, None
        if lease is not None and lease.usable:
            lease.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lease"] = None
        return state


class LMDBStore(_Leased):
    """Reads a complete fastdata LMDB store. Use :func:`open_lmdb` to open any LMDB store.

    The metadata and the labels are read when the store opens, and again in each process that
    receives the reader pickled (a worker): a pickle holds the path and the store's id, not one
    label per record.
    """

    def __init__(self, path: str | os.PathLike[str], lease: Lease | None = None) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._lease = lease or open_reader(self.path)
        self._meta, self._labels = self._load(self._lease)
        self._opened(self._meta)

    def _load(self, lease: Lease) -> tuple[StoreMeta, np.ndarray]:
        def get(txn: Any) -> tuple[bytes | None, bytes | None]:
            raw_meta = lease.value(txn.get(META_KEY), f"{self.path}: the metadata")
            return raw_meta, lease.value(txn.get(LABELS_KEY), f"{self.path}: the labels")

        raw_meta, raw_labels = lease.read(get, self.path)
        if raw_meta is None:
            raise IncompleteStoreError(f"{self.path}: store metadata missing")
        meta = StoreMeta.from_json(raw_meta, self.path)
        return meta, check_labels(raw_labels, meta, self.path)

    def skipped_files(self) -> list[SkippedFile]:
        lease = self._env()
        where = self.path
        count = self.meta.skipped_count

        def get(txn: Any) -> list[SkippedFile] | bytes | None:
            if txn.get(skipped_key(0)) is not None or not count:
                return _read_skipped(lease, txn, count, where)
            return lease.value(txn.get(META_KEY), f"{where}: the metadata")

        found = lease.read(get, where)
        if isinstance(found, list):
            return found
        legacy = json.loads(found or b"{}").get("skipped", [])  # earlier versions kept it there
        return [skipped_file(item, where) for item in legacy]

    def _check_identity(self, lease: Lease) -> None:
        try:
            meta, labels = self._load(lease)
        except IncompleteStoreError:
            raise self._replaced("(none: an unfinished store)") from None
        seen = self._as_opened(meta, labels)
        if seen is None:
            raise self._replaced(meta.id)
        if self.__dict__.get("_meta") is None:  # unpickled: what the pickle left out
            self._meta, self._labels = seen

    def _replaced(self, now: str) -> StoreReplacedError:
        return StoreReplacedError(
            f"{self.path}: the store was replaced since this dataset opened it (store id "
            f"{self._id or '(none)'}, now {now}); its records no longer match the labels held "
            "here: create the dataset (and its DataLoader) again"
        )

    def _loaded(self) -> None:
        if self.__dict__.get("_meta") is None:
            self._env()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_meta"] = state["_labels"] = None  # read again where it is unpickled
        return state

    def iter_headers(
        self, stop: int | None = None, batch_size: int = 1024
    ) -> Iterator[RecordHeader]:
        """The headers alone, walked with a cursor (they sort apart from the image bytes)."""
        n = len(self) if stop is None else stop
        lease = self._env()

        def batch(txn: Any, start: int) -> list[RecordHeader]:
            out = []
            cursor = txn.cursor()
            found = cursor.set_key(header_key(start))
            for i in range(start, min(n, start + batch_size)):
                where = f"{self.path}: record {i}"
                if not found or bytes(cursor.key()) != header_key(i):
                    raise RecordError(
                        f"{where}: its header is missing; the store is damaged, run "
                        "`fastdata verify` on it"
                    )
                raw = lease.value(cursor.value(), where) or b""
                out.append(RecordHeader.from_json(raw, where))
                found = cursor.next()
            return out

        for start in range(0, n, batch_size):
            yield from lease.read(functools.partial(batch, start=start), self.path)

    def _record(self, lease: Lease, txn: Any, key: bytes) -> bytes:
        where = f"{self.path}: record {key.decode()}"
        value = lease.value(txn.get(key), where)
        if value is None:
            raise RecordError(
                f"{where} is missing; the store is damaged, run `fastdata verify` on it and "
                "convert it again"
            )
        return value

    def record_names(self) -> PackedStrings:
        lease = self._env()
        raw = lease.read(
            lambda txn: lease.value(txn.get(NAMES_KEY), f"{self.path}: the names"), self.path
        )
        names = PackedStrings.from_joined(raw or b"")
        if len(names) != len(self) or len(self) == 0:
            return super().record_names()  # written before the index existed, or damaged
        return names

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        lease = self._env()
        labels = self._labels[idx].tolist()

        # Read in key order (file order), so pages that come from disk come in ascending runs.
        def get(txn: Any) -> dict[int, bytes]:
            return {i: self._record(lease, txn, record_key(i)) for i in sorted(set(idx))}

        data = lease.read(get, self.path)
        return list(zip([data[i] for i in idx], labels, strict=True))

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        lease = self._env()

        def get(txn: Any) -> list[Record]:
            out = []
            for i in idx:
                key = record_key(i)
                data = self._record(lease, txn, key)
                head = self._record(lease, txn, header_key(i))
                header = RecordHeader.from_json(head, f"{self.path}: record {key.decode()}")
                out.append(Record(i, header, data))
            return out

        return lease.read(get, self.path)

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)  # in an unpickled reader, this loads the labels
        labels = self._labels[idx].tolist()
        return [
            (r.header.name, r.data, label)
            for r, label in zip(self.read_records(indices), labels, strict=True)
        ]

    _damage: tuple[lmdb_file.Damage, ...] = ()

    def structure_damage(self) -> list[str]:
        """The damaged pages of the data file (see :func:`~fastdata.stores.lmdb_file.walk`)."""
        self._damage = tuple(lmdb_file.walk(_data_file(self.path)))
        return [str(d) for d in self._damage]

    def damaged_record(self, index: int) -> str | None:
        keys = (record_key(index), header_key(index))
        for damage in self._damage:
            if any(damage.covers(k) for k in keys):
                return f"lies under damaged page {damage.page}; not read"
        return None


def _unpickled_sample(raw: bytes, where: str) -> tuple[bytes, int]:
    try:
        obj = pickle.loads(raw)
    except Exception as exc:
        raise RecordError(f"{where}: cannot unpickle the value ({exc})") from exc
    if not isinstance(obj, (tuple, list)) or len(obj) < 2:
        raise RecordError(f"{where}: expected a pickled (image, label) pair, got {type(obj)}")
    img, label = obj[0], obj[1]
    if isinstance(img, np.ndarray):
        img = img.tobytes()
    elif isinstance(img, (bytearray, memoryview)):
        img = bytes(img)
    if not isinstance(img, bytes):
        raise RecordError(f"{where}: image is a {type(img).__name__}, not encoded bytes")
    return img, int(label)


class PickleLMDBStore(_Leased):
    """Reads LMDB stores written by the common pickle-based recipes.

    Values are ``pickle((image_bytes, label))`` under the keys listed in a pickled ``__keys__``
    (``b'0'``, ``b'1'``, ... or zero-padded). Unpickling can run arbitrary code, so this reader is
    only used when the caller passes ``allow_pickle=True``. Classes and labels are not stored by
    those recipes: they are gathered by reading every record, once, when first asked for.
    """

    has_checksums = False

    def __init__(self, path: str | os.PathLike[str], lease: Lease | None = None) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._lease = lease or open_reader(self.path)
        with _reading(self.path), self._lease.env.begin(buffers=True) as txn:
            raw_keys = self._lease.value(txn.get(KEYS_KEY), f"{self.path}: __keys__")
        if raw_keys is None:
            raise StoreError(f"{self.path}: no __keys__ entry; not a pickle-based LMDB store")
        try:
            keys = pickle.loads(raw_keys)
        except Exception as exc:
            raise StoreError(f"{self.path}: cannot unpickle __keys__ ({exc})") from exc
        if not isinstance(keys, (list, tuple)) or not all(
            isinstance(k, (bytes, str)) for k in keys
        ):
            raise StoreError(f"{self.path}: __keys__ is not a list of keys")
        # One packed buffer instead of a list of Python objects in every worker.
        self._keys = PackedStrings([k.encode() if isinstance(k, str) else bytes(k) for k in keys])
        self._lazy_labels: np.ndarray | None = None
        self._lazy_meta: StoreMeta | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def _get(self, txn: Any, i: int) -> tuple[bytes, int]:
        key = self._keys[i]
        raw = self._env().value(txn.get(key), f"{self.path}: key {key!r}")
        if raw is None:
            raise RecordError(f"{self.path}: key {key!r} listed in __keys__ is missing")
        return _unpickled_sample(raw, f"{self.path}: key {key!r}")

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        with _reading(self.path), self._env().env.begin(buffers=True) as txn:
            return [self._get(txn, i) for i in idx]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..images.codec import sniff
        from ..records import checksum

        out = []
        for i, (data, label) in zip(
            self.check_indices(indices), self.read_samples(indices), strict=True
        ):
            fmt = sniff(data) or "unknown"
            key = self._keys[i].decode("ascii", "replace")
            header = RecordHeader(f"{label}/{key}.{fmt}", label, len(data), checksum(data), fmt)
            out.append(Record(i, header, data))
        return out

    @property
    def labels(self) -> np.ndarray:
        if self._lazy_labels is None:
            n = len(self)
            labels = np.empty(n, dtype=np.int64)
            with _reading(self.path), self._env().env.begin(buffers=True) as txn:
                for i in range(n):
                    labels[i] = self._get(txn, i)[1]
            labels.setflags(write=False)
            self._lazy_labels = labels
        return self._lazy_labels

    @property
    def meta(self) -> StoreMeta:
        if self._lazy_meta is None:
            labels = self.labels
            n_classes = class_count(labels, self.path)
            self._lazy_meta = StoreMeta(
                count=len(self),
                classes=[str(c) for c in range(n_classes)],
                source=self.path,
                format="pickle-lmdb",
                version=0,
            )
        return self._lazy_meta


def open_lmdb(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> StoreReader:
    """Open an LMDB store for reading: a fastdata store, or (with ``allow_pickle``) a pickle one.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        IncompleteStoreError: a conversion into it did not finish; the message says how to resume.
        PickleNotAllowedError: it holds pickled values and ``allow_pickle`` is false.
        StoreError: it is not a store fastdata can read.
    """
    path = os.fspath(path)
    lease = open_reader(path)
    try:
        if lease.env.stat()["entries"] == 0:
            raise IncompleteStoreError(
                f"{path}: an empty store: a conversion into it stopped before it began; run "
                f"`fastdata convert IMAGE_FOLDER {path}` again"
            )
        with _reading(path), lease.env.begin(buffers=True) as txn:
            has_meta = txn.get(META_KEY) is not None
            raw_progress = lease.value(txn.get(PROGRESS_KEY), f"{path}: the progress")
            has_keys = txn.get(KEYS_KEY) is not None
        if has_meta:
            return LMDBStore(path, lease)
        if has_keys and allow_pickle:
            return PickleLMDBStore(path, lease)
    except BaseException:
        lease.release()
        raise
    lease.release()
    if raw_progress is not None:
        progress = Progress.from_json(raw_progress, path)
        raise IncompleteStoreError(
            f"{path}: incomplete store: its conversion stopped after {progress.next_sample} of "
            f"{progress.total} images; finish it with "
            f"`{progress.resume_command(shlex.quote(path))}`"
        )
    if has_keys:
        raise PickleNotAllowedError(
            f"{path}: this LMDB store was written by another tool and its values are Python "
            "pickles, which can run arbitrary code when loaded; pass allow_pickle=True "
            "(CLI: --allow-pickle) only if you trust where it came from"
        )
    raise StoreError(
        f"{path}: an LMDB store without fastdata metadata (written by another tool); "
        "fastdata reads its own stores and the pickle-based recipes' (allow_pickle=True)"
    )
