"""Check a store: every record's size and checksum, and optionally that every image decodes."""

from __future__ import annotations

import multiprocessing
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptImageError, FastdataError, StoreError
from ..images.codec import scan_end
from ..images.decode import check_repaired, decode_check, image_size
from ..packed import PackedStrings
from ..records import RecordHeader, checksum, checksums, fields_problem, name_bytes, plain_headers
from ..stores.reader import Foreign, ScanBlock, StoreReader
from .export_files import any_unsafe, safe_name

__all__ = ["Failure", "VerifyReport", "check_file", "verify_store"]


@dataclass(frozen=True)
class Failure:
    """One record that failed verification."""

    index: int
    name: str
    reason: str
    decoding: bool = False
    """Whether the record is whole (its checksum holds) but its image is not: found by
    decoding it (a JPEG cut short, damaged pixel data)."""


@dataclass
class VerifyReport:
    """What :func:`verify_store` found."""

    location: str
    checked: int = 0
    decoded: int = 0
    failures: list[Failure] = field(default_factory=list)
    damaged_pages: list[str] = field(default_factory=list)
    """Every damaged page, in page order."""
    broken: list[str] = field(default_factory=list)
    """The invariants of a finished store that it breaks, each named (docs/stores.md, "What a
    finished store guarantees")."""
    checksums: bool = True
    """Whether the store has checksums to check (stores of other tools have none)."""
    foreign: list[str] = field(default_factory=list)
    """What the store holds that fastdata did not write (another tool's content), each said as
    what it is: not damage, and not counted against :attr:`ok`."""

    columns: list[str] = field(default_factory=list)
    """What is wrong with what the store keeps beside its records, built from them (LMDB: its
    fields kept a second time as columns, for queries and batches, and its index of names),
    each said with the command that builds them again from the records."""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.damaged_pages and not self.broken and not self.columns


UNCOUNTED = "its records cannot be counted: "
"""How the check of the invariants says that a walk of the keys failed (a damaged page: where
the check of the records lists one, the page says it)."""

NAMES_EVERY = 4096
"""Records read between comparisons of the names read with the index of names."""

PARALLEL_FROM = 20_000
"""Stores of at least this many records are checked by several processes (where they can be)."""


