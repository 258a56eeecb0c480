"""What ``fastdata convert SRC STORE --append`` adds: the plan, made before anything is written.

The store is read once: its record names (with each record's size and checksum, to tell whether a
file changed since it was stored), labels, classes and skipped list. The samples of the source
that the store does not hold by relative path become the new records, with labels in the store's
classes: a class the store lacks goes at the end of its class list, so every label already handed
out keeps its meaning. A source file the store holds already is never stored twice; when it
changed since (another size, or newer and other bytes) it is reported.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import numpy as np

from .errors import CorruptImageError, SourceError
from .folder import FolderScan, _SampleBuilder, read_file
from .jpeg import checksum, validate_image
from .packed import PackedStrings
from .records import Progress, SkippedFile, StoreMeta
from .stores.base import StoreWriter

if TYPE_CHECKING:
    from .convert import ConvertReport

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

    def completed(self, report: ConvertReport) -> ConvertReport:
        """``report`` with what the append adds to it."""
        report.appended = True
        report.already_stored = self.already_stored
        report.new_classes = list(self.new_classes)
        report.class_order = self.class_order
        report.changed = list(self.changed)
        return report

    def meta(self, base: StoreMeta, state: Progress) -> StoreMeta:
        """The store's metadata once the append ``state`` is complete."""
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
            updated=datetime.now(UTC).isoformat(timespec="seconds"),
        )


def _stored_at(meta: StoreMeta) -> float:
    """When the store last changed, as a timestamp (0 when it does not say)."""
    for text in (meta.updated, meta.created):
        try:
            return datetime.fromisoformat(text).timestamp()
        except ValueError:
            continue
    return 0.0


def _change(path: str, size: int, crc: int, limit: int) -> str | None:
    """How the file at ``path`` differs from the record stored from it (``size`` bytes of the
    source file, ``crc`` of the stored bytes), or None."""
    data = read_file(path, limit)
    if isinstance(data, str):
        return f"unreadable now: {data}"
    if len(data) != size:
        return f"{len(data)} bytes now, {size} when it was stored"
    try:
        stored = validate_image(data, path).data  # as it would be stored (a repair appended)
    except CorruptImageError:
        return "changed since it was stored (no longer a valid image)"
    if checksum(stored) != crc:
        return "changed since it was stored (other bytes, same size)"
    return None


def _find(stored: PackedStrings, wanted: PackedStrings) -> np.ndarray:
    """For each of ``wanted``, its index in ``stored``, or -1: matched by hash in one sorted
    array (8 bytes an entry, no object per entry held), confirmed byte for byte."""
    out = np.full(len(wanted), -1, dtype=np.int64)
    if not len(stored) or not len(wanted):
        return out
    keys = stored.hashes()
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    probes = wanted.hashes()
    at = np.minimum(np.searchsorted(ranked, probes), len(ranked) - 1)
    step = 1 << 16
    for lo in range(0, len(wanted), step):
        hi = min(len(wanted), lo + step)
        hits = lo + np.flatnonzero(ranked[at[lo:hi]] == probes[lo:hi])
        names = wanted.take(hits)
        for i, name, first in zip(hits.tolist(), names, stored.take(order[at[hits]]), strict=True):
            if first == name:
                out[i] = order[at[i]]
                continue
            k = int(at[i]) + 1  # another name with the same hash: look on
            while k < len(ranked) and ranked[k] == probes[i]:
                if stored[int(order[k])] == name:
                    out[i] = order[k]
                    break
                k += 1
    return out


def plan_append(
    scan: FolderScan,
    writer: StoreWriter,
    base: StoreMeta,
    *,
    verify_decode: bool,
    max_file_bytes: int,
    check_changed: bool = True,
) -> AppendPlan:
    """Read the store at ``writer``'s location and work out what the source ``scan`` adds.

    Costs about a folder scan: the store's names are read as one value (LMDB) or one query
    (MongoDB), each source file the store holds is looked at with one ``stat``, and only files
    modified since the store was written are read and compared with their records.

    Raises:
        SourceError: the source is laid out differently from the store's (a folder against a
            manifest).
    """
    if scan.layout != base.layout:
        raise SourceError(
            f"{scan.root}: a {scan.layout} source cannot be appended to a store converted from a "
            f"{base.layout}; append a {base.layout}"
        )
    known = base.class_to_idx
    new_classes = [c for c in scan.classes if c not in known]
    classes = [*base.classes, *new_classes]
    index = {c: i for i, c in enumerate(classes)}
    remap = np.array([index[c] for c in scan.classes], dtype=np.int64)
    since = _stored_at(base)
    root = os.fspath(scan.root)
    todo = _SampleBuilder()
    already = 0
    changed: list[SkippedFile] = []
    suspects: list[int] = []
    reader = writer.open_reader()
    try:
        base_labels = np.array(reader.labels, dtype=np.int64)
        stored = reader.record_names()
        base_names = stored.joined()
        skipped_before = reader.skipped_files()
        source = scan.samples.packed_names
        held = _find(stored, source)
        labels = scan.samples.labels
        prefix = os.fsencode(os.path.join(root, ""))
        step = 1 << 16  # a slice of names at a time: no object per name held for long
        rows = (
            zip(
                source.slice_list(lo, min(len(source), lo + step)),
                held[lo : lo + step].tolist(),
                remap[labels[lo : lo + step]].tolist(),
                strict=True,
            )
            for lo in range(0, len(source), step)
        )
        for raw, at, label in itertools.chain.from_iterable(rows):
            if at < 0:
                todo.add(raw.decode("utf-8", "surrogateescape"), label)
                continue
            already += 1
            if not check_changed:
                continue
            # a file not modified since the store was written is the file stored; one that was
            # is compared with its record, size and then bytes
            try:
                modified = os.stat(raw if raw[:1] == b"/" else prefix + raw).st_mtime > since
            except OSError as exc:
                name = raw.decode("utf-8", "surrogateescape")
                changed.append(SkippedFile(name, f"unreadable now: {exc.strerror or exc}"))
                continue
            if modified:
                suspects.append(at)
        for start in range(0, len(suspects), 256):
            for rec in reader.read_records(suspects[start : start + 256]):
                h = rec.header
                why = _change(
                    scan.file_path(h.name), h.size - 2 * h.repaired, h.crc32, max_file_bytes
                )
                if why is not None:
                    changed.append(SkippedFile(h.name, why))
    finally:
        reader.close()
    listed = {(s.name, s.reason) for s in skipped_before}
    unusable = [s for s in scan.unusable if (s.name, s.reason) not in listed]
    plan_scan = FolderScan(
        scan.root,
        classes,
        todo.build(),
        scan.skipped_files,
        unusable,
        layout=scan.layout,
        source=scan.source,
    )
    order = "sorted" if base.class_order == "sorted" and classes == sorted(classes) else "appended"
    progress = Progress(
        source=scan.source,
        fingerprint=plan_scan.fingerprint(),
        total=len(plan_scan.samples),
        verify_decode=verify_decode,
        skipped=[*skipped_before, *unusable],
        first_index=base.count,
        base_id=base.id,
    )
    for item in changed:
        log.warning("%s changed since it was stored (%s): not stored again", item.name, item.reason)
    return AppendPlan(
        plan_scan,
        progress,
        base_labels,
        base_names,
        new_classes,
        order,
        already,
        changed,
        len(skipped_before),
    )
