"""The cold-read policy of a reader's share of an environment: when a batch's values are asked
for before LMDB looks them up, and the read-ahead window of a scan.

NOTE [ Read-ahead ]

Readers map the store with the kernel's read-ahead off (LMDB's MDB_NORDAHEAD: MADV_RANDOM on the
whole map): with it on, a cold random read of a 2 kB record pulled about 0.5-1.5 MB from the
disk, and a store larger than the page cache spent its reads evicting useful pages. With it off,
LMDB's lookup (and py-lmdb's touch of every page of the value before it returns) brings a record
in a page at a time: one read from the disk per 4 kB page, one after the other, 28 of them for a
114 kB JPEG. So the first batch, and the batches after one that came from the disk (its lookups
and copies took longer than memory could: COLD_NS_PER_PAGE), announce their values before any is
looked up: the tree is read down to each value's place with pread (``pages.value_places``; the
leaf pages of the batch asked for together on the way), and each value on pages of its own asked
for whole (POSIX_FADV_WILLNEED, in requests of at most ``pages.advice.ASK_MOST``), all of the
batch's requests in flight at once. The labels (read on opening) and the index of names are asked
for so too. Whether the pages of the descent and the first and last page of each value were in
memory already (mincore) says when to stop: at the first batch where all were, or all but a few
(MISSING_SHARE): a store in memory whose pages the kernel has partly let go (a few in a hundred,
under pressure or a reclaim daemon) has some in nearly every batch, and announcing every batch
for them cost a store of a million small records 12% of its loader's time, where the few pages
missing come in by themselves as LMDB's lookup meets them. Where that cannot
be known (no mincore), COLD_BATCHES batches are announced, then one is timed unannounced again,
and while the store keeps coming from the disk the run doubles (up to COLD_BATCHES_MOST), so that
few batches pay for the check. A lone record within its leaf page is not announced (the descent
would read the page LMDB's lookup reads). A scan in index order (export, copy) asks for
sequential read-ahead (MADV_SEQUENTIAL) and keeps a window ahead of it requested while it runs.
``scripts/bench_readahead.py`` and ``scripts/bench_lmdb.py`` measure these against a bare lmdb
loop.
"""

from __future__ import annotations

import mmap
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from .entry import Entry
from .pages import value_places
from .pages.advice import ask, madvise, resident

__all__ = ["COLD_BATCHES", "COLD_BATCHES_MOST", "COLD_NS_PER_PAGE", "ColdReads"]

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
MISSING_SHARE = 16
"""A batch announced whose pages are all in memory but at most one in this many counts as in
memory: the next is not announced."""
SCAN_WINDOW = 32 << 20
"""How far ahead of a scan its pages are requested."""


def major_faults() -> int | None:
    """Pages this thread has read from the disk through its maps (its major faults); None
    where the system does not count them per thread."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    try:
        return resource.getrusage(who).ru_majflt
    except OSError:
        return None


class ColdReads:
    """One reader's read-ahead state (NOTE [ Read-ahead ]).

    Attributes:
        announce_left: batches left to announce their values before looking them up: set when
            one came from the disk; the first batch is announced (nothing is known yet).
        announce_run: how many batches the next run of announced ones is.
        large: whether the last batch's values spanned a page or more each, on average: then even
            one value alone is worth announcing.
        scan_until: in a scan, the file offset up to which read-ahead was requested (None: no
            scan).
    """

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.announce_left = 1
        self.announce_run = COLD_BATCHES
        self.large = True
        self.scan_until: int | None = None

    def before(self, keys: Sequence[bytes]) -> tuple[int, int | None, bool | None, bool]:
        """A batch of ``keys`` is about to be looked up: its values announced where the policy
        says so. When it began, this thread's major faults so far (None: not known), whether
        its pages were in memory (None: not announced, or not known), and whether advice is
        being given (then it is not timed)."""
        started = time.perf_counter_ns()
        in_memory = None
        if self.announce_left > 0 and (len(keys) > 1 or self.large):
            in_memory = self.announce(keys)
        advising = self.announce_left > 0 or self.scan_until is not None
        return started, None if advising else major_faults(), in_memory, advising

    def after(
        self,
        started: int,
        faults: int | None,
        in_memory: bool | None,
        advising: bool,
        count: int,
        spanned: int,
    ) -> None:
        """A batch of ``count`` values (``spanned`` bytes) begun at ``started`` (this thread's
        major faults then: ``faults``) was copied: the next batches announced or not. A batch
        timed as from the disk is one that took longer than memory could, and, where the
        kernel counts them, that read at least one page in :data:`MISSING_SHARE` from the disk
        (a major fault each): a batch of a store in memory that met a few pages the kernel had
        let go, or whose thread waited for a core, is not."""
        pages = count + spanned // mmap.PAGESIZE  # (about the pages the values span)
        self.large = spanned >= count * mmap.PAGESIZE
        if in_memory is not None:  # (announced, and known to be from the disk or not)
            self.announce_left = 1 if not in_memory else 0
            self.announce_run = COLD_BATCHES
        elif self.announce_left:
            self.announce_left -= 1
        elif not advising:
            slow = time.perf_counter_ns() - started > pages * COLD_NS_PER_PAGE + COLD_NS_SLACK
            if slow and faults is not None:  # (where they are counted: did it read the disk?)
                now = major_faults()
                slow = now is None or (now - faults) * MISSING_SHARE >= pages
            if slow:
                self.announce_left = self.announce_run  # then one batch unannounced, timed
                self.announce_run = min(2 * self.announce_run, COLD_BATCHES_MOST)
            else:
                self.announce_run = COLD_BATCHES

    def announce(self, keys: Sequence[bytes]) -> bool | None:
        """Ask for the pages of the values of ``keys`` that lie on pages of their own, each
        value whole, before LMDB's lookup touches them. Whether the pages of the descent to
        them and the first and last page of each were in memory already, all but at most one
        in :data:`MISSING_SHARE` (None: unknown)."""
        entry = self.entry
        fd, span = entry.fd, entry.span
        if fd is None or entry.writable:
            return None
        lo, hi = span if span is not None else (0, 0)  # (no span: nothing can be known)

        def in_memory(offset: int) -> bool | None:
            return resident(lo + offset) if lo + offset < hi else None

        try:
            places, asked = value_places(fd, keys, in_memory)
            for offset, n in places:
                ask(fd, offset, n)
        except OSError:  # advice only
            return None
        if asked is None:
            return None
        count, missing = asked
        return missing * MISSING_SHARE <= count

    @contextmanager
    def sequential(self) -> Iterator[None]:
        """Read-ahead for a scan in index order while the block runs."""
        span = self.entry.span
        if span is None or self.entry.writable:
            yield
            return
        madvise(span[0], span[1] - span[0], mmap.MADV_SEQUENTIAL)
        self.scan_until = 0
        try:
            yield
        finally:
            self.scan_until = None
            madvise(span[0], span[1] - span[0], mmap.MADV_RANDOM)

    def advise(self, offset: int, n: int) -> None:
        """In a scan, keep a window of the file past the value read (``n`` bytes at
        ``offset``) on its way in (records are stored in index order)."""
        fd = self.entry.fd
        if fd is None or self.scan_until is None:
            return
        with suppress(OSError):  # advice only
            end = offset + n
            if end + SCAN_WINDOW // 2 > self.scan_until:
                start = max(end, self.scan_until)
                self.scan_until = end + SCAN_WINDOW
                ask(fd, start, self.scan_until - start)
