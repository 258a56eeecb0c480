"""Sources that are not an ImageFolder tree: a CSV or JSON Lines manifest, one row per image.

A CSV manifest has a header row naming a ``path`` and a ``label`` column (other columns are
ignored); a JSON Lines manifest (``.jsonl``) has one object a line with those keys, and may give
the class order on its first line, ``{"classes": [...]}``. A path is relative to the manifest's
folder, or absolute. A label is a class name, or an integer index into an explicit class list
(the ``classes`` argument, ``--classes FILE``, or that first line). Classes are sorted like
ImageFolder's unless an order is given; records keep the manifest's row order.

Bad rows (a missing column, an empty path, an unknown class), duplicate paths and files that are
missing or not regular files are listed with their line numbers, under the same skip /
``--strict`` rules as a folder's unusable files. The scan is a
:class:`~fastdata.sources.samples.FolderScan` like a folder's, so the conversion is the same.

The rows themselves are read by :mod:`fastdata.sources.rows`; where ``export`` writes a
manifest's images back is :mod:`fastdata.sources.export_layout`.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import stat
from array import array
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Phrase, SourceError, option
from ..field_inference import SchemaBuilder
from ..fields import (
    Field,
    Schema,
    canonical,
    parse_text_value,
)
from ..packed import PackedStrings
from ..records import MAX_CLASSES, SkippedFile, name_bytes
from .reading import file_kind, os_reason
from .rows import NO_LABEL, Rows
from .samples import FolderScan, SampleBuilder, Samples

__all__ = [
    "MANIFEST_SUFFIXES",
    "is_manifest",
    "listed_folders",
    "read_class_list",
    "row_key",
    "scan_manifest",
]

MANIFEST_SUFFIXES = (".csv", ".jsonl", ".ndjson")


def is_manifest(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` names a manifest file (by its suffix) rather than a folder."""
    return str(source).lower().endswith(MANIFEST_SUFFIXES) and not os.path.isdir(source)


