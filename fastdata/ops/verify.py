"""Check a store: every record's size and checksum, and optionally that every image decodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CorruptImageError, FastdataError
from ..images.decode import decode_check
from ..records import checksum, fields_problem
from ..stores.reader import StoreReader

__all__ = ["Failure", "VerifyReport", "check_file", "verify_store"]


@dataclass(frozen=True)
class Failure:
    """One record that failed verification."""

    index: int
    name: str
    reason: str


@dataclass
class VerifyReport:
    """What :func:`verify_store` found."""

    location: str
    checked: int = 0
    decoded: int = 0
    failures: list[Failure] = field(default_factory=list)
    damaged_pages: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    """The invariants of a finished store that it breaks, each named (README, "What a finished
    store guarantees")."""
    checksums: bool = True
    """Whether the store has checksums to check (stores of other tools have none)."""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.damaged_pages and not self.broken


def verify_store(
    reader: StoreReader,
    *,
    decode: bool = False,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check the store's structure (an LMDB file's every page), then read every record and check
    its size and CRC-32 (and, with ``decode``, decode it).

    Damaged pages and the records that fail are listed in the report; records under a damaged
    page are not read; reading goes on after a failure.
    """
    report = VerifyReport(reader.location, checksums=reader.has_checksums)
    total = len(reader)
    labels = reader.labels
    checked = reader.has_checksums
    schema = reader.meta.schema if checked else None
    failures = report.failures
    for i, h, data, why in reader.scan_records(report.damaged_pages, batch_size):
        if progress is not None and i % batch_size == 0 and i:
            progress(i, total)
        if h is None:
            failures.append(Failure(i, f"record {i}", why or "unreadable"))
            continue
        report.checked += 1
        if checked and h.label != labels.item(i):
            report.broken.append(
                f"each record's label is the one the labels list gives: record {i} ({h.name}) "
                f"says {h.label}, the list {labels.item(i)}"
            )
        if len(data) != h.size:
            failures.append(Failure(i, h.name, f"size {len(data)}, expected {h.size}"))
        elif checksum(data) != h.crc32:
            failures.append(Failure(i, h.name, "checksum mismatch"))
        elif (schema or h.fields is not None) and (why := fields_problem(h, schema)):
            failures.append(Failure(i, h.name, why))
        elif decode:
            try:
                decode_check(bytes(data), h.name)
                report.decoded += 1
            except CorruptImageError as exc:
                failures.append(Failure(i, h.name, exc.reason))
    if progress is not None:
        progress(total, total)
    if reader.has_checksums:
        _check_invariants(reader, report)
    return report


def _check_invariants(reader: StoreReader, report: VerifyReport) -> None:
    """The invariants of the whole store (names, skipped list, counts), named when broken."""
    from ..stores.invariants import invariant_failures

    try:
        names = reader.record_names()
        skipped = reader.skipped_files()
    except FastdataError as exc:
        report.broken.append(f"the names and the skipped list can be read: {exc}")
        return
    report.broken.extend(invariant_failures(reader.meta, reader.labels, names, skipped))
    held = reader.record_check()
    if held is not None:
        report.broken.append(f"the records are 0 .. count-1, each once: {held}")


def check_file(path: str) -> list[str]:
    """The damaged pages of the LMDB store at ``path``, checked without opening it as a store
    (for a store too damaged to open); none for anything else.

    Raises:
        StoreError: its header is damaged or it is truncated.
    """
    import os

    from ..stores.lmdb.file import walk
    from ..stores.lmdb.layout import DATA_FILE

    data_file = os.path.join(path, DATA_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(data_file):
        return []
    return [str(d) for d in walk(data_file)]
