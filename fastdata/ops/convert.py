"""Convert an image folder or a manifest into a store: read and validate in parallel, write in
ordered batches.

``convert`` is everything ``fastdata convert`` does, as one call. Files are read and validated by a
pool of threads (reading and CRC-32 release the GIL; see :mod:`.threads`), results are consumed
in scan order, and the writer commits them in batches together with the progress, so an
interrupted run resumes where its last commit ended. The source is only ever read. An append
(:mod:`.append`) is the same run over the images a store lacks. What each worker does to a sample
is :mod:`.ingest`; the source's scan and the destination's check, :mod:`.scan`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from ..errors import CorruptImageError, SourceError, StoreError, UsageError, option
from ..loaders.malloc import tune_malloc, tuned_malloc
from ..packed import PackedStrings
from ..records import Progress, Record, SkippedFile, StoreMeta, name_bytes
from ..sources.samples import FolderScan
from ..stores import StoreWriter, open_writer
from ..stores.batch import Batch
from .append import AppendPlan, plan_append
from .ingest import sample_loader
from .reports import ConvertReport
from .scan import STRICT_HINT, check_destination, scan_for_store, scan_source, stored_meta
from .threads import CHUNK, chunks, default_workers, ordered_map, tuned_map, window

__all__ = ["ConvertReport", "ProgressCallback", "convert", "default_workers"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while converting (samples handled, samples in the folder)."""

NAMED_REPAIRS = 20
"""Repaired images named in a report (the rest are counted)."""
COMMIT_RECORDS = 512
"""Records per committed batch at most: batches keep the writer's memory flat."""
COMMIT_BYTES = 32 << 20
"""A batch is also committed once it holds this many image bytes."""
MAX_FILE_BYTES = 1 << 30
"""Files larger than this are skipped (``max_file_bytes``, ``--max-file-size``): no image in a
training set is that large, and reading one whole would hold it all in memory."""


