"""Per-image fields beside the image and its class: captions, multi-labels, boxes, scores, any
JSON. A store keeps one schema (:class:`Schema`: each field's name, type and shape) in its
metadata, and each record's values in its header (LMDB) or as BSON fields of its document
(MongoDB), covered by a checksum of their canonical encoding (:func:`canonical`).

Types:

- ``str``: a UTF-8 string (at most a manifest line, 1 MiB);
- ``int`` (64-bit signed), ``float`` (64-bit, finite), ``bool``: a scalar, or with a shape a
  list of them: ``float[4]`` (4 numbers), ``int[-1]`` (any number of them), ``float[-1,4]``
  (any number of rows of 4: boxes); only the first dimension may vary;
- ``json``: any JSON value (objects, lists, strings, numbers, null), nested at most
  :data:`MAX_DEPTH` deep. No other type takes null.

A field's type never changes between rows: a value of another type, NaN or infinity, a row
without a field of the schema, a string that is not valid UTF-8 and JSON nested too deep each make
the row unusable, with the reason (:meth:`Schema.check`). A schema inferred from a source's
values is :mod:`fastdata.field_inference`'s.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import SourceError, StoreError, option

__all__ = [
    "MAX_DEPTH",
    "Field",
    "Schema",
    "canonical",
    "parse_field_specs",
]

TYPES = ("str", "int", "float", "bool", "json")
NUMERIC = ("int", "float", "bool")
MAX_DEPTH = 64
"""JSON nested deeper than this (objects and lists) is refused."""
MAX_RANK = 8
FLOAT32_MAX = 3.4028235677973362e38
"""Floats up to this round to a finite float32 (its largest, 3.4028235e38, included)."""
EXACT = 1 << 53
"""The largest int a float holds exactly (an int read into a float field is at most this)."""
EXACT32 = 1 << 24
"""The largest int a float32 holds exactly: ints in lists past it keep a list of ints."""
MAX_ITEMS = 1 << 19
"""The most numbers a fixed shape may hold (a row is at most 1 MiB, two bytes a number)."""
INT64 = (-(1 << 63), (1 << 63) - 1)
RESERVED = frozenset({"path", "label", "image", "target", "classes"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,127}")
_SPEC = re.compile(
    r"\s*(?P<name>[^:\s]+)\s*(?::\s*(?P<type>[a-z]+)\s*(?:\[(?P<shape>[-0-9,\s*]*)\])?)?\s*"
)


def canonical(values: Mapping[str, Any]) -> bytes:
    """The canonical encoding of a record's field values: compact JSON, keys sorted, UTF-8. The
    record's ``fields_crc32`` is the CRC-32 of these bytes, the same whichever backend holds
    them (BSON gives back what JSON gave)."""
    return json.dumps(
        values, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json.loads``'s ``object_pairs_hook``): an
    object that gives a key twice is refused, not read with its last value only.

    Raises:
        ValueError: a key given twice, named.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} is given twice in one object")
            seen.add(key)
    return out


@dataclass(frozen=True)
class Field:
    """One field of a store's schema.

    Attributes:
        name: the key a manifest row, a sidecar or a reader uses.
        type: ``str``, ``int``, ``float``, ``bool`` or ``json``.
        shape: ``()`` for a scalar; for a list of ``int`` / ``float`` / ``bool``, its
            dimensions, ``-1`` where the length varies (the first dimension only).
    """

    name: str
    type: str
    shape: tuple[int, ...] = ()

    @property
    def spec(self) -> str:
        """The field as ``--fields`` writes it (``boxes:float[-1,4]``)."""
        dims = f"[{','.join(str(d) for d in self.shape)}]" if self.shape else ""
        return f"{self.name}:{self.type}{dims}"

    @property
    def fixed(self) -> bool:
        """Whether every value has one shape (a batch of them is one tensor)."""
        return self.type in NUMERIC and -1 not in self.shape

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "shape": list(self.shape)}

    def check(self, value: Any) -> tuple[Any, str | None]:
        """``(value as stored, None)``, or ``(None, why it is not a value of this field)``.
        An ``int`` given for a ``float`` becomes a float (the type says so); nothing else is
        converted."""
        if value is None and self.type != "json":
            return None, f"field {self.name!r} is null"
        if self.type == "str":
            if type(value) is not str:
                return None, f"field {self.name!r} is {_kind(value)}, not a string"
            why = _text_problem(value)
            return (value, None) if why is None else (None, f"field {self.name!r}: {why}")
        if self.type == "json":
            why = _json_problem(value, 1)
            return (value, None) if why is None else (None, f"field {self.name!r}: {why}")
        out, why = _numbers(value, self.type, self.shape, 0)
        if why is None:
            return out, None
        kind = f" ({_spec(self.type, self.shape)})" if self.shape else ""
        return None, f"field {self.name!r}{kind}: {why}"


class Schema:
    """A store's fields, in order; inferred from a source's values
    (:class:`~fastdata.field_inference.SchemaBuilder`) or declared, and the rule every row's
    values are checked by (:meth:`check`)."""

    def __init__(self, fields: Iterable[Field] = ()) -> None:
        self.fields: tuple[Field, ...] = tuple(fields)
        self._by_name = {f.name: f for f in self.fields}
        if len(self._by_name) != len(self.fields):
            raise ValueError("a field is named twice")

    def __bool__(self) -> bool:
        return bool(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"Schema({', '.join(f.spec for f in self.fields)})"

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def get(self, name: str) -> Field | None:
        return self._by_name.get(name)

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.fields]

    @classmethod
    def from_list(cls, items: Any, where: str) -> Schema:
        """The schema saved in a store's metadata, checked.

        Raises:
            StoreError: a damaged entry.
        """
        if not isinstance(items, list):
            raise StoreError(f"{where}: the store's field schema is damaged (not a list)")
        out = []
        for item in items:
            ok = (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and item.get("type") in TYPES
                and isinstance(item.get("shape", []), list)
                and (not item.get("shape") or _shape_problem(tuple(item["shape"])) is None)
            )
            if not ok:
                raise StoreError(f"{where}: the store's field schema is damaged ({item!r:.80})")
            out.append(Field(item["name"], item["type"], tuple(item.get("shape", []))))
        try:
            return cls(out)
        except ValueError as exc:
            raise StoreError(f"{where}: the store's field schema is damaged ({exc})") from None

    def check(self, values: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """A row's values checked against the schema: ``(values as stored, None)`` or
        ``(None, why the row is unusable)``. Every field of the schema must be there; a key
        the schema does not name is refused too (it would be lost)."""
        out: dict[str, Any] = {}
        for field in self.fields:
            if field.name not in values:
                return None, f"field {field.name!r} is missing"
            value, why = field.check(values[field.name])
            if why is not None:
                return None, why
            out[field.name] = value
        if len(values) != len(out):
            extra = next(k for k in values if k not in self._by_name)
            names = ", ".join(self.names) or "none"
            return None, f"field {extra!r} is not one of the fields ({names})"
        return out, None

    def describe(self, sep: str = ", ") -> str:
        """The fields as ``--fields`` takes them (with ``sep=","``)."""
        return sep.join(f.spec for f in self.fields)


def _numbers(value: Any, kind: str, shape: tuple[int, ...], depth: int) -> tuple[Any, str | None]:
    if not shape:
        out, why = _scalar(value, kind)
        if depth and kind == "float" and why is None and abs(out) >= FLOAT32_MAX:
            # a list of floats is read as a float32 array: nothing may become infinite there
            return (
                None,
                f"{out!r} is outside float32, which lists of floats are read as (declare json)",
            )
        return out, why
    if not isinstance(value, list):
        return None, f"{_kind(value)}, not a list ({_spec(kind, shape)})"
    want = shape[0]
    if want != -1 and len(value) != want:
        return None, f"a list of {len(value)}, not {want} ({_spec(kind, shape)})"
    if len(shape) == 1 and _plain(value, kind):
        return value, None  # (the common case, checked in one pass; kept as it is)
    out = []
    for item in value:
        got, why = _numbers(item, kind, shape[1:], depth + 1)
        if why is not None:
            return None, why
        out.append(got)
    return out, None


def _plain(items: list[Any], kind: str) -> bool:
    """Whether every item is a value of ``kind`` as stored, nothing to convert or refuse (a
    float: finite, inside float32; NaN fails the comparison)."""
    if kind == "float":
        return all(type(v) is float and -FLOAT32_MAX < v < FLOAT32_MAX for v in items)
    if kind == "int":
        return all(type(v) is int and INT64[0] <= v <= INT64[1] for v in items)
    return all(type(v) is bool for v in items)


def _scalar(value: Any, kind: str) -> tuple[Any, str | None]:
    t = type(value)
    if kind == "bool":
        return (value, None) if t is bool else (None, f"{_kind(value)} where the field is a bool")
    if kind == "int":
        if t is int:
            if not INT64[0] <= value <= INT64[1]:
                return None, f"{str(value)[:24]} is outside 64-bit integers"
            return value, None
        if t is float:
            return None, f"{value!r} is a float where the field is an int"
        return None, f"{_kind(value)} where the field is an int"
    # float
    if t is float:
        if not math.isfinite(value):
            return None, f"{value!r} where the field holds finite numbers"
        return value, None
    if t is int:
        if not -EXACT <= value <= EXACT:
            return None, f"{str(value)[:24]} is too large for a float to hold exactly (declare int)"
        return float(value), None
    return None, f"{_kind(value)} where the field is a float"


def _text_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8 (a lone surrogate or bytes of another encoding)"
    return None


def _json_problem(value: Any, depth: int) -> str | None:
    """Why ``value`` cannot be stored as JSON on both backends, or None (``depth``: how many
    lists and objects hold it, itself included if it is one)."""
    t = type(value)
    if (t is list or t is dict) and depth > MAX_DEPTH:
        return f"JSON nested deeper than {MAX_DEPTH}"
    if t is str:
        return _text_problem(value)
    if t is float:
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    if t is int:
        if not INT64[0] <= value <= INT64[1]:
            return f"{str(value)[:24]} is outside 64-bit integers"
        return None
    if value is None or t is bool:
        return None
    if t is list:
        for item in value:
            why = _json_problem(item, depth + 1)
            if why is not None:
                return why
        return None
    if t is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"key {key!r} is not a string"
            why = _text_problem(key)
            if why is not None:
                return f"key {key!r}: {why}"
            if key.startswith("$") or "." in key or "\x00" in key:
                return f"key {key!r} cannot be a MongoDB field name (no '$' first, no '.')"
            why = _json_problem(item, depth + 1)
            if why is not None:
                return why
        return None
    return f"{_kind(value)} is not JSON"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if type(value) is bool:
        return "a bool"
    if type(value) is int:
        return "an int"
    if type(value) is float:
        return "a float"
    if type(value) is str:
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _spec(kind: str, shape: tuple[int, ...]) -> str:
    return f"{kind}[{','.join(str(d) for d in shape)}]" if shape else kind


def check_name(name: str, where: str) -> str | None:
    """Why ``name`` cannot name a field, or None."""
    if name in RESERVED:
        return f"{where}: {name!r} cannot name a field (it names the image or its class)"
    if not _NAME.fullmatch(name):
        return (
            f"{where}: {name[:40]!r} cannot name a field: ASCII letters, digits, '_' and '-', "
            "starting with a letter or '_', at most 128 (rename the key or column)"
        )
    return None


_FIELDS = option("fields", None)


def parse_field_specs(text: str | Sequence[str]) -> tuple[list[Field], bool]:
    """``--fields`` as fields: ``caption,score:float,boxes:float[-1,4],meta:json`` (a name
    without a type is a string; ``*`` takes every other column as a string). Returns the
    fields and whether ``*`` was given.

    Raises:
        SourceError: a spec that names no type this knows, a bad shape or name.
    """
    items = [text] if isinstance(text, str) else list(text)
    parts: list[str] = []
    for item in items:
        parts.extend(_split_specs(item))
    if not parts:
        raise SourceError(_FIELDS, ": no field named; give NAME[:TYPE],... or '*'")
    out: list[Field] = []
    star = False
    for part in parts:
        if part.strip() == "*":
            star = True
            continue
        m = _SPEC.fullmatch(part)
        if m is None:
            raise SourceError(
                _FIELDS,
                f": cannot read {part!r}; write NAME or NAME:TYPE, TYPE one of "
                f"{', '.join(TYPES)}, with [N] or [-1,N] after int/float/bool for a list",
            )
        name, kind, dims = m.group("name"), m.group("type") or "str", m.group("shape")
        why = check_name(name, "--fields")
        if why is not None:
            raise SourceError(why)
        if kind not in TYPES:
            raise SourceError(
                _FIELDS, f": {name}: unknown type {kind!r}; one of {', '.join(TYPES)}"
            )
        shape: tuple[int, ...] = ()
        if dims is not None:
            if kind not in NUMERIC:
                raise SourceError(
                    _FIELDS, f": {name}: only int, float and bool fields take a shape"
                )
            try:
                shape = tuple(-1 if d.strip() == "*" else int(d) for d in dims.split(","))
            except ValueError:
                raise SourceError(_FIELDS, f": {name}: cannot read the shape [{dims}]") from None
            why = _shape_problem(shape)
            if why is not None:
                raise SourceError(_FIELDS, f": {name}: shape [{dims}]: {why}")
        if any(f.name == name for f in out):
            raise SourceError(_FIELDS, f": {name!r} is named twice")
        out.append(Field(name, kind, shape))
    return out, star


def _shape_problem(shape: tuple[Any, ...]) -> str | None:
    """Why ``shape`` cannot be a field's shape, or None."""
    if not shape or len(shape) > MAX_RANK:
        return f"1 to {MAX_RANK} dimensions"
    if any(type(d) is not int or d == 0 or d < -1 for d in shape) or -1 in shape[1:]:
        return "positive sizes, -1 (any length) first only"
    if math.prod(d for d in shape if d != -1) > MAX_ITEMS:
        return f"at most {MAX_ITEMS:,} numbers a row"
    return None


