"""LMDB environments, one owner per process: the registry every reader and writer goes through,
read-ahead advice, and the append epoch that readers check (NOTE [ Appends against readers ] in
``writer.py``)."""

from __future__ import annotations

import ctypes
import mmap
import os
import shlex
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import lmdb

from ...errors import (
    FastdataError,
    RecordError,
    StoreError,
    StoreNotFoundError,
)
from ..files import open_regular
from ..names import DATA_FILE, EPOCH_FILE, epoch_temp
from . import file as lmdb_file
from .address import address
from .layout import EPOCH_BYTES

T = TypeVar("T")
READ_ATTEMPTS = 64
"""Reads begun again at most this often when appends keep beginning while they read."""


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
    epoch_map: mmap.mmap | None = None
    epoch_view: memoryview | None = None
    """The append epoch (see "the append epoch"), mapped (readers only)."""
    covered: int = 0
    """Where the zeros covering the map past the file's end begin (see "past the end"); 0:
    nothing is covered."""
    map_end: int = 0

    def epoch(self) -> int:
        """The append epoch now (see "the append epoch"); -1 in a writer's environment."""
        view = self.epoch_view
        return -1 if view is None else int(view[0])

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
            if self.covered:
                self._uncover(size)
            self.span = (self.span[0], self.span[0] + min(size, self.map_length))
        self.size = size
        return True

    def cover(self) -> None:
        """Cover the map past the end of the file with zeros (see "past the end")."""
        if self.span is None or self.writable:
            return
        start = self.span[0] + _page_up(self.size)
        end = self.span[0] + self.map_length
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        if start < end and _map_fixed(start, end - start, flags, -1, 0):
            self.covered, self.map_end = start, end

    def _uncover(self, size: int) -> None:
        """Map the pages of the file that grew to ``size`` where zeros covered them."""
        assert self.span is not None and self.fd is not None
        upto = min(self.span[0] + _page_up(size), self.map_end)
        if upto <= self.covered:
            return
        offset = self.covered - self.span[0]
        if not _map_fixed(self.covered, upto - self.covered, _MAP_SHARED, self.fd, offset):
            raise StoreError(
                f"{self.path}: the store grew and its new part could not be mapped; open the "
                "dataset again"
            )
        self.covered = upto

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


_pid = os.getpid()
"""This process's id, kept up to date across forks (``os.getpid`` is a system call, and a
lease checks it on every read)."""


def _reset_after_fork() -> None:
    global _envs_lock, _pid
    _envs_lock = threading.Lock()
    _pid = os.getpid()


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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
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
# off, LMDB's lookup (and py-lmdb's touch of every page of the value before it returns) brings a
# record in a page at a time: one read from the disk per 4 kB page, one after the other, 28 of
# them for a 114 kB JPEG. So the first batch, and the batches after one that came from the disk
# (its lookups and copies took longer than memory could: COLD_NS_PER_PAGE), announce their values
# before any is looked up: the tree is read down to each value's place with pread
# (file.value_places; the leaf pages of the batch asked for together on the way), and each value on
# pages of its own asked for whole (POSIX_FADV_WILLNEED, in requests of at most file.ASK_MOST: the
# kernel drops what one asks for past its read-ahead size), all of the batch's requests in flight at
# once. The labels (read on opening) and the index of names are asked for so too. Whether the pages
# of the descent (the leaf pages above all) and the first and last page of each value were in memory
# already (mincore) says when to stop: at the first batch where all were. Where that cannot be known
# (no mincore), COLD_BATCHES batches are announced, then one is timed unannounced again, and while
# the store keeps coming from the disk the run doubles (up to COLD_BATCHES_MOST), so that few
# batches pay for the check. A lone record within its leaf page is not announced (the descent would
# read the page LMDB's lookup reads). From memory, announcing would cost a descent per key for
# nothing: a batch taken for one from the disk (a pause of the thread) costs one. A scan in index
# order (export, copy) asks for sequential read-ahead (MADV_SEQUENTIAL) and keeps a window ahead of
# it requested while it runs.
# ``scripts/bench_readahead.py`` and ``scripts/bench_lmdb.py`` measure these against a bare lmdb
# loop.