@dataclass(frozen=True)
class _Options:
    """How a conversion reads and writes (``convert``'s keywords, travelling together)."""

    workers: int | None
    strict: bool
    verify_decode: bool | None
    max_file_bytes: int | None
    commit_records: int
    progress: ProgressCallback | None
    check_content: bool


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str] | StoreWriter,
    *,
    workers: int | None = None,
    strict: bool = False,
    verify_decode: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    commit_records: int = COMMIT_RECORDS,
    collection: str | None = None,
    max_file_bytes: int | None = None,
    timeout_s: float | None = None,
    tune_allocator: bool | None = None,
    append: bool = False,
    classes: Sequence[str] | None = None,
    check_content: bool = False,
    drop_unlisted: bool = False,
    fields: str | Sequence[str] | None = None,
    sidecars: Sequence[str] | str | None = None,
) -> ConvertReport:
    """Pack an image folder (``source/<class>/<image>``), or the images a CSV or JSON Lines
    manifest lists (see :mod:`fastdata.sources.manifest`), into a store.

    Every image is validated (its real format sniffed from its bytes; JPEGs checked for their
    start-of-image marker, and repaired when only their end-of-image marker is missing). Files
    that cannot be used are skipped and listed in the report, or, with ``strict``, stop the run.

    Args:
        source: the image folder, or a manifest (``.csv``, ``.jsonl``).
        destination: an LMDB folder path, a ``mongodb://host:port/DB`` URI, or a
            :class:`~fastdata.stores.StoreWriter`.
        workers: reader threads; by default the conversion measures a few counts as it goes
            and uses the fastest (see :func:`.threads.tuned_map`).
        strict: raise on the first unusable file instead of skipping it.
        verify_decode: also decode every image fully with Pillow and skip those that fail. Not
            given (None): off for a new run, as recorded for a resumed one.
        resume: continue an interrupted conversion into ``destination`` with the options it
            was started with (an option given that conflicts with them is refused).
        overwrite: replace an existing store at ``destination``.
        progress: called as ``progress(done, total)`` as samples are handled.
        commit_records: records per committed batch.
        collection: the Mongo collection (default: the source folder's name).
        max_file_bytes: files larger than this are skipped (default :data:`MAX_FILE_BYTES`;
            a resume keeps the limit it began with).
        timeout_s: for a MongoDB destination, the server selection and connection timeout.
        tune_allocator: glibc's allocator tuned for image-sized buffers
            (:func:`fastdata.loaders.malloc.tune_malloc`): by default (None) while the
            conversion runs, its thresholds put back after (a conversion costs about a third
            more without it: freed buffers go back to the kernel and come back page by page);
            True: for the rest of the process (what the ``fastdata convert`` command does, the
            process being the conversion's alone); False: not at all.
        append: add the images of ``source`` that the store at ``destination`` does not hold
            yet (by relative path) as new records, in place (see :mod:`fastdata.ops.append`);
            ``resume`` then continues an interrupted append.
        classes: for a manifest, the class order (integer labels index it).
        drop_unlisted: for a manifest with a class list, leave out the rows of classes the
            list lacks (by default such a list is refused, naming them).
        check_content: with ``append``, read every source file the store holds and compare
            it with its record by checksum (by default only the size is compared, and the bytes
            of files modified since the store was written).
        fields: per-image fields beyond the class (see :mod:`fastdata.fields`), as ``--fields``
            writes them: ``"caption,score:float,boxes:float[-1,4]"``. For a CSV manifest, the
            columns to keep (``"*"``: all, as strings unless typed); for JSON Lines, where every
            key beside ``path`` and ``label`` is a field, the types of those named; for a folder
            with ``sidecars``, the types of the sidecar fields named.
        sidecars: for an image folder, the sidecar files read beside each image (``"json,txt"``:
            ``x.json``'s keys and ``x.txt``'s text become fields of ``x.jpg``).

    Returns:
        A :class:`ConvertReport`.

    Raises:
        SourceError: the folder is missing, has no classes or no images, or contains the
            destination.
        StoreExistsError: the destination holds a store and neither ``resume`` nor ``overwrite``
            was given.
        CorruptImageError: with ``strict``, the first unusable file.
    """
    started = time.perf_counter()
    if tune_allocator:
        tune_malloc()
    with tuned_malloc() if tune_allocator is None else nullcontext():
        mongo: dict[str, Any] = {"timeout_s": timeout_s} if timeout_s is not None else {}
        stored = None
        if append and not isinstance(destination, StoreWriter):
            stored = stored_meta(destination, collection, source, mongo)

        def scanned(base: StoreMeta | None) -> FolderScan | None:
            """For an append: the source scanned with ``base``'s fields (None: not needed)."""
            if base is None or not (base.schema or base.sidecars):
                return None
            return scan_for_store(base, source, classes, strict, drop_unlisted, fields, sidecars)

        scan = scanned(stored) or scan_source(
            source, classes, strict, drop_unlisted, fields, sidecars
        )
        writer = open_writer(
            destination, collection=collection, default_collection=scan.root.resolve().name, **mongo
        )
        check_destination(scan, writer)
        if append and overwrite:
            raise UsageError(
                option("append"),
                " adds to a store and ",
                option("overwrite"),
                " replaces it: choose one",
            )
        options = _Options(
            workers, strict, verify_decode, max_file_bytes, commit_records, progress, check_content
        )
        with writer:
            run = _Run(scan, writer, options, started)
            if append:
                done = run.start_append(resume=resume, rescan=scanned)
            else:
                done = run.start(resume=resume, overwrite=overwrite)
            if done is not None:
                return done
            run.store_all()
            run.finish()
        return run.report()