def verify_store(
    reader: StoreReader,
    *,
    decode: bool = False,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Check the store's structure (an LMDB file's every page) and every record: its size and
    CRC-32 (and, with ``decode``, that it decodes; without it, that a JPEG repaired at
    conversion lacked only its end-of-image marker, which costs a decode of each).

    Damaged pages and the records that fail are listed in the report; records under a damaged
    page are not read; reading goes on after a failure.

    Args:
        workers: processes that check parts of the store side by side. By default one per CPU
            (at most 8) for an LMDB store of 20,000 records or more, where a process can be
            forked safely (Linux, and no other thread running in this one); 1 checks here.
    """
    report = VerifyReport(reader.location, checksums=reader.has_checksums)
    total = len(reader)
    n = _processes(reader, total, workers)
    try:  # (read once, here: forked processes have it too)
        index = reader.names_index() if reader.has_checksums else None
    except FastdataError:  # (the check of the invariants names it)
        index = None
    damage: list[Any] = []
    of_names = 0  # (how many of the whole store's broken invariants are its names' and list's)

    def whole_store() -> VerifyReport:
        """The invariants of the whole store it breaks (``broken``), and what it holds that
        fastdata did not write (``foreign``)."""
        nonlocal of_names
        found = VerifyReport(reader.location)
        if reader.has_checksums:
            of_names = _check_invariants(reader, found, index)
        return found

    if n > 1:  # (the whole store is checked here meanwhile)
        args = (reader, report, damage, index, n, decode, batch_size, progress, whole_store)
        whole = _check_in_processes(*args)
    else:
        _check_range(reader, report, damage, index, 0, total, decode, batch_size, progress)
        whole = whole_store()
    # in page order, each once (a page above the parts of two processes is met by both): the
    # same report however many processes checked
    unique = {str(d): d for d in damage}
    ordered = sorted(unique, key=lambda text: (unique[text].page, text))
    report.damaged_pages = [text for text in ordered if not isinstance(unique[text], Foreign)]
    report.foreign = [text for text in ordered if isinstance(unique[text], Foreign)]
    if progress is not None:
        progress(total, total)
    if report.columns:  # (records whose header the index of names disagrees with: the
        # invariants of names hold or not for the headers' names, the source of truth)
        whole.broken[:of_names] = _invariants_of_names(reader, None, from_headers=True)
    if report.damaged_pages:  # (what kept the records from being counted: named above)
        whole.broken = [said for said in whole.broken if not said.startswith(UNCOUNTED)]
    report.broken.extend(whole.broken)
    report.foreign.extend(whole.foreign)
    report.columns.extend(whole.columns)
    return report


def _check_range(
    reader: StoreReader,
    report: VerifyReport,
    damage: list[Any],
    index: PackedStrings | None,
    start: int,
    stop: int,
    decode: bool,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Check records ``start .. stop-1`` into ``report`` (and the damage to the store's pages
    found on the way into ``damage``; their names against ``index``, the store's index of
    names, when it has one); ``progress(done, total)`` every batch."""
    total = len(reader)
    labels = reader.labels
    checked = reader.has_checksums
    schema = reader.meta.schema if checked else None
    in_folders = reader.meta.layout != "manifest"  # (a manifest's names may be absolute:
    # an export gives those a place of their own)
    failures = report.failures
    seen: list[tuple[int, str]] = []  # (records read one at a time since the last comparison,
    # and their names: compared every NAMES_EVERY records read, counting blocks, so that what
    # is reported comes in the same order as when every record is read one at a time)
    read = 0
    told = start

    def count(n: int) -> None:
        nonlocal read
        read += n
        if read >= NAMES_EVERY:
            read -= NAMES_EVERY
            if seen and index is not None:
                _compare_names(index, seen, report)

    def one(i: int, h: RecordHeader | None, data: bytes | memoryview, why: str | None) -> None:
        if h is None:
            failures.append(Failure(i, f"record {i}", why or "unreadable"))
            return
        report.checked += 1
        if checked and h.label != labels.item(i):
            report.broken.append(
                f"each record's label is the one the labels list gives: record {i} ({h.name}) "
                f"says {h.label}, the list {labels.item(i)}"
            )
        if index is not None:
            seen.append((i, h.name))
        count(1)
        if in_folders and not safe_name(h.name):
            failures.append(Failure(i, h.name, "its name is not a safe relative path"))
        elif len(data) != h.size:
            failures.append(Failure(i, h.name, f"size {len(data)}, expected {h.size}"))
        elif checksum(data) != h.crc32:
            failures.append(Failure(i, h.name, "checksum mismatch"))
        elif (schema or h.fields is not None) and (why := fields_problem(h, schema)):
            failures.append(Failure(i, h.name, why))
        elif h.scan_end != -1 and (found := scan_end(data)) != h.scan_end:
            where = f"at byte {found}" if found >= 0 else "nowhere"
            said = (
                f"says its first scan ends at byte {h.scan_end}"
                if h.scan_end >= 0
                else "gives a scan_end that is not an offset in its bytes"
            )
            failures.append(Failure(i, h.name, f"its header {said}; it ends {where}"))
        elif decode or (h.repaired and h.format == "jpeg"):
            try:
                if h.repaired and h.format == "jpeg":  # did it lack only its end marker?
                    image_size(data, h.name)
                    check_repaired(bytes(data), h.name)
                if decode:
                    decode_check(bytes(data), h.name)
                    report.decoded += 1
            except CorruptImageError as exc:
                failures.append(Failure(i, h.name, exc.reason, decoding=True))

    for item in reader.scan_records(damage, batch_size, start=start, stop=stop):
        if isinstance(item, ScanBlock):
            if (
                decode
                or schema
                or not checked
                or not _block_passes(item, labels, index, in_folders)
            ):
                for record in item.items():  # (one at a time: they say what is wrong)
                    one(*record)
            else:
                report.checked += len(item)
                count(len(item))
            i = item.start + len(item) - 1
        else:
            i = item[0]
            one(*item)
        if progress is not None and i - told >= batch_size:
            told = i
            progress(i - start, total)
    if index is not None and seen:
        _compare_names(index, seen, report)


