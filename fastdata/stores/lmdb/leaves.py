"""The pages LMDB will meet on its way to a key, checked before it is sent there (NOTE
[ Damaged branches ] in ``lease.py``): the branches above the leaves when a file is opened, each
leaf when a key under it is first wanted."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .file import open_tree
from .pages import Damage
from .pages.advice import resident_pages

__all__ = ["Leaves"]


class Leaves:
    """A data file's tree as far as reads have needed it, checked: its damaged pages (each with
    the keys under it), and which leaves are sound.

    Built when the file is opened (the branches read and checked: a few milliseconds) and again
    after an append (``epoch``: the append epoch it was built at), since an append writes new
    branches and leaves. Thread-safe.

    Raises:
        StoreError: the file's header is damaged or the file is truncated.
    """

    def __init__(self, data_file: str, epoch: int) -> None:
        self.data_file = data_file
        self.epoch = epoch
        self._lock = threading.Lock()
        self._tree = open_tree(data_file)
        self._tree.random_access()  # (a leaf at a time, where reads want one: no read-ahead)
        try:
            self.damaged: tuple[Damage, ...] = tuple(self._tree.branches())
        except BaseException:
            self._tree.close()
            raise
        self._seen: set[int] = set()
        size = os.path.getsize(data_file) // self._tree.head.psize  # (the file's own pages)
        self._shared = _shared_marks(min(self._tree.head.last_page + 1, size))
        self._checkers = _shared_marks(_slots.size) if self._shared is not None else None
        """The processes sharing the marks that are checking leaves now (NOTE [ Leaves beside a
        read ]): a slot of :data:`CHECKERS` a process, its id (0: none), in the same memory."""
        self._set_routes(self._tree.routes)

    def _set_routes(self, routes: list[Any]) -> None:
        self._routes = routes
        self._lows = [r[2] or b"" for r in routes]
        self._unread = {r[0] for r in routes} - self._seen
        self._unmarked = self._marks_of(self._unread)
        """One flag a page of :attr:`_shared`'s: the leaves not read yet (None: no marks)."""
        # a route meets [a, b) where its low (None: from the first key) is below b and its high
        # (None: to the last) above a; a comprehension each (a million routes at 1M records)
        (v0, v1), (h0, h1) = VALUES, HEADERS
        self._values = {
            p for p, _, lo, hi in routes if (lo is None or lo < v1) and (hi is None or hi > v0)
        }
        self._headers = {
            p for p, _, lo, hi in routes if (lo is None or lo < h1) and (hi is None or hi > h0)
        }
        self._values_unread = len(self._values & self._unread)
        self._headers_unread = len(self._headers & self._unread)
        self._pending = routes, self._lows, [*self._lows[1:], None]
        """The routes a key may still need read (every route not read yet, and some read
        since), in key order, with their lows and the low of the route after each (None: the
        last): a key's route looked up among a few, not among every leaf's, once most are read
        (NOTE [ Leaves beside a read ])."""
        self._cursor = _start(len(routes))
        """Where, among the pending routes, the next leaves checked beside a read's own are
        looked for."""
        self._sound()

    def _shrink(self) -> None:
        """The pending routes less those read, once they are at most half of them."""
        routes, lows, nexts = self._pending
        unread = self._unread
        if 2 * len(unread) >= len(routes):
            return
        kept = [n for n, r in enumerate(routes) if r[0] in unread]
        self._cursor = bisect_right(kept, self._cursor - 1)  # (the first kept at or past it)
        self._pending = [routes[n] for n in kept], [lows[n] for n in kept], [nexts[n] for n in kept]
        if self._cursor >= len(kept):
            self._cursor = 0

    def _read(self, pages: set[int]) -> None:
        """``pages`` were read and checked (each sound, or damaged and listed); the sound leaves
        among them marked for the processes forked from the one that built this (NOTE
        [ Checked once ] in ``env.py``)."""
        if self._shared is not None:
            damaged = {d.page for d in self._tree.found}
            self._mark((pages & self._tree.sound_leaves) - damaged, SOUND)
        pages &= self._unread
        self._unread -= pages
        if self._unmarked is not None and pages:
            self._unmarked[_below(pages, len(self._unmarked))] = False
        self._values_unread -= len(pages & self._values)
        self._headers_unread -= len(pages & self._headers)
        self._shrink()
        self._sound()

    def _sound(self) -> None:
        damaged = bool(self._tree.found)
        self.all_sound = not self._unread and not damaged
        """Every leaf is read and sound, and no page is damaged: no key needs looking at."""
        self.values_sound = not damaged and not self._values_unread
        """Every leaf that holds records' values is read and sound, and no page is damaged: a
        read of a record's bytes needs no look (the shortest path, ``Lease.value_at``)."""
        self.records_sound = self.values_sound and not self._headers_unread
        """The same of the leaves of the records' values and of their headers (a checked read's
        shortest path, ``Lease.values_at``)."""

    def _checked(self, wanted: list[Any], cold: bool = True) -> bool:
        """Read and check the pages of ``wanted`` routes; a branch among them (where a leaf
        should be: the header's depth lies) gives way to its children, to be read in turn
        (``cold``: they may be on the disk: asked for first). Whether it did (the routes
        changed); if not, every one of ``wanted`` is read now."""
        with self._checking():
            self._mark({r[0] for r in wanted}, CHECKING, over=False)
            below = self._tree.check(wanted, self._seen, cold=cold)
            if below:
                damaged = {d.page for d in self._tree.found}
                sound = self._tree.sound_leaves
                gone = {r[0] for r in wanted} - damaged - sound
                kept = [r for r in self._routes if r[0] not in gone]
                self._set_routes(sorted(kept + below, key=lambda r: r[2] or b""))
                return True
            self._read({r[0] for r in wanted})
            return False

    @contextmanager
    def _checking(self) -> Iterator[None]:
        """This process listed among those checking leaves while the block runs (its slot of
        :attr:`_checkers`), for the processes beside it."""
        checkers = self._checkers
        if checkers is None:
            yield
            return
        pid = os.getpid()
        at = 4 * (pid % CHECKERS)
        struct.pack_into("=i", checkers, at, pid)
        try:
            yield
        finally:
            if struct.unpack_from("=i", checkers, at)[0] == pid:  # (not taken since: a process
                struct.pack_into("=i", checkers, at, 0)  # with an id of the same slot)

    def _sibling_checking(self) -> bool:
        """Whether a process beside this one is checking leaves now: the leaves marked as being
        checked may then be its own, left to it; else they are the marks of checks that never
        ended (a process killed in one, or one that raised) or of damaged leaves, which no
        process will mark sound."""
        checkers, me = self._checkers, os.getpid()
        if checkers is None:
            return False
        return any(pid > 0 and pid != me and _alive(pid) for pid in _slots.unpack(checkers))

    def close(self) -> None:
        with self._lock:  # (not while a thread checks: its views of the marks would keep
            self._tree.close()  # them from being unmapped)
            if self._shared is not None:
                self._shared.close()
                self._shared = None
            if self._checkers is not None:
                self._checkers.close()
                self._checkers = None

    def adopt(self, data_file: str) -> bool:
        """Taken over by a forked child (NOTE [ Checked once ] in ``env.py``), which opened the
        same file as ``data_file``, with a lock of its own; False (not taken over: the child
        checks the file anew) where a thread of the parent held the lock at the fork: its check
        was half done (pages it read counted as seen, not yet as read: met again, they were
        taken for a loop in the tree) and its state half updated."""
        self._tree.forked()
        held = self._lock.locked()  # (in the child, no thread of its own holds it)
        self._lock = threading.Lock()  # (so that close() does not wait on the parent's thread)
        if held:
            return False
        self.data_file = data_file
        self._cursor = _start(len(self._pending[0]))  # (not where the parent's or a sibling's is)
        return True

    def known_sound(self, keys: Sequence[bytes]) -> bool:
        """Whether LMDB may be sent to ``keys`` without a look: every leaf is checked, or every
        key is a record's value (or header) and every leaf of those is (a few comparisons a
        key, on every read of a store whose other leaves no read has needed)."""
        if self.all_sound:
            return True
        if self.records_sound:
            return all(b"0" <= k < b":" or b"#0" <= k < b"#:" for k in keys)
        if self.values_sound:
            return all(b"0" <= k < b":" for k in keys)
        return False

    def damage_of(
        self,
        keys: Sequence[bytes],
        more: int = 0,
        mapped: int | None = None,
        ahead: bool = False,
        cold: bool = True,
    ) -> list[Damage | None]:
        """For each of ``keys``, the damaged page LMDB would meet on its way to it (None: none),
        the leaves it would land on read and checked first where they were not yet; with
        ``more``, at least as many other leaves not read yet beside them, checked side by side
        (NOTE [ Leaves beside a read ]): of those in memory (``mapped``: where this process
        maps the file's first byte, to ask the kernel; none is read from the disk for it), or
        with ``ahead`` (a scan in key order) the leaves after the keys, whether in memory or
        not: the scan reads them next; ``cold``: the leaves may be on the disk (the reader's
        cold-read policy says so): asked for first."""
        with self._lock:
            for _ in range(64):  # (a branch where a leaf should be is checked, then its children)
                wanted: dict[int, Any] = {}
                unread = self._unread
                routes, lows, nexts = self._pending
                for key in keys if unread else ():
                    n = bisect_right(lows, key) - 1  # (-1: before the first pending route, so
                    if n < 0:  # in one read)
                        continue
                    route, after = routes[n], nexts[n]  # (past the next route's low: the key
                    if route[0] in unread and (after is None or key < after):  # is in a later
                        wanted[route[0]] = route  # route, read)
                if more and mapped is not None and 0 < len(unread) <= self._last_few():
                    for route in routes:  # (the last few, which the kernel had let go of)
                        if route[0] in unread:
                            wanted.setdefault(route[0], route)
                    cold = True  # (asked for first: from the disk, together)
                if wanted and self._marked(wanted):  # (checked sound by a process beside
                    self._from_siblings()  # this: so may be many more)
                    wanted = {p: r for p, r in wanted.items() if p in self._unread}
                if not wanted:
                    break
                if more and ahead:  # (the leaves after the first wanted, in key order)
                    at = bisect_right(self._lows, min(keys)) if keys else 0
                    for r in self._routes[at : at + 2 * more]:
                        if r[0] in unread:
                            wanted.setdefault(r[0], r)
                elif more and mapped is not None:
                    self._beside(wanted, more, mapped)
                more = 0
                if not self._checked(list(wanted.values()), cold or ahead):
                    break  # (every route wanted is read now)
            found = self._tree.found
            if not found:
                return [None] * len(keys)
            return [next((d for d in reversed(found) if d.covers(k)), None) for k in keys]

    def _marks_of(self, pages: set[int]) -> np.ndarray | None:
        """``pages`` as flags, one a page of :attr:`_shared` (None where there are no marks)."""
        if self._shared is None:
            return None
        flags = np.zeros(len(self._shared), bool)
        flags[_below(pages, len(flags))] = True
        return flags

    def _mark(self, pages: set[int], mark: int, *, over: bool = True) -> None:
        """Mark ``pages`` for the processes beside this one (``over``: whatever their mark was;
        else only those not marked yet)."""
        if self._shared is None or not pages:
            return
        marks = np.frombuffer(self._shared, np.uint8)  # (a view: dropped on return, before
        at = _below(pages, len(marks))  # close() may unmap)
        marks[at if over else at[marks[at] == 0]] = mark

    def _marked(self, pages: dict[int, Any]) -> bool:
        """Whether a process beside this one has checked one of ``pages`` and found it sound."""
        shared = self._shared
        return shared is not None and any(p < len(shared) and shared[p] == SOUND for p in pages)

    def _from_siblings(self) -> None:
        """Take as read, in one pass over the marks, every leaf not read yet that a process
        beside this one has checked and found sound (NOTE [ Checked once ] in ``env.py``)."""
        if self._shared is None or self._unmarked is None:
            return
        marks = np.frombuffer(self._shared, np.uint8)  # (a view: dropped on return, before
        known = np.flatnonzero((marks == SOUND) & self._unmarked)  # close() may unmap)
        del marks
        if len(known):
            self._read(set(known.tolist()))

    def _last_few(self) -> int:
        """How many leaves not read yet are read together, from the disk where they must be,
        rather than left to the reads that want them (NOTE [ Leaves beside a read ])."""
        return min(MOST_BESIDE, len(self._routes) >> 8)

    def _beside(self, wanted: dict[int, Any], more: int, mapped: int) -> None:
        """Add to ``wanted`` the leaves not read yet among the next pending routes from the
        cursor, those the kernel holds (NOTE [ Leaves beside a read ]): as many as the larger
        of ``more`` and :data:`MOST_BESIDE`, so that a store of any size is checked in its first
        few hundred batches."""
        routes = self._pending[0]
        unread, shared = self._unread, self._shared
        count = len(routes)
        if not count or not unread:
            return
        more = min(max(more, MOST_BESIDE), len(unread))  # (in large passes: cheaper a leaf)
        at = self._cursor % count
        look = min(count, 2 * more)  # (routes looked at: some are read already)
        places = [*range(at, min(count, at + look)), *range(max(0, at + look - count))]
        fresh = [n for n in places if routes[n][0] in unread and routes[n][0] not in wanted]
        fresh = fresh[: more + PASSED_MOST]
        end = (fresh[-1] + 1) if len(fresh) == more + PASSED_MOST else at + look
        known: set[int] = set()
        if shared is not None:  # (checked sound by a process beside this: read, not again;
            # being checked by one: left to it, while one is checking)
            marks = [shared[p] if p < len(shared) else 0 for p in (routes[n][0] for n in fresh)]
            known = {routes[n][0] for n, m in zip(fresh, marks, strict=True) if m == SOUND}
            stale = CHECKING in marks and not self._sibling_checking()  # (no one will end them)
            taking = (0, CHECKING) if stale else (0,)
            fresh = [n for n, m in zip(fresh, marks, strict=True) if m in taking]
        taken = passed = 0
        step, asked = 2 * PASSED_MOST, 0  # (the kernel asked about a few first, then more:
        while asked < len(fresh):  # where it holds few, the pass ends among the first few)
            part = fresh[asked : asked + step]
            held = resident_pages(mapped, [routes[n][0] for n in part], self._tree.head.psize)
            asked, step = asked + len(part), 2 * step
            for n, in_memory in zip(part, held, strict=True):
                if in_memory:
                    wanted[routes[n][0]] = routes[n]
                    taken += 1
                else:  # (left to the read that wants it, or to a later pass)
                    passed += 1
                if taken >= more or passed > taken + PASSED_MOST:  # (enough; or a store on
                    end = n + 1  # the disk, none read for this: the next batch looks past
                    asked = len(fresh)  # these)
                    break
        self._cursor = end % count
        if known:
            self._read(known)  # (last: the pending routes may shrink, the cursor with them)

    def check_all(self) -> tuple[Damage, ...]:
        """Read and check every leaf not read yet (what a walk of every key would meet, the
        way LMDB's cursor steps from leaf to leaf); every damaged page found."""
        with self._lock:
            for _ in range(64):
                wanted = [r for r in self._routes if r[0] in self._unread]
                if not wanted:
                    break
                self._checked(wanted)
            return tuple(self._tree.found)


