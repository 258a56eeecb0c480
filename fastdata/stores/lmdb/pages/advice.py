"""Kernel advice, in one place: what is asked of the kernel about a file's pages before they are
read (``posix_fadvise``), about this process's map of it (``madvise``, ``mincore``), and the
read-ahead of a full check (a thread that streams the file into the page cache ahead of it).
Advice only: a request refused changes nothing but the speed."""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import sys
import threading
from contextlib import suppress
from typing import Any

ASK_MOST = 128 << 10
"""The most bytes asked for in one request. The kernel reads no more for one than the larger of
the device's read-ahead and its largest transfer (128 KiB by default), and drops the rest."""
PREFETCH_GAP = 16
"""Pages this close together are asked for as one run (the pages between come along), where the
run spans at most twice as many pages as it holds."""
AHEAD = 64 << 20
"""How far past the furthest page a walk has read the file is read ahead of it (bounded, so
that a store larger than memory does not push out pages the walk has yet to read)."""
AHEAD_CHUNK = 4 << 20


def ask(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to read ``n`` bytes of the file from ``offset`` now, without waiting for
    them (in requests of at most :data:`ASK_MOST`). A request refused ends it."""
    if not hasattr(os, "posix_fadvise"):
        return
    end = offset + n
    with suppress(OSError):
        while offset < end:
            os.posix_fadvise(fd, offset, min(ASK_MOST, end - offset), os.POSIX_FADV_WILLNEED)
            offset += ASK_MOST


def random_access(fd: int) -> None:
    """Ask the kernel not to read ahead of what is read through ``fd`` (POSIX_FADV_RANDOM)."""
    if hasattr(os, "posix_fadvise"):
        with suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def prefetch(fd: int, pages: list[int], psize: int) -> None:
    """Ask for pages now, in runs, while a walk goes on: one page at a time, a cold file's walk
    waits for the disk once per page. What is asked for is at most about twice the pages
    themselves, however a damaged branch spreads them."""
    pages = sorted(set(pages))
    run = [pages[0]]
    for page in [*pages[1:], None]:
        if page is not None and page - run[-1] <= PREFETCH_GAP:
            run.append(page)
            continue
        span = run[-1] - run[0] + 1
        if span <= 2 * len(run):
            ask(fd, run[0] * psize, span * psize)
        else:
            for one in run:
                ask(fd, one * psize, psize)
        if page is not None:
            run = [page]


_libc: Any = None


def c_library() -> Any:
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


def madvise(address: int, length: int, advice: int) -> None:
    """Give the kernel ``advice`` about a range of this process's map; a no-op where it cannot."""
    libc = c_library()
    if not libc:
        return
    start = address - address % mmap.PAGESIZE
    libc.madvise(start, address + length - start, advice)  # (its failure is harmless)


def resident(address: int) -> bool | None:
    """Whether the page of this process's map at ``address`` is in memory (None: unknown)."""
    libc = c_library()
    if not libc:
        return None
    vec = ctypes.create_string_buffer(1)
    if libc.mincore(address - address % mmap.PAGESIZE, 1, vec) != 0:
        return None
    return bool(vec.raw[0] & 1)


def resident_pages(base: int, pages: list[int], psize: int) -> list[bool]:
    """Whether each of ``pages`` (numbers of ``psize`` bytes from ``base``, an address of this
    process's map) is in memory: the kernel asked once for each stretch of at most
    :data:`RESIDENT_SPAN_MOST` pages they lie in with no gap of more than
    :data:`RESIDENT_GAP_MOST` between them (a file's leaves in key order mostly lie in one); False
    where it cannot tell. (The kernel looks up every page of a stretch asked about, about 0.15 us
    each where this process has not touched it: a stretch of 65,536 pages to learn of a few
    spread over it took 10 ms, a call for each of them about 1 us.)"""
    libc = c_library()
    if not libc or not pages:
        return [False] * len(pages)
    per = psize // mmap.PAGESIZE or 1
    stretch = max(1, RESIDENT_SPAN_MOST // per)
    gap = max(1, RESIDENT_GAP_MOST // per)
    held: dict[int, bool] = {}
    ordered = sorted(set(pages))
    vec = ctypes.create_string_buffer(stretch * per)  # (one answer's room, for every call)
    answer = memoryview(vec).cast("B")
    mincore = libc.mincore
    at = 0
    while at < len(ordered):
        low = ordered[at]
        end = at + 1
        while (
            end < len(ordered)
            and ordered[end] - low < stretch
            and ordered[end] - ordered[end - 1] <= gap
        ):
            end += 1
        span = (ordered[end - 1] - low + 1) * per
        if mincore(base + low * psize, span * mmap.PAGESIZE, vec) != 0:
            return [False] * len(pages)
        for page in ordered[at:end]:
            held[page] = bool(answer[(page - low) * per] & 1)
        at = end
    return [held[page] for page in pages]


RESIDENT_SPAN_MOST = 1 << 16
"""The most pages :func:`resident_pages` asks about at once (its answer: a byte a page)."""
RESIDENT_GAP_MOST = 8
"""The most pages between two that :func:`resident_pages` asks about in one call (about what
a call costs beyond the pages asked)."""


class ReadAhead:
    """A thread that reads the file in order from where a walk began reading leaves, up to
    :data:`AHEAD` bytes past where it is, so that the disk streams at its own speed while the
    walk checks what it has read (the walk's reads then find the page cache filled). It stops
    at the end of the file or when :meth:`stop` is called; a failed read ends it (the walk
    reads for itself)."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._start, self._end = start, end
        self._until = start + AHEAD
        self._stopped = False
        self._moved = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="fastdata-read-ahead", daemon=True)
        self._thread.start()

    def advance(self, offset: int) -> None:
        """The walk has read as far as ``offset``."""
        with self._moved:
            self._until = offset + AHEAD
            self._moved.notify()

    def stop(self) -> None:
        with self._moved:
            self._stopped = True
            self._moved.notify()
        self._thread.join()
        os.close(self._fd)

    def _run(self) -> None:
        sink = Sink()
        try:
            offset = self._start
            while offset < self._end:
                with self._moved:
                    while offset >= self._until and not self._stopped:
                        self._moved.wait()
                    if self._stopped:
                        return
                try:
                    got = sink.read(self._fd, offset)
                except OSError:
                    return
                if got <= 0:
                    return
                offset += got
        finally:
            sink.close()


class Sink:
    """Reads a file a chunk at a time into the page cache and nowhere else: sent to the null
    device (``sendfile``, where the system has it: the kernel reads the pages and copies
    nothing), else read into one buffer, over and over."""

    def __init__(self) -> None:
        self._null = -1
        self._view: memoryview | None = None
        if sys.platform == "linux" and hasattr(os, "sendfile"):
            with suppress(OSError):
                # the null device itself, checked before it is opened (opening some devices
                # does something, a FIFO would block) and after: never a file, a terminal or
                # anything else standing at its path, which would be sent the whole store
                if _is_null(os.stat(os.devnull)):
                    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
                    null = os.open(os.devnull, flags)
                    if _is_null(os.fstat(null)):
                        self._null = null
                    else:
                        os.close(null)

    def read(self, fd: int, offset: int) -> int:
        """Bytes read from ``offset`` (at most :data:`AHEAD_CHUNK`; 0 at the end)."""
        if self._null >= 0:
            try:
                return os.sendfile(self._null, fd, offset, AHEAD_CHUNK)
            except OSError:  # (a system whose null device takes no pages: read them)
                os.close(self._null)
                self._null = -1
        if self._view is None:
            self._view = memoryview(bytearray(AHEAD_CHUNK))
        return os.preadv(fd, [self._view], offset)

    def close(self) -> None:
        if self._null >= 0:
            os.close(self._null)
            self._null = -1


def _is_null(st: os.stat_result) -> bool:
    """Whether ``st`` is Linux's null device (character device 1, 3)."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