def read_class_list(path: str | os.PathLike[str]) -> list[str]:
    """A class list from a file: a JSON list, or one name a line (blank lines ignored)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
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


def _name(raw: str) -> str | None:
    """The record name of a manifest path: normalised, ``/``-separated; None if empty."""
    text = raw.strip()
    if not text or "\x00" in text:
        return None
    norm = posixpath.normpath(text.replace(os.sep, "/"))
    return None if norm in (".", "/") else norm


_WHOLE = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
MAX_LABEL = MAX_CLASSES - 1
"""The largest whole-number label (it sizes the class list when no list is given)."""


def _as_number(label: Any) -> int | str | None:
    """A label's whole number; why it is a number that is not a usable one (text); or None when
    it is a name. One rule for CSV text and JSON values: ``2``, ``"2"``, ``2.0`` and ``"2.0"`` are
    the number 2; ``2.5``, ``"1e3"`` are not whole; only ASCII digits count."""
    if isinstance(label, bool):
        return None
    if isinstance(label, float):
        if not label.is_integer():
            return f"label {label!r} is not a whole number"
        value = int(label)
    elif isinstance(label, int):
        value = label
    elif isinstance(label, str):
        text = label.strip()
        if not _WHOLE.fullmatch(text):
            return f"label {text!r} is not a whole number" if _DECIMAL.fullmatch(text) else None
        digits = text.lstrip("+-").split(".")[0]
        if len(digits) > len(str(MAX_LABEL)):
            return f"label {text[:24]} is too large (at most {MAX_LABEL})"
        value = int(text.split(".")[0])
    else:
        return None
    if abs(value) > MAX_LABEL:
        return f"label {str(value)[:24]} is too large (at most {MAX_LABEL})"
    return value


# Longer than the house's ~80 lines, for a reason: its two passes over the manifest share the
# class order and the row naming, and the second pass packs samples as it goes (no row held as
# an object); the steps that stand alone (labels, file identities, duplicates, names) are apart.
def scan_manifest(
    manifest: str | os.PathLike[str],
    classes: Sequence[str] | None = None,
    *,
    drop_unlisted: bool = False,
    fields: Sequence[Field] = (),
    all_fields: bool = False,
    closed: bool = False,
) -> FolderScan:
    """Read a CSV or JSON Lines manifest into samples and classes, checking every file.

    Labels follow one rule in both formats: a label that names a class of the class list is
    that class; otherwise a whole number (a JSON integer, or CSV text of digits) is an index
    into the class list. Without a class list, classes are the sorted label names, or, when
    every label is a whole number, ``"0" .. "N-1"`` (N = the largest label + 1), so that a
    label keeps its number as its target. Names and numbers mixed need a class list.

    One file is one record: rows are compared by the file they name (device and inode, links
    resolved), so a relative and an absolute path to one file, or two spellings of it, are
    stored once; the later rows are listed as duplicates, by their line.

    Args:
        manifest: the manifest file.
        classes: the class order (label ``k`` is ``classes[k]``). By default the order comes
            from the manifest's first line (JSON Lines), else as above.
        fields: declared fields (``fastdata.fields.parse_field_specs``): the CSV columns to
            keep, with their types; for JSON Lines, where every key beside ``path`` and
            ``label`` is a field, the types of those named (the others are inferred:
            ``fastdata.field_inference.SchemaBuilder``).
        all_fields: keep every other CSV column, as a string unless declared (``--fields '*'``).
        closed: ``fields`` are all the fields there are (an append's: the store's); a JSON
            Lines row with another key is unusable.

    A manifest in which no row has a label makes a store without classes (an image-text set:
    every target is -1).

    Raises:
        SourceError: the manifest cannot be read, lacks its header row, mixes class names and
            numbers without a class list, or names no usable image.
    """
    path = Path(manifest).expanduser()
    if not path.exists():
        raise SourceError(f"{path}: no such manifest file")
    if not path.is_file():
        raise SourceError(f"{path}: not a regular file; give a .csv or .jsonl manifest")
    root = path.parent
    csv_manifest = path.suffix.lower() == ".csv"
    rows = Rows(path, fields, all_fields)
    # Two passes over the file, so that no row is held: the class names (and the fields' types)
    # first, then the samples, packed as they come.
    names_of_classes: set[str] = set()
    integers = names = False
    largest = -1
    labelled_rows = 0
    builder: SchemaBuilder | None = None
    for line, raw, label, values in rows:
        if raw is None:
            continue
        if builder is None:  # (after the first line, which may declare types)
            builder = SchemaBuilder(rows.declared, closed)
        if not csv_manifest:
            builder.see(values or {}, f"line {line}")
        if label is NO_LABEL:
            continue
        labelled_rows += 1
        number = _as_number(label)
        if isinstance(number, int):
            integers = True
            largest = max(largest, number)
        elif number is None and isinstance(label, str) and label.strip():
            names = True
            names_of_classes.add(label.strip())
    labelled = labelled_rows > 0
    if csv_manifest:
        schema = Schema([*fields, *(Field(c, "str") for c in rows.columns[len(fields) :])])
    else:
        schema = (builder or SchemaBuilder(rows.declared, closed)).build(str(path))
    if not labelled and classes is not None:
        raise SourceError(f"{path}: a class list was given, but no row has a label")
    order = list(classes) if classes is not None else rows.classes
    if not labelled:
        order = []
    if order is not None and len(set(order)) != len(order):
        raise SourceError(f"{path}: the class list names a class twice")
    if order is not None and labelled and not drop_unlisted:
        _refuse_unlisted(path, rows, order)
    if order is None:
        if integers and names:
            raise SourceError(
                f"{path}: labels mix class names and numbers: pass a class list (",
                Phrase("--classes FILE, a name a line", "classes=[...], the names in order"),
                ') or start a JSON Lines manifest with {"classes": [...]}',
            )
        order = [str(k) for k in range(largest + 1)] if integers else sorted(names_of_classes)
    index = {c: i for i, c in enumerate(order)}
    unusable: list[SkippedFile] = []
    samples_builder = SampleBuilder()
    devs, inodes, lines = array("q"), array("q"), array("q")
    missing: dict[str, int] = {}  # unusable files, by absolute path: the line that named it

    def row_name(number: int) -> str:
        return f"{path.name}:{number}"

    for number, raw, label, values in rows:
        name = _name(raw) if raw is not None else None
        if name is None:
            why = label if raw is None else "empty path"
            unusable.append(SkippedFile(row_name(number), f"line {number}: {why}"))
            continue
        if not labelled:
            k: int | str = -1
        elif label is NO_LABEL:
            k = "no label (other rows have one)"
        else:
            k = _label(label, index, len(order))
        if isinstance(k, str):
            unusable.append(SkippedFile(row_name(number), f"line {number}: {name}: {k}"))
            continue
        encoded = None
        if schema:
            checked, why = _row_fields(schema, values or {}, csv_manifest)
            if why is not None:
                unusable.append(SkippedFile(row_name(number), f"line {number}: {name}: {why}"))
                continue
            encoded = canonical(checked)
        found = _file_identity(root, name)
        if isinstance(found, str):
            where = os.path.normpath(os.path.join(root, name))
            first = missing.setdefault(where, number)
            if first == number:
                unusable.append(SkippedFile(name, f"line {number}: {found}"))
            else:
                unusable.append(
                    SkippedFile(
                        row_name(number), f"line {number}: {name}: duplicate of line {first}"
                    )
                )
            continue
        samples_builder.add(name, k, encoded)
        devs.append(found[0])
        inodes.append(found[1])
        lines.append(number)
    samples = samples_builder.build()
    keep = _first_of_each(samples, devs, inodes, lines, unusable, row_name, order)
    if keep is not None:
        samples = samples.select(keep)
    unusable = _named_apart(sorted(unusable, key=_line_of), samples)
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
        schema=schema,
        labelled=labelled,
        unused_columns=tuple(rows.unused),
    )


def _row_fields(
    schema: Schema, values: dict[str, Any], from_text: bool
) -> tuple[dict[str, Any], str | None]:
    """A row's field values checked against the schema (CSV cells parsed by their type)."""
    if not from_text:
        checked, why = schema.check(values)
        return (checked or {}), why
    out: dict[str, Any] = {}
    for field in schema.fields:
        value, why = parse_text_value(field, values.get(field.name, ""))
        if why is not None:
            return {}, why
        out[field.name] = value
    return out, None


