"""Sidecar files: the fields an image carries in the files beside it, WebDataset's way
(``x.jpg`` with ``x.json``, ``x.txt``, ...), read per image into raw field values; and which
sidecar-like files a folder scanned without them holds (:data:`SIDECAR_HINTS`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..errors import SourceError, option
from ..field_inference import SchemaBuilder
from ..fields import Field, check_name, parse_text_value, unique_keys
from .reading import read_file
from .samples import IMG_EXTENSIONS

__all__ = [
    "MAX_SIDECAR_BYTES",
    "SIDECAR_HINTS",
    "SIDECAR_LIMIT",
    "Sidecars",
    "beside_images",
    "sidecar_list",
]

MAX_SIDECAR_BYTES = 1 << 20
"""A sidecar file larger than this makes its image unusable (nothing larger is read)."""
SIDECAR_LIMIT = "a sidecar holds at most 1 MiB; keep larger values in files of their own"


SIDECAR_HINTS = ("json", "txt", "cls")


def beside_images(entries: list[os.DirEntry[str]]) -> set[str]:
    """The extensions of :data:`SIDECAR_HINTS` that a file named like an image has here."""
    stems = {e.name.rpartition(".")[0] for e in entries if e.name.lower().endswith(IMG_EXTENSIONS)}
    found = set()
    for e in entries:
        stem, _, ext = e.name.rpartition(".")
        if ext in SIDECAR_HINTS and stem in stems:
            found.add(ext)
    return found


def sidecar_list(sidecars: Sequence[str]) -> list[str]:
    out: list[str] = []
    for ext in sidecars:
        ext = ext.strip().lstrip(".")
        if not ext:
            continue
        if f".{ext.lower()}" in IMG_EXTENSIONS:
            raise SourceError(
                option("sidecars", None), f": {ext!r} is an image extension, not a sidecar's"
            )
        if ext != "json":
            why = check_name(ext, "--sidecars")
            if why is not None:
                raise SourceError(why)
        if ext not in out:
            out.append(ext)
    return out


class Sidecars:
    """Reads the sidecar files of each image into its raw field values (JSON text, checked
    against the schema once every image has been seen: see :func:`checked_fields`)."""

    def __init__(self, sidecars: list[str], declared: Sequence[Field], closed: bool) -> None:
        self.sidecars = sidecars
        self.builder = SchemaBuilder(declared, closed)
        self.typed = {f.name: f for f in declared if f.type != "str"}
        """Text sidecars declared of another type (``--fields cls:int``): parsed as such."""

    def read(self, image_path: str, name: str, siblings: set[str]) -> bytes | str:
        base = os.path.basename(image_path).rpartition(".")[0]
        folder = os.path.dirname(image_path)
        values: dict[str, Any] = {}
        for ext in self.sidecars:
            file = f"{base}.{ext}"
            if file not in siblings:
                if os.path.isdir(os.path.join(folder, file)):
                    return f"its sidecar {file} is a folder, not a file"
                return f"its sidecar {file} is missing (--sidecars {','.join(self.sidecars)})"
            data = read_file(os.path.join(folder, file), MAX_SIDECAR_BYTES, SIDECAR_LIMIT)
            if isinstance(data, str):
                return f"its sidecar {file}: {data}"
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"its sidecar {file} is not valid UTF-8 (byte {exc.start})"
            if ext != "json":
                if ext in values:
                    return f"field {ext!r} comes from {file} and from {base}.json"
                typed = self.typed.get(ext)
                if typed is None:
                    values[ext] = text
                    continue
                value, why = parse_text_value(typed, text.removeprefix("\ufeff"))
                if why is not None:
                    return f"its sidecar {file}: {why}"
                values[ext] = value
                continue
            try:
                obj = json.loads(text.removeprefix("\ufeff"), object_pairs_hook=unique_keys)
            except (ValueError, RecursionError) as exc:
                return f"its sidecar {file} is not valid JSON ({type(exc).__name__}: {exc})"
            if not isinstance(obj, dict):
                return f"its sidecar {file} does not hold a JSON object"
            for key, value in obj.items():
                why = check_name(key, file)
                if why is not None:
                    return why
                if key in values:
                    return f"field {key!r} comes from {file} and from {base}.{key}"
                values[key] = value
        self.builder.see(values, name)
        return json.dumps(values).encode("utf-8", "surrogatepass")
