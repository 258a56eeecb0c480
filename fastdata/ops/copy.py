"""Copy a store to another place or backend: LMDB to MongoDB and back, LMDB to LMDB (compacted).

``copy_store`` is everything ``fastdata copy`` does, as one call. Records are read in index
order, each checked against its checksum, and written through the same writer policy as a
conversion (lock, resume, build aside and replace, a new store id), with every record's bytes,
header (name, label, size, checksum, format, repair flag), the labels, the skipped list and the
metadata carried over as they are. The next batch is read while one is written.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from ..errors import Phrase, RecordError, UsageError, option
from ..images.codec import scan_end
from ..records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Progress,
    Record,
    StoreMeta,
    checksum,
    fields_problem,
    name_bytes,
)
from ..stores import open_store, open_writer
from ..stores.batch import Batch
from ..stores.policy import StoreWriter
from ..stores.reader import StoreReader

__all__ = ["CopyReport", "copy_store"]

log = logging.getLogger(__name__)

COPY_BATCH = 256
"""Records read per request from the source."""
COPY_COMMIT_BYTES = 64 << 20
"""Image bytes per committed batch at most."""


@dataclass
class CopyReport:
    """What :func:`copy_store` did."""

    source: str
    destination: str
    count: int
    total_bytes: int
    seconds: float
    resumed_from: int = 0
    copied: int = 0

    @property
    def records_per_second(self) -> float:
        return self.copied / self.seconds if self.seconds > 0 else 0.0


def _checked(reader: StoreReader, records: list[Record]) -> list[Record]:
    """``records``, each checked against its header's size and checksum, its fields against
    the store's schema and their checksum, and its scan end against its bytes; a JPEG's header
    that has none (a store written before fastdata recorded them, another tool's) is given its
    own (NOTE [ Scan ends ] in :mod:`fastdata.images.codec`)."""
    checked = reader.has_checksums
    schema = reader.meta.schema if checked else None
    out = []
    for rec in records:
        h = rec.header
        why = None
        # (a header that gives one is checked whatever its format says, as verify checks it)
        ends = scan_end(rec.data) if h.format == "jpeg" or h.scan_end != -1 else -1
        if checked and (len(rec.data) != h.size or checksum(rec.data) != h.crc32):
            why = "fails its checksum"
        elif checked and (schema or h.fields is not None):
            problem = fields_problem(h, schema)
            why = None if problem is None else f"fails its fields check ({problem})"
        if why is None and h.scan_end != -1 and h.scan_end != ends:
            said = (
                f"its header says byte {h.scan_end}, not {ends}"
                if h.scan_end >= 0
                else "its header's is no offset in its bytes"
            )
            why = f"fails its scan end check ({said})"
        if why is not None:
            raise RecordError(
                f"{reader.location}: record {rec.index} ({h.name}) {why}; nothing damaged is "
                "copied",
                store=reader.command_target,
            )
        if h.scan_end != ends:
            rec = Record(rec.index, replace(h, scan_end=ends), rec.data)
        out.append(rec)
    return out


def _batches(reader: StoreReader, start: int, size: int) -> Iterator[list[Record]]:
    """The records from ``start`` on, in index order, the next batch read while one is used."""
    n = len(reader)
    spans = [(lo, min(n, lo + size)) for lo in range(start, n, size)]
    with reader.sequential(), ThreadPoolExecutor(1, thread_name_prefix="fastdata-copy") as pool:

        def read(span: tuple[int, int]) -> list[Record]:
            return _checked(reader, reader.read_records(range(*span)))

        pending = pool.submit(read, spans[0]) if spans else None
        for k in range(len(spans)):
            assert pending is not None
            batch = pending.result()
            pending = pool.submit(read, spans[k + 1]) if k + 1 < len(spans) else None
            yield batch


def _name_of(reader: StoreReader) -> str:
    """A collection name for a copy of ``reader``: its collection's, or its folder's stem."""
    name = getattr(reader, "collection", None)
    if isinstance(name, str):
        return name
    return os.path.splitext(os.path.basename(os.path.normpath(reader.location)))[0]


def _source_words(reader: StoreReader) -> str:
    """The source store as command-line words (quoted for the shell), resolved, so that a
    resume from any folder, with any spelling of the path, names the same store: ``PATH`` or
    ``URI --source-collection C``."""
    import shlex

    path = getattr(reader, "path", None)
    if isinstance(path, str):
        return shlex.quote(os.path.realpath(path))
    uri, name = getattr(reader, "uri", None), getattr(reader, "collection", None)
    if isinstance(uri, str) and isinstance(name, str):
        from ..stores.uri import command_words

        return command_words(uri, name, "--source-collection")
    return shlex.quote(reader.location)


def _same_place(reader: StoreReader, writer: StoreWriter) -> bool:
    a, b = getattr(reader, "path", None), getattr(writer, "path", None)
    if isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(a) == os.path.realpath(b)
    return reader.location == writer.location


def copy_store(
    source: str | os.PathLike[str] | StoreReader,
    destination: str | os.PathLike[str] | StoreWriter,
    *,
    source_collection: str | None = None,
    collection: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
    batch_size: int = COPY_BATCH,
    timeout_s: float | None = None,
    where: Any = None,
) -> CopyReport:
    """Copy the store ``source`` into ``destination``, record for record.

    Args:
        source: an LMDB path, a ``mongodb://host:port/DB`` URI (with ``source_collection``),
            or an open reader. Stores of other tools are copied into fastdata's format.
        destination: an LMDB folder, a URI (with ``collection``, default the source's
            collection), or a writer.
        source_collection: the source's collection, when it is a URI.
        collection: the destination's collection, when it is a URI; when only the source is
            one, the source's (``--collection`` names the one MongoDB side).
        overwrite: replace a store at ``destination`` (built aside; the old one stays whole
            until the copy is complete).
        resume: continue an interrupted copy of the same source store (and the same
            selection).
        where: copy only the records a query selects (:mod:`fastdata.query`, the same on every
            store), in store order, or a predicate over their fields.
        allow_pickle: read a pickle-recipe LMDB source (only one you trust).
        progress: called as ``progress(done, total)``.
        batch_size: records per read from the source.
        timeout_s: for MongoDB, the server selection and connection timeout.

    Raises:
        RecordError: a source record fails its checksum (nothing damaged is copied; what was
            committed is kept and ``resume`` continues once the source is fixed).
        StoreExistsError, StoreLockedError, StoreError: as for :func:`fastdata.ops.convert`.
    """
    started = time.perf_counter()
    from ..stores.uri import is_mongo_uri, mask_uri

    if is_mongo_uri(source) and not is_mongo_uri(destination):
        # one side is MongoDB: ``collection`` names that side, whichever it is
        if source_collection is None:
            source_collection, collection = collection, None
        elif collection is not None:
            raise UsageError(
                f"{destination}: an LMDB destination has no collection; ",
                option("collection", None),
                " names the source's when only the source is a MongoDB URI (give it once)",
            )
    if is_mongo_uri(source) and not source_collection:
        flag = "--source-collection" if is_mongo_uri(destination) else "--collection"
        raise UsageError(
            f"{mask_uri(str(source))}: name the source's collection (",
            Phrase(f"{flag} NAME", "source_collection=NAME"),
            ")",
        )
    mongo: dict[str, Any] = {"timeout_s": timeout_s} if timeout_s is not None else {}
    reader = (
        source
        if isinstance(source, StoreReader)
        else open_store(source, collection=source_collection, allow_pickle=allow_pickle, **mongo)
    )
    words = _source_words(reader)
    if where is not None:
        from ..stores.view import StoreView

        reader = StoreView(reader, where=where)
        if isinstance(where, dict):  # (a predicate has no words: a caller resumes by its call)
            import json
            import shlex

            words += f" --where {shlex.quote(json.dumps(where))}"
    src_meta = reader.meta
    writer = open_writer(
        destination, collection=collection, default_collection=_name_of(reader), **mongo
    )
    if _same_place(reader, writer):
        raise UsageError(f"{writer.location}: the source and the destination are the same store")
    total = len(reader)
    fresh = Progress(
        source=words,
        fingerprint=f"store:{src_meta.id or reader.location}" + _selection(reader),
        total=total,
        skipped=reader.skipped_files(),
    )
    with writer:
        state = writer.start(fresh, overwrite=overwrite, resume=resume)
        if state is None:
            assert writer.completed is not None
            meta = writer.completed
            return CopyReport(reader.location, writer.location, meta.count, meta.total_bytes, 0.0)
        resumed_from = state.next_sample
        batch = Batch(writer, state, 4 * batch_size, COPY_COMMIT_BYTES)
        # (the names of the records copied before: from their headers, the source of truth;
        # the source's index of names may disagree with them, and the copy's would then too)
        names = bytearray(b"\0".join(name_bytes(h.name) for h in reader.iter_headers(resumed_from)))
        for records in _batches(reader, state.next_sample, batch_size):
            for rec in records:
                if rec.index:
                    names += b"\0"  # names joined by NULs, as they come
                names += name_bytes(rec.header.name)
                batch.add(rec)
                state.count += 1
                state.next_sample += 1
                state.total_bytes += len(rec.data)
                state.repairs += rec.header.repaired
            batch.commit_if_full()
            if progress is not None:
                progress(state.next_sample, total)
        if batch or state.next_sample == resumed_from:
            batch.commit()
        meta = _copied_meta(src_meta, state)
        writer.finish(meta, reader.labels, state.skipped, bytes(names))
    if progress is not None:
        progress(total, total)
    return CopyReport(
        reader.location,
        writer.location,
        meta.count,
        meta.total_bytes,
        time.perf_counter() - started,
        resumed_from,
        total - resumed_from,
    )


def _selection(reader: StoreReader) -> str:
    """A view's records, as a copy's fingerprint names them ("": the whole store): a resume
    with another selection is another copy, refused as one from another store is."""
    view = reader.identity().get("view")
    return f"/selection:{view}" if view else ""


def _copied_meta(src: StoreMeta, state: Progress) -> StoreMeta:
    """The source's metadata as it is (``updated`` too: an append to the copy compares files
    with the time the records were written), under the copy's own identity."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    return replace(
        src,
        count=state.count,
        total_bytes=state.total_bytes,
        repairs=state.repairs,
        skipped_count=len(state.skipped),
        source=src.source or state.source,
        created=src.created or now,
        format=FORMAT_NAME,
        version=FORMAT_VERSION,
        id=state.store_id,
        appended_from=[],
        copied_from=src.id,
        updated=src.updated or src.created or now,
    )