COLD_NS_PER_PAGE = 16_000
"""A batch whose values took longer than this per page they span (plus COLD_NS_SLACK) to look
up and copy was read from the disk, not from memory: a page in memory costs at most a microsecond
or so (a first touch), one from a disk tens of microseconds or more."""
COLD_NS_SLACK = 50_000
"""Allowed to any batch, for the scheduler's and the collector's pauses."""
COLD_BATCHES = 16
"""Batches announced after one that came from the disk, before one is timed again (a batch
announced looks as fast as memory: its pages come in together)."""
COLD_BATCHES_MOST = 256
"""The longest run of batches announced: runs double from COLD_BATCHES while the timed batch
after each still comes from the disk."""
SCAN_WINDOW = 32 << 20
"""How far ahead of a scan its pages are requested."""

_libc: Any = None


def _c_library() -> Any:
    """The C library's ``madvise``, ``mincore`` and ``mmap`` (Linux), or False where they
    cannot be had."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
            libc.mmap.argtypes = (
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            )
            libc.mmap.restype = ctypes.c_void_p
            _libc = libc if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _libc = False
    return _libc


def _madvise(address: int, length: int, advice: int) -> None:
    """Give the kernel ``advice`` about a range of this process's map; a no-op where it cannot."""
    libc = _c_library()
    if not libc:
        return
    start = address - address % mmap.PAGESIZE
    libc.madvise(start, address + length - start, advice)  # advice only: its failure is harmless


def _resident(address: int) -> bool | None:
    """Whether the page of this process's map at ``address`` is in memory (None: unknown)."""
    libc = _c_library()
    if not libc:
        return None
    vec = ctypes.create_string_buffer(1)
    if libc.mincore(address - address % mmap.PAGESIZE, 1, vec) != 0:
        return None
    return bool(vec.raw[0] & 1)


# ------------------------------------------------------------------------------ past the end
#
# py-lmdb touches every page of a value before it returns it (its "preload", with the GIL
# released), so a damaged node whose size runs past the end of the file would fault (SIGBUS)
# inside LMDB's own get, before any check of ours could look at the value. Readers map far more
# than the file (READER_MAP_SIZE), so the map past the file's last page is covered with an
# anonymous, read-only mapping: touching it reads zeros, and the value is then found to lie
# outside the file (Lease.value). LMDB never takes a page of zeros for one of its own (its flags
# name no kind of page), so a read that meets one fails and is tried again once the file is found
# to have grown. When an append grows the file, the pages it now holds are mapped from the file
# again in their place (_Env.grown) before anything past the old end is read.

_PROT_READ, _MAP_SHARED, _MAP_PRIVATE = 0x1, 0x01, 0x02
_MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x10, 0x20, 0x4000  # Linux's values


def _page_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _map_fixed(address: int, length: int, flags: int, fd: int, offset: int) -> bool:
    """Map ``length`` bytes, read-only, at exactly ``address`` (replacing what was there)."""
    libc = _c_library()
    if not libc:
        return False
    got = libc.mmap(address, length, _PROT_READ, flags | _MAP_FIXED, fd, offset)
    return bool(got == address)


