"""A manifest's rows, read: a CSV file with a header row naming ``path`` and ``label`` (and the
columns taken as fields), or JSON Lines, one object a line (its first line may give the class
order and the fields' types). :class:`Rows` gives each row's line number, path, label and field
values, or why the row is bad; what the rows mean is
:func:`~fastdata.sources.manifest.scan_manifest`'s business."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import SourceError, option
from ..fields import Field, check_name, parse_field_specs, unique_keys
from .reading import os_reason

__all__ = ["MAX_ROW_BYTES", "NO_LABEL", "Rows"]

MAX_ROW_BYTES = 1 << 20
"""A manifest line longer than this is a bad row (and is not held in memory whole)."""

NO_LABEL = object()
"""The label of a row that gives none (a manifest without labels: an image-text set)."""


class Rows:
    """``(line number, path, label, fields)`` of every row, bad rows as ``(line, None, why,
    None)``. ``fields`` are the row's other values: for JSON Lines every key beside ``path``
    and ``label``; for CSV the columns ``declared`` names (every other one with ``star``), as
    text. A row without a label gives ``NO_LABEL``."""

    def __init__(self, path: Path, declared: Sequence[Field] = (), star: bool = False) -> None:
        self.path = path
        self.classes: list[str] | None = None
        self.declared = list(declared)
        self.star = star
        self.columns: list[str] = []
        """The CSV columns taken as fields, in order."""
        self.unused: list[str] = []
        """The CSV columns neither path, label nor a field."""

    def _lines(self, f: Any) -> Iterator[tuple[int, str | None]]:
        """``(line number, text)``; the text is None for a line over ``MAX_ROW_BYTES`` bytes
        (read in binary, so the limit counts bytes; a UTF-8 byte-order mark is dropped)."""
        for number, raw in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), 1):
            if len(raw) > MAX_ROW_BYTES:
                yield number, None  # too long: reported, and the rest of it skipped
                while len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                    raw = f.readline(MAX_ROW_BYTES + 1)
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield number, raw.decode("utf-8", "surrogateescape")

    def _open(self) -> Any:
        try:
            return open(self.path, "rb")
        except OSError as exc:
            why = os_reason(exc, "cannot read the manifest")
            raise SourceError(f"{self.path}: {why}") from None

    def __iter__(self) -> Iterator[tuple[int, str | None, Any, Any]]:
        with self._open() as f:
            if self.path.suffix.lower() == ".csv":
                yield from self._csv(f)
            else:
                yield from self._jsonl(f)

    def _head(self, obj: dict[str, Any]) -> None:
        """A JSON Lines manifest's first line: the class order, and the fields' types (what
        ``export`` writes); types given with ``--fields`` win."""
        if "classes" in obj:
            order = obj["classes"]
            if not isinstance(order, list) or not all(isinstance(c, str) for c in order):
                raise SourceError(f"{self.path}: line 1: 'classes' must be a list of names")
            self.classes = order
        if "fields" in obj:
            specs = obj["fields"]
            if not isinstance(specs, list) or not all(isinstance(x, str) for x in specs):
                raise SourceError(
                    f"{self.path}: line 1: 'fields' must be a list like [\"caption:str\"]"
                )
            try:
                given, _ = parse_field_specs(specs) if specs else ([], False)
            except SourceError as exc:
                raise SourceError(f"{self.path}: line 1: {exc}") from None
            named = {f.name for f in self.declared}
            self.declared += [f for f in given if f.name not in named]

    def _csv(self, f: Any) -> Iterator[tuple[int, str | None, Any, Any]]:
        lines = self._lines(f)
        numbers: list[int] = []
        too_long: set[int] = set()

        def texts() -> Iterator[str]:
            for number, line in lines:
                numbers.append(number)
                if line is None:
                    too_long.add(number)
                yield "\n" if line is None else line

        # strict: a quote out of place is an error of that row, and a quoted field still open at
        # the end of the file is named (not read as one row holding every later line)
        reader = csv.reader(texts(), strict=True)
        # a cell may be as long as a row; past the csv module's own limit (128 KiB) it would
        # stop mid-cell and read the rest of the cell as rows (raising the limit is harmless
        # to anyone else in the process: it only refuses less)
        csv.field_size_limit(max(csv.field_size_limit(), MAX_ROW_BYTES))
        try:
            header = next(reader)
        except StopIteration:
            raise SourceError(f"{self.path}: an empty manifest") from None
        except csv.Error as exc:
            raise SourceError(f"{self.path}: line 1: {exc}") from None
        names = [h.strip().lower() for h in header]
        if "path" not in names:
            raise SourceError(
                f"{self.path}: line 1 must be a header row naming a 'path' and a 'label' column "
                f"(images without classes need no 'label'; found "
                f"{', '.join(repr(h) for h in header) or 'nothing'})"
            )
        at_path = names.index("path")
        at_label = names.index("label") if "label" in names else None
        columns = self._field_columns([h.strip() for h in header])
        last = max([at_path, at_label or 0, *columns.values()])
        while True:
            number = numbers[-1] + 1  # the row's first line (a quoted field may span lines)
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                if "field larger than field limit" in str(exc):
                    # what follows is the rest of that cell, not rows: nothing more is read
                    raise SourceError(
                        f"{self.path}: line {number}: a cell over {MAX_ROW_BYTES} bytes; the "
                        "rows after it cannot be told apart from its text: shorten it (keep "
                        "large values in files of their own)"
                    ) from None
                why = f"not a valid CSV row ({exc})"
                if str(exc) == "unexpected end of data":
                    why = (
                        f"a quoted field opens on this line and never closes (lines {number}-"
                        f"{numbers[-1]}, the end of the file, were read as one row)"
                    )
                yield number, None, why, None
                continue
            if too_long and any(n in too_long for n in range(number, numbers[-1] + 1)):
                yield number, None, f"longer than {MAX_ROW_BYTES} bytes", None
                continue
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= last:
                yield number, None, f"{len(row)} column(s), the header names {len(header)}", None
                continue
            if len(row) > len(header) and any(c.strip() for c in row[len(header) :]):
                # (a cell too many: a comma in an unquoted value, most often)
                why = (
                    f"{len(row)} cells, the header names {len(header)} (quote a cell with a comma)"
                )
                yield number, None, why, None
                continue
            # spaces around a field are not part of it ("img/x.jpg, cat")
            label = row[at_label].strip() if at_label is not None else NO_LABEL
            fields = {name: row[at] for name, at in columns.items()} if columns else None
            yield number, row[at_path].strip(), label, fields

    def _field_columns(self, header: list[str]) -> dict[str, int]:
        """The columns taken as fields (``--fields``), by name: where each is."""
        at = {h: i for i, h in enumerate(header)}
        used = {"path", "label", *(f.name for f in self.declared)}
        keys = [h.lower() if h.lower() in ("path", "label") else h for h in header]
        twice = [h for i, h in enumerate(keys) if h in keys[:i] and (self.star or h in used)]
        if twice:
            raise SourceError(
                f"{self.path}: line 1: the header names the column {twice[0]!r} twice; give each "
                "column its own name"
            )
        out: dict[str, int] = {}
        for field in self.declared:
            if field.name not in at:
                raise SourceError(
                    f"{self.path}: ",
                    option("fields", None),
                    f" names {field.name!r}, which is not a column of the header "
                    f"({', '.join(repr(h) for h in header)})",
                )
            out[field.name] = at[field.name]
        if self.star:
            for i, h in enumerate(header):
                if h.lower() in ("path", "label") or h in out or not h:
                    continue  # (an empty name: a trailing comma)
                why = check_name(h, f"{self.path}: line 1")
                if why is not None:
                    raise SourceError(why)
                out[h] = i
        self.columns = list(out)
        self.unused = [
            h for h in header if h and h.lower() not in ("path", "label") and h not in out
        ]
        return out

    def _jsonl(self, f: Any) -> Iterator[tuple[int, str | None, Any, Any]]:
        for number, line in self._lines(f):
            if line is None:
                yield number, None, f"longer than {MAX_ROW_BYTES} bytes", None
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=unique_keys)
            except (ValueError, RecursionError) as exc:
                why = f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})"
                yield number, None, why, None
                continue
            if number == 1 and isinstance(obj, dict) and obj and set(obj) <= {"classes", "fields"}:
                self._head(obj)
                continue
            if not isinstance(obj, dict) or "path" not in obj:
                yield number, None, "not an object with a 'path'", None
                continue
            if not isinstance(obj["path"], str):
                yield number, None, "'path' is not a string", None
                continue
            path, label = obj.pop("path"), obj.pop("label", NO_LABEL)
            bad = [p for key in obj if (p := check_name(key, "key")) is not None]
            if bad:
                yield number, None, bad[0].split(": ", 1)[1], None
                continue
            yield number, path, label, obj