def _refuse_unlisted(path: Path, rows: Rows, order: list[str]) -> None:
    """Refuse a class list that leaves out classes the manifest uses (their rows would be
    dropped), naming the first few with their row counts."""
    listed = set(order)
    missing: dict[str, int] = {}
    for _, raw, label, _ in rows:
        if raw is None or not isinstance(label, str):
            continue
        name = label.strip()
        if name and name not in listed and _as_number(label) is None:
            missing[name] = missing.get(name, 0) + 1
    if missing:
        shown = sorted(missing.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        names = ", ".join(f"{name!r} ({n} rows)" for name, n in shown)
        more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
        raise SourceError(
            f"{path}: the class list leaves out {len(missing)} class(es) the manifest uses: "
            f"{names}{more}; add them to the list, or pass ",
            option("drop_unlisted", flag="--drop-unlisted-classes"),
            " to leave their rows out",
        )


def _first_of_each(
    samples: Samples,
    devs: array[int],
    inodes: array[int],
    lines: array[int],
    unusable: list[SkippedFile],
    row_name: Any,
    classes: Sequence[str],
) -> np.ndarray | None:
    """Which samples to keep when one file is named by several rows: the first (the others
    are added to ``unusable``, named by their line); None when every file is named once. One
    sort by (device, inode): O(n log n) however many rows name one file."""
    dev = np.frombuffer(devs, dtype=np.int64)
    ino = np.frombuffer(inodes, dtype=np.int64)
    if len(ino) < 2:
        return None
    order = np.lexsort((np.arange(len(ino)), ino, dev))  # one file's rows together, in line order
    same = (dev[order][1:] == dev[order][:-1]) & (ino[order][1:] == ino[order][:-1])
    if not same.any():
        return None
    keep = np.ones(len(ino), dtype=bool)
    # the first row of each run of one file: the row each later one repeats
    starts = np.concatenate([[True], ~same])
    run_start = np.maximum.accumulate(np.where(starts, np.arange(len(ino)), 0))
    for at in (np.flatnonzero(same) + 1).tolist():
        later, first = int(order[at]), int(order[run_start[at]])
        keep[later] = False
        a, b = samples[later], samples[first]
        labels = (
            f", labelled {classes[a.label]!r} here and {classes[b.label]!r} there"
            if a.label != b.label and a.label >= 0
            else ""
        )
        unusable.append(
            SkippedFile(
                row_name(lines[later]),
                f"line {lines[later]}: {a.name}: the same file as line {lines[first]} "
                f"({b.name}){labels}: stored once, as line {lines[first]} says",
            )
        )
    return keep


def _line_of(item: SkippedFile) -> int:
    """The manifest line an entry's reason starts with (``line N: ...``)."""
    head = item.reason.split(":", 1)[0]
    return int(head[5:]) if head.startswith("line ") and head[5:].isdigit() else 0


_ROW_NAME = re.compile(r"(?P<manifest>.+):(?P<line>[0-9]+)(?: \(row\))*")
"""How an entry that names a manifest's row is named (``labels.csv:7``, see scan_manifest)."""


def row_key(item: SkippedFile) -> str | None:
    """For a skipped entry that names a manifest's row (``labels.csv:7``), not a file: what the
    row says and what is wrong with it, less where it stood (its manifest and line numbers), so
    that the same row listed again, from another manifest or from another line, is known as
    one; None for an entry that names a file."""
    found = _ROW_NAME.fullmatch(item.name)
    if found is None or not item.reason.startswith(f"line {found['line']}: "):
        return None
    return re.sub(r"\bline [0-9]+\b", "line", item.reason.split(": ", 1)[1])


def _named_apart(unusable: list[SkippedFile], samples: Samples) -> list[SkippedFile]:
    """``unusable``, with an entry named by its row (``labels.csv:7``) renamed where a stored
    file has that very name (a skipped entry is never also a record)."""
    listed = PackedStrings([name_bytes(s.name) for s in unusable])
    clash = np.flatnonzero(samples.packed_names.find(listed) >= 0)
    if not len(clash):
        return unusable
    taken = {n for n in samples.name_bytes()}
    out = list(unusable)
    for i in clash.tolist():
        name = out[i].name
        while name_bytes(name) in taken:
            name += " (row)"
        out[i] = replace(out[i], name=name)
    return out


def _label(label: Any, index: dict[str, int], n: int) -> int | str:
    """The class index of a row's label, or why it has none (the rule: see scan_manifest)."""
    if isinstance(label, bool) or not isinstance(label, (int, float, str)):
        return f"label {label!r} is neither a class name nor a whole number"
    if isinstance(label, str) and label.strip() in index:
        return index[label.strip()]
    number = _as_number(label)
    if isinstance(number, str):
        return number
    if number is None:
        text = str(label).strip()
        return f"unknown class {text!r}" if text else "empty label"
    if not 0 <= number < n:
        return f"label {number} is outside the {n} classes"
    return number


def _file_identity(root: Path, name: str) -> tuple[int, int] | str:
    """The device and inode of the file a manifest names (links followed), or why it cannot
    be read."""
    try:
        st = os.stat(os.path.join(root, name))
    except OSError as exc:
        return "no such file" if exc.errno == 2 else os_reason(exc)
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({file_kind(st.st_mode)})"
    return st.st_dev, st.st_ino


def listed_folders(scan: FolderScan) -> set[str]:
    """The folders that the files of a manifest scan lie in, links resolved (one call per
    folder, not per file)."""
    parents: set[bytes] = set()
    names = scan.samples.packed_names
    step = 1 << 16
    for lo in range(0, len(names), step):
        for n in names.slice_list(lo, min(len(names), lo + step)):
            parents.add(n.rpartition(b"/")[0] or (b"/" if n.startswith(b"/") else b""))
    root = os.fspath(scan.root)
    return {os.path.realpath(os.path.join(root, os.fsdecode(p)) if p else root) for p in parents}