def _block_passes(
    block: ScanBlock, labels: Any, index: PackedStrings | None, in_folders: bool
) -> bool:
    """Whether every record in the block passes every check, all checked at once: headers as
    fastdata writes them without fields (:func:`~fastdata.records.plain_headers`), labels as
    the labels list gives them, sizes and checksums those of the bytes, names those of the
    index (and, ``in_folders``, each a safe relative path)."""
    parsed = plain_headers(block.heads)
    if parsed is None:
        return False
    names, head_labels, sizes, crcs, ends = parsed
    a, b = block.start, block.start + len(block)
    data = block.data
    return (
        np.array_equal(head_labels, labels[a:b])
        and np.array_equal(sizes, np.fromiter(map(len, data), np.int64, len(data)))
        and np.array_equal(crcs, checksums(data))
        and (index is None or names == index.joined(a, b))
        and not (in_folders and any_unsafe(names))
        and all(scan_end(data[j]) == end for j, end in enumerate(ends.tolist()) if end >= 0)
    )


def _compare_names(index: PackedStrings, seen: list[tuple[int, str]], report: VerifyReport) -> None:
    """Compare the names of the records read (index, name) with the index of names, in one
    comparison for a run of records with none left out between them; then forget them."""
    first, last = seen[0][0], seen[-1][0]
    if last - first + 1 == len(seen):
        text = "\0".join(name for _, name in seen)
        try:
            joined = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a header's name that no file could have: told below
            joined = b""
        if text.count("\0") == len(seen) - 1 and joined == index.joined(first, last + 1):
            seen.clear()  # (no name holds a NUL)
            return
    for i, name in seen:
        try:
            same = index[i] == name_bytes(name)
        except UnicodeEncodeError:
            same, name = False, ascii(name)
        if not same:  # (the headers are the source of truth: the index is built from them)
            report.columns.append(
                f"each record's name is the one the index of names gives: record {i} is "
                f"{name}, the index says {index[i].decode('utf-8', 'surrogateescape')}"
            )
    seen.clear()