# NOTE [ Leaves beside a read ]
# A leaf is checked the first time a key under it is wanted. Were that all, a store read at
# random would check about two leaves for each of its first records, with a lookup per key into
# a list of every leaf (a million of them at a million records, 2 us a lookup), through most of
# its first epoch: a third of the read's cost of a small image at a million records, where a
# store of ten thousand is checked whole in its first batches. So each batch of a store in memory
# also checks leaves of its own choosing: from a cursor (each process's starting elsewhere, so
# that workers do not check the same leaves side by side), the next MOST_BESIDE not read yet that
# the kernel holds; side by side they cost 2-3 us a leaf (passes of a few hundred, a 256th of
# those left, had cost three times that a leaf at a million records, in each pass's own work:
# 7.8 s of a first epoch's reads in one process, against 2.4 now). A store in memory is
# then checked whole within its first few hundred batches, whatever its size, after which its
# reads take the shortest path (``known_sound``). Workers forked from one reader share marks
# of the leaves: a leaf a sibling has checked is taken over, one it is checking is left to it
# (two workers had checked a sixth of a million-record store's leaves twice, side by side)
# while a sibling is in the middle of a check (each lists its process id in shared slots while
# it checks). Where none is, the leaves marked as being checked are those of a check that never
# ended (a worker killed in it by the OOM killer, or a check that raised) or damaged ones, which
# no process will mark sound, and a pass takes them (left to a dead worker for good, they were
# checked only where a read wanted one: its siblings' reads of part of the store, or at random
# through most of an epoch, never took the shortest path). A
# leaf the kernel does not hold is passed (a read that wants it checks it, or a later pass of the
# cursor once it is in memory), and a store on the disk, where most are not held, has none read
# for this; the kernel is asked about the first few leaves of a pass before the rest, so that
# such a pass ends there (asking about a full pass's worth cost 6 ms a batch). But once no
# more than a 256th of the leaves is left unread (at most MOST_BESIDE), those are read together,
# from the disk where they must be: a store in memory of which the kernel has let a few pages go
# (under pressure, or a reclaim daemon: 378 leaves of 666,666 here) would otherwise look up
# every key of every batch among them through its first epoch (about 2 us an image at a million
# records), for leaves only a few batches want. Until every leaf is read, a key's route is
# looked up among the routes still pending, a list that halves as they are read.
MOST_BESIDE = 4096
"""The leaves checked beside a batch's own, while as many are left (about 10 ms)."""
PASSED_MOST = 64
"""Leaves the kernel does not hold that the cursor passes, beyond those it took, before it
stops for the batch (a store on the disk)."""