class Lease:
    """One user's share of an environment; let go by :meth:`release` or garbage collection."""

    def __init__(self, entry: _Env) -> None:
        self.entry = entry
        self.env = entry.env
        self.pid = os.getpid()
        self._released = False
        self._finalizer = weakref.finalize(self, _release, entry.key, self.pid)
        self._finalizer.atexit = False

    @property
    def usable(self) -> bool:
        """Held by this process and not released."""
        return self.pid == _pid and not self._released

    def release(self) -> None:
        self._released = True
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

    _cold = 1
    """Batches left to announce their values before looking them up: set when one came from
    the disk; the first batch is announced (nothing is known of the store's pages yet)."""
    _cold_run = COLD_BATCHES
    """How many batches the next run of announced ones is (see "read-ahead")."""
    _large = True
    """Whether the last batch's values spanned a page or more each, on average: then even one
    value alone is worth announcing (a record within its leaf page is not: the descent to it
    would read the page LMDB's lookup reads, one more time)."""

    def _advise(self, offset: int, n: int) -> None:
        """In a scan, keep a window of the file past the value read (``n`` bytes at
        ``offset``) on its way in (records are stored in index order)."""
        fd = self.entry.fd
        if fd is None or self._ahead is None:
            return
        with suppress(OSError):  # advice only
            end = offset + n
            if end + SCAN_WINDOW // 2 > self._ahead:
                start = max(end, self._ahead)
                self._ahead = end + SCAN_WINDOW
                lmdb_file.ask(fd, start, self._ahead - start)

    def value_at(self, key: bytes) -> bytes | None:
        """The value of one key on the shortest path there is, or None where that path cannot
        give it (the key is not there, the value lies outside the known bounds, an error, an
        append began meanwhile, no epoch file, a scan or a store read from the disk): the
        caller then reads it with :meth:`values`, which handles each of those."""
        entry = self.entry
        epoch = entry.epoch_view
        span = entry.span
        if epoch is None or span is None or self._cold or self._ahead is not None:
            return None
        before = epoch[0]
        out: bytes | None = None
        txn = self.env.begin(buffers=True)
        try:
            raw = txn.get(key)
            if raw is not None:
                at = address(raw)
                if span[0] <= at and at + len(raw) <= span[1]:
                    out = bytes(raw)
        except lmdb.Error:
            return None
        finally:
            txn.abort()
        return out if epoch[0] == before else None

    def values_at(self, keys: Sequence[bytes]) -> list[bytes] | None:
        """The values of a few keys in one transaction, on the shortest path there is, or None
        where that path cannot give them all (as :meth:`value_at`, which is this for one key,
        written apart: it is every unchecked raw read's path)."""
        entry = self.entry
        epoch = entry.epoch_view
        span = entry.span
        if epoch is None or span is None or self._cold or self._ahead is not None:
            return None
        before = epoch[0]
        out: list[bytes] = []
        txn = self.env.begin(buffers=True)
        try:
            for key in keys:
                raw = txn.get(key)
                if raw is None:
                    return None
                at = address(raw)
                if not (span[0] <= at and at + len(raw) <= span[1]):
                    return None
                out.append(bytes(raw))
        except lmdb.Error:
            return None
        finally:
            txn.abort()
        return out if epoch[0] == before else None

    def values(self, keys: Sequence[bytes], where: Callable[[int], str]) -> list[bytes | None]:
        """The values of ``keys`` (None for a key not there), read in one transaction as
        :meth:`read` reads, each checked to lie inside the file before it is copied;
        ``where(n)`` names the ``n``-th for an error."""
        return self.read(lambda txn: self._copies(txn, keys, where), self.entry.path)

    def _copies(
        self, txn: Any, keys: Sequence[bytes], where: Callable[[int], str]
    ) -> list[bytes | None]:
        # The path of every raw read: a few comparisons per value beyond LMDB's own lookup and
        # copy. Values outside the file's bounds go through value(), which looks again.
        started = time.perf_counter_ns()
        in_memory = None
        if self._cold > 0 and (len(keys) > 1 or self._large):
            in_memory = self._announce(keys)
        get = txn.get
        views = [get(k) for k in keys]
        entry = self.entry
        lo, hi = entry.span or (1, 0)  # no span: every value takes the checked path
        advising = self._cold > 0 or self._ahead is not None
        if self._ahead is not None:  # a scan: its window is kept ahead of the furthest value
            ends = [address(v) + len(v) for v in views if v is not None]
            if ends and lo <= max(ends) <= hi:
                self._advise(max(ends) - lo, 0)
        out: list[bytes | None] = []
        append = out.append
        spanned = 0
        for n, view in enumerate(views):
            if view is None:
                append(None)
                continue
            size = len(view)
            at = address(view)
            if lo <= at and at + size <= hi:
                append(bytes(view))
            else:
                append(self.value(view, where(n)))
            spanned += size
        pages = len(views) + spanned // mmap.PAGESIZE  # (about the pages the values span)
        self._large = spanned >= len(views) * mmap.PAGESIZE
        if in_memory is not None:  # (announced, and known to be from the disk or not)
            self._cold = 1 if not in_memory else 0
            self._cold_run = COLD_BATCHES
        elif self._cold:
            self._cold -= 1
        elif not advising:
            if time.perf_counter_ns() - started > pages * COLD_NS_PER_PAGE + COLD_NS_SLACK:
                self._cold = self._cold_run  # then one batch unannounced again, timed
                self._cold_run = min(2 * self._cold_run, COLD_BATCHES_MOST)
            else:
                self._cold_run = COLD_BATCHES
        return out

    def ask_for(self, keys: Sequence[bytes]) -> None:
        """Ask for the pages of the values of ``keys`` that lie on pages of their own before
        reading them: a value of many pages (the labels, the names) then comes from the disk
        in a few large reads, not one read a page as LMDB's lookup faults it in."""
        self._announce(keys)

    def _announce(self, keys: Sequence[bytes]) -> bool | None:
        """Ask for the pages of the values of ``keys`` that lie on pages of their own, each
        value whole, before LMDB's lookup touches them (see "read-ahead"). Whether
        every page of the descent to them and the first and last page of each were in memory
        already (None: it cannot be known)."""
        entry = self.entry
        fd, span = entry.fd, entry.span
        if fd is None or entry.writable:
            return None
        lo, hi = span if span is not None else (0, 0)  # (no span: nothing can be known)

        def resident(offset: int) -> bool | None:
            return _resident(lo + offset) if lo + offset < hi else None

        try:
            places, in_memory = lmdb_file.value_places(fd, keys, resident)
            for offset, n in places:
                lmdb_file.ask(fd, offset, n)
        except OSError:  # advice only
            return None
        return in_memory

    def read(self, fn: Callable[[Any], T], where: str) -> T:
        """``fn(txn)`` in a read transaction (``buffers=True``), begun again in a new one when
        an append began while it read: then the pages it read may have been reused, and what
        it copied is not trusted, nor an error it met (see "appends"). ``fn`` copies what it
        keeps out of the transaction."""
        entry = self.entry
        for _ in range(READ_ATTEMPTS):
            view = entry.epoch_view  # (read inline: this is on every read's path)
            before = view[0] if view is not None else entry.epoch()
            try:
                txn = self.env.begin(buffers=True)
                try:
                    out = fn(txn)
                finally:
                    txn.abort()  # a read transaction: nothing to commit
            except lmdb.Error as exc:
                if entry.epoch() != before or entry.grown():
                    continue
                raise StoreError(
                    f"{where}: reading failed: {exc}; the store is damaged, run "
                    "`fastdata verify` on it"
                ) from None
            except FastdataError:
                if entry.epoch() != before:
                    continue
                raise
            view = entry.epoch_view
            if (view[0] if view is not None else entry.epoch()) == before:
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
            at = address(raw)
            while at < entry.span[0] or at + n > entry.span[1]:
                if not entry.grown():
                    raise _damage(where, f"its value ({n} bytes) lies outside the file")
            if self._ahead is not None:
                self._advise(at - entry.span[0], n)
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
            f"{path}: no LMDB store here; create one with "
            f"`fastdata convert IMAGE_FOLDER {shlex.quote(path)}`"
        )
    data_file = _data_file(path)
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
            env = _open_for_reading(path, data_file)
            if _file_key(data_file)[0] != key:  # replaced between the check and the open
                env.close()
                continue
            fd = _open_fd(data_file, key)
            if fd is None:  # (replaced since, or gone)
                env.close()
                continue
            entry = _Env(key, path, env, False, _span(key, size), size, fd)
            try:
                entry.epoch_map, entry.epoch_view = _map_epoch(fd, head.psize)
            except (OSError, ValueError) as exc:
                entry.close()
                raise StoreError(f"{data_file}: cannot map its first page: {exc}") from None
            entry.cover()
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
            lmdb_file.check_file(data_file, for_lmdb=True)
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


@contextmanager
def _reading(where: str) -> Iterator[None]:
    """LMDB's own errors on a damaged file, as a StoreError naming the store."""
    try:
        yield
    except lmdb.Error as exc:
        raise StoreError(
            f"{where}: reading failed: {exc}; the store is damaged, run `fastdata verify` on it"
        ) from None
