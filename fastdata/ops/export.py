"""Write a store back out as the image folder it came from, byte for byte: each record checked,
and the manifest or the sidecar files that held its labels and fields written beside the images.
How each file is written (inside the folder, aside and renamed into place) is
:mod:`.export_files`."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptImageError,
    RecordError,
    StoreError,
    StoreExistsError,
    UnsafePathError,
    option,
)
from ..fields import Schema
from ..records import Record, StoreMeta, checksum, fields_problem
from ..sources.export_layout import EXPORT_MARK, EXPORTED_MANIFEST, export_name
from ..stores.files import unused_name
from ..stores.reader import StoreReader
from .export_files import (
    Destination,
    replace_file,
    safe_destination,
    safe_name,
    write_failed,
    write_file,
)
from .reports import ExportReport

__all__ = ["ExportReport", "export_store", "safe_destination"]

log = logging.getLogger(__name__)


def export_store(
    reader: StoreReader,
    outdir: str | os.PathLike[str],
    *,
    repaired: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    skip_damaged: bool = False,
    decode: bool = False,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> ExportReport:
    """Write every record to ``outdir/<its relative path>``.

    By default the original file bytes are written (a JPEG whose end-of-image marker was appended
    at conversion gets its original bytes back); ``repaired`` writes the stored, repaired bytes.
    Every record's size and checksum are checked before it is written. Each file is written under
    a temporary name and renamed into place, so no file is left partial under its own name,
    however the export ends (a temporary file that a killed export left is removed by the next
    export into that folder); a file replaced (``overwrite``) stays whole until its new bytes are.

    Args:
        reader: the store.
        outdir: the folder to write (created if missing); never inside the store itself.
        repaired: write the stored bytes rather than the original ones.
        overwrite: replace files that exist.
        resume: keep files that exist with exactly the bytes they would get, and complete those
            that hold a prefix of them (left by an export of an earlier fastdata, which wrote
            files in place), so that an export that stopped goes on where it stopped. A
            ``manifest.jsonl`` in ``outdir`` is replaced only by an export that goes on with one
            fastdata started there (its mark, ``.fastdata-export``, is there until the manifest
            is written), or with ``overwrite``: never the manifest a store came from.
        skip_damaged: leave out records that fail their checksum (listed in the report) instead
            of stopping at the first.
        decode: also decode every image fully and strictly, as ``verify --decode`` does: one
            that does not decode (a JPEG cut short, damaged pixel data) is damaged too.
        batch_size: records read at a time.
        progress: called as ``progress(done, total)``.

    Raises:
        RecordError: a record fails its checksum, or (``decode``) does not decode, without
            ``skip_damaged``; nothing is written for it.
        UnsafePathError: a record's name would land outside ``outdir``; nothing is written for it.
        StoreExistsError: a file exists already and neither ``overwrite`` nor ``resume`` fits;
            for a ``manifest.jsonl`` that no export fastdata started there wrote, before
            anything is written.
        StoreError: writing failed (a full disk, ...); the files written so far are whole.
    """
    out = Path(outdir)
    _refuse_inside_store(reader, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_failed(out, exc) from None
    report = ExportReport(str(out), repaired=repaired)
    destination = Destination(out, resume=resume)
    total = len(reader)
    meta = reader.meta
    rows: list[bytes] | None = None
    schema = meta.schema
    if meta.layout == "manifest":  # the images under their paths, and the manifest
        head: dict[str, Any] = {"classes": meta.classes} if meta.labelled else {}
        if schema:  # the types, so that converting the manifest back gives the same schema
            head["fields"] = [f.spec for f in schema.fields]
        rows = [json.dumps(head).encode() + b"\n"] if head else []
        _claim(out, reader, overwrite=overwrite)
    sidecars_written: dict[str, tuple[str, bytes]] = {}
    written: set[int] = set()
    for done, rec in enumerate(_records(reader, batch_size, skip_damaged, report), 1):
        data = _checked(reader, rec, skip_damaged, report, schema)
        if data is not None and decode:
            data = _decodes(reader, rec, data, skip_damaged, report)
        name = rec.header.name if rows is None else export_name(rec.header.name)
        if data is not None:
            data = _named(reader, rec, name, data, destination, written, skip_damaged, report)
        values = rec.header.fields or {}
        if data is None:
            pass  # (damaged, listed in the report: neither written nor in the manifest)
        elif rows is not None:
            row: dict[str, Any] = {"path": name}
            if meta.labelled:
                row["label"] = meta.classes[int(rec.header.label)]
            row.update(_in_order(values, schema))
            try:
                line = json.dumps(row, ensure_ascii=False).encode()
            except UnicodeEncodeError:  # a name of bytes that are not UTF-8: \udcXX escapes
                line = json.dumps(row).encode()  # (which the manifest reader turns back)
            rows.append(line + b"\n")
        if data is not None:
            write_file(destination, name, data, overwrite=overwrite, resume=resume, report=report)
            if meta.sidecars and rows is None:
                ordered = _in_order(values, schema)
                for side, content in _sidecar_files(name, meta.sidecars, ordered, schema):
                    # x.jpg and x.png share x.json: written once (the same values) or refused
                    first = sidecars_written.setdefault(side, (name, content))
                    if first[0] != name:
                        if first[1] != content:
                            raise StoreError(
                                f"{reader.location}: {first[0]} and {name} share the sidecar "
                                f"{side} but hold other fields; nothing can write both"
                            )
                        continue
                    files, size, kept = report.files, report.total_bytes, report.kept
                    write_file(
                        destination,
                        side,
                        content,
                        overwrite=overwrite,
                        resume=resume,
                        report=report,
                    )
                    # (sidecars go with their image: counted apart)
                    report.files, report.total_bytes, report.kept = files, size, kept
                    report.sidecars += 1
        if progress is not None and (done % 64 == 0 or done == total):
            progress(done, total)
    if rows is not None:
        manifest = b"".join(rows)
        write_file(
            destination, EXPORTED_MANIFEST, manifest, overwrite=True, resume=False, report=report
        )
        report.files -= 1  # the manifest is not one of the images
        report.total_bytes -= len(manifest)
        report.manifest = str(out / EXPORTED_MANIFEST)
        try:
            os.unlink(out / EXPORT_MARK)
        except OSError as exc:  # (the export is whole: a mark left over costs nothing)
            log.warning("%s: cannot remove it: %s", out / EXPORT_MARK, exc.strerror or exc)
    report.convert_back = _convert_back(out, report.manifest, meta)
    return report


def _claim(out: Path, reader: StoreReader, *, overwrite: bool) -> None:
    """Before the export of a store converted from a manifest writes anything into ``out``:
    refuse a ``manifest.jsonl`` there that no export fastdata started in ``out`` wrote (often
    the very manifest the store came from), unless ``overwrite``; then mark ``out`` as holding
    this export (the mark is removed once the manifest is written)."""
    manifest, mark = out / EXPORTED_MANIFEST, out / EXPORT_MARK
    ours = _marked(mark)
    if os.path.lexists(manifest) and not overwrite and not ours:
        raise StoreExistsError(
            f"{manifest}: exists already, and fastdata cannot tell that an export it left "
            f"unfinished in {out} wrote it (it may be the manifest the store came from, or a "
            "finished export's); export into another folder, or pass ",
            option("overwrite"),
            " to replace it",
        )
    if not ours:
        made = {"export of": reader.location, "store id": reader.meta.id}
        try:
            replace_file(mark, json.dumps(made).encode() + b"\n")
        except OSError as exc:
            raise write_failed(mark, exc) from None


def _marked(mark: Path) -> bool:
    """Whether ``mark`` is the mark an export leaves in its folder until it is done (a regular
    file of a few bytes, read without following a link or waiting on a FIFO)."""
    try:
        fd = os.open(mark, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        found = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    return isinstance(found, dict) and "export of" in found


def _records(
    reader: StoreReader, batch_size: int, skip_damaged: bool, report: ExportReport
) -> Iterator[Record]:
    """Every record in index order; with ``skip_damaged``, one that cannot even be read (a
    header that is not one) is listed in the report as ``record N`` and the rest go on."""
    n = len(reader)
    with reader.sequential():
        for start in range(0, n, batch_size):
            span = range(start, min(n, start + batch_size))
            try:
                batch = reader.read_records(span)
            except RecordError:
                if not skip_damaged:
                    raise
                batch = []
                for i in span:  # the batch again, one at a time, to find the damaged ones
                    try:
                        batch.extend(reader.read_records([i]))
                    except RecordError as exc:
                        log.warning("%s; skipped", exc)
                        report.damaged.append(f"record {i}")
            yield from batch


def _in_order(values: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """A record's field values in the schema's order (the order the source gave them)."""
    return {f.name: values[f.name] for f in schema.fields if f.name in values}


def _convert_back(out: Path, manifest: str, meta: StoreMeta) -> str:
    """``fastdata convert`` of what an export wrote, into ``<outdir>.lmdb``."""
    import shlex

    folder = os.path.abspath(out)
    source = os.path.abspath(manifest) if manifest else folder
    words = ["fastdata", "convert", source, unused_name(f"{folder.rstrip(os.sep)}.lmdb")]
    if not manifest and meta.sidecars:
        words += ["--sidecars", ",".join(meta.sidecars)]
        if meta.schema:
            words += ["--fields", meta.schema.describe(",")]
    return " ".join(shlex.quote(w) for w in words)


def _sidecar_files(
    name: str, sidecars: list[str], values: dict[str, Any], schema: Schema
) -> list[tuple[str, bytes]]:
    """The sidecar files of the image ``name``: ``x.txt`` (any extension but json) with its
    field's text as it was read (a field of another type than ``str``, as JSON text, which
    ``--fields`` reads back as that type), ``x.json`` with the other fields as one object."""
    base = name.rpartition(".")[0] or name
    out, rest = [], dict(values)
    for ext in sidecars:
        if ext != "json" and ext in rest:
            value = rest.pop(ext)
            field = schema.get(ext)
            text = value if field is None or field.type == "str" else json.dumps(value)
            out.append((f"{base}.{ext}", str(text).encode("utf-8")))
    if "json" in sidecars:
        out.append((f"{base}.json", json.dumps(rest, ensure_ascii=False).encode("utf-8")))
    return out


def _checked(
    reader: StoreReader, rec: Record, skip_damaged: bool, report: ExportReport, schema: Schema
) -> bytes | None:
    """The bytes to write for ``rec``, after its size and checksum are checked, and its fields
    against the schema and their checksum."""
    h = rec.header
    if len(rec.data) != h.size or checksum(rec.data) != h.crc32:
        _left_out(reader, rec, "fails its checksum", skip_damaged, report.damaged)
        return None
    why = fields_problem(h, schema) if schema or h.fields is not None else None
    if why is not None:
        _left_out(reader, rec, f"fails its fields check ({why})", skip_damaged, report.damaged)
        return None
    return rec.data if report.repaired else rec.original_bytes()


_SKIP_DAMAGED = (
    option("skip_damaged"),
    " and ",
    option("resume"),
    " to export the rest (the files written so far are kept)",
)


def _left_out(
    reader: StoreReader,
    rec: Record,
    what: str,
    skip_damaged: bool,
    listed: list[str],
    entry: str | None = None,
) -> None:
    """Record ``rec``, damaged (``what``: how), left out: with ``skip_damaged``, logged and
    listed in the report's ``listed`` (``record N (name)``, and ``entry`` after it where
    given); else its error, which says how to export the rest."""
    record = f"record {rec.index} ({rec.header.name})"
    where = f"{reader.location}: {record}"
    if skip_damaged:
        log.warning("%s %s; skipped", where, what)
        listed.append(record if entry is None else f"{record}: {entry}")
        return None
    raise RecordError(
        f"{where} {what}; nothing was written for it: pass ",
        *_SKIP_DAMAGED,
        store=reader.command_target,
    )


def _named(
    reader: StoreReader,
    rec: Record,
    name: str,
    data: bytes,
    destination: Destination,
    written: set[int],
    skip_damaged: bool,
    report: ExportReport,
) -> bytes | None:
    """``data`` if the record's file may be written under ``name``: a name no conversion
    gives (absolute, with ``..`` parts: a damaged header's) or one an earlier record of the
    store has (``written``: the names' hashes, a name the export wrote whose file is there) is
    the record's damage, as ``verify`` finds it (the names do not match its index of names)."""
    why = ""
    if not safe_name(name):
        why = "is not a safe relative path"
    elif hash(name) in written and os.path.lexists(destination.outdir / name):
        why = "is an earlier record's too"
    written.add(hash(name))
    if not why:
        return data
    _left_out(reader, rec, f"has a name that {why}", skip_damaged, report.damaged)
    return None


def _decodes(
    reader: StoreReader, rec: Record, data: bytes, skip_damaged: bool, report: ExportReport
) -> bytes | None:
    """``data`` (the bytes to write for ``rec``) if the record's image decodes, strictly, and
    one repaired at conversion was not cut between two scans (which decodes without a word)."""
    from ..images.decode import check_scans, decode_check

    try:
        if rec.header.repaired and rec.header.format == "jpeg":
            check_scans(rec.data, rec.header.name)
        decode_check(rec.data, rec.header.name)
    except CorruptImageError as exc:
        what = f"does not decode ({exc.reason})"
        _left_out(reader, rec, what, skip_damaged, report.undecodable, exc.reason)
        return None
    return data


def _refuse_inside_store(reader: StoreReader, out: Path) -> None:
    """Never write into the store's own folder (paths compared with links resolved)."""
    path = getattr(reader, "path", None)
    if not isinstance(path, str) or not os.path.exists(path):
        return
    store = Path(os.path.realpath(path))
    dest = Path(os.path.realpath(out))
    if dest == store or store in dest.parents:
        raise UnsafePathError(
            f"{out}: it is inside the store {path}; export into a folder outside it"
        )
