"""Write a store back out as the image folder it came from, byte for byte."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreExistsError, UnsafePathError
from .stores.base import StoreReader

__all__ = ["ExportReport", "export_store", "safe_destination"]


@dataclass
class ExportReport:
    """What :func:`export_store` wrote."""

    outdir: str
    files: int = 0
    total_bytes: int = 0


def safe_destination(outdir: Path, name: str) -> Path:
    """The path under ``outdir`` for a record named ``name``.

    Raises:
        UnsafePathError: the name is absolute, empty, has ``.`` or ``..`` parts or a NUL byte,
            or would resolve (through a link) outside ``outdir``.
    """
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\x00" in name
        or any(p in ("", ".", "..") for p in parts)
        or (len(parts[0]) >= 2 and parts[0][1] == ":")
    ):
        raise UnsafePathError(
            f"record name {name!r} is not a safe relative path; refusing to write it"
        )
    target = outdir.joinpath(*parts)
    root = os.path.realpath(outdir)
    if os.path.commonpath([root, os.path.realpath(target)]) != root:
        raise UnsafePathError(
            f"record name {name!r} resolves outside {outdir}; refusing to write it"
        )
    return target


def export_store(
    reader: StoreReader,
    outdir: str | os.PathLike[str],
    *,
    repaired: bool = False,
    overwrite: bool = False,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> ExportReport:
    """Write every record to ``outdir/<its relative path>``.

    By default the original file bytes are written (a JPEG whose end-of-image marker was appended
    at conversion gets its original bytes back); ``repaired`` writes the stored, repaired bytes.

    Raises:
        UnsafePathError: a record's name would land outside ``outdir``; nothing is written for it.
        StoreExistsError: a file exists already and ``overwrite`` is false.
    """
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    report = ExportReport(str(out))
    total = len(reader)
    mode = "wb" if overwrite else "xb"
    for rec in reader.iter_records(batch_size):
        target = safe_destination(out, rec.header.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        safe_destination(out, rec.header.name)  # again, now that the folders exist
        data = rec.data if repaired else rec.original_bytes()
        try:
            with open(target, mode) as f:
                f.write(data)
        except FileExistsError as exc:
            raise StoreExistsError(
                f"{target}: exists already; export into an empty folder or pass --overwrite"
            ) from exc
        report.files += 1
        report.total_bytes += len(data)
        if progress is not None and (report.files % 64 == 0 or report.files == total):
            progress(report.files, total)
    return report
