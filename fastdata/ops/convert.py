"""Convert an image folder into a store: read and validate in parallel, write in ordered batches.

``convert`` is everything ``fastdata convert`` does, as one call. Files are read and validated by a
pool of threads (reading and CRC-32 release the GIL), results are consumed in scan order, and the
writer commits them in batches together with the progress, so an interrupted run resumes where
its last commit ended. The source folder is only ever read.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import CorruptImageError, SourceError, UsageError
from ..images.validate import validate_image
from ..packed import PackedStrings
from ..records import (
    Progress,
    Record,
    RecordHeader,
    SkippedFile,
    StoreMeta,
    checksum,
    name_bytes,
)
from ..sources.folder import FolderScan, Sample, read_file, scan_folder
from ..sources.manifest import is_manifest, listed_folders, scan_manifest
from ..stores import StoreWriter, open_writer
from .append import AppendPlan, plan_append
from .malloc import tune_malloc

__all__ = ["ConvertReport", "ProgressCallback", "convert", "default_workers"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while converting (samples handled, samples in the folder)."""

COMMIT_RECORDS = 512
"""Records per committed batch at most: batches keep the writer's memory flat."""
COMMIT_BYTES = 32 << 20
"""A batch is also committed once it holds this many image bytes."""
CHUNK = 8
"""Samples per task handed to a reader thread."""
READ_AHEAD = 256
"""Samples read ahead of the writer (about one commit's worth of typical JPEGs)."""
MAX_FILE_BYTES = 1 << 30
"""Files larger than this are skipped (``max_file_bytes``, ``--max-file-size``): no image in a
training set is that large, and reading one whole would hold it all in memory."""

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """The largest reader-thread count a conversion without ``--workers`` tries (see
    :func:`_tuned_map`): twice the CPUs, at least 8, at most 32."""
    return min(32, max(8, 2 * (os.cpu_count() or 1)))


PROBE_CHUNKS = 48
"""Chunks each candidate thread count converts while the conversion measures them."""
RETUNE_CHUNKS = 5000
"""Chunks converted with the chosen count before the candidates are measured again (the folder
may turn from cold to warm, or the other way, as it goes)."""


@dataclass
class ConvertReport:
    """What a conversion did.

    Attributes:
        destination: the store written.
        count: records in the store.
        repaired: records whose JPEG end-of-image marker was appended.
        skipped: files left out (unreadable or not decodable), with the reason.
        non_image_files: files below the class folders ignored for their extension.
        total_bytes: image bytes stored.
        seconds: wall time of this run.
        resumed_from: samples already handled by an earlier run (0 for a fresh one).
        converted: samples handled by this run.
        classes: the class names, in label order.
        reader_threads: the reader-thread counts used: the one given, or each one the
            conversion chose by measurement (1: reading in the writing thread).
        appended: the run added to a store (``append``); then ``count`` is the store's new
            size, ``converted`` what this run handled, and:
        already_stored: samples of the source the store held already (not stored again).
        new_classes: classes the store did not have, added at the end of its class list.
        class_order: ``"sorted"`` (ImageFolder's) or ``"appended"`` (new classes at the end).
        changed: files the store holds that changed since they were stored (reported, not
            stored again).
        gone: the first few images of the store that the source no longer has (the store keeps
            them); ``gone_count`` counts them all.
        moved: ``(stored name, new name)`` of images that look moved (another folder, same file
            name): stored again as new records, the old ones kept.
        skipped_unchanged: files the store lists as skipped, unchanged since: not read again.
        resumed_options: the options a resumed run continued with, as command-line flags.
    """

    destination: str
    count: int
    repaired: int
    skipped: list[SkippedFile]
    non_image_files: int
    total_bytes: int
    seconds: float
    resumed_from: int = 0
    converted: int = 0
    classes: list[str] = field(default_factory=list)
    reader_threads: list[int] = field(default_factory=list)
    appended: bool = False
    already_stored: int = 0
    new_classes: list[str] = field(default_factory=list)
    class_order: str = "sorted"
    changed: list[SkippedFile] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    gone_count: int = 0
    moved: list[tuple[str, str]] = field(default_factory=list)
    skipped_unchanged: int = 0
    resumed_options: list[str] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        return self.converted / self.seconds if self.seconds > 0 else 0.0


