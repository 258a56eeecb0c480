"""Sources that are not an ImageFolder tree: a CSV or JSON Lines manifest, one row per image.

A CSV manifest has a header row naming a ``path`` and a ``label`` column (other columns are
ignored); a JSON Lines manifest (``.jsonl``) has one object a line with those keys, and may give
the class order on its first line, ``{"classes": [...]}``. A path is relative to the manifest's
folder, or absolute. A label is a class name, or an integer index into an explicit class list
(the ``classes`` argument, ``--classes FILE``, or that first line). Classes are sorted like
ImageFolder's unless an order is given; records keep the manifest's row order.

Bad rows (a missing column, an empty path, an unknown class), duplicate paths and files that are
missing or not regular files are listed with their line numbers, under the same skip /
``--strict`` rules as a folder's unusable files. The scan is a :class:`~fastdata.folder.FolderScan`
like a folder's, so the conversion is the same.
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
import stat
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SourceError
from .folder import FolderScan, Samples, _SampleBuilder, file_kind, os_reason
from .records import SkippedFile

__all__ = [
    "EXPORTED_MANIFEST",
    "MANIFEST_SUFFIXES",
    "export_name",
    "is_manifest",
    "read_class_list",
    "scan_manifest",
]

EXPORTED_MANIFEST = "manifest.jsonl"
"""What ``export`` writes beside the images of a store converted from a manifest."""

MANIFEST_SUFFIXES = (".csv", ".jsonl", ".ndjson")
MAX_ROW_BYTES = 1 << 20
"""A manifest line longer than this is a bad row (and is not held in memory whole)."""


def is_manifest(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` names a manifest file (by its suffix) rather than a folder."""
    return str(source).lower().endswith(MANIFEST_SUFFIXES) and not os.path.isdir(source)


def read_class_list(path: str | os.PathLike[str]) -> list[str]:
    """A class list from a file: a JSON list, or one name a line (blank lines ignored)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: cannot read the class list ({exc})") from None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except ValueError as exc:
            raise SourceError(f"{path}: the class list is not valid JSON ({exc})") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SourceError(f"{path}: the class list must be a JSON list of names")
        return names
    return [line.strip() for line in text.splitlines() if line.strip()]


class _Rows:
    """``(line number, path, label)`` of every row, bad rows as ``(line, None, why)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.classes: list[str] | None = None

    def _lines(self, f: Any) -> Iterator[tuple[int, str]]:
        for number, line in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), ""), 1):
            if len(line) > MAX_ROW_BYTES:
                yield number, ""  # too long: reported, and the rest of it skipped
                while len(line) > MAX_ROW_BYTES and not line.endswith("\n"):
                    line = f.readline(MAX_ROW_BYTES + 1)
                continue
            yield number, line

    def _open(self) -> Any:
        try:
            return open(self.path, encoding="utf-8", newline="", errors="surrogateescape")
        except OSError as exc:
            why = os_reason(exc, "cannot read the manifest")
            raise SourceError(f"{self.path}: {why}") from None

    def __iter__(self) -> Iterator[tuple[int, str | None, Any]]:
        with self._open() as f:
            if self.path.suffix.lower() == ".csv":
                yield from self._csv(f)
            else:
                yield from self._jsonl(f)

    def _csv(self, f: Any) -> Iterator[tuple[int, str | None, Any]]:
        lines = self._lines(f)
        numbers: list[int] = []
        too_long: set[int] = set()

        def texts() -> Iterator[str]:
            for number, line in lines:
                numbers.append(number)
                if not line:
                    too_long.add(number)
                yield line or "\n"

        reader = csv.reader(texts())
        try:
            header = next(reader)
        except StopIteration:
            raise SourceError(f"{self.path}: an empty manifest") from None
        except csv.Error as exc:
            raise SourceError(f"{self.path}: line 1: {exc}") from None
        names = [h.strip().lower() for h in header]
        if "path" not in names or "label" not in names:
            raise SourceError(
                f"{self.path}: line 1 must be a header row naming a 'path' and a 'label' column "
                f"(found {', '.join(repr(h) for h in header) or 'nothing'})"
            )
        at_path, at_label = names.index("path"), names.index("label")
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                yield numbers[-1], None, f"not a valid CSV row ({exc})"
                continue
            number = numbers[-1]
            if number in too_long:
                yield number, None, f"longer than {MAX_ROW_BYTES} bytes"
                continue
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= max(at_path, at_label):
                yield number, None, f"{len(row)} column(s), the header names {len(header)}"
                continue
            yield number, row[at_path], row[at_label]

    def _jsonl(self, f: Any) -> Iterator[tuple[int, str | None, Any]]:
        for number, line in self._lines(f):
            if not line.strip():
                continue
            if not line:
                yield number, None, f"longer than {MAX_ROW_BYTES} bytes"
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                yield number, None, f"not valid JSON ({exc})"
                continue
            if number == 1 and isinstance(obj, dict) and set(obj) == {"classes"}:
                order = obj["classes"]
                if not isinstance(order, list) or not all(isinstance(c, str) for c in order):
                    raise SourceError(f"{self.path}: line 1: 'classes' must be a list of names")
                self.classes = order
                continue
            if not isinstance(obj, dict) or "path" not in obj or "label" not in obj:
                yield number, None, "not an object with a 'path' and a 'label'"
                continue
            if not isinstance(obj["path"], str):
                yield number, None, "'path' is not a string"
                continue
            yield number, obj["path"], obj["label"]


