"""One user's share of an LMDB environment (the registry in ``env.py`` hands them out): the read
path, every value checked to lie inside the file before it is copied (NOTE [ Past the end of the
file ] in ``guard.py``), reads begun again when an append began meanwhile (the append epoch, in
``env.py``), and the cold-read policy (``readahead.py``)."""

from __future__ import annotations

import os
import shlex
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import lmdb

from ...errors import FastdataError, RecordError, StoreDamagedError, StoreError
from .address import address
from .entry import Entry
from .readahead import ColdReads

__all__ = ["READ_ATTEMPTS", "Lease"]

T = TypeVar("T")
LEAVES_AT_ONCE = 255
"""Leaves not read yet that a read of a store in memory checks beside the ones it needs (one
call for 256 costs about what one for a single leaf does)."""
READ_ATTEMPTS = 64
"""Reads begun again at most this often when appends keep beginning while they read."""

_pid = os.getpid()
"""This process's id, kept up to date across forks (``os.getpid`` is a system call, and a
lease checks it on every read)."""


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class Lease:
    """One user's share of an environment; let go by :meth:`release` or garbage collection
    (``release(key, pid)``, the registry's)."""

    def __init__(self, entry: Entry, release: Callable[[tuple[int, int], int], None]) -> None:
        self.entry = entry
        self.env = entry.env
        self.pid = os.getpid()
        self.cold_reads = ColdReads(entry)
        """The cold-read policy's state (NOTE [ Read-ahead ] in ``readahead.py``)."""
        self._released = False
        self._finalizer = weakref.finalize(self, release, entry.key, self.pid)
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
        """Read-ahead for a scan in index order while the block runs."""
        with self.cold_reads.sequential():
            yield

    def value_at(self, key: bytes) -> bytes | None:
        """The value of one key on the shortest path there is, or None where that path cannot
        give it (the key is not there, the value lies outside the known bounds, an error, an
        append began meanwhile, no epoch, a scan or a store read from the disk): the caller
        then reads it with :meth:`values`, which handles each of those."""
        entry = self.entry
        epoch = entry.epoch_view
        span = entry.span
        cold = self.cold_reads
        if epoch is None or span is None or cold.announce_left or cold.scan_until is not None:
            return None
        leaves = entry.leaves  # (the checked path reads the leaves first, NOTE [ Damaged
        if leaves is not None and (not leaves.values_sound or leaves.epoch != epoch[0]):
            return None  # branches ]; after an append, it checks them again)
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
        cold = self.cold_reads
        if epoch is None or span is None or cold.announce_left or cold.scan_until is not None:
            return None
        leaves = entry.leaves
        if leaves is not None and (not leaves.records_sound or leaves.epoch != epoch[0]):
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
        cold = self.cold_reads
        # (the cold-read advice first: it reads the pages down to the values with pread, so the
        # leaves' check below finds them in memory, NOTE [ Read-ahead ] in readahead.py)
        started, faults, in_memory, advising = cold.before(keys)
        leaves = self.entry.leaves
        if leaves is not None and not (
            leaves.epoch == self.entry.epoch() and leaves.known_sound(keys)
        ):
            checking = time.perf_counter_ns()  # (not the lookups' time: not what says "cold")
            self.refuse_damaged(keys, where)
            started += time.perf_counter_ns() - checking
        get = txn.checked_get if type(txn) is _Guarded else txn.get  # (the keys: just checked)
        try:
            views = [get(k) for k in keys]
        except DAMAGED_PAGE:  # (under one of them: that record is damaged; unless the file
            # grew meanwhile, past what was mapped: then read() begins again)
            if not self.entry.larger_now():
                _name_the_damaged(self.env, keys, where, self.entry)
            raise
        entry = self.entry
        lo, hi = entry.span or (1, 0)  # no span: every value takes the checked path
        if cold.scan_until is not None:  # a scan: its window is kept ahead of the furthest value
            ends = [address(v) + len(v) for v in views if v is not None]
            if ends and lo <= max(ends) <= hi:
                cold.advise(max(ends) - lo, 0)
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
        cold.after(started, faults, in_memory, advising, len(views), spanned)
        return out

    def refuse_damaged(self, keys: Sequence[bytes], where: Callable[[int], str]) -> None:
        """Raise the error of the first of ``keys`` that lies under a damaged branch (NOTE
        [ Damaged branches ]), before LMDB is asked for it."""
        cold = self.cold_reads  # (a store in memory, or a scan: its leaves checked a few
        scan = cold.scan_until is not None  # hundred at a time)
        more = LEAVES_AT_ONCE if scan or not cold.announce_left else 0
        on_disk = scan or cold.announce_left > 0  # (a store in memory: no advice, NOTE
        for n, damage in enumerate(self.entry.damage_of(keys, more, scan, on_disk)):  # [ Read-
            # ahead ] in readahead.py: its cold-read policy says which)
            if damage is None:
                continue
            if damage.low is not None and damage.high == damage.low + b"\0":  # (its value)
                raise _damage(
                    where(n), f"its value is damaged: page {damage.page}, {damage.what}", self.entry
                )
            raise _damage(where(n), f"it lies under damaged {damage}", self.entry)

    def ask_for(self, keys: Sequence[bytes]) -> None:
        """Ask for the pages of the values of ``keys`` that lie on pages of their own before
        reading them: a value of many pages (the labels, the names) then comes from the disk
        in a few large reads, not one read a page as LMDB's lookup faults it in."""
        self.cold_reads.announce(keys)

    def read(self, fn: Callable[[Any], T], where: str) -> T:
        """``fn(txn)`` in a read transaction (``buffers=True``), begun again in a new one when
        an append began while it read: then the pages it read may have been reused, and what
        it copied is not trusted, nor an error it met (see "the append epoch" in ``env.py``).
        ``fn`` copies what it keeps out of the transaction."""
        entry = self.entry
        for _ in range(READ_ATTEMPTS):
            view = entry.epoch_view  # (read inline: this is on every read's path)
            before = view[0] if view is not None else entry.epoch()
            try:
                txn = self.env.begin(buffers=True)
                leaves = entry.leaves  # (after an append, its checks begin again)
                if leaves is not None and (not leaves.all_sound or leaves.epoch != before):
                    txn = _Guarded(txn, self, where)
                try:
                    out = fn(txn)
                finally:
                    txn.abort()  # a read transaction: nothing to commit
            except lmdb.Error as exc:
                if entry.epoch() != before or entry.grown():  # (NOTE [ Past the end ], 3)
                    continue
                raise StoreDamagedError(
                    f"{where}: reading failed: {exc}", store=shlex.quote(entry.path)
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
        file: a damaged page can give a value a size or place that would fault on copying
        (NOTE [ Past the end of the file ], rule 4)."""
        if raw is None:
            return None
        n = len(raw)
        entry = self.entry
        if n and entry.span is not None:
            at = address(raw)
            while at < entry.span[0] or at + n > entry.span[1]:
                if not entry.grown():
                    raise _damage(where, f"its value ({n} bytes) lies outside the file", entry)
            if self.cold_reads.scan_until is not None:
                self.cold_reads.advise(at - entry.span[0], n)
        elif not entry.writable and n > entry.size and not entry.grown():
            raise _damage(where, f"its value ({n} bytes) is larger than the file", entry)
        return bytes(raw)


# NOTE [ Damaged branches ]
# LMDB ends the process (an assertion, then abort) on some pages met on its way down the tree: a
# branch of one node, a page that is not a leaf where its cursor steps, records marked as
# duplicates. So LMDB is never sent to a page that fastdata has not checked (``leaves.Leaves``):
#   1. the branches above the leaves are checked when a file is opened (a few milliseconds: a
#      tree's branches are a small share of its pages); a leaf, when a key under it is first
#      wanted (a page there that is a branch, the header's depth lying, is checked as one);
#   2. a store whose own keys (metadata, progress, labels, names) lie under a damaged page is
#      not opened; a key under one is never looked up: its read raises that record's
#      RecordError, and a transaction handed out (``Lease.read``) refuses it in ``get``; a
#      cursor (which steps from leaf to leaf) is given only once every leaf is checked;
#   3. nothing is written into a store with a damaged page (``env.open_writable`` checks every
#      page first); after an append (the append epoch moved), the checks begin again.
# Once every leaf is read and found sound, a read pays one attribute's look (``all_sound``).
# Where a limit on address space leaves the map no room past the file for the guard, every leaf
# is checked when the file is opened (a lying value size is damage of its leaf).


class _Guarded:
    """A read transaction of a file not yet checked whole: ``get`` refuses a key under a
    damaged page (NOTE [ Damaged branches ], 2), ``cursor`` checks every leaf first."""

    def __init__(self, txn: Any, lease: Lease, where: str) -> None:
        self._txn, self._lease, self._where = txn, lease, where

    def get(self, key: bytes, default: Any = None) -> Any:
        entry = self._lease.entry
        leaves = entry.leaves
        if leaves is not None and not (
            leaves.epoch == entry.epoch() and leaves.known_sound((key,))
        ):
            self._lease.refuse_damaged([key], lambda _: f"{self._where}: key {key!r}")
        return self._txn.get(key) if default is None else self._txn.get(key, default)

    def cursor(self) -> Any:
        entry = self._lease.entry
        self._lease.refuse_damaged([], lambda _: self._where)  # (rebuilt after an append)
        damaged = entry.leaves.check_all() if entry.leaves is not None else ()
        if damaged:
            raise StoreDamagedError(
                f"{self._where}: its keys cannot be walked: damaged {damaged[0]}",
                store=shlex.quote(entry.path),
            )
        return self._txn.cursor()

    def abort(self) -> None:
        self._txn.abort()

    @property
    def checked_get(self) -> Any:
        """The transaction's own ``get``, for keys the caller has just checked."""
        return self._txn.get

    def __getattr__(self, name: str) -> Any:  # (the rest of a transaction, as it is)
        return getattr(self._txn, name)


def _damage(where: str, what: str, entry: Any = None) -> RecordError:
    """A record's damage; its store's path (``entry.path``) for the command the hint prints."""
    return RecordError(f"{where}: {what}", store=shlex.quote(entry.path) if entry else "")


def _name_the_damaged(
    env: Any, keys: Sequence[bytes], where: Callable[[int], str], entry: Any = None
) -> None:
    """Raise the error of the first of ``keys`` that LMDB cannot look up (a damaged page on its
    way down the tree), each looked up in a transaction of its own (a failed lookup leaves its
    transaction unusable): that record is damaged, not the read of every record beside it
    (``export --skip-damaged`` leaves it out and goes on). Returns when each reads alone."""
    for n, key in enumerate(keys):
        txn = env.begin(buffers=True)
        try:
            txn.get(key)
        except DAMAGED_PAGE as exc:
            raise _damage(where(n), f"LMDB cannot read it ({exc})", entry) from None
        finally:
            txn.abort()


DAMAGED_PAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.CursorFullError)
"""LMDB's errors for a page that is not what the tree says (MDB_CORRUPTED, MDB_PAGE_NOTFOUND,
and MDB_CURSOR_FULL: a path down the tree deeper than LMDB follows, a loop); others (a
transaction made invalid, say) are no record's damage."""