def _split_specs(text: str) -> list[str]:
    """Split at commas outside brackets (``boxes:float[-1,4],caption``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def parse_text_value(field: Field, text: str) -> tuple[Any, str | None]:
    """A CSV cell as a value of ``field``: a string as it is; numbers and bools as written
    (``true``/``false``); a list or a ``json`` field as JSON text."""
    if field.type == "str":
        return field.check(text)
    cell = text.strip()
    if not cell:
        return None, f"field {field.name!r} is empty"
    if field.type in NUMERIC and not field.shape:
        if field.type == "bool":
            low = cell.lower()
            if low in ("true", "false"):
                return low == "true", None
            return None, f"field {field.name!r}: {cell[:24]!r} is not true or false"
        kind = "an int" if field.type == "int" else "a number"
        if not cell.isascii() or "_" in cell:  # (int() and float() take both: JSON does not)
            return None, f"field {field.name!r}: {cell[:24]!r} is not {kind}"
        try:
            whole = cell.lstrip("+-").isdigit()  # (an int in a float column: checked as one)
            value: Any = int(cell) if field.type == "int" or whole else float(cell)
        except ValueError:
            return None, f"field {field.name!r}: {cell[:24]!r} is not {kind}"
        return field.check(value)
    try:
        value = json.loads(cell)
    except (ValueError, RecursionError) as exc:
        return None, f"field {field.name!r}: not valid JSON ({type(exc).__name__})"
    return field.check(value)