def _processes(reader: StoreReader, total: int, asked: int | None) -> int:
    if asked is not None:
        if asked < 1:
            raise ValueError(f"workers must be 1 or more, not {asked}")
        wanted = asked
    elif total < PARALLEL_FROM:
        return 1
    else:
        wanted = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    forkable = (
        sys.platform == "linux"
        and "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and not multiprocessing.current_process().daemon  # (a DataLoader worker may not fork)
    )
    if not (reader.scans_in_parallel and forkable):
        return 1
    return min(wanted, max(1, total // (64 if asked is not None else 1000)))


def _check_in_processes(
    reader: StoreReader,
    report: VerifyReport,
    damage: list[Any],
    index: PackedStrings | None,
    n: int,
    decode: bool,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
    meanwhile: Callable[[], VerifyReport],
) -> VerifyReport:
    """Check ``n`` parts of the store in ``n`` forked processes, side by side; their reports,
    merged in index order, make ``report``. What ``meanwhile()`` gives, called here while they
    check, is returned."""
    from multiprocessing.connection import wait

    total = len(reader)
    ctx = multiprocessing.get_context("fork")
    bounds = [total * k // n for k in range(n + 1)]
    done = ctx.RawArray("q", n)
    procs, pipes = [], []
    try:
        # Ctrl-C waits while the processes start: one that came in the middle of a fork would
        # be lost in it, or end a child before it ignores it (Ctrl-C is this process's to
        # handle). Blocking it is not enough: a native thread (a BLAS pool) may take it, and its
        # handler would then raise inside a fork's hooks, where an exception is dropped; so it
        # is only noted meanwhile, and raised once the processes have started.
        previous = signal.getsignal(signal.SIGINT)
        pressed: list[int] = []
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, lambda *_: pressed.append(1))
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for k in range(n):
                recv, send = ctx.Pipe(duplex=False)
                part = (bounds[k], bounds[k + 1], decode, batch_size, done, k, send)
                args = (reader, report.location, index, *part)
                proc = ctx.Process(target=_child, args=args, daemon=True)
                proc.start()
                send.close()
                procs.append(proc)
                pipes.append(recv)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if previous is signal.default_int_handler:
                signal.signal(signal.SIGINT, previous)
        if pressed:
            raise KeyboardInterrupt
        found = meanwhile()
        parts: list[Any] = [None] * n
        waiting = {id(conn): k for k, conn in enumerate(pipes)}
        while waiting:
            for ready in wait([pipes[k] for k in waiting.values()], timeout=0.25):
                k = waiting.pop(id(ready))
                try:
                    parts[k] = pipes[k].recv()
                except EOFError:
                    procs[k].join()
                    parts[k] = StoreError(
                        f"{report.location}: the process checking records {bounds[k]} to "
                        f"{bounds[k + 1] - 1} ended without a report (exit code "
                        f"{procs[k].exitcode}); check the store in one process with "
                        f"`fastdata verify --workers 1 {shlex.quote(report.location)}`"
                    )
            if progress is not None:
                progress(sum(done), total)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
        for conn in pipes:
            conn.close()
    for part in parts:
        if isinstance(part, BaseException):
            raise part
    for part, part_damage in parts:
        report.checked += part.checked
        report.decoded += part.decoded
        report.failures.extend(part.failures)
        report.broken.extend(part.broken)
        report.columns.extend(part.columns)
        damage.extend(part_damage)
    return found


def _child(
    reader: StoreReader,
    location: str,
    index: PackedStrings | None,
    start: int,
    stop: int,
    decode: bool,
    batch_size: int,
    done: Any,
    k: int,
    send: Any,
) -> None:
    """One process's part: its report and the damage it found (or the error that stopped it)
    sent back. It ends itself if its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the parent's to handle)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()
    report = VerifyReport(location, checksums=reader.has_checksums)
    damage: list[Any] = []

    def counted(got: int, _total: int) -> None:
        if os.getppid() != parent:  # (killed: nobody reads what this finds)
            os._exit(1)
        done[k] = got

    try:
        _check_range(reader, report, damage, index, start, stop, decode, batch_size, counted)
        out: Any = (report, damage)
    except FastdataError as exc:
        out = exc
    except Exception as exc:  # (sent as text: it may not pickle)
        out = StoreError(f"{location}: checking records {start} to {stop - 1} failed: {exc!r}")
    try:
        send.send(out)
    finally:
        send.close()


def _check_invariants(
    reader: StoreReader, report: VerifyReport, index: PackedStrings | None
) -> int:
    """The invariants of the whole store (names, skipped list, counts), named when broken;
    ``index``: the store's index of names, read already (None: the names are read here).
    Returns how many of those named come first and are of the names and the skipped list."""
    of_names = _invariants_of_names(reader, index)
    report.broken.extend(of_names)
    if of_names and of_names[0].startswith(_UNREAD):  # (the rest is not checked then)
        return len(of_names)
    try:
        held = reader.record_check()
    except FastdataError as exc:
        report.broken.append(f"{UNCOUNTED}{exc.without_hint()}")
        return len(of_names)
    if held is not None:
        report.broken.append(f"the records are 0 .. count-1, each once: {held}")
    try:
        report.columns.extend(reader.columns_problems())
    except FastdataError as exc:
        report.columns.append(f"its columns cannot be read: {exc.without_hint(cli=True)}")
    try:
        report.foreign.extend(reader.foreign_content())
    except FastdataError as exc:
        report.broken.append(f"its keys cannot be counted: {exc.without_hint()}")
    return len(of_names)


_UNREAD = "its names and skipped list cannot be read: "


def _invariants_of_names(
    reader: StoreReader, index: PackedStrings | None, *, from_headers: bool = False
) -> list[str]:
    """The invariants of the store's names and skipped list it breaks, each named: over
    ``index`` (its index of names, read already; None: read here), or over the records'
    headers where ``from_headers`` (an index that disagrees with them)."""
    from ..stores.invariants import invariant_failures

    try:
        if from_headers:  # (a name no file could have is one name all the same)
            names = PackedStrings(
                [h.name.encode("utf-8", "surrogatepass") for h in reader.iter_headers()]
            )
        else:
            names = index if index is not None else reader.record_names()
        skipped = reader.skipped_files()
    except FastdataError as exc:
        return [f"{_UNREAD}{exc.without_hint()}"]
    return invariant_failures(reader.meta, reader.labels, names, skipped)


def check_file(path: str) -> list[str]:
    """The damaged pages of the store at ``path``, checked without opening it as a store (for
    a store too damaged to open): what its backend can say (none where it keeps no pages).

    Raises:
        StoreError: its header is damaged or it is truncated.
    """
    from ..stores import reader_class

    return reader_class(path).damaged_pages(path)