def _tuned_map(
    fn: Callable[[T], R], items: Iterable[T], most: int, chosen: list[int]
) -> Iterator[R]:
    """``map(fn, items)`` in order, with the reader-thread count chosen by measurement.

    No fixed count is right everywhere: on a warm folder and few CPUs, reading in the writing
    thread is fastest (threads only compete for the interpreter lock); on a cold folder or a
    network file system, where reads wait, several threads are. So the candidates (none, 2, 4, ...
    up to ``most``, stopping once one is clearly slower than the best so far) each convert
    ``PROBE_CHUNKS`` chunks, end to end, and the fewest within 10% of the fastest converts the
    next ``RETUNE_CHUNKS``, then
    they are measured again. ``chosen`` gets each count chosen.
    """
    it = iter(items)
    candidates = [1] + [k for k in (2, 4, 8, 16, 32) if k <= most]
    while True:
        rates: list[tuple[float, int]] = []
        for k in candidates:
            t = time.perf_counter()
            done = yield from _counted_map(fn, it, PROBE_CHUNKS, k)
            if done < PROBE_CHUNKS:
                return
            rates.append((done / (time.perf_counter() - t), k))
            if rates[-1][0] < 0.8 * max(rates)[0]:
                break  # past the peak: more threads only compete for the same cores
        # the fewest threads within 10% of the fastest: a probe is short, and a count that only
        # looks faster by chance costs more (threads compete for the CPUs) than it could gain
        top = max(rates)[0]
        best = min(k for rate, k in rates if rate >= 0.9 * top)
        chosen.append(best)
        log.debug("reader threads: %s; chose %d", rates, best)
        if (yield from _counted_map(fn, it, RETUNE_CHUNKS, best)) < RETUNE_CHUNKS:
            return


def _counted_map(
    fn: Callable[[T], R], it: Iterator[T], n: int, workers: int
) -> Generator[R, None, int]:
    """The next ``n`` items of ``it`` mapped by ``workers`` threads; returns how many there were."""
    done = 0
    for out in _ordered_map(fn, islice(it, n), workers, _window(workers)):
        done += 1
        yield out
    return done


def _window(workers: int) -> int:
    """Chunks in flight: about one commit's worth, so the readers keep working while a batch
    is flushed, and memory stays bounded."""
    return max(2 * workers + 2, READ_AHEAD // CHUNK)


def _ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int, window: int
) -> Iterator[R]:
    """``map(fn, items)`` on a thread pool, in order, with at most ``window`` items in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastdata-convert")
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Loaded:
    """A sample read and validated by a worker, ready to be stored."""

    header: RecordHeader
    data: bytes


def _chunks(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def _loader(
    scan: FolderScan, verify_decode: bool, max_file_bytes: int
) -> Callable[[list[Sample]], list[tuple[Sample, _Loaded | SkippedFile]]]:
    """The workers' job: read, validate and checksum a chunk of samples (never writes)."""

    def skip(sample: Sample, path: str, reason: str) -> SkippedFile:
        # the file as it was, so that an append reads it again only once it changed
        try:
            st = os.stat(path)
        except OSError:
            return SkippedFile(sample.name, reason)
        return SkippedFile(sample.name, reason, st.st_size, st.st_mtime_ns)

    def load_one(sample: Sample) -> _Loaded | SkippedFile:
        path = scan.file_path(sample.name)
        data = read_file(path, max_file_bytes)
        if isinstance(data, str):
            return skip(sample, path, data)
        try:
            checked = validate_image(data, sample.name, decode=verify_decode)
        except CorruptImageError as exc:
            return skip(sample, path, exc.reason)
        header = RecordHeader(
            name=sample.name,
            label=sample.label,
            size=len(checked.data),
            crc32=checksum(checked.data),
            format=checked.format,
            repaired=checked.repaired,
        )
        return _Loaded(header, checked.data)

    def load(chunk: list[Sample]) -> list[tuple[Sample, _Loaded | SkippedFile]]:
        return [(sample, load_one(sample)) for sample in chunk]

    return load


