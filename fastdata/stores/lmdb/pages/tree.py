"""The main B-tree of an LMDB data file, read with ``pread`` (never mapped), so that damage is an
error and not a fault: one walk in key order (:meth:`Tree.leaves`, :meth:`Tree.entries`, values in
stretches with :meth:`Tree.values`), every page it reads checked by :mod:`.check`. (A cold read's
descent to a few keys' values, advice only, is :mod:`.places`.)"""

from __future__ import annotations

import itertools
import os
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import advice
from . import format as mdb
from .check import NAMED, Checked, check_file, check_overflow, check_pages, read_pages

STRETCH_BYTES = 1 << 20
"""The most bytes of values on pages of their own that a check reads in one call (a value larger
than this is read alone)."""
DEEPEST = 64
"""A page reached deeper than this is taken for a loop."""


BRANCHES_AT_ONCE = 1024
"""Branch pages :meth:`Tree.branches` reads and checks side by side, at most (4 MiB of 4 KiB
pages)."""


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
        if self.high is None:
            return f"page {self.page} (keys {low} to the last key): {self.what}"
        high = self.high.decode("ascii", "replace")
        return f"page {self.page} (keys {low} up to but not including {high}): {self.what}"


class Leaves:
    """A run of leaf entries in key order, from the pages they were read from.

    Attributes:
        buf: the pages' bytes; an entry's value on its page is ``buf[start : start + size]``.
        rows: the keys, one row each, where they are all one length (None otherwise).
        starts, sizes, firsts: each entry's value: where it starts in ``buf``, its size, and
            its first overflow page (-1: on the page).
        reached: the highest page number read.
    """

    __slots__ = ("buf", "firsts", "keys", "reached", "rows", "sizes", "starts")

    def __init__(
        self,
        buf: bytes | memoryview,
        checked: Checked,
        nodes: np.ndarray,
        reached: int,
        keys: list[bytes],
    ) -> None:
        self.buf, self.reached, self.keys = buf, reached, keys
        a, b = (int(nodes[0]), int(nodes[-1]) + 1) if len(nodes) else (0, 0)
        self.rows = checked.uniform(a, b) if len(nodes) == b - a else None
        self.starts, self.sizes = checked.starts[nodes], checked.sizes[nodes]
        self.firsts = checked.values[nodes]

    def __len__(self) -> int:
        return len(self.sizes)


Bounds = tuple[int, int, "bytes | None", "bytes | None"]


def walk(path: str, *, limit: int = 100) -> list[Damage]:
    """Check every page of the main B-tree; what is wrong (at most ``limit`` damaged pages)."""
    with Tree(path, limit=limit) as tree:
        for _ in tree.entries(values=False):
            pass
        return tree.damage


