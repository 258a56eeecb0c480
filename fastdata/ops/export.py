"""Write a store back out as the image folder it came from, byte for byte."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    SAME_COMMAND,
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
from ..stores import names
from ..stores.files import open_regular
from ..stores.reader import StoreReader

__all__ = ["ExportReport", "export_store", "safe_destination"]

log = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """What :func:`export_store` wrote."""

    outdir: str
    files: int = 0
    total_bytes: int = 0
    kept: int = 0
    """Files that existed with the right bytes (``resume``) and were left as they were."""
    damaged: list[str] = field(default_factory=list)
    """Records left out because they fail their checksum or fields check (``skip_damaged``)."""
    undecodable: list[str] = field(default_factory=list)
    """Records left out because they do not decode (``decode`` and ``skip_damaged``), each as
    ``name: why``."""
    repaired: bool = False
    manifest: str = ""
    """For a store converted from a manifest: the manifest written beside the images (JSON Lines,
    its first line the class list), which converts back to the same store."""
    sidecars: int = 0
    """Sidecar files written beside the images (a folder store's fields)."""
    convert_back: str = ""
    """The command that converts what was written back into a store like this one (the fields'
    types declared, so that they do not depend on what the values look like)."""


def safe_destination(outdir: Path, name: str) -> Path:
    """The path under ``outdir`` for a record named ``name``.

    Raises:
        UnsafePathError: the name is absolute, empty, has ``.`` or ``..`` parts or a NUL byte,
            or would resolve (through a link) outside ``outdir``.
    """
    return _Destination(outdir).path_for(name, create=False)


class _Destination:
    """Where an export writes: each record's path checked to stay inside the folder, each
    folder under it created and resolved once (its links followed) however many files go in."""

    def __init__(self, outdir: Path, *, resume: bool = False) -> None:
        self.outdir = outdir
        self.resume = resume
        """Remove what a killed export left in each folder (``--resume`` only: a folder of the
        user's may hold a file of that name of its own)."""
        self.root = os.path.realpath(outdir)
        self._folders: set[tuple[str, ...]] = set()
        """Folders (as name parts) made and found to resolve inside the root."""
        self._plain: set[str] = set()
        """Resolved folders found to be no store's folder."""

    def path_for(self, name: str, *, create: bool = True) -> Path:
        """The checked path of the record ``name``; with ``create``, its folder exists."""
        parts = name.split("/")
        if (
            not name
            or name.startswith("/")
            or "\x00" in name
            or any(p in ("", ".", "..") for p in parts)
            or (os.name == "nt" and ":" in name)  # a drive or a stream there; a plain name here
        ):
            raise UnsafePathError(
                f"record name {name!r} is not a safe relative path; refusing to write it"
            )
        target = self.outdir.joinpath(*parts)
        folder = tuple(parts[:-1])
        if folder not in self._folders:
            if create:
                # the deepest folder that exists must resolve inside first: making the rest
                # through a link that leads out would create folders outside
                existing = target.parent
                while not existing.exists() and existing != self.outdir:
                    existing = existing.parent
                self.inside(existing, name)
                target.parent.mkdir(parents=True, exist_ok=True)
            self.inside(target.parent, name)
            self.not_in_a_store(target.parent, name)
            if create:
                if self.resume and existing == target.parent:  # (a new folder holds none)
                    _remove_stale_temporaries(target.parent)
                self._folders.add(folder)
        # the folder resolves inside the root; only the file's own name may still be a link,
        # which the caller looks at (it stats the target anyway)
        if not create and os.path.islink(target):
            self.inside(target, name)
        return target

    def not_in_a_store(self, folder: Path, name: str) -> None:
        """Refuse a folder that is an LMDB store's (it holds ``data.mdb``) or lies inside one,
        however the export is asked to write (``overwrite`` too): a file written there could
        take the place of the store's own."""
        path = os.path.realpath(folder)
        while True:
            if path not in self._plain:
                if os.path.lexists(os.path.join(path, names.DATA_FILE)):
                    raise UnsafePathError(
                        f"record name {name!r} would be written into {path}, the folder of an "
                        "LMDB store; export into a folder outside every store"
                    )
                self._plain.add(path)
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent

    def inside(self, path: Path, name: str) -> None:
        """Refuse ``path`` (for the record ``name``) unless it resolves inside the folder."""
        if os.path.commonpath([self.root, os.path.realpath(path)]) != self.root:
            raise UnsafePathError(
                f"record name {name!r} resolves outside {self.outdir}; refusing to write it"
            )


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
        raise _write_failed(out, exc) from None
    report = ExportReport(str(out), repaired=repaired)
    destination = _Destination(out, resume=resume)
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
    for done, rec in enumerate(_records(reader, batch_size, skip_damaged, report), 1):
        data = _checked(reader, rec, skip_damaged, report, schema)
        if data is not None and decode:
            data = _decodes(reader, rec, data, skip_damaged, report)
        name = rec.header.name
        values = rec.header.fields or {}
        if data is None:
            pass  # (damaged, listed in the report: neither written nor in the manifest)
        elif rows is not None:
            name = export_name(name)
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
            _write(destination, name, data, overwrite=overwrite, resume=resume, report=report)
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
                    _write(
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
        _write(
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
            f"{manifest}: exists already, and no export that fastdata started in {out} wrote it "
            "(it may be the manifest the store came from); export into another folder, or pass ",
            option("overwrite"),
            " to replace it",
        )
    if not ours:
        made = {"export of": reader.location, "store id": reader.meta.id}
        try:
            _replace(mark, json.dumps(made).encode() + b"\n")
        except OSError as exc:
            raise _write_failed(mark, exc) from None


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
    words = ["fastdata", "convert", source, _unused(f"{folder.rstrip(os.sep)}.lmdb")]
    if not manifest and meta.sidecars:
        words += ["--sidecars", ",".join(meta.sidecars)]
        if meta.schema:
            words += ["--fields", meta.schema.describe(",")]
    return " ".join(shlex.quote(w) for w in words)


def _unused(path: str) -> str:
    """``path``, or the first of ``<stem>-2<ext>``, ``-3`` ... that nothing has taken: a
    command that converts into a store there never meets one (another store, the source)."""
    stem, ext = os.path.splitext(path)
    n, found = 1, path
    while os.path.lexists(found):
        n += 1
        found = f"{stem}-{n}{ext}"
    return found


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
    if len(rec.data) == h.size and checksum(rec.data) == h.crc32:
        why = fields_problem(h, schema) if schema or h.fields is not None else None
        if why is None:
            return rec.data if report.repaired else rec.original_bytes()
        if skip_damaged:
            log.warning("%s: record %d (%s): %s; skipped", reader.location, rec.index, h.name, why)
            report.damaged.append(h.name)
            return None
        raise RecordError(
            f"{reader.location}: record {rec.index} ({h.name}): {why}; nothing was written for "
            "it: pass ",
            *_SKIP_DAMAGED,
            store=reader.command_target,
        )
    if skip_damaged:
        log.warning(
            "%s: record %d (%s) fails its checksum; skipped", reader.location, rec.index, h.name
        )
        report.damaged.append(h.name)
        return None
    raise RecordError(
        f"{reader.location}: record {rec.index} ({h.name}) fails its checksum; nothing was "
        "written for it: pass ",
        *_SKIP_DAMAGED,
        store=reader.command_target,
    )


_SKIP_DAMAGED = (
    option("skip_damaged"),
    " and ",
    option("resume"),
    " to export the rest (the files written so far are kept)",
)


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
        if skip_damaged:
            log.warning(
                "%s: record %d (%s) does not decode (%s); skipped",
                reader.location,
                rec.index,
                rec.header.name,
                exc.reason,
            )
            report.undecodable.append(f"{rec.header.name}: {exc.reason}")
            return None
        raise RecordError(
            f"{reader.location}: record {rec.index} ({rec.header.name}) does not decode "
            f"({exc.reason}); nothing was written for it: pass ",
            *_SKIP_DAMAGED,
        ) from None
    return data


def _write(
    out: _Destination,
    name: str,
    data: bytes,
    *,
    overwrite: bool,
    resume: bool,
    report: ExportReport,
) -> None:
    """Write one file: under a temporary name beside it, then renamed into place (assumption 1
    of docs/guarantees.md), so that a file under its own name is always whole, however the
    export ends (Ctrl-C, a full disk, killed); a file it replaces (``overwrite``) stays whole
    until then."""
    target = out.outdir / name  # (for a message, until it is checked)
    try:
        target = out.path_for(name)
        try:
            st: os.stat_result | None = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                out.inside(target, name)  # a link there may not lead out of the folder
            held = _held(target, st, data) if resume else "other"
            if held == "whole":
                report.kept += 1
                return
            if held != "part" and not overwrite:  # (a prefix: left by an earlier fastdata)
                hint = (
                    ("it differs from the record: pass ", option("overwrite"), " to replace it")
                    if resume
                    else (
                        "export into an empty folder, or pass ",
                        option("resume"),
                        " (keep files that match) or ",
                        option("overwrite"),
                    )
                )
                raise StoreExistsError(f"{target}: exists already; ", *hint)
        _replace(target, data)
    except OSError as exc:
        raise _write_failed(target, exc) from None
    report.files += 1
    report.total_bytes += len(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_new(path: Path, data: bytes) -> None:
    """``data`` into a new file at ``path`` (which must not exist, not even as a link); a write
    that fails, or is interrupted, removes the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _temporary(target: Path) -> Path:
    return Path(names.export_temp(target, os.getpid()))


def _replace(target: Path, data: bytes) -> None:
    """``data`` written aside and renamed to ``target``: no file under that name is ever partial
    (what was there stays whole until then)."""
    tmp = _temporary(target)
    try:
        try:
            _write_new(tmp, data)
        except FileExistsError:  # left by a killed process that had this process's id
            os.unlink(tmp)
            _write_new(tmp, data)
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporary files that exports killed outright (SIGKILL, a power cut) left in
    ``folder``: those of processes that no longer run (an export running beside this one keeps
    its own)."""
    with suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            found = names.EXPORT_TEMP.fullmatch(entry.name)
            if found and not _running(int(found.group(1))) and entry.is_file(follow_symlinks=False):
                with suppress(OSError):
                    os.unlink(entry.path)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # (its temporary files exist only while it writes one, never here)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: running)
        return True
    return True


def _held(target: Path, st: os.stat_result, data: bytes) -> str:
    """What the regular file ``target`` (``st``: its lstat) holds against ``data``: ``"whole"``
    (exactly it), ``"part"`` (a shorter prefix of it: an export by an earlier fastdata, which
    wrote files in place, stopped while writing it) or ``"other"``."""
    if not stat.S_ISREG(st.st_mode) or st.st_size > len(data):
        return "other"
    fd = open_regular(target, os.O_RDONLY)  # (what lstat saw may have changed since)
    if isinstance(fd, str):
        return "other"
    with open(fd, "rb") as f:
        held = f.read(len(data) + 1)
    if held == data:
        return "whole"
    return "part" if len(held) < len(data) and data.startswith(held) else "other"


def _write_failed(where: Path, exc: OSError) -> StoreError:
    return StoreError(
        f"{where}: writing failed: {exc.strerror or exc}; free space (or fix the cause) and run ",
        SAME_COMMAND,
        " with ",
        option("resume"),
        ": the files written so far are whole and are kept",
    )


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