def _check_destination(scan: FolderScan, writer: StoreWriter) -> None:
    """Refuse a store where it would hold what it converts, comparing paths with links
    resolved: inside the source folder, or, for a manifest (whose source is the files it lists,
    not the folder it sits in), at the manifest or at a folder that holds a listed file."""
    target = getattr(writer, "path", None)
    if not isinstance(target, str):
        return  # not on the file system
    dest = Path(os.path.realpath(target))
    if scan.layout == "manifest":
        manifest = Path(scan.source)
        if dest == manifest or dest in manifest.parents:
            raise SourceError(
                f"{target}: the store would be written over the manifest {scan.source}; "
                "choose another destination"
            )
        for folder in map(Path, listed_folders(scan)):
            if dest == folder or dest in folder.parents:
                raise SourceError(
                    f"{target}: the store would be written where the manifest's images are "
                    f"(links resolved, {folder} is {'it' if dest == folder else 'inside it'}); "
                    "choose a destination that holds none of them (the images are never "
                    "written to)"
                )
        return
    root = Path(os.path.realpath(scan.root))
    if dest == root or root in dest.parents:
        raise SourceError(
            f"{target}: the store would be written inside the source folder {scan.root} "
            f"(links resolved, it is {dest}); choose a destination outside it (the source "
            "folder is never written to)"
        )


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
    max_file_bytes: int = MAX_FILE_BYTES,
    timeout_s: float | None = None,
    tune_allocator: bool = False,
    append: bool = False,
    classes: Sequence[str] | None = None,
    check_content: bool = False,
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
            and uses the fastest (see ``_tuned_map``).
        strict: raise on the first unusable file instead of skipping it.
        verify_decode: also decode every image fully with Pillow and skip those that fail. Not
            given (None): off for a new run, as recorded for a resumed one.
        resume: continue an interrupted conversion into ``destination`` with the options it
            was started with (an option given that conflicts with them is refused).
        overwrite: replace an existing store at ``destination``.
        progress: called as ``progress(done, total)`` as samples are handled.
        commit_records: records per committed batch.
        collection: the Mongo collection (default: the source folder's name).
        max_file_bytes: files larger than this are skipped.
        timeout_s: for a MongoDB destination, the server selection and connection timeout.
        tune_allocator: retune glibc's allocator for image-sized buffers
            (:func:`fastdata.ops.malloc.tune_malloc`), for the rest of the process: what the
            ``fastdata convert`` command does, since the process is the conversion's alone.
        append: add the images of ``source`` that the store at ``destination`` does not hold
            yet (by relative path) as new records, in place (see :mod:`fastdata.ops.append`);
            ``resume`` then continues an interrupted append.
        classes: for a manifest, the class order (integer labels index it).
        check_content: with ``append``, read every source file the store holds and compare
            it with its record by checksum (by default only the size is compared, and the bytes
            of files modified since the store was written).

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
    if is_manifest(source):
        scan = scan_manifest(source, classes)
    elif classes is not None:
        raise UsageError(f"{source}: a class list applies to manifests, not to image folders")
    else:
        scan = scan_folder(source)
    if strict and scan.unusable:
        first = scan.unusable[0]
        where = (
            f"{scan.source}: {first.name}"
            if scan.layout == "manifest"
            else str(scan.root / first.name)
        )
        raise SourceError(
            f"{where}: {first.reason} (--strict stops at the first unusable file; without it "
            "such files are skipped and listed)"
        )
    total = len(scan.samples)
    mongo: dict[str, Any] = {"timeout_s": timeout_s} if timeout_s is not None else {}
    writer = open_writer(
        destination, collection=collection, default_collection=scan.root.resolve().name, **mongo
    )
    _check_destination(scan, writer)
    if append and overwrite:
        raise UsageError("--append adds to a store and --overwrite replaces it: choose one")
    with writer:
        plan: AppendPlan | None = None
        fresh: Progress | None = None
        if append:

            def make_plan(base: StoreMeta) -> Progress:
                nonlocal plan
                plan = plan_append(
                    scan,
                    writer,
                    base,
                    verify_decode=bool(verify_decode),
                    max_file_bytes=max_file_bytes,
                    check_content=check_content,
                )
                plan.progress.verify_decode = verify_decode  # type: ignore[assignment]
                return plan.progress

            state = writer.start_append(make_plan, resume=resume)
            assert plan is not None and writer.base is not None, "start_append() plans"
            scan, total = plan.scan, len(plan.scan.samples)
            if state is None:
                log.info("%s: nothing to add; the store is as it was", writer.location)
                report = _report(writer.base, writer.location, scan, started, total, [])
                report.skipped = list(scan.unusable)
                return plan.completed(report)
        else:
            fresh = Progress(
                source=scan.source,
                fingerprint=scan.fingerprint(),
                total=total,
                verify_decode=verify_decode,  # type: ignore[arg-type]
                skipped=list(scan.unusable),
            )
            state = writer.start(fresh, overwrite=overwrite, resume=resume)
        if state is None:
            assert writer.completed is not None, "start() returns None only for a complete store"
            log.info("%s: the conversion is complete already; nothing to do", writer.location)
            # Its skipped list stays in the store (`fastdata info --skipped`).
            return _report(writer.completed, writer.location, scan, started, total, [])
        resumed_from = state.next_sample
        resumed = state is not (plan.progress if plan is not None else fresh)
        verify_decode = state.verify_decode = bool(state.verify_decode)
        if resumed:
            log.info(
                "%s: resuming with %s", writer.location, " ".join(state.options()) or "no options"
            )
        batch: list[Record] = []
        batch_bytes = 0

        def commit() -> None:
            nonlocal batch, batch_bytes
            writer.write(batch, state)
            batch, batch_bytes = [], 0

        todo = scan.samples[state.next_sample :]
        load = _loader(scan, verify_decode, max_file_bytes)
        # Chunks of a few samples keep the per-task overhead small.
        chosen: list[int] = []
        if workers is None:
            chunks = _tuned_map(load, _chunks(todo, CHUNK), default_workers(), chosen)
        else:
            chunks = _ordered_map(load, _chunks(todo, CHUNK), workers, _window(workers))
        for sample, loaded in (pair for chunk in chunks for pair in chunk):
            if isinstance(loaded, SkippedFile):
                if strict:
                    if batch:
                        commit()
                    raise CorruptImageError(
                        str(scan.path_of(sample)),
                        f"{loaded.reason} (--strict stops at the first unusable file; "
                        "without it such files are skipped and listed)",
                    )
                log.warning("skipping %s: %s", loaded.name, loaded.reason)
                state.skipped.append(loaded)
            else:
                header = loaded.header
                batch.append(Record(state.next_index, header, loaded.data))
                batch_bytes += header.size
                state.count += 1
                state.repairs += header.repaired
                state.total_bytes += header.size
            state.next_sample += 1
            if len(batch) >= commit_records or batch_bytes >= COMMIT_BYTES:
                commit()
            if progress is not None and (state.next_sample % 32 == 0 or state.next_sample == total):
                progress(state.next_sample, total)
        if batch or state.next_sample == resumed_from:
            commit()
        if state.count == 0 and plan is None:
            reasons = "; ".join(f"{s.name}: {s.reason}" for s in state.skipped[:3])
            raise SourceError(
                f"{scan.root}: none of its {total} images could be used ({reasons}); "
                "fix or remove them and convert again"
            )
        skipped_from = None
        final_skipped = new_skipped = state.skipped
        if plan is not None:
            assert writer.base is not None
            new_skipped = state.skipped[plan.base_skipped :]
            labels, names = _stored(scan, state.count, new_skipped)
            final_skipped = plan.final_skipped(state.skipped, PackedStrings.from_joined(names))
            if final_skipped != state.skipped:
                pairs = zip(final_skipped, state.skipped, strict=False)
                skipped_from = next(
                    (i for i, (a, b) in enumerate(pairs) if a != b),
                    min(len(final_skipped), len(state.skipped)),
                )
            labels = np.concatenate([plan.base_labels, labels])
            names = b"\0".join(n for n in (plan.base_names, names) if n)
            state.skipped = final_skipped
            meta = plan.meta(writer.base, state)
        else:
            labels, names = _stored(scan, state.count, state.skipped)
            now = datetime.now(UTC).isoformat(timespec="seconds")
            meta = StoreMeta(
                count=state.count,
                classes=list(scan.classes),
                repairs=state.repairs,
                total_bytes=state.total_bytes,
                skipped_count=len(state.skipped),
                source=state.source,
                created=now,
                id=state.store_id,
                fingerprint=state.fingerprint,
                layout=scan.layout,
                updated=now,
            )
        writer.finish(meta, labels, final_skipped, names, skipped_from=skipped_from)
    if progress is not None:
        progress(total, total)
    skipped = new_skipped if plan is not None else state.skipped
    report = _report(meta, writer.location, scan, started, resumed_from, skipped)
    report.reader_threads = chosen if workers is None else [workers]
    report.resumed_options = state.options() if resumed else []
    return plan.completed(report) if plan is not None else report


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


def _report(
    meta: StoreMeta,
    location: str,
    scan: FolderScan,
    started: float,
    resumed_from: int,
    skipped: list[SkippedFile],
) -> ConvertReport:
    """The report of a conversion that ended with the store ``meta`` describes."""
    return ConvertReport(
        destination=location,
        count=meta.count,
        repaired=meta.repairs,
        skipped=list(skipped),
        non_image_files=scan.skipped_files,
        total_bytes=meta.total_bytes,
        seconds=time.perf_counter() - started,
        resumed_from=resumed_from,
        converted=len(scan.samples) - resumed_from,
        classes=list(meta.classes),
    )
