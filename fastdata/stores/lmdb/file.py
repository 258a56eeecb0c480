"""LMDB's on-disk layout, read without LMDB: the only place that knows it.

LMDB maps ``data.mdb`` into memory and follows the page numbers it finds there. A file cut short
(an interrupted copy, a full disk) or a damaged page makes it touch memory past the end of the
file, which kills the process with SIGBUS or SIGSEGV instead of raising an error. So nothing is
handed to LMDB before the file's header has been checked here against the file's size, and
``fastdata verify`` walks every page of the B-tree here, with ``pread`` (never mapped), where
damage is an error.

Layout (LMDB 0.9, 64-bit, little-endian): pages of ``psize`` bytes; pages 0 and 1 are meta pages,
the one with the larger transaction id is current. Each page starts with a 16-byte header
(page number, flags, lower/upper bounds or overflow page count).
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
import sys
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from ...errors import StoreError

__all__ = [
    "SLACK",
    "Damage",
    "Header",
    "Leaves",
    "Tree",
    "check_file",
    "pad",
    "value_places",
    "walk",
]

MAGIC = 0xBEEFC0DE
PAGE_HEADER = 16
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
NODE_HEADER = 8
DB_RECORD = 48
"""The size of the record of a named database (LMDB's MDB_db), the value of its node."""
NAMED = -2
"""The first overflow page :func:`_check_page` gives the node of a named database."""
SLACK = 128 << 10
"""Zero bytes kept after the last page of a finished store: LMDB reading a damaged page near the
end of the file then reads zeros (and reports the page as corrupt) instead of faulting."""


@dataclass(frozen=True)
class Header:
    """The current meta page's facts."""

    psize: int
    last_page: int
    txnid: int
    root: int
    depth: int
    entries: int

    @property
    def used_bytes(self) -> int:
        return (self.last_page + 1) * self.psize


def _damaged(path: str, what: str) -> StoreError:
    return StoreError(
        f"{path}: damaged LMDB file: {what}; run `fastdata verify` on the store, then convert it "
        "again (or copy it again, if it was copied)"
    )


def _meta(page: bytes) -> Header | None:
    if len(page) < 152 or struct.unpack_from("<I", page, 16)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", page, 40)[0]
    depth = struct.unpack_from("<H", page, 94)[0]
    entries, root = struct.unpack_from("<QQ", page, 120)
    last_page, txnid = struct.unpack_from("<QQ", page, 136)
    return Header(psize, last_page, txnid, root, depth, entries)


def _metas(fd: int) -> tuple[Header | None, Header | None]:
    """The first meta page's facts (None: no LMDB header) and the current meta page's, the one
    of the two with the larger transaction id (None: the first's page size is none LMDB
    writes, so the second cannot be found)."""
    head = _meta(os.pread(fd, 160, 0))
    if head is None or head.psize & (head.psize - 1) or not 512 <= head.psize <= 65536:
        return head, None
    second = _meta(os.pread(fd, 160, head.psize))
    return head, max((m for m in (head, second) if m is not None), key=lambda m: m.txnid)


def check_file(path: str, *, for_lmdb: bool = False) -> Header:
    """Check an LMDB data file's header against its size before anything maps it; ``for_lmdb``
    (before LMDB maps it), its root page too: LMDB asserts that a branch has two or more
    nodes, and an assertion stops the whole process (``abort``), whatever the caller would
    have done with an error (a branch deeper down is named by :class:`Tree`'s walk, as any
    damaged page).

    Raises:
        StoreError: unreadable, not an LMDB file, shorter than its header says (truncated), or
            (``for_lmdb``) a root that is a branch of fewer than two nodes.
    """
    try:
        # (without blocking: opening a FIFO for reading waits for a writer, forever)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StoreError(f"{path}: not a regular file, so not an LMDB data file")
            size = info.st_size
            head, current = _metas(fd)
            if head is None:
                raise _damaged(path, "no LMDB header (not an LMDB data file, or overwritten)")
            if current is None:
                raise _damaged(path, f"page size {head.psize} in its header")
            root = b""
            if for_lmdb and current.psize == head.psize and current.root != P_INVALID:
                root = os.pread(fd, PAGE_HEADER, current.root * head.psize)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if current.psize != head.psize or current.last_page < 1:
        raise _damaged(path, "inconsistent meta pages")
    if size < current.used_bytes:
        raise StoreError(
            f"{path}: the file is truncated: {size} bytes, but its last page ends at byte "
            f"{current.used_bytes} (an interrupted copy or a full disk); copy or convert the "
            "store again"
        )
    if current.root != P_INVALID and not 2 <= current.root <= current.last_page:
        raise _damaged(path, f"root page {current.root} outside the file")
    if len(root) == PAGE_HEADER:
        _, _, flags, lower, _ = _PAGE.unpack_from(root, 0)
        if flags & P_BRANCH and lower < PAGE_HEADER + 4:
            count = max(0, (lower - PAGE_HEADER) // 2)
            raise _damaged(path, f"root page {current.root} is a branch of {count} node(s)")
    return current


def pad(path: str) -> None:
    """Make sure :data:`SLACK` zero bytes follow the last page (a sparse extension)."""
    head = check_file(path)
    want = head.used_bytes + SLACK
    if os.path.getsize(path) < want:
        os.truncate(path, want)


@dataclass(frozen=True)
class Damage:
    """A damaged page of the B-tree, and the range of keys that live under it.

    Attributes:
        page: the page number.
        what: what is wrong with it.
        low: the smallest key that may live under it (None: from the first key).
        high: the first key past it (None: to the last key).
    """

    page: int
    what: str
    low: bytes | None
    high: bytes | None

    def covers(self, key: bytes) -> bool:
        return (self.low is None or key >= self.low) and (self.high is None or key < self.high)

    def __str__(self) -> str:
        low = self.low.decode("ascii", "replace") if self.low is not None else "the first key"
        if self.low is not None and self.high == self.low + b"\0":  # (one value's own pages)
            return f"page {self.page} (the value of key {low}): {self.what}"
        high = self.high.decode("ascii", "replace") if self.high is not None else "the last key"
        return f"page {self.page} (keys {low} to {high}): {self.what}"


_Bounds = tuple[int, int, "bytes | None", "bytes | None"]
_Item = tuple[bytes, int, int, int]
"""A leaf entry: its key, where its value starts on the page, its size, and its first overflow
page (-1: the value is on the page)."""
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_PAGE = struct.Struct("<QHHHH")
_OFFSETS: dict[int, struct.Struct] = {}
"""The array of a page's node offsets, by its length (a page holds at most psize / 2 of them)."""
_OVERFLOW = struct.Struct("<QHHI")


def walk(path: str, *, limit: int = 100) -> list[Damage]:
    """Check every page of the main B-tree, reading the file directly; return what is wrong
    (at most ``limit`` damaged pages; see :class:`Tree`).

    Raises:
        StoreError: the file's header is damaged or the file is truncated (nothing to walk).
    """
    with Tree(path, limit=limit) as tree:
        for _ in tree.entries(values=False):
            pass
        return tree.damage


class Tree:
    """The main B-tree of an LMDB data file, read directly with ``pread`` (never mapped), so
    that damage is an error and not a fault: what ``fastdata verify`` reads, in one pass.

    Every branch and leaf page reached is checked: its page number and type, its bounds, every
    node's offset and key length, every child page and overflow run within the file; a value's
    overflow pages are checked too when it is read. The leaves under a branch page are read
    with a call per run of consecutive pages and checked side by side with numpy; where any of
    them fails a check or is out of the ordinary, they are walked a page at a time, which names
    what is wrong (so the entries and the damage found are the same either way). A damaged
    page's subtree is not followed; its damage names the keys it holds. The first ``limit``
    damaged pages are listed in :attr:`damage`; :attr:`more` counts the rest.

    Raises:
        StoreError: the file's header is damaged or the file is truncated.
    """

    def __init__(self, path: str, *, limit: int = 100) -> None:
        self.path = path
        self.head = check_file(path)
        self.limit = limit
        self.found: list[Damage] = []
        """Every damaged page found, in the order found."""
        self._seen: set[Damage] = set()
        self.databases: list[tuple[bytes, int]] = []
        """The named databases (sub-databases) found in the main tree, which fastdata stores
        have none of: their names and the leaf pages that hold them, in the order found. Their
        nodes are not entries, and their own trees are not walked."""
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._ahead: _ReadAhead | None = None
        self._reached = 0
        """The furthest byte a walk has read."""

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def file_key(self) -> tuple[int, int]:
        """The file read: its device and inode."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    @property
    def damage(self) -> list[Damage]:
        return self.found[: self.limit]

    @property
    def more(self) -> int:
        return max(0, len(self.found) - self.limit)

    def covering(self, key: bytes) -> Damage | None:
        """The damaged page under which ``key`` would lie, if one was found (the latest first:
        a walk in key order finds the damage over a key just before it would have reached it, so
        a badly damaged file's long list is not gone through for every key it hides)."""
        return next((d for d in reversed(self.found) if d.covers(key)), None)

    def _damaged(self, page: int, what: str, low: bytes | None, high: bytes | None) -> None:
        damage = Damage(page, what, low, high)
        if damage not in self._seen:  # (a page above the ranges of two walks is met by both)
            self._seen.add(damage)
            self.found.append(damage)

    def entries(
        self, low: bytes | None = None, high: bytes | None = None, *, values: bool = True
    ) -> Iterator[tuple[bytes, bytes | memoryview | None]]:
        """The leaf entries whose keys lie in ``[low, high)`` (every one by default), in key
        order, as ``(key, value)``. The value is None with ``values=False``, and for an entry
        whose overflow pages are damaged (then listed as damage). Entries under a damaged page
        are not given (the damage names their keys). Subtrees outside the range are not read,
        so their damage is found only by a walk whose range they are in."""
        for run in self.leaves(low, high):
            if not values:
                for key in run.keys:
                    yield key, None
                continue
            for j, key in enumerate(run.keys):
                yield key, self.value(run, j)

    def value(self, run: Leaves, j: int) -> bytes | memoryview | None:
        """The value of ``run``'s entry ``j`` (None if its overflow pages are damaged)."""
        first = int(run.firsts[j])
        start, size = int(run.starts[j]), int(run.sizes[j])
        if first < 0:
            return run.buf[start : start + size]
        return self._overflow(first, size, run.keys[j])

    def leaves(self, low: bytes | None = None, high: bytes | None = None) -> Iterator[Leaves]:
        """The leaf entries whose keys lie in ``[low, high)``, as :meth:`entries` gives them,
        a run of them at a time: the leaves under one branch page, checked side by side
        (:func:`_check_leaves`), or one leaf page where they cannot be (then checked alone)."""
        head = self.head
        if head.root == P_INVALID:
            return
        psize, last, fd = head.psize, head.last_page, self._fd
        ahead = head.used_bytes > 2 * AHEAD and hasattr(os, "preadv")
        mark = -1  # (the read-ahead is moved on once a chunk of leaves is read)
        seen = bytearray((last >> 3) + 1)
        seen_bits = np.frombuffer(seen, np.uint8)  # (the same bytes, for the pages checked
        # side by side)
        stack: list[_Bounds] = [(head.root, 0, None, None)]
        items: list[_Item] = []
        above_leaves = head.depth - 2  # (a branch at this level has leaves for children, when
        # the header tells the truth: when it does not, the leaves' check fails and they are
        # walked one at a time)
        while stack:
            number, level, lo, hi = stack.pop()
            if (low is not None and hi is not None and hi <= low) or (
                high is not None and lo is not None and lo >= high
            ):
                continue
            bit = 1 << (number & 7)
            again = seen[number >> 3] & bit or level > 64
            seen[number >> 3] |= bit
            pushed = len(stack)
            data = os.pread(fd, psize, number * psize)
            if level == above_leaves and level < 64 and not again:  # (a leaf deeper than 64
                # is taken for a loop, by the walk a page at a time)
                run = self._leaves_under(data, number, lo, hi, seen_bits, low, high)
                if run is not None:
                    top = run.reached * psize
                    if ahead and top > mark:
                        mark = self._read_ahead(top) + AHEAD_CHUNK
                    if len(run):
                        yield run
                    continue
            items.clear()
            what = _check_page(data, number, last, level, lo, hi, stack, items)
            if again:  # (its keys are checked against this place in the tree first, so that a
                # page two branches point to is named alike by any walk that reaches it)
                del stack[pushed:]
                what = what or "reached twice (a loop in the tree)"
            if what:
                self._damaged(number, what, lo, hi)
                continue
            if len(stack) > pushed:
                _prefetch(fd, [c[0] for c in stack[pushed:]], psize)
                continue
            if ahead and number * psize > mark:
                mark = self._read_ahead(number * psize) + AHEAD_CHUNK
            inside = (low is None or (lo is not None and lo >= low)) and (
                high is None or (hi is not None and hi <= high)
            )
            if not inside:
                items[:] = [
                    item
                    for item in items
                    if (low is None or item[0] >= low) and (high is None or item[0] < high)
                ]
            if any(item[3] == NAMED for item in items):
                self.databases += [(item[0], number) for item in items if item[3] == NAMED]
                items[:] = [item for item in items if item[3] != NAMED]
            if items:
                keys, starts, sizes, firsts = zip(*items, strict=True)
                yield Leaves(data, _rows(keys), starts, sizes, firsts, number, list(keys))

    def _leaves_under(
        self,
        data: bytes,
        number: int,
        lo: bytes | None,
        hi: bytes | None,
        seen: np.ndarray,
        low: bytes | None,
        high: bytes | None,
    ) -> Leaves | None:
        """The entries in ``[low, high)`` under a branch page whose children are leaves (its
        bytes ``data``, its key bounds ``lo`` and ``hi``): its children read with a call per
        run of consecutive pages, and all checked side by side (:func:`_check_branch`,
        :func:`_check_leaves`). None, with nothing marked as seen, where any of them is out of
        the ordinary or fails a check: they are then walked a page at a time, which names what
        is wrong."""
        psize = self.head.psize
        branch = _check_branch(data, number, self.head.last_page, lo, hi)
        if branch is None:
            return None
        children, keys = branch
        at = _KeyAt(keys.tobytes(), keys.shape[1], len(keys))
        # the children whose keys may lie in the range: child j holds keys[j - 1] .. keys[j]
        a = 0 if low is None else bisect_right(at, low)
        b = len(children) if high is None else bisect_left(at, high) + 1
        if a >= b:
            return Leaves(b"", None, (), (), (), 0, [])
        numbers = children[a:b]
        byte, bit = numbers >> 3, np.left_shift(1, numbers & 7).astype(np.uint8)
        if (seen[byte] & bit).any() or len(np.unique(numbers)) != len(numbers):
            return None  # (reached before: a loop, for the walk one page at a time to name)
        buf = bytearray(len(numbers) * psize)  # (a short read leaves zeros: no page passes)
        view = memoryview(buf)
        edges = [0, *(np.flatnonzero(np.diff(numbers) != 1) + 1).tolist(), len(numbers)]
        for c, d in itertools.pairwise(edges):
            os.preadv(self._fd, [view[c * psize : d * psize]], int(numbers[c]) * psize)
        first_low = lo if a == 0 else at[a - 1]
        last_high = hi if b == len(children) else at[b - 1]
        run = _check_leaves(
            buf, numbers, keys[a : b - 1], first_low, last_high, psize, self.head.last_page
        )
        if run is None:
            return None
        np.bitwise_or.at(seen, byte, bit)
        assert run.rows is not None
        got = _KeyAt(run.rows.tobytes(), run.rows.shape[1], len(run))
        c = 0 if low is None else bisect_left(got, low)
        d = len(run) if high is None else bisect_left(got, high)
        return run if (c, d) == (0, len(run)) else run.cut(c, d)

    def _read_ahead(self, offset: int) -> int:
        """A walk has read a leaf at ``offset``: the read-ahead begins there, or moves on."""
        if self._ahead is None:
            self._ahead = _ReadAhead(self.path, offset, self.head.used_bytes)
        self._reached = max(self._reached, offset)
        self._ahead.advance(self._reached)
        return self._reached

    def values(self, run: Leaves, a: int, b: int) -> list[bytes | memoryview | None]:
        """The values of ``run``'s entries from ``a`` on, as :meth:`value` gives each, up to
        ``b`` or to the first whose pages are damaged (None, last), or fewer. Values on pages
        of their own that follow one another in the file (values within the leaves between
        them aside) are read with one call per stretch of them (at most
        :data:`STRETCH_BYTES`), their pages' headers checked side by side; the values end
        before the first that fails a check, or with it read alone (which names what is wrong)
        where it is the first."""
        out: list[bytes | memoryview | None] = []
        if b <= a:
            return out
        psize = self.head.psize
        firsts = np.asarray(run.firsts[a:b], np.int64)
        sizes = np.asarray(run.sizes[a:b], np.int64)
        pages = (sizes + PAGE_HEADER + psize - 1) // psize
        own = np.flatnonzero((firsts >= 0) & (pages * psize <= STRETCH_BYTES))
        # where a stretch must end: a value that does not begin where the last one ended
        breaks = (
            np.flatnonzero(firsts[own[1:]] != firsts[own[:-1]] + pages[own[:-1]]) + 1
        ).tolist()
        reach = np.cumsum(pages[own]) * psize  # (bytes of own[0 .. k], for the cap)
        own_at = own.tolist()
        ready: dict[int, memoryview] = {}
        failed = -1
        at = 0  # (the next of own not read yet)
        for j in range(b - a):
            if j not in ready and j != failed:
                end = at
                if at < len(own) and own_at[at] == j:  # j is the next value of its own
                    k = bisect_right(breaks, at)
                    end = breaks[k] if k < len(breaks) else len(own)
                    if end > at + 1:
                        done = int(reach[at - 1]) if at else 0
                        cap = int(np.searchsorted(reach, done + STRETCH_BYTES, side="right"))
                        end = max(at + 1, min(end, cap))
                if end > at + 1:  # a stretch of two or more begins here
                    members = own[at:end]
                    got = self._stretch(firsts[members], sizes[members], pages[members])
                    ready.update(zip(members[: len(got)].tolist(), got, strict=True))
                    if len(got) < len(members):
                        failed = int(members[len(got)])
                    at = end
                else:  # (within its leaf, larger than a stretch, or a stretch of one: alone,
                    # the cheaper way)
                    at = end
                    value = self.value(run, a + j)
                    out.append(value)
                    if value is None:
                        return out
                    continue
            if j == failed:
                if not out:
                    out.append(self.value(run, a + j))
                return out
            out.append(ready.pop(j))
        return out

    def _stretch(
        self, firsts: np.ndarray, sizes: np.ndarray, pages: np.ndarray
    ) -> list[memoryview]:
        """Values on pages of their own, one after the other in the file (their first pages,
        sizes and page counts): read in one call, each checked as :meth:`_overflow` checks
        one; those before the first that fails a check."""
        psize = self.head.psize
        first = int(firsts[0])
        data = os.pread(self._fd, int(pages.sum()) * psize, first * psize)
        at = (firsts - first) * psize
        whole = at + pages * psize <= len(data)
        fields = np.zeros(len(at), _OVERFLOW_DTYPE)
        fields[whole] = (
            np.frombuffer(data, np.uint8)[at[whole][:, None] + _OVERFLOW_BYTES]
            .view(_OVERFLOW_DTYPE)
            .ravel()
        )
        sound = (
            whole
            & (fields["pgno"] == firsts)
            & (fields["flags"] & P_OVERFLOW != 0)
            & (fields["count"] == pages)
        )
        n = len(sound) if sound.all() else int(sound.argmin())
        view = memoryview(data)
        starts = (at[:n] + PAGE_HEADER).tolist()
        return [
            view[start : start + size]
            for start, size in zip(starts, sizes[:n].tolist(), strict=True)
        ]

    def _overflow(self, first: int, size: int, key: bytes) -> memoryview | None:
        """The value of ``size`` bytes on the overflow pages from ``first`` (checked to lie in
        the file by the leaf that points at them); None if their header is damaged."""
        psize = self.head.psize
        pages = -(-(size + PAGE_HEADER) // psize)
        # the first page alone first: a size that lies is caught by the page count there before
        # anything is allocated for it
        run = os.pread(self._fd, psize, first * psize)
        what = ""
        if len(run) < psize:
            what = "past the end of the file"
        else:
            pgno, _pad, flags, count = _OVERFLOW.unpack_from(run, 0)
            if pgno != first:
                what = f"damaged (its header says page {pgno})"
            elif not flags & P_OVERFLOW or count != pages:
                what = (
                    f"damaged (flags {flags:#x}, {count} pages: not the overflow run of a value "
                    f"of {size} bytes)"
                )
        if not what and pages > 1:
            run += os.pread(self._fd, (pages - 1) * psize, (first + 1) * psize)
            if len(run) < PAGE_HEADER + size:
                what = "past the end of the file"
        if what:
            self._damaged(first, what, key, key + b"\0")
            return None
        return memoryview(run)[PAGE_HEADER : PAGE_HEADER + size]


STRETCH_BYTES = 1 << 20
"""The most bytes of values on pages of their own that a check reads in one call (a value larger
than this is read alone)."""
_OVERFLOW_BYTES = np.arange(PAGE_HEADER)
_OVERFLOW_DTYPE = np.dtype([("pgno", "<u8"), ("pad", "<u2"), ("flags", "<u2"), ("count", "<u4")])

AHEAD = 64 << 20
"""How far past the furthest page a walk has read the file is read ahead of it (bounded, so
that a store larger than memory does not push out pages the walk has yet to read)."""
AHEAD_CHUNK = 4 << 20


class _ReadAhead:
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
        sink = _Sink()
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


class _Sink:
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


PREFETCH_GAP = 16
"""Child pages this close together are asked for as one run (the pages between come along),
where the run spans at most twice as many pages as it holds."""

ASK_MOST = 128 << 10
"""The most bytes asked for in one request. The kernel reads no more for one than the larger of
the device's read-ahead and its largest transfer (128 KiB by default), and drops the rest."""


def ask(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to read ``n`` bytes of the file from ``offset`` now, without waiting for
    them (in requests of at most :data:`ASK_MOST`). Advice only: a request refused ends it."""
    if not hasattr(os, "posix_fadvise"):
        return
    end = offset + n
    with suppress(OSError):
        while offset < end:
            os.posix_fadvise(fd, offset, min(ASK_MOST, end - offset), os.POSIX_FADV_WILLNEED)
            offset += ASK_MOST


def _prefetch(fd: int, pages: list[int], psize: int) -> None:
    """Ask the kernel to read a branch page's children now, in runs, while the walk goes on:
    one page at a time, a cold file's walk waits for the disk once per page. What is asked for
    is at most about twice the pages themselves, however a damaged branch spreads them."""
    pages = sorted(set(pages))
    run = [pages[0]]
    for page in pages[1:]:
        if page - run[-1] > PREFETCH_GAP:
            _ask_run(fd, run, psize)
            run = [page]
        else:
            run.append(page)
    _ask_run(fd, run, psize)


def _ask_run(fd: int, run: list[int], psize: int) -> None:
    """Pages ``run`` (ascending, each within PREFETCH_GAP of the last) asked for: as one span
    where it is at most twice as long as the pages it holds, else each page alone."""
    span = run[-1] - run[0] + 1
    if span <= 2 * len(run):
        ask(fd, run[0] * psize, span * psize)
        return
    for page in run:
        ask(fd, page * psize, psize)


def value_places(
    fd: int, keys: Sequence[bytes], resident: Callable[[int], bool | None] | None = None
) -> tuple[list[tuple[int, int]], bool | None]:
    """Where the values of ``keys`` that lie on pages of their own (LMDB's overflow pages) are
    in the file, as ``(offset, size)``, found as LMDB finds them, down the tree from the
    current root, with ``pread``; each level's pages are asked for together first (one request
    per run, all in flight at once). This is what lets a reader ask for a value's pages before
    LMDB touches them: LMDB's lookup faults them in one page at a time, a read from the disk
    each on a cold store.

    Advice only: anything out of the ordinary (a page not what its parent says, a node outside
    its page, a key not there, a value outside the file) ends the search under it, silently;
    the lookup itself checks and names it. Every place given lies inside the file.

    ``resident(offset)`` (whether the file's page at ``offset`` is in memory, None: unknown) is
    asked of every page of the descent before it is read, and of each value's first and last
    page: the second result is whether all of them were (None: unknown, or nothing asked)."""
    places: list[tuple[int, int]] = []
    seen: set[bool | None] = set()

    def note(offset: int) -> None:
        if resident is not None and False not in seen:  # (one from the disk decides)
            seen.add(resident(offset))

    def in_memory() -> bool | None:
        return False if False in seen else (True if seen == {True} else None)

    try:
        size = os.fstat(fd).st_size
        head, current = _metas(fd)
        if head is None or current is None:
            return places, None
        psize = head.psize
        last = min(current.last_page, size // psize - 1)
        level = {current.root: sorted(set(keys))} if 2 <= current.root <= last else {}
        for _ in range(CURSOR_DEPTH):  # (deeper, LMDB gives up too: a loop)
            if not level:
                break
            numbers = sorted(level)
            for number in numbers:
                note(number * psize)
            if len(numbers) > 1:
                _prefetch(fd, numbers, psize)
            below: dict[int, list[bytes]] = {}
            for number in numbers:
                page = os.pread(fd, psize, number * psize)
                if len(page) == psize:
                    _places_on(page, number, level[number], last, size, below, places)
            level = {child: found for child, found in below.items() if 2 <= child <= last}
    except OSError:
        pass
    for offset, n in places:
        note(offset)
        note(offset + n - 1)
    return places, in_memory()


CURSOR_DEPTH = 32
"""The deepest path LMDB's cursor follows from the root (its CURSOR_STACK)."""


def _places_on(
    page: bytes,
    number: int,
    keys: list[bytes],
    last: int,
    size: int,
    below: dict[int, list[bytes]],
    places: list[tuple[int, int]],
) -> None:
    """One page of :func:`value_places`' descent: a branch's children (with the keys under
    each) into ``below``, a leaf's places of ``keys`` into ``places``."""
    psize = len(page)
    pgno, _pad, flags, lower, upper = _PAGE.unpack_from(page, 0)
    kind = flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
    if pgno != number or kind not in (P_BRANCH, P_LEAF) or not PAGE_HEADER <= lower <= upper:
        return
    count = (lower - PAGE_HEADER) // 2
    if upper > psize or count < 1:
        return
    offsets = struct.unpack_from(f"<{count}H", page, PAGE_HEADER)
    if min(offsets) < upper or max(offsets) > psize - NODE_HEADER:
        return
    nodes = _NodeKeys(page, offsets)
    try:
        if kind == P_BRANCH:
            for key in keys:
                lo, hi, top, _ = _NODE.unpack_from(page, offsets[bisect_right(nodes, key, 1) - 1])
                below.setdefault(lo | (hi << 16) | (top << 32), []).append(key)
            return
        for key in keys:
            j = bisect_left(nodes, key)
            if j == count or nodes[j] != key:
                continue
            lo, hi, nflags, ksize = _NODE.unpack_from(page, offsets[j])
            start = offsets[j] + NODE_HEADER + ksize
            if nflags != F_BIGDATA or start + 8 > psize:
                continue  # (a value on the leaf itself: read already)
            first = _PGNO.unpack_from(page, start)[0]
            offset, n = first * psize + PAGE_HEADER, lo | (hi << 16)
            if 2 <= first <= last and offset + n <= size:
                places.append((offset, n))
    except ValueError:  # (a node's key runs past the page)
        return


class _NodeKeys:
    """The keys of a page's nodes, by index, as a sequence (for a binary search)."""

    def __init__(self, page: bytes, offsets: tuple[int, ...]) -> None:
        self.page, self.offsets = page, offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, j: int) -> bytes:
        at = self.offsets[j] + NODE_HEADER
        end = at + _NODE.unpack_from(self.page, self.offsets[j])[3]
        if end > len(self.page):
            raise ValueError("a key past the page")
        return self.page[at:end]


class Leaves:
    """A run of leaf entries in key order, from the pages they were read from.

    Attributes:
        buf: the pages' bytes; an entry's value on its page is ``buf[start : start + size]``.
        rows: the keys, one row each, where they are all one length (None otherwise).
        starts, sizes, firsts: each entry's value: where it starts in ``buf``, its size, and
            its first overflow page (-1: on the page).
        reached: the highest page number read.
    """

    __slots__ = ("_keys", "buf", "firsts", "reached", "rows", "sizes", "starts")

    def __init__(
        self,
        buf: bytes | memoryview,
        rows: np.ndarray | None,
        starts: Sequence[int] | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        firsts: Sequence[int] | np.ndarray,
        reached: int,
        keys: list[bytes] | None = None,
    ) -> None:
        self.buf, self.rows, self.reached = buf, rows, reached
        self.starts, self.sizes, self.firsts = starts, sizes, firsts
        self._keys = keys

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:
            assert self.rows is not None
            flat, width = self.rows.tobytes(), self.rows.shape[1]
            self._keys = [flat[j : j + width] for j in range(0, len(flat), width)]
        return self._keys

    def cut(self, a: int, b: int) -> Leaves:
        """Entries ``a .. b-1``."""
        rows = None if self.rows is None else self.rows[a:b]
        keys = None if self._keys is None else self._keys[a:b]
        return Leaves(
            self.buf,
            rows,
            self.starts[a:b],
            self.sizes[a:b],
            self.firsts[a:b],
            self.reached,
            keys,
        )


class _KeyAt:
    """Fixed-width keys packed in one bytes object, as a sequence (for a binary search)."""

    def __init__(self, flat: bytes, width: int, n: int) -> None:
        self.flat, self.width, self.n = flat, width, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> bytes:
        return self.flat[j * self.width : (j + 1) * self.width]


_PAGE_DTYPES: dict[int, np.dtype] = {}
_NODE_BYTES = np.arange(NODE_HEADER)


def _rows(keys: Sequence[bytes]) -> np.ndarray | None:
    """Keys as :attr:`Leaves.rows`: one row each where they are all one length (None
    otherwise)."""
    width = len(keys[0])
    if not width or any(len(key) != width for key in keys):
        return None
    return np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), width)


def _page_dtype(psize: int) -> np.dtype:
    dtype = _PAGE_DTYPES.get(psize)
    if dtype is None:
        dtype = _PAGE_DTYPES[psize] = np.dtype(
            {
                "names": ["pgno", "flags", "lower", "upper"],
                "formats": ["<u8", "<u2", "<u2", "<u2"],
                "offsets": [0, 10, 12, 14],
                "itemsize": psize,
            }
        )
    return dtype


def _words(rows: np.ndarray) -> np.ndarray:
    """Fixed-width keys (one uint8 row each) as big-endian 64-bit words, zero-padded, which
    compare in the keys' order."""
    n, width = rows.shape
    pad = -width % 8
    if pad:
        rows = np.concatenate([rows, np.zeros((n, pad), np.uint8)], axis=1)
    return np.ascontiguousarray(rows).view(">u8")


def _before(a: np.ndarray, b: np.ndarray, *, strict: bool) -> np.ndarray:
    """Row by row, whether key ``a`` sorts before key ``b`` (or equals it, if not
    ``strict``); both as :func:`_words`."""
    less = np.zeros(len(a), bool)
    same = np.ones(len(a), bool)
    for w in range(a.shape[1]):
        less |= same & (a[:, w] < b[:, w])
        same &= a[:, w] == b[:, w]
    return less if strict else less | same


def _node_headers(flat: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The 8-byte headers of the nodes at ``at`` in ``flat``, as four int64 columns: the low
    and high halves of the value's size (a branch's: of its child), its flags (a branch's: the
    child's top bits) and the key's size."""
    return flat[at[:, None] + _NODE_BYTES].view("<u2").astype(np.int64)


def _ascending(words: np.ndarray) -> bool:
    """Whether the keys (as :func:`_words`) are in strictly ascending order."""
    return bool(_before(words[:-1], words[1:], strict=True).all())


def _check_branch(
    data: bytes, number: int, last: int, low: bytes | None, high: bytes | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """A branch page's children and the keys between them (one row each), checked as
    :func:`_check_page` checks a branch page, all at once; None where any check fails or its
    keys are of different lengths (for :func:`_check_page` to check and name)."""
    psize = len(data)
    if psize < PAGE_HEADER:
        return None
    pgno, _pad, flags, lower, upper = _PAGE.unpack_from(data, 0)
    kind = flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
    if pgno != number or kind != P_BRANCH or not PAGE_HEADER <= lower <= upper <= psize:
        return None
    count = (lower - PAGE_HEADER) // 2
    if (lower - PAGE_HEADER) % 2 or count < 2:
        return None
    off = np.frombuffer(data, "<u2", count, PAGE_HEADER).astype(np.int64)
    if (off < upper).any() or (off > psize - NODE_HEADER).any():
        return None
    flat = np.frombuffer(data, np.uint8)
    node = _node_headers(flat, off)
    children = node[:, 0] | (node[:, 1] << 16) | (node[:, 2] << 32)
    ksize = node[:, 3]
    width = int(ksize[1])
    if (
        (off + NODE_HEADER + ksize > psize).any()
        or (children < 2).any()
        or (children > last).any()
        or width == 0
        or (ksize[1:] != width).any()
    ):
        return None
    # node 0's key is empty: its child begins at the page's low key
    keys = flat[(off[1:] + NODE_HEADER)[:, None] + np.arange(width)]
    if not _ascending(_words(keys)):
        return None
    if (low is not None and keys[0].tobytes() <= low) or (
        high is not None and keys[-1].tobytes() >= high
    ):
        return None
    return children, keys


def _check_leaves(
    buf: bytearray,
    numbers: np.ndarray,
    between: np.ndarray,
    low: bytes | None,
    high: bytes | None,
    psize: int,
    last: int,
) -> Leaves | None:
    """The entries of leaf pages read side by side into ``buf`` (``numbers``, in key order;
    ``between`` the keys their branch puts between them, one row each; ``low`` and ``high`` the
    bounds of the first's keys and the last's), checked as :func:`_check_page` checks a leaf
    page, all at once. None where any check fails or any page is out of the ordinary (keys of
    different lengths, an empty page, flags other than a plain or an overflow value), for the
    page-at-a-time walk to check and name."""
    k = len(numbers)
    pages = np.frombuffer(buf, _page_dtype(psize), count=k)
    if not np.array_equal(pages["pgno"], numbers):
        return None
    kinds = pages["flags"] & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
    lower, upper = pages["lower"].astype(np.int64), pages["upper"].astype(np.int64)
    if (
        (kinds != P_LEAF).any()
        or (lower < PAGE_HEADER + 2).any()  # (an empty leaf: for the walk one at a time)
        or (lower > upper).any()
        or (upper > psize).any()
        or ((lower - PAGE_HEADER) & 1).any()
    ):
        return None
    count = (lower - PAGE_HEADER) >> 1
    most = int(count.max())
    offsets = np.frombuffer(buf, "<u2").reshape(k, psize // 2)[:, 8 : 8 + most]
    row = np.repeat(np.arange(k), count)
    off = offsets[np.arange(most) < count[:, None]].astype(np.int64)
    if (off < upper[row]).any() or (off > psize - NODE_HEADER).any():
        return None
    flat = np.frombuffer(buf, np.uint8)
    at = row * psize + off
    node = _node_headers(flat, at)
    size = node[:, 0] | (node[:, 1] << 16)
    nflags, ksize = node[:, 2], node[:, 3]
    width = int(ksize[0])
    if width == 0 or (ksize != width).any():
        return None
    start = off + NODE_HEADER + width
    big = nflags == F_BIGDATA
    if (~big & (nflags != 0)).any() or (~big & (start + size > psize)).any():
        return None
    firsts = np.full(len(off), -1, np.int64)
    if big.any():
        if (big & (start + 8 > psize)).any():
            return None
        where = (row * psize + start)[big]
        first = flat[where[:, None] + np.arange(8)].view("<u8").ravel()
        if ((first < 2) | (first > last)).any():
            return None
        first = first.astype(np.int64)
        if (first + (size[big] + PAGE_HEADER - 1) // psize > last).any():
            return None
        firsts[big] = first
    keys = flat[(at + NODE_HEADER)[:, None] + np.arange(width)]
    words = _words(keys)
    if not _ascending(words):
        return None
    # each page's keys within the bounds its branch gave it: its first at or after its low
    # bound, its last before its high bound
    ends = np.cumsum(count)
    if k > 1:
        if between.shape[1] != width:
            return None  # (keys of other lengths: for the walk one page at a time)
        bounds = _words(between)
        if not (
            _before(bounds, words[(ends - count)[1:]], strict=False).all()
            and _before(words[ends[:-1] - 1], bounds, strict=True).all()
        ):
            return None
    if (low is not None and keys[0].tobytes() < low) or (
        high is not None and keys[-1].tobytes() >= high
    ):
        return None
    return Leaves(memoryview(buf), keys, row * psize + start, size, firsts, int(numbers.max()))


def _check_page(
    data: bytes,
    number: int,
    last: int,
    level: int,
    low: bytes | None,
    high: bytes | None,
    stack: list[_Bounds],
    items: list[_Item],
) -> str:
    """What is wrong with one tree page ("" if nothing); a branch page's children are pushed,
    a leaf page's entries added to ``items`` (both in key order)."""
    psize = len(data)
    if psize < PAGE_HEADER:
        return "past the end of the file"
    pgno, _pad, flags, lower, upper = _PAGE.unpack_from(data, 0)
    if pgno != number:
        return f"damaged (its header says page {pgno})"
    kind = flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
    if kind not in (P_BRANCH, P_LEAF):
        return f"damaged (flags {flags:#x}, not a tree page)"
    if not PAGE_HEADER <= lower <= upper <= psize or (lower - PAGE_HEADER) % 2:
        return f"damaged (bounds {lower}-{upper})"
    count = (lower - PAGE_HEADER) // 2
    if kind == P_BRANCH and count < 2:  # (LMDB stops the process on one: an assertion)
        return f"damaged (a branch of {count} node{'' if count == 1 else 's'}, not two or more)"
    offsets_of = _OFFSETS.get(count)
    if offsets_of is None:
        offsets_of = _OFFSETS[count] = struct.Struct(f"<{count}H")
    offsets = offsets_of.unpack_from(data, PAGE_HEADER)
    last_node = psize - NODE_HEADER
    node = _NODE.unpack_from
    if kind == P_LEAF:  # (most pages: checked in the fewest steps)
        before, strict = (low if low is not None else b""), False
        for offset in offsets:
            if not upper <= offset <= last_node:
                return _node_damage(offsets, offset, f"at offset {offset}, outside the page")
            lo, hi, nflags, ksize = node(data, offset)
            start = offset + NODE_HEADER + ksize
            size = lo | (hi << 16)
            key = data[offset + NODE_HEADER : start]
            if key < before or (strict and key == before) or (high is not None and key >= high):
                return _node_damage(offsets, offset, "its key is out of order")
            before, strict = key, True
            if not nflags:
                if start + size > psize:
                    why = f"a key of {ksize} bytes and a value of {size} run past the page"
                    return _node_damage(offsets, offset, why)
                items.append((key, start, size, -1))
            elif nflags == F_SUBDATA and size == DB_RECORD and start + size <= psize:
                items.append((key, start, size, NAMED))  # (another tool's: see Tree.databases)
            elif nflags & (F_SUBDATA | F_DUPDATA):  # (none in a fastdata store)
                return _node_damage(offsets, offset, f"flags {nflags:#x} of a sub-database")
            elif start + 8 > psize:
                return _node_damage(offsets, offset, "overflow pointer runs past the page")
            else:
                first = _PGNO.unpack_from(data, start)[0]
                if first < 2 or first + (size + PAGE_HEADER - 1) // psize > last:
                    why = f"a value of {size} bytes on pages outside the file"
                    return _node_damage(offsets, offset, why)
                items.append((key, start, size, first))
        return ""
    children: list[int] = []
    keys: list[bytes | None] = [low]
    prior = low
    for offset in offsets:
        if not upper <= offset <= last_node:
            return _node_damage(offsets, offset, f"at offset {offset}, outside the page")
        lo, hi, nflags, ksize = node(data, offset)
        start = offset + NODE_HEADER + ksize
        if start > psize:
            return _node_damage(offsets, offset, f"key of {ksize} bytes runs past the page")
        child = lo | (hi << 16) | (nflags << 32)
        if not 2 <= child <= last:
            return _node_damage(offsets, offset, f"child page {child} outside the file")
        key = data[offset + NODE_HEADER : start]
        if children:  # (node 0's key is empty: its child begins at this page's low key)
            if (prior is not None and key <= prior) or (high is not None and key >= high):
                return _node_damage(offsets, offset, "its key is out of order")
            prior = key
        children.append(child)
        keys.append(key)
    keys[1:2] = []  # (a branch's first key is empty: its children begin at the page's low key)
    keys.append(high)
    # pushed last first, so that they are walked in order (the order they were prefetched in)
    for i in range(len(children) - 1, -1, -1):
        stack.append((children[i], level + 1, keys[i], keys[i + 1]))
    return ""


def _node_damage(offsets: tuple[int, ...], offset: int, what: str) -> str:
    return f"damaged (node {offsets.index(offset)}: {what})"