def _start(count: int) -> int:
    """Where a process's cursor begins among ``count`` routes: spread by its process id."""
    return (os.getpid() * 2654435761) % count if count else 0


VALUES, HEADERS = (b"0", b":"), (b"#0", b"#:")
"""The ranges of the keys of records' values (ten digits) and of their headers (``#`` and ten
digits)."""


SOUND, CHECKING = 1, 2
"""The marks of a page in :func:`_shared_marks`: a leaf checked and found sound; a page a
process is checking (not yet known sound: a page it found damaged keeps it, and each process
that wants one checks it itself, as do the passes beside reads once no process is checking)."""


CHECKERS = 256
"""The slots of :attr:`Leaves._checkers`, one a process checking leaves, by its id (two of the
same slot, rare among a loader's workers, are taken for one: the leaves of the one that
checks longer may be checked twice)."""
_slots = struct.Struct(f"={CHECKERS}i")


def _below(pages: set[int], count: int) -> np.ndarray:
    """``pages`` that are below ``count`` (those the marks have a byte for), as an array."""
    at = np.fromiter(pages, np.int64, len(pages))
    return at[at < count]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is still running (or its id taken by another since): one that
    ended and that its parent has not yet waited for (a zombie: a killed worker, until its
    loader notices) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: there)
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # (no /proc, or it ended since: taken as there, as the signal said)
        return True
    end = stat.rfind(b")")  # (the state follows the name, which may hold any byte)
    return stat[end + 2 : end + 3] != b"Z"


def _shared_marks(pages: int) -> mmap.mmap | None:
    """One byte a page of the file, in memory shared with the processes forked from this one
    (anonymous, shared: what one of them checked and found a sound leaf, the others need not
    read again; what one is checking, the others' passes beside their reads leave to it); None
    where none can be made (the checks then stay each process's own)."""
    if pages <= 0:
        return None
    try:
        return mmap.mmap(-1, pages)
    except (OSError, ValueError, OverflowError):
        return None
