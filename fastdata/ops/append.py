"""What ``fastdata convert SRC STORE --append`` adds: the plan, made before anything is written.

The store is read once: its record names (with each record's size and checksum, to tell whether a
file changed since it was stored), labels, classes and skipped list. The samples of the source
that the store does not hold by relative path become the new records, with labels in the store's
classes: a class the store lacks goes at the end of its class list, so every label already handed
out keeps its meaning. A source file the store holds already is never stored twice; when it
changed since (another size, or newer and other bytes) it is reported.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np

from ..errors import CorruptImageError, SourceError, StoreError, option
from ..images.validate import validate_image
from ..packed import PackedStrings
from ..records import Progress, SkippedFile, StoreMeta, checksum, name_bytes
from ..sources.manifest import row_key
from ..sources.reading import file_kind, read_file
from ..sources.samples import FolderScan, SampleBuilder
from ..stores.policy import StoreWriter
from ..stores.reader import StoreReader
from .reports import ConvertReport

__all__ = ["AppendPlan", "plan_append"]

log = logging.getLogger(__name__)


@dataclass
class AppendPlan:
    """An append, planned.

    Attributes:
        scan: the samples to add, labelled in the store's class list (which ``scan.classes``
            is, new classes at the end).
        progress: the progress of a fresh append of them.
        base_labels: the labels of the records the store holds.
        base_names: their names (see :func:`fastdata.records.name_bytes`), joined by NULs.
        new_classes: classes the store did not have.
        class_order: ``"sorted"`` while the class list is still ImageFolder's, else
            ``"appended"``.
        already_stored: samples of the source that the store holds already.
        changed: those of them whose file changed since it was stored, and how.
        base_skipped: entries of the store's skipped list before the append.
    """

    scan: FolderScan
    progress: Progress
    base_labels: np.ndarray
    base_names: bytes
    new_classes: list[str]
    class_order: str
    already_stored: int = 0
    changed: list[SkippedFile] = field(default_factory=list)
    base_skipped: int = 0
    gone: list[str] = field(default_factory=list)
    gone_count: int = 0
    moved: list[tuple[str, str]] = field(default_factory=list)
    skipped_unchanged: int = 0
    compared: int = 0

    def completed(self, report: ConvertReport) -> ConvertReport:
        """``report`` with what the append adds to it."""
        report.appended = True
        report.already_stored = self.already_stored
        report.new_classes = list(self.new_classes)
        report.class_order = self.class_order
        report.changed = list(self.changed)
        report.gone, report.gone_count = list(self.gone), self.gone_count
        report.moved = list(self.moved)
        report.skipped_unchanged = self.skipped_unchanged
        report.compared = self.compared
        return report

    def final_skipped(self, skipped: list[SkippedFile], added: PackedStrings) -> list[SkippedFile]:
        """The store's skipped list once the append is complete: the entries it had, less the
        files this append stored (fixed since) and those it listed again (their new entry
        replaces the old one), then the new entries."""
        base, new = skipped[: self.base_skipped], skipped[self.base_skipped :]
        if not base:
            return list(skipped)
        names = PackedStrings([name_bytes(s.name) for s in base])
        again = PackedStrings([name_bytes(s.name) for s in new])
        drop = (added.find(names) >= 0) | (again.find(names) >= 0)
        return [s for s, gone in zip(base, drop.tolist(), strict=True) if not gone] + new

    def meta(self, base: StoreMeta, state: Progress) -> StoreMeta:
        """The store's metadata once the append ``state`` is complete."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        written = base.written or [[0, base.created or base.updated]]
        if state.count:
            written = [*written, [base.count, now]]
        return replace(
            base,
            count=state.next_index,
            classes=list(self.scan.classes),
            repairs=base.repairs + state.repairs,
            total_bytes=base.total_bytes + state.total_bytes,
            skipped_count=len(state.skipped),
            id=state.store_id,
            appended_from=[*base.appended_from, base.id],
            class_order=self.class_order,
            updated=now,
            written=written,
        )