def _name(raw: str) -> str | None:
    """The record name of a manifest path: normalised, ``/``-separated; None if empty."""
    text = raw.strip()
    if not text or "\x00" in text:
        return None
    norm = posixpath.normpath(text.replace(os.sep, "/"))
    return None if norm in (".", "/") else norm


def scan_manifest(
    manifest: str | os.PathLike[str], classes: Sequence[str] | None = None
) -> FolderScan:
    """Read a CSV or JSON Lines manifest into samples and classes, checking every file.

    Args:
        manifest: the manifest file.
        classes: the class order (label ``k`` is ``classes[k]``); integer labels index it. By
            default the order comes from the manifest's first line (JSON Lines) or is the
            sorted class names.

    Raises:
        SourceError: the manifest cannot be read, lacks its header row, uses integer labels
            without a class list, or names no usable image.
    """
    path = Path(manifest).expanduser()
    if not path.exists():
        raise SourceError(f"{path}: no such manifest file")
    if not path.is_file():
        raise SourceError(f"{path}: not a regular file; give a .csv or .jsonl manifest")
    root = path.parent
    rows = _Rows(path)
    # Two passes over the file, so that no row is held: the class names first, then the samples,
    # packed as they come.
    names_of_classes: set[str] = set()
    integers = False
    for _, raw, label in rows:
        if raw is not None:
            integers |= isinstance(label, int) and not isinstance(label, bool)
            if isinstance(label, str) and label:
                names_of_classes.add(label)
    order = list(classes) if classes is not None else rows.classes
    if order is not None and len(set(order)) != len(order):
        raise SourceError(f"{path}: the class list names a class twice")
    if order is None:
        if integers:
            raise SourceError(
                f"{path}: integer labels need a class list: pass one (--classes FILE, a name a "
                'line) or start a JSON Lines manifest with {"classes": [...]}'
            )
        order = sorted(names_of_classes)
    index = {c: i for i, c in enumerate(order)}
    unusable: list[SkippedFile] = []
    builder = _SampleBuilder()
    hashes, lines = array("q"), array("q")
    for number, raw, label in rows:
        name = _name(raw) if raw is not None else None
        if name is None:
            why = label if raw is None else "empty path"
            unusable.append(SkippedFile(f"{path.name}:{number}", f"line {number}: {why}"))
            continue
        k = _label(label, index, len(order))
        if isinstance(k, str):
            unusable.append(SkippedFile(name, f"line {number}: {k}"))
            continue
        why = _unusable_file(root, name)
        if why is not None:
            unusable.append(SkippedFile(name, f"line {number}: {why}"))
            continue
        builder.add(name, k)
        hashes.append(hash(name))
        lines.append(number)
    samples = builder.build()
    keep = _first_of_each(samples, hashes, lines, unusable)
    if keep is not None:
        samples = samples.select(keep)
    if not len(samples):
        reasons = "; ".join(f"{s.reason}" for s in unusable[:3]) or "no rows"
        raise SourceError(f"{path}: no usable image in the manifest ({reasons})")
    return FolderScan(
        root,
        order,
        samples,
        0,
        unusable,
        layout="manifest",
        source=os.path.realpath(path),
    )


def _first_of_each(
    samples: Samples, hashes: array[int], lines: array[int], unusable: list[SkippedFile]
) -> np.ndarray | None:
    """Which samples to keep when a path is listed twice: the first listing (the others are
    added to ``unusable``); None when no path is. Paths are compared by hash, in one sort, and
    by their bytes where hashes meet."""
    h = np.frombuffer(hashes, dtype=np.int64)
    order = np.argsort(h, kind="stable")  # equal hashes stay in line order
    ranked = h[order]
    meets = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if not len(meets):
        return None
    keep = np.ones(len(h), dtype=bool)
    for at in meets.tolist():
        later = int(order[at])
        name = samples[later].name
        first = at - 1
        while first >= 0 and ranked[first] == ranked[at]:
            earlier = int(order[first])
            if keep[earlier] and samples[earlier].name == name:
                keep[later] = False
                unusable.append(
                    SkippedFile(
                        name,
                        f"line {lines[later]}: duplicate of line {lines[earlier]}: stored once",
                    )
                )
                break
            first -= 1
    return keep


def _label(label: Any, index: dict[str, int], n: int) -> int | str:
    """The class index of a row's label, or why it has none."""
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        return f"label {label!r} is neither a class name nor an integer"
    if isinstance(label, str):
        if label in index:
            return index[label]
        text = label.strip()
        if text in index:
            return index[text]
        if not text.lstrip("-").isdigit():
            return f"unknown class {label!r}" if text else "empty label"
        label = int(text)
    if not 0 <= label < n:
        return f"label {label} is outside the {n} classes"
    return label


def _unusable_file(root: Path, name: str) -> str | None:
    """Why the file a manifest names cannot be read, or None."""
    try:
        st = os.stat(os.path.join(root, name))
    except OSError as exc:
        return "no such file" if exc.errno == 2 else os_reason(exc)
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({file_kind(st.st_mode)})"
    return None


def export_name(name: str) -> str:
    """Where ``export`` writes the image a manifest named ``name``, relative to the export
    folder: the same path when it is a plain relative one; an absolute path under ``_root/``, and
    ``..`` parts as ``_up``, so that every image lands inside the export folder."""
    parts = name.split("/")
    if name.startswith("/"):
        parts = ["_root", *[p for p in parts if p]]
    return "/".join("_up" if p == ".." else p for p in parts if p not in ("", "."))
