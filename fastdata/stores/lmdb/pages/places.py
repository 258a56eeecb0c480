"""Where a few keys' values lie in an LMDB data file, found down the tree as LMDB's lookup finds
them, before LMDB touches them: the advice of a cold read (``readahead.py``'s NOTE)."""

from __future__ import annotations

import os
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence

from . import advice
from . import format as mdb

CURSOR_DEPTH = 32
"""The deepest path LMDB's cursor follows from the root (its CURSOR_STACK)."""


def value_places(
    fd: int, keys: Sequence[bytes], resident: Callable[[int], bool | None] | None = None
) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """Where the values of ``keys`` that lie on pages of their own are in the file, as
    ``(offset, size)``, found as LMDB finds them, down the tree from the current root with
    ``pread``; each level's pages asked for together first (one request per run, all in flight
    at once). This lets a reader ask for a value's pages before LMDB's lookup faults them in one
    page at a time, a read from the disk each on a cold store.

    Advice only, on every cold read's path (so it reads each page's header and the nodes on its
    way, not every node: :func:`~.check.check_pages` costs a millisecond a call): anything out
    of the ordinary (a page not what its parent says, a node outside its page, a key not there,
    a value outside the file) ends the search under it, silently; the lookup itself checks and
    names it. Every place given lies inside the file.

    ``resident(offset)`` (whether the file's page at ``offset`` is in memory, None: unknown) is
    asked of every page of the descent before it is read, and of each value's first and last
    page: the second result is how many pages were asked of and how many of them were not in
    memory (None: unknown for one of them, or nothing asked)."""
    places: list[tuple[int, int]] = []
    asked = {True: 0, False: 0, None: 0}  # (pages in memory, not, unknown)

    def note(offset: int) -> None:
        if resident is not None:
            asked[resident(offset)] += 1

    try:
        size = os.fstat(fd).st_size
        head = mdb.current_meta(fd)
        psize = head.psize
        last = min(head.last_page, size // psize - 1)
        level = {head.root: sorted(set(keys))} if 2 <= head.root <= last else {}
        for _ in range(CURSOR_DEPTH):  # (deeper, LMDB gives up too: a loop)
            if not level:
                break
            numbers = sorted(level)
            for number in numbers:
                note(number * psize)
            if len(numbers) > 1:
                advice.prefetch(fd, numbers, psize)
            below: dict[int, list[bytes]] = {}
            for number in numbers:
                page = os.pread(fd, psize, number * psize)
                if len(page) == psize:
                    _places_on(page, number, level[number], last, size, below, places)
            level = {child: found for child, found in below.items() if 2 <= child <= last}
    except (OSError, mdb.FormatError):
        pass
    for offset, n in places:
        note(offset)
        note(offset + n - 1)
    count = asked[True] + asked[False]
    return places, (count, asked[False]) if count and not asked[None] else None


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
    pgno, _, flags, lower, upper = mdb.PAGE_HEADER.unpack_from(page, 0)
    kind = flags & mdb.P_KINDS
    if (
        pgno != number
        or kind not in (mdb.P_BRANCH, mdb.P_LEAF)
        or not mdb.PAGEHDRSZ <= lower <= upper
    ):
        return
    count = (lower - mdb.PAGEHDRSZ) // 2
    if upper > psize or count < 1:
        return
    offsets = struct.unpack_from(f"<{count}H", page, mdb.PAGEHDRSZ)
    if min(offsets) < upper or max(offsets) > psize - mdb.NODESIZE:
        return
    nodes = _NodeKeys(page, offsets)
    try:
        if kind == mdb.P_BRANCH:
            for key in keys:
                at = offsets[bisect_right(nodes, key, 1) - 1]
                lo, hi, top, _ = mdb.NODE_HEADER.unpack_from(page, at)
                below.setdefault(lo | (hi << 16) | (top << 32), []).append(key)
            return
        for key in keys:
            j = bisect_left(nodes, key)
            if j == count or nodes[j] != key:
                continue
            lo, hi, nflags, ksize = mdb.NODE_HEADER.unpack_from(page, offsets[j])
            start = offsets[j] + mdb.NODESIZE + ksize
            if nflags != mdb.F_BIGDATA or start + 8 > psize:
                continue  # (a value on the leaf itself: read already)
            first = int.from_bytes(page[start : start + 8], "little")
            offset, n = first * psize + mdb.PAGEHDRSZ, lo | (hi << 16)
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
        at = self.offsets[j] + mdb.NODESIZE
        end = at + mdb.NODE_HEADER.unpack_from(self.page, self.offsets[j])[3]
        if end > len(self.page):
            raise ValueError("a key past the page")
        return self.page[at:end]