def _unchanged_skip(before: SkippedFile | None, path: bytes, limit: int) -> bool:
    """Whether a file the store lists as skipped is as it was then (same size and time), and
    the reason still holds (one skipped as too large is read again under a larger limit)."""
    if before is None or before.size < 0:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    if (st.st_size, st.st_mtime_ns) != (before.size, before.mtime_ns):
        return False
    return not (before.reason.startswith("too large") and st.st_size <= limit)


class _StoredFiles:
    """The files a manifest store's records name, by device and inode (looked at once, when a
    new row needs it), so that a new name for a file the store holds is not stored again."""

    def __init__(self, names: PackedStrings, root: str) -> None:
        self._names, self._root = names, root
        self._by_file: dict[tuple[int, int], str] | None = None

    def holder(self, path: bytes) -> str | None:
        """The stored name of the file at ``path``, when the store holds it under another."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if self._by_file is None:
            self._by_file = {}
            prefix = os.fsencode(os.path.join(self._root, ""))
            for lo in range(0, len(self._names), 1 << 16):
                for raw in self._names.slice_list(lo, min(len(self._names), lo + (1 << 16))):
                    with contextlib.suppress(OSError):
                        known = os.stat(raw if raw[:1] == b"/" else prefix + raw)
                        self._by_file.setdefault(
                            (known.st_dev, known.st_ino), raw.decode("utf-8", "surrogateescape")
                        )
        return self._by_file.get((st.st_dev, st.st_ino))


def _change(path: str, crc: int, limit: int) -> str | None:
    """Whether the file at ``path`` (of the size it was stored with) holds other bytes than
    the record (``crc`` of the stored bytes), and how; None when it does not."""
    data = read_file(path, limit)
    if isinstance(data, str):
        return f"unreadable now: {data}"
    try:
        stored = validate_image(data, path).data  # as it would be stored (a repair appended)
    except CorruptImageError:
        return "changed since it was stored (no longer a valid image)"
    if checksum(stored) != crc:
        return "changed since it was stored (other bytes, same size)"
    return None


SHOWN = 10
"""Paths listed by name in a report (gone from the source, moved); the rest are counted."""


def plan_append(
    scan: FolderScan,
    writer: StoreWriter,
    base: StoreMeta,
    *,
    verify_decode: bool,
    max_file_bytes: int,
    check_changed: bool = True,
    check_content: bool = False,
) -> AppendPlan:
    """Read the store at ``writer``'s location and work out what the source ``scan`` adds.

    Costs about a folder scan: the store's names and sizes are read at once, each source file
    the store holds is looked at with one ``stat``. A file whose size differs from its record's
    is reported as changed; one of the same size is read and compared with its record when it
    was modified since the store was written (the time is a hint), or always with
    ``check_content``. A file the store lists as skipped is read again only when its size or
    modification time changed since; then, if it is usable now, it is stored and taken off the
    list.

    Raises:
        SourceError: the source is laid out differently from the store's (a folder against a
            manifest).
    """
    if scan.layout != base.layout:
        raise SourceError(
            f"{scan.root}: a {scan.layout} source cannot be appended to a store converted from a "
            f"{base.layout}; append a {base.layout}"
        )
    scan = _with_store_fields(scan, base)
    reader = writer.open_reader()
    try:
        look = _Look(scan, base, reader, max_file_bytes)
        look.walk(check_changed=check_changed, check_content=check_content)
        look.compare(reader)
    finally:
        reader.close()
    return look.plan(verify_decode)


def _with_store_fields(scan: FolderScan, base: StoreMeta) -> FolderScan:
    """``scan`` with its samples' fields checked against the store's schema (an ``int`` where
    the store has ``float`` becomes a float; other types make the sample unusable), refused
    when the source gives other fields than the store holds, or labels where it has none. (A
    conversion scans an append's source with the store's fields declared, so only other
    names are left to refuse here.)"""
    from dataclasses import replace as replaced

    from ..fields import Schema
    from ..sources.samples import checked_fields

    schema = base.schema
    source = os.path.realpath(scan.source or scan.root)
    if scan.labelled != base.labelled:
        has = "has classes" if base.labelled else "has no classes (its manifest had no labels)"
        raise SourceError(f"{source}: the store {has}; the source must be the same")
    if not schema and scan.schema:
        raise SourceError(
            f"{source}: the store has no fields, and an append keeps a store's fields as they "
            f"are: to store {scan.schema.describe()}, convert the source again into a new store "
            "(or over this one with ",
            option("overwrite"),
            ")",
        )
    if set(scan.schema.names) != set(schema.names):
        other = sorted(set(scan.schema.names) ^ set(schema.names))
        raise SourceError(
            f"{source}: the store's fields are {schema.describe() or 'none'}, the source gives "
            f"{scan.schema.describe() or 'none'}: an append carries the same fields (not "
            f"{', '.join(repr(n) for n in other)}); give the new rows the store's fields"
        )
    if scan.schema == schema or not schema:
        return scan
    unusable = list(scan.unusable)
    samples = checked_fields(scan.samples, schema, unusable, " (the store's type)")
    return replaced(scan, samples=samples, unusable=unusable, schema=Schema(schema.fields))


class _Look:
    """One look at a source against the store it is appended to: which samples are new, which
    the store holds (and whether they changed), which it listed as skipped."""

    def __init__(
        self, scan: FolderScan, base: StoreMeta, reader: StoreReader, max_file_bytes: int
    ) -> None:
        self.scan, self.base, self.max_file_bytes = scan, base, max_file_bytes
        known = base.class_to_idx
        self.new_classes = [c for c in scan.classes if c not in known]
        self.classes = [*base.classes, *self.new_classes]
        index = {c: i for i, c in enumerate(self.classes)}
        self.remap = np.array([index[c] for c in scan.classes], dtype=np.int64)
        self.base_labels = np.array(reader.labels, dtype=np.int64)
        self.stored = reader.record_names()
        self.skipped_before = reader.skipped_files()
        self.reader = reader
        self.todo = SampleBuilder()
        self.already = self.unchanged_skips = 0
        self.changed: list[SkippedFile] = []
        self.duplicates: list[SkippedFile] = []
        self.suspects: list[int] = []
        self.field_crcs: np.ndarray | None = None

    def walk(self, *, check_changed: bool, check_content: bool) -> None:
        """Sort every sample of the source: new, held (and checked), or skipped before."""
        scan, stored = self.scan, self.stored
        root = os.fspath(scan.root)
        source = scan.samples.packed_names
        held = stored.find(source)
        self.gone_at = np.flatnonzero(source.find(stored) < 0)
        self._trust_names()
        self.sizes = self.reader.record_sizes() if check_changed and (held >= 0).any() else None
        self.starts, self.times = self.base.written_at()
        self.check_content = check_content
        self.earlier = {name_bytes(s.name): s for s in self.skipped_before}
        self.files = _StoredFiles(stored, root) if scan.layout == "manifest" else None
        labels = scan.samples.labels
        prefix = os.fsencode(os.path.join(root, ""))
        step = 1 << 16  # a slice of names at a time: no object per name held for long
        mapped = self.remap[labels] if self.base.labelled else labels.astype(np.int64)
        values: Any = scan.samples.field_bytes() or itertools.repeat(None, len(source))
        # the stored fields' checksums, to tell which held images' fields changed since
        if scan.samples.has_fields and (held >= 0).any():
            crcs = [h.fields_crc32 for h in self.reader.iter_headers()]
            self.field_crcs = np.array(crcs, dtype=np.int64)
        rows = (
            zip(
                source.slice_list(lo, min(len(source), lo + step)),
                held[lo : lo + step].tolist(),
                mapped[lo : lo + step].tolist(),
                strict=True,
            )
            for lo in range(0, len(source), step)
        )
        for (raw, at, label), fields in zip(
            itertools.chain.from_iterable(rows), values, strict=True
        ):
            path = raw if raw[:1] == b"/" else prefix + raw
            if at < 0:
                self._new(raw, path, label, fields)
            else:
                self._held(raw, path, label, at, fields)

    def _new(self, raw: bytes, path: bytes, label: int, fields: bytes | None = None) -> None:
        name = raw.decode("utf-8", "surrogateescape")
        same = self.files.holder(path) if self.files is not None else None
        if same is not None:  # another name for a file the store holds
            self.duplicates.append(
                SkippedFile(name, f"the same file as the stored {same}: stored once")
            )
        elif _unchanged_skip(self.earlier.get(raw), path, self.max_file_bytes):
            self.unchanged_skips += 1  # skipped before, unchanged: not read again
        else:
            self.todo.add(name, label, fields)

    def _held(self, raw: bytes, path: bytes, label: int, at: int, fields: bytes | None) -> None:
        self.already += 1
        name = raw.decode("utf-8", "surrogateescape")
        crcs = self.field_crcs
        if fields is not None and crcs is not None and checksum(fields) != crcs[at]:
            why = "its fields differ from the store's now (the store keeps its own)"
            self.changed.append(SkippedFile(name, why))
        was = int(self.base_labels[at])
        if label != was:
            self.changed.append(
                SkippedFile(
                    name,
                    f"labelled {self.classes[label]!r} now, {self.classes[was]!r} in the store "
                    "(the store keeps its label)",
                )
            )
        sizes = self.sizes
        if sizes is None:
            return
        try:
            st = os.stat(path)
        except OSError as exc:
            self.changed.append(SkippedFile(name, f"unreadable now: {exc.strerror or exc}"))
            return
        if not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode)
            self.changed.append(SkippedFile(name, f"not a regular file now ({kind})"))
        elif st.st_size != sizes[at]:
            self.changed.append(
                SkippedFile(name, f"{st.st_size} bytes now, {sizes[at]} when it was stored")
            )
        elif self.check_content or st.st_mtime > self._written(at):
            self.suspects.append(at)  # modified since its record was written: compare bytes

    def _written(self, at: int) -> float:
        """When record ``at`` was written (the run that wrote it)."""
        return float(self.times[np.searchsorted(self.starts, at, "right") - 1])

    def compare(self, reader: StoreReader) -> None:
        """Read the suspects and compare them with their records, by checksum."""
        for start in range(0, len(self.suspects), 256):
            for rec in reader.read_records(self.suspects[start : start + 256]):
                h = rec.header
                why = _change(self.scan.file_path(h.name), h.crc32, self.max_file_bytes)
                if why is not None:
                    self.changed.append(SkippedFile(h.name, why))

    def _unusable(self) -> list[SkippedFile]:
        """What the scan could not use, to list: not what the store lists already (a manifest's
        row, each once, also where another manifest or another line of it gives the row again);
        a file the store holds (it became a FIFO, a broken link...) is reported as changed
        instead."""
        listed = {(s.name, s.reason) for s in self.skipped_before}
        rows = Counter(key for s in self.skipped_before if (key := row_key(s)) is not None)
        found = [*self.scan.unusable, *self.duplicates]
        again = [(item.name, item.reason) in listed for item in found]
        for item, same in zip(found, again, strict=True):
            if same and (key := row_key(item)) is not None:
                rows[key] -= 1  # (listed as it is: that entry is no other row's)
        fresh = []
        for item, same in zip(found, again, strict=True):
            key = None if same else row_key(item)
            if key is not None and rows[key] > 0:
                rows[key] -= 1  # the same row, listed already from where it stood then
            elif not same:
                fresh.append(item)
        is_stored = self.stored.find(PackedStrings([name_bytes(i.name) for i in fresh])) >= 0
        unusable = []
        for item, held_now in zip(fresh, is_stored.tolist(), strict=True):
            if held_now:
                self.changed.append(SkippedFile(item.name, f"{item.reason} now"))
            else:
                unusable.append(item)
        return unusable

    def _trust_names(self) -> None:
        """Check the store's names, as its index gives them, against its records' headers
        where the append acts on them without reading the image: a name the source lacks
        (an index that lost a name lists another there, and the image it lost would be stored
        again) and a name listed twice. The rest agree with the source, name by name.

        Raises:
            StoreError: they differ; the message names the command that builds the index again.
        """
        hashes = self.stored.hashes()
        values, counts = np.unique(hashes, return_counts=True)
        twice = np.flatnonzero(np.isin(hashes, values[counts > 1]))
        said = self.reader.names_disagree(np.union1d(self.gone_at, twice))
        if said:
            target = self.reader.command_target
            raise StoreError(
                f"{self.reader.location}: its index of names does not agree with its records' "
                f"headers ({said}), and an append would store an image it holds again; build "
                f"the index again from the headers with `fastdata columns {target}`, then append"
            )

    def plan(self, verify_decode: bool) -> AppendPlan:
        scan, base, stored, classes = self.scan, self.base, self.stored, self.classes
        gone_at = self.gone_at
        gone = [n.decode("utf-8", "surrogateescape") for n in stored.take(gone_at[:SHOWN])]
        new_samples = self.todo.build()
        unusable = self._unusable()
        plan_scan = FolderScan(
            scan.root,
            classes,
            new_samples,
            scan.skipped_files,
            unusable,
            layout=scan.layout,
            source=scan.source,
            schema=scan.schema,
            sidecars=scan.sidecars,
            labelled=scan.labelled,
        )
        ordered = base.class_order == "sorted" and classes == sorted(classes)
        progress = Progress(
            source=scan.source,
            fingerprint=plan_scan.fingerprint(),
            total=len(plan_scan.samples),
            verify_decode=verify_decode,
            skipped=[*self.skipped_before, *unusable],
            first_index=base.count,
            base_id=base.id,
        )
        for item in self.changed:
            log.warning(
                "%s changed since it was stored (%s): not stored again", item.name, item.reason
            )
        if len(gone_at):
            log.warning(
                "%d image(s) of the store are not in the source (the store keeps them): %s%s",
                len(gone_at),
                ", ".join(gone),
                ", ..." if len(gone_at) > len(gone) else "",
            )
        return AppendPlan(
            plan_scan,
            progress,
            self.base_labels,
            stored.joined(),
            self.new_classes,
            "sorted" if ordered else "appended",
            self.already,
            self.changed,
            len(self.skipped_before),
            gone,
            len(gone_at),
            _moves(stored, gone_at, new_samples.packed_names),
            self.unchanged_skips,
            len(self.suspects),
        )


def _moves(stored: PackedStrings, gone_at: np.ndarray, new: PackedStrings) -> list[tuple[str, str]]:
    """``(stored name, new name)`` of images that look moved: a path gone from the source and a
    new one with the same file name, when only one gone path has it (at most ``SHOWN``)."""
    if not len(gone_at) or not len(new):
        return []
    by_file: dict[bytes, bytes | None] = {}
    for name in stored.take(gone_at[: 1 << 16]):
        base = name.rpartition(b"/")[2]
        by_file[base] = None if base in by_file else name  # a name gone twice: no guess
    out = []
    for lo in range(0, len(new), 1 << 16):
        for name in new.slice_list(lo, min(len(new), lo + (1 << 16))):
            old = by_file.get(name.rpartition(b"/")[2])
            if old is not None:
                out.append((os.fsdecode(old), os.fsdecode(name)))
                if len(out) >= SHOWN:
                    return out
    return out