class Tree:
    """The main B-tree of an LMDB data file, in one pass: what ``fastdata verify`` reads.

    Every branch and leaf page reached is checked (:func:`~.check.check_pages`); a value's
    overflow pages are checked when it is read. The leaves under a branch page are read with a
    call per run of consecutive pages and checked side by side. A damaged page's subtree is not
    followed; its damage names the keys it holds. The first ``limit`` damaged pages are listed in
    :attr:`damage`; :attr:`more` counts the rest.

    Raises:
        FormatError: the file's header is damaged or the file is truncated.
    """

    def __init__(self, path: str, *, limit: int = 100) -> None:
        self.path = path
        self.head = check_file(path)
        self.limit = limit
        self.found: list[Damage] = []
        """Every damaged page found, in the order found."""
        self._seen: set[Damage] = set()
        self.databases: list[tuple[bytes, int]] = []
        """The named databases (sub-databases) found in the main tree: their names and the leaf
        pages that hold them, in the order found. Not entries; their own trees are not walked."""
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._ahead: advice.ReadAhead | None = None
        self._reached = 0

    def forked(self) -> None:
        """In a forked child: the parent's read-ahead thread is not here (its pages stay)."""
        self._ahead = None

    def random_access(self) -> None:
        """Pages will be read here and there: the kernel's read-ahead is asked not to read
        beyond each (advice only)."""
        advice.random_access(self._fd)

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
        a walk in key order finds the damage over a key just before it reaches the key)."""
        return next((d for d in reversed(self.found) if d.covers(key)), None)

    def _damaged(self, page: int, what: str, low: bytes | None, high: bytes | None) -> None:
        damage = Damage(page, what, low, high)
        if damage not in self._seen:  # (a page above the ranges of two walks is met by both)
            self._seen.add(damage)
            self.found.append(damage)

    def branches(self) -> list[Damage]:
        """Check every branch page above the leaves, a level at a time (the pages of a level
        read and checked side by side), and give what is wrong (also in :attr:`found`), each
        with the keys that live under it. What LMDB meets on its way down to any key, short of
        the leaf: a branch that fails here (one node, say, on which LMDB ends the process)
        must not be handed to it. The leaves are not read: :attr:`routes` lists them, each with
        its keys' bounds, for :meth:`check` to read when a key under one is first wanted (a
        page there that is a branch, the header's depth lying, is checked then as one)."""
        head = self.head
        self.routes: list[Bounds] = []
        """The pages the branches point to at the header's leaf level, unread."""
        self.sound_leaves: set[int] = set()
        """Leaves found sound (by :meth:`branches`, above the header's depth, or :meth:`check`)."""
        self.leaf_routes: list[Bounds] = []
        """The sound leaves :meth:`check` found, with their keys' bounds."""
        if head.root == mdb.P_INVALID:
            return []
        level: list[Bounds] = [(head.root, 0, None, None)]
        if head.depth < 2:
            self.routes = level
            return []
        seen: set[int] = set()
        for _ in range(min(head.depth - 1, DEEPEST)):
            level = self.check(level, seen)
        self.routes = sorted(level + self.leaf_routes, key=lambda c: c[2] or b"")
        return self.found

    def check(self, pages: list[Bounds], seen: set[int], *, cold: bool = True) -> list[Bounds]:
        """Read and check ``pages`` (each with its keys' bounds) side by side: the sound
        leaves join :attr:`sound_leaves`, the damaged ones :attr:`found`; the children of
        those that are sound branches (where leaves should be: the header's depth lies) are
        given back, for a check of their own. ``cold``: the pages may be on the disk, so they
        are asked for together first; of a file in memory, asking costs 3x the check itself
        (POSIX_FADV_WILLNEED walks the page cache for each)."""
        below: list[Bounds] = []
        for at in range(0, len(pages), BRANCHES_AT_ONCE):
            below += self._checked_level(pages[at : at + BRANCHES_AT_ONCE], seen, cold)
        return below

    def _checked_level(self, level: list[Bounds], seen: set[int], cold: bool) -> list[Bounds]:
        """Pages of one level of the tree, checked side by side; the children of the sound
        branches among them."""
        psize = self.head.psize
        numbers = [c[0] for c in level]
        if cold and len(numbers) > 1:
            advice.prefetch(self._fd, numbers, psize)
        buf, whole = read_pages(self._fd, numbers, psize)
        lows, highs = [c[2] for c in level], [c[3] for c in level]
        last = self.head.last_page
        # (a page's own number is not checked: LMDB never reads it, and what a page holds is
        # what LMDB would meet there, whichever page it says it is)
        own = np.frombuffer(buf, mdb.page_dtype(psize), count=len(numbers))["mp_pgno"]
        checked = check_pages(buf, own.astype(np.int64), lows, highs, last, psize, whole)
        if (
            not checked.values_alone
            and not any(checked.reasons)
            and seen.isdisjoint(numbers)
            and max(c[1] for c in level) < DEEPEST
            and len(set(numbers)) == len(numbers)
        ):  # (every page sound and met once: the usual level, taken whole)
            seen.update(numbers)
            branches = (checked.kinds == mdb.P_BRANCH).tolist()
            below = []
            for p in itertools.compress(range(len(level)), branches):
                below += _children(checked, p, level[p][2], level[p][3], level[p][1] + 1)
            leaves = [c for c, branch in zip(level, branches, strict=True) if not branch]
            self.sound_leaves.update(c[0] for c in leaves)
            self.leaf_routes += leaves
            return below
        below = []
        alone: dict[int, list[int]] = {}
        for n in checked.values_alone:
            alone.setdefault(int(checked.row[n]), []).append(n)
        for p, (number, depth, lo, hi) in enumerate(level):
            what = checked.reasons[p]
            if what and p in alone:  # (a leaf sound but for some values: they are damaged)
                for n in alone[p]:
                    key = checked.key_list(n, n + 1)[0]
                    self._damaged(number, checked.values_alone[n], key, key + b"\0")
                what = ""
            if not what and number in seen:
                what = "reached twice (a loop in the tree)"
            if not what and depth >= DEEPEST:
                what = "reached deeper than a tree goes (a loop in the tree)"
            seen.add(number)
            if what:
                self._damaged(number, what, lo, hi)
            elif checked.kinds[p] == mdb.P_BRANCH:
                below += _children(checked, p, lo, hi, depth + 1)
            else:
                self.sound_leaves.add(number)
                self.leaf_routes.append((number, depth, lo, hi))
        return below

    def entries(
        self, low: bytes | None = None, high: bytes | None = None, *, values: bool = True
    ) -> Iterator[tuple[bytes, bytes | memoryview | None]]:
        """The leaf entries whose keys lie in ``[low, high)`` (every one by default), in key
        order, as ``(key, value)``. The value is None with ``values=False``, and for an entry
        whose overflow pages are damaged (then listed as damage). Entries under a damaged page
        are not given. Subtrees outside the range are not read."""
        for run in self.leaves(low, high):
            for j, key in enumerate(run.keys):
                yield key, (self.value(run, j) if values else None)

    def value(self, run: Leaves, j: int) -> bytes | memoryview | None:
        """The value of ``run``'s entry ``j`` (None if its overflow pages are damaged)."""
        first = int(run.firsts[j])
        start, size = int(run.starts[j]), int(run.sizes[j])
        if first < 0:
            return run.buf[start : start + size]
        return self._overflow(first, size, run.keys[j])

    def leaves(self, low: bytes | None = None, high: bytes | None = None) -> Iterator[Leaves]:
        """The entries whose keys lie in ``[low, high)``, a run at a time: the leaves under one
        branch page, read and checked side by side, or one leaf page."""
        head = self.head
        if head.root == mdb.P_INVALID:
            return
        psize = head.psize
        ahead = head.used_bytes > 2 * advice.AHEAD and hasattr(os, "preadv")
        self._mark = -1 if ahead else 1 << 62  # (the read-ahead is moved on past it)
        seen = np.zeros((head.last_page >> 3) + 1, np.uint8)
        stack: list[Bounds] = [(head.root, 0, None, None)]
        above_leaves = head.depth - 2  # (a branch here has leaves for children, where the
        # header tells the truth: where it does not, its children are walked one at a time)
        while stack:
            number, level, lo, hi = stack.pop()
            if (low is not None and hi is not None and hi <= low) or (
                high is not None and lo is not None and lo >= high
            ):
                continue
            again = bool(seen[number >> 3] & (1 << (number & 7))) or level > DEEPEST
            seen[number >> 3] |= 1 << (number & 7)
            data = os.pread(self._fd, psize, number * psize)
            whole = np.array([len(data) == psize])
            data = data.ljust(psize, b"\0")
            checked = check_pages(
                data, np.array([number]), [lo], [hi], head.last_page, psize, whole
            )
            what = checked.reasons[0]
            if again:  # (its keys are checked against this place first, so that a page two
                # branches point to is named alike by any walk that reaches it)
                what = what or "reached twice (a loop in the tree)"
            if what:
                self._damaged(number, what, lo, hi)
                continue
            if checked.kinds[0] == mdb.P_BRANCH:
                below = _children(checked, 0, lo, hi, level + 1)
                if level == above_leaves and level < DEEPEST:
                    yield from self._under(below, seen, stack, low, high)
                    continue
                advice.prefetch(self._fd, [c[0] for c in below], psize)
                stack.extend(reversed(below))
                continue
            self._advance(number)
            yield from self._runs(data, checked, np.array([True]), np.array([number]), low, high)

    def _under(
        self,
        below: list[Bounds],
        seen: np.ndarray,
        stack: list[Bounds],
        low: bytes | None,
        high: bytes | None,
    ) -> Iterator[Leaves]:
        """The leaves ``below`` a branch page: those that may hold keys in ``[low, high)``, up
        to the first reached before (for the walk a page at a time to name), read with a call
        per run of consecutive pages and checked side by side."""
        a = next((i for i, c in enumerate(below) if low is None or c[3] is None or c[3] > low), 0)
        b = len(below)
        if high is not None:
            b = next((i for i, c in enumerate(below) if c[2] is not None and c[2] >= high), b)
        numbers = np.array([c[0] for c in below[a:b]], np.int64)
        bits = np.left_shift(1, numbers & 7).astype(np.uint8)
        _, firsts = np.unique(numbers, return_index=True)
        fresh = ((seen[numbers >> 3] & bits) == 0) & np.isin(np.arange(len(numbers)), firsts)
        n = len(numbers) if fresh.all() else int(np.argmin(fresh))
        stack.extend(reversed(below[a + n : b]))  # (reached before: one at a time, below)
        if not n:
            return
        numbers = numbers[:n]
        psize, last = self.head.psize, self.head.last_page
        buf, got = read_pages(self._fd, numbers, psize)
        view = memoryview(buf)
        kids = below[a : a + n]
        lows, highs = [c[2] for c in kids], [c[3] for c in kids]
        checked = check_pages(buf, numbers, lows, highs, last, psize, got)
        # a branch where leaves should be (the header's depth lies): it and those after it are
        # walked one at a time
        kinds = checked.kinds.tolist()
        stop = next((p for p in range(n) if not checked.reasons[p] and kinds[p] == mdb.P_BRANCH), n)
        stack.extend(reversed(kids[stop:]))
        if stop:
            np.bitwise_or.at(seen, numbers[:stop] >> 3, bits[:stop])
            self._advance(int(numbers[:stop].max()))
        start = 0
        for p in range(stop + 1):
            if p == stop or checked.reasons[p]:
                if p > start:
                    pages = np.zeros(n, bool)
                    pages[start:p] = True
                    yield from self._runs(view, checked, pages, numbers, low, high)
                if p < stop:
                    self._damaged(int(numbers[p]), checked.reasons[p], lows[p], highs[p])
                start = p + 1

    def _runs(
        self,
        buf: bytes | memoryview,
        checked: Checked,
        pages: np.ndarray,
        numbers: np.ndarray,
        low: bytes | None,
        high: bytes | None,
    ) -> Iterator[Leaves]:
        """The entries of sound leaf ``pages`` (of page ``numbers``) in ``[low, high)``, as one
        run; named databases apart (:attr:`databases`)."""
        nodes = np.flatnonzero(pages[checked.row])
        keys = checked.key_list(int(nodes[0]), int(nodes[-1]) + 1) if len(nodes) else []
        c = 0 if low is None else bisect_left(keys, low)
        d = len(keys) if high is None else bisect_left(keys, high)
        nodes = nodes[c:d]
        named = checked.values[nodes] == NAMED
        keys = keys[c:d]
        if named.any():
            held = numbers[checked.row[nodes[named]]].tolist()
            names = [keys[i] for i in np.flatnonzero(named).tolist()]
            self.databases += list(zip(names, held, strict=True))
            nodes = nodes[~named]
            keys = [k for k, n in zip(keys, named.tolist(), strict=True) if not n]
        if len(nodes):
            yield Leaves(buf, checked, nodes, int(numbers[pages].max()), keys)

    def _advance(self, number: int) -> None:
        """A walk has read a leaf of page ``number``: the read-ahead begins there, or moves on."""
        offset = number * self.head.psize
        if offset <= self._mark:
            return
        if self._ahead is None:
            self._ahead = advice.ReadAhead(self.path, offset, self.head.used_bytes)
        self._reached = max(self._reached, offset)
        self._ahead.advance(self._reached)
        self._mark = self._reached + advice.AHEAD_CHUNK

    def values(self, run: Leaves, a: int, b: int) -> list[bytes | memoryview | None]:
        """The values of ``run``'s entries from ``a`` on, as :meth:`value` gives each, up to
        ``b`` or to the first whose pages are damaged (None, last), or fewer. Values on pages
        of their own that follow one another in the file are read with one call per stretch
        of them (at most :data:`STRETCH_BYTES`), checked side by side; the values end before the
        first that fails a check, or with it read alone (which names it) where it is the first."""
        out: list[bytes | memoryview | None] = []
        psize = self.head.psize
        firsts = np.asarray(run.firsts[a:b], np.int64)
        sizes = np.asarray(run.sizes[a:b], np.int64)
        pages = (sizes + mdb.PAGEHDRSZ + psize - 1) // psize
        own = np.flatnonzero((firsts >= 0) & (pages * psize <= STRETCH_BYTES))
        # where a stretch must end: a value that does not begin where the last one ended
        breaks = (
            np.flatnonzero(firsts[own[1:]] != firsts[own[:-1]] + pages[own[:-1]]) + 1
        ).tolist()
        reach = np.cumsum(pages[own]) * psize  # (bytes of own[0 .. k], for the cap)
        own_at = own.tolist()
        ready: dict[int, memoryview] = {}
        failed, at = -1, 0  # (at: the next of own not read yet)
        for j in range(max(0, b - a)):
            if j not in ready and j != failed:
                end = at
                if at < len(own) and own_at[at] == j:  # j is the next value of its own
                    k = bisect_right(breaks, at)
                    end = breaks[k] if k < len(breaks) else len(own)
                    if end > at + 1:
                        done = int(reach[at - 1]) if at else 0
                        cap = int(np.searchsorted(reach, done + STRETCH_BYTES, side="right"))
                        end = max(at + 1, min(end, cap))
                if end <= at + 1:  # (within its leaf, larger than a stretch, or alone)
                    at = end
                    out.append(self.value(run, a + j))
                    if out[-1] is None:
                        return out
                    continue
                members = own[at:end]
                got = self._stretch(firsts[members], sizes[members], pages[members])
                ready.update(zip(members[: len(got)].tolist(), got, strict=True))
                if len(got) < len(members):
                    failed = int(members[len(got)])
                at = end
            if j == failed:
                if not out:
                    out.append(self.value(run, a + j))
                return out
            out.append(ready.pop(j))
        return out

    def _stretch(
        self, firsts: np.ndarray, sizes: np.ndarray, pages: np.ndarray
    ) -> list[memoryview]:
        """Values on pages of their own, one after the other in the file: read in one call,
        checked side by side; those before the first that fails a check."""
        psize = self.head.psize
        first = int(firsts[0])
        data = os.pread(self._fd, int(pages.sum()) * psize, first * psize)
        at = (firsts - first) * psize
        n, _ = check_overflow(data, at, firsts, sizes, psize)
        view = memoryview(data)
        starts = (at[:n] + mdb.PAGEHDRSZ).tolist()
        return [view[s : s + z] for s, z in zip(starts, sizes[:n].tolist(), strict=True)]

    def _overflow(self, first: int, size: int, key: bytes) -> memoryview | None:
        """The value of ``size`` bytes on the overflow pages from ``first``; None (listed as
        damage) if they fail their check. The first page is read alone first: a size that lies
        is caught by the page count there before anything is allocated for it."""
        psize = self.head.psize
        pages = -(-(size + mdb.PAGEHDRSZ) // psize)
        run = os.pread(self._fd, psize, first * psize)
        args = (np.zeros(1, np.int64), np.array([first]), np.array([size]), psize)
        _, what = check_overflow(run, *args, whole=False)
        if not what:
            if pages > 1:
                run += os.pread(self._fd, (pages - 1) * psize, (first + 1) * psize)
            _, what = check_overflow(run, *args)
        if what:
            self._damaged(first, what, key, key + b"\0")
            return None
        return memoryview(run)[mdb.PAGEHDRSZ : mdb.PAGEHDRSZ + size]


def _children(
    checked: Checked, p: int, lo: bytes | None, hi: bytes | None, level: int
) -> list[Bounds]:
    """A sound branch page's children, each with the bounds of its keys, in key order."""
    a, b = checked.span(p)
    keys: list[bytes | None] = [lo, *checked.key_list(a + 1, b), hi]
    children = checked.values[a:b].tolist()
    return [(c, level, keys[i], keys[i + 1]) for i, c in enumerate(children)]