@dataclass
class _Run:
    """One conversion or append, from its start under the writer's lock to its report."""

    scan: FolderScan
    writer: StoreWriter
    options: _Options
    started: float
    state: Progress = field(init=False)
    plan: AppendPlan | None = None
    resumed_from: int = 0
    repaired_names: list[str] = field(default_factory=list)
    """The first records this run repaired (NAMED_REPAIRS of them)."""
    resumed: bool = False
    chosen: list[int] = field(default_factory=list)
    meta: StoreMeta = field(init=False)
    new_skipped: list[SkippedFile] = field(init=False)

    def start(self, *, resume: bool, overwrite: bool) -> ConvertReport | None:
        """Start (or resume) a conversion; the report when there is nothing to do."""
        fresh = Progress(
            source=self.scan.source,
            fingerprint=self.scan.fingerprint(),
            total=len(self.scan.samples),
            verify_decode=self.options.verify_decode,  # type: ignore[arg-type]
            skipped=list(self.scan.unusable),
            max_file_bytes=self.options.max_file_bytes or 0,
            fields=self.scan.schema.describe(","),
            sidecars=",".join(self.scan.sidecars),
        )
        if not resume:
            self._one_usable()
        state = self.writer.start(fresh, overwrite=overwrite, resume=resume)
        if state is None:
            assert self.writer.completed is not None, "start() returns None only when complete"
            log.info("%s: the conversion is complete already; nothing to do", self.writer.location)
            # Its skipped list stays in the store (`fastdata info --skipped`).
            return self._report(self.writer.completed, len(self.scan.samples), [])
        self._began(state, fresh)
        return None

    def _one_usable(self) -> None:
        """Refuse a source none of whose images can be used before the writer starts: the run
        would end refused, and a writer that started would have set aside what it replaces
        (an interrupted replacement of the store there, say), though a refused command changes
        nothing. Reads until the first usable image: one file, as a rule."""
        scan, options = self.scan, self.options
        load = sample_loader(
            scan, bool(options.verify_decode), options.max_file_bytes or MAX_FILE_BYTES
        )
        skipped = []
        for sample in scan.samples:
            [(_, result)] = load([sample])
            if not isinstance(result, SkippedFile):
                return
            skipped.append(result)
        if skipped or scan.unusable:
            raise _none_usable(scan, [*scan.unusable, *skipped])

    def start_append(
        self, *, resume: bool, rescan: Callable[[StoreMeta], FolderScan | None] | None = None
    ) -> ConvertReport | None:
        """Plan and start (or resume) an append; the report when there is nothing to add.
        ``rescan`` gives the source scanned again for the store found, where it must be."""
        writer, options = self.writer, self.options

        def make_plan(base: StoreMeta) -> Progress:
            scan = self.scan
            if rescan is not None and (
                scan.schema != base.schema or scan.sidecars != tuple(base.sidecars)
            ):
                self.scan = rescan(base) or scan  # (the store changed since it was looked at)
            self.plan = plan_append(
                self.scan,
                writer,
                base,
                verify_decode=bool(options.verify_decode),
                max_file_bytes=options.max_file_bytes or MAX_FILE_BYTES,
                check_content=options.check_content,
            )
            self.plan.progress.verify_decode = options.verify_decode  # type: ignore[assignment]
            self.plan.progress.max_file_bytes = options.max_file_bytes or 0
            return self.plan.progress

        state = writer.start_append(make_plan, resume=resume)
        plan = self.plan
        assert plan is not None and writer.base is not None, "start_append() plans"
        self.scan = plan.scan
        if state is None:
            log.info("%s: nothing to add; the store is as it was", writer.location)
            report = self._report(writer.base, len(plan.scan.samples), list(plan.scan.unusable))
            return plan.completed(report)
        self._began(state, plan.progress)
        return None

    def _began(self, state: Progress, fresh: Progress) -> None:
        self.state = state
        self.resumed_from = state.next_sample
        self.resumed = state is not fresh
        state.verify_decode = bool(state.verify_decode)
        if not state.max_file_bytes and self.options.max_file_bytes:  # (not recorded before)
            state.max_file_bytes = self.options.max_file_bytes
        if self.resumed:
            flags = " ".join(state.options()) or "no options"
            log.info("%s: resuming with %s", self.writer.location, flags)
            if self.plan is None:
                self._check_skipped(state)

    def _check_skipped(self, state: Progress) -> None:
        """A resumed conversion's skipped list names only files it handled: those the scan
        found unusable and among the first samples it went through, as many of those as it
        did not store, and the rest of those are the records it wrote (their headers read
        back). The store's names and labels are the scan's less that list: one that damage
        changed since would finish a store of other names.

        Raises:
            StoreError: it names another file, too many or too few, or a file it stored.
        """
        handled = self.scan.samples[: state.next_sample].packed_names
        unusable = {name_bytes(s.name) for s in self.scan.unusable}
        listed = [n for n in (name_bytes(s.name) for s in state.skipped) if n not in unusable]
        found = handled.find(PackedStrings(listed)) if listed else np.empty(0, dtype=np.int64)
        left_out = state.next_sample - state.count
        stray = [n for n, at in zip(listed, found.tolist(), strict=True) if at < 0][:1]
        why = ""
        if stray:
            why = f"{stray[0].decode('utf-8', 'surrogateescape')}, which it did not handle"
        elif len(listed) != left_out:
            why = f"{len(listed)} of the {left_out} images it did not store"
        else:
            out = set(listed)
            kept = b"\0".join(n for n in handled.slice_list(0, len(handled)) if n not in out)
            if kept != self.writer.written_names(state.count).joined():
                why = "files it stored (its records' headers say which)"
        if why:
            state.unreadable = f"its saved list of the files it left out names {why}"
            raise StoreError(
                f"{self.writer.location}: cannot resume the conversion it holds: "
                f"{state.finish_advice(self.writer.command_target)}"
            )

    def store_all(self) -> None:
        """Read, validate and store every sample left, committing in batches."""
        scan, state, options = self.scan, self.state, self.options
        total = len(scan.samples)
        batch = Batch(self.writer, state, options.commit_records, COMMIT_BYTES)
        todo = scan.samples[state.next_sample :]
        load = sample_loader(scan, state.verify_decode, state.max_file_bytes or MAX_FILE_BYTES)
        if options.workers is None:  # chunks of a few samples keep the per-task overhead small
            loaded = tuned_map(load, chunks(todo, CHUNK), default_workers(), self.chosen)
        else:
            workers = options.workers
            loaded = ordered_map(load, chunks(todo, CHUNK), workers, window(workers))
        for sample, result in (pair for chunk in loaded for pair in chunk):
            if isinstance(result, SkippedFile):
                if options.strict:
                    batch.commit()
                    raise CorruptImageError(str(scan.path_of(sample)), result.reason, *STRICT_HINT)
                log.warning("skipping %s: %s", result.name, result.reason)
                state.skipped.append(result)
            else:
                header = result.header
                batch.add(Record(state.next_index, header, result.data))
                state.count += 1
                state.repairs += header.repaired
                if header.repaired and len(self.repaired_names) < NAMED_REPAIRS:
                    self.repaired_names.append(header.name)
                state.total_bytes += header.size
            state.next_sample += 1
            batch.commit_if_full()
            if options.progress is not None and (
                state.next_sample % 32 == 0 or state.next_sample == total
            ):
                options.progress(state.next_sample, total)
        if batch or state.next_sample == self.resumed_from:
            batch.commit()
        if state.count == 0 and self.plan is None:
            # nothing worth resuming: the store goes (a store it would replace stays), so that
            # the same command runs again once the source is fixed
            self.writer.abandon()
            raise _none_usable(scan, state.skipped)

    def finish(self) -> None:
        """Complete the store: labels, names, skipped list and metadata (invariants checked)."""
        state, plan = self.state, self.plan
        skipped_from = None
        skipped = state.skipped
        if plan is None:
            labels, names = _stored(self.scan, state.count, state.skipped)
            self.meta = self._new_meta()
        else:
            assert self.writer.base is not None
            new_skipped = state.skipped[plan.base_skipped :]
            labels, names = _stored(self.scan, state.count, new_skipped)
            skipped = plan.final_skipped(state.skipped, PackedStrings.from_joined(names))
            if skipped != state.skipped:
                pairs = zip(skipped, state.skipped, strict=False)
                skipped_from = next(
                    (i for i, (a, b) in enumerate(pairs) if a != b),
                    min(len(skipped), len(state.skipped)),
                )
            labels = np.concatenate([plan.base_labels, labels])
            names = b"\0".join(n for n in (plan.base_names, names) if n)
            self.new_skipped = new_skipped
            state.skipped = skipped
            self.meta = plan.meta(self.writer.base, state)
        self.writer.finish(self.meta, labels, skipped, names, skipped_from=skipped_from)
        if self.options.progress is not None:
            self.options.progress(len(self.scan.samples), len(self.scan.samples))

    def _new_meta(self) -> StoreMeta:
        state = self.state
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return StoreMeta(
            count=state.count,
            classes=list(self.scan.classes),
            repairs=state.repairs,
            total_bytes=state.total_bytes,
            skipped_count=len(state.skipped),
            source=state.source,
            created=now,
            id=state.store_id,
            fingerprint=state.fingerprint,
            layout=self.scan.layout,
            updated=now,
            written=[[0, now]],
            fields=self.scan.schema.to_list(),
            labelled=self.scan.labelled,
            sidecars=list(self.scan.sidecars),
        )

    def report(self) -> ConvertReport:
        plan = self.plan
        skipped = self.new_skipped if plan is not None else self.state.skipped
        report = self._report(self.meta, self.resumed_from, skipped)
        workers = self.options.workers
        report.reader_threads = self.chosen if workers is None else [workers]
        report.resumed_options = self.state.options() if self.resumed else []
        report.finished = True
        report.discarded = self.writer.discarded
        report.repaired_now = self.state.repairs
        report.repaired_names = list(self.repaired_names)
        if plan is not None and self.writer.base is not None:
            report.added = self.meta.count - self.writer.base.count
        return plan.completed(report) if plan is not None else report

    def _report(
        self, meta: StoreMeta, resumed_from: int, skipped: list[SkippedFile]
    ) -> ConvertReport:
        """The report of a run that ended with the store ``meta`` describes."""
        return ConvertReport(
            destination=self.writer.location,
            destination_words=self.writer.command_target,
            count=meta.count,
            repaired=meta.repairs,
            skipped=list(skipped),
            non_image_files=self.scan.skipped_files,
            non_image_names=list(self.scan.non_image_names),
            unused_columns=list(self.scan.unused_columns),
            sidecars_seen=list(self.scan.sidecars_seen),
            total_bytes=meta.total_bytes,
            seconds=time.perf_counter() - self.started,
            resumed_from=resumed_from,
            converted=len(self.scan.samples) - resumed_from,
            classes=list(meta.classes),
            labelled=meta.labelled,
            fields=[f.spec for f in meta.schema.fields],
        )


def _none_usable(scan: FolderScan, skipped: Sequence[SkippedFile]) -> SourceError:
    reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:3])
    return SourceError(
        f"{scan.source if scan.layout == 'manifest' else scan.root}: none of its "
        f"{len(scan.samples)} images could be used ({reasons}); fix or remove them and convert "
        "again"
    )


def _stored(scan: FolderScan, count: int, skipped: list[SkippedFile]) -> tuple[np.ndarray, bytes]:
    """The labels of the records stored from ``scan``, and their names joined by NULs: the
    scan's, less those of the files ``skipped``."""
    samples = scan.samples
    labels = samples.labels.astype(np.int64)
    if count == len(samples):
        return labels, samples.joined_names()
    left_out = {name_bytes(s.name) for s in skipped}
    keep = np.fromiter(
        (n not in left_out for n in samples.name_bytes()), dtype=bool, count=len(samples)
    )
    return labels[keep], samples.joined_names(keep)
