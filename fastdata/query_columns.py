"""A query (:mod:`fastdata.query`) run over a store's columns (:mod:`fastdata.columns`): one
boolean array per condition, combined with numpy, instead of one Python call per record.

It gives the records a MongoDB server (and :func:`fastdata.query.compile_query` over each
record's document) selects, by the same rules: values of another type match nothing, a
condition on an array matches where one of its elements does, ``$ne`` and ``$nin`` match where
the path reaches nothing. Paths it runs: ``_id``, ``label``, and a field's values, with indices
into arrays of numbers (``fields.boxes.3``, ``fields.boxes.0.2``). Where a query says more (a
JSON field, an array to equal, ``$elemMatch``), :func:`column_mask` gives None and the caller
reads the records' headers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .columns import Column, column_kind
from .query_values import kind

__all__ = ["column_mask"]

EXACT = 1 << 53
INT64 = (-(1 << 63), (1 << 63) - 1)
_PCRE_END = re.compile(r"(?<!\\)((?:\\\\)*)\\([zZ])")


class _Unsupported(Exception):
    """What this module does not run: the caller reads the headers."""


ColumnOf = Callable[[str], "Column | None"]


def column_mask(
    query: Mapping[str, Any], count: int, labels: np.ndarray, column: ColumnOf
) -> np.ndarray | None:
    """The records (a bool array of ``count``) that ``query`` (checked: ``check_query``)
    selects, or None where the query needs more than the columns hold (or a column is not
    there): the caller then runs it over each record's header."""
    try:
        return _Run(count, labels, column).filter(query)
    except _Unsupported:
        return None


class _Operand:
    """What a path reaches in every record: scalars (``values``, where ``present``), or
    arrays whose elements are scalars (``elements``: ``count x k``, or rows ``flat`` with
    ``offsets``), or arrays of arrays (only their lengths matter: ``lengths``)."""

    def __init__(
        self,
        count: int,
        kind_: str,
        *,
        values: Any = None,
        present: np.ndarray | None = None,
        elements: np.ndarray | None = None,
        flat: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
    ) -> None:
        self.count, self.kind = count, kind_
        self.values, self.present = values, present
        self.elements, self.flat, self.offsets = elements, flat, offsets
        self.lengths = lengths
        """Where the path reaches an array: its length, per record (-1: no array)."""

    def none(self) -> np.ndarray:
        return np.zeros(self.count, dtype=bool)

    def exists(self) -> np.ndarray:
        return np.ones(self.count, dtype=bool) if self.present is None else self.present.copy()

    def any(self, test: Callable[[Any], np.ndarray]) -> np.ndarray:
        """Where a scalar the path reaches passes ``test`` (given an array of scalars)."""
        if self.values is not None:
            out = np.asarray(test(self.values), dtype=bool)
            return out & self.present if self.present is not None else out
        if self.elements is not None:
            if not self.elements.shape[1]:
                return self.none()
            return np.asarray(np.asarray(test(self.elements), dtype=bool).any(axis=1))
        if self.flat is not None and self.offsets is not None:
            passed = np.zeros(len(self.flat) + 1, dtype=np.int64)
            np.cumsum(test(self.flat), out=passed[1:])
            return passed[self.offsets[1:]] > passed[self.offsets[:-1]]
        return self.none()

    def sized(self, n: int) -> np.ndarray:
        if self.lengths is None:
            return self.none()
        return self.lengths == n


class _Run:
    def __init__(self, count: int, labels: np.ndarray, column: ColumnOf) -> None:
        self.count, self.labels, self.column = count, labels, column

    def filter(self, query: Mapping[str, Any]) -> np.ndarray:
        out = np.ones(self.count, dtype=bool)
        for key, value in query.items():
            if key in ("$and", "$or", "$nor"):
                parts = [self.filter(q) for q in value]
                if key == "$and":
                    mask = np.logical_and.reduce(parts)
                else:
                    mask = np.logical_or.reduce(parts)
                    if key == "$nor":
                        mask = ~mask
            else:
                operand = self.operand(key.split("."))
                if isinstance(value, Mapping) and value and all(k.startswith("$") for k in value):
                    mask = self.operators(operand, value)
                else:
                    mask = self.equals(operand, value)
            out &= mask
        return out

    # -- what a path reaches

    def operand(self, path: list[str]) -> _Operand:
        n = self.count
        head, rest = path[0], path[1:]
        if head in ("_id", "label") and not rest:
            values = np.arange(n, dtype=np.int64) if head == "_id" else self.labels
            return _Operand(n, "num", values=values)
        if head != "fields" or not rest:
            raise _Unsupported
        column = self.column(rest[0])
        if column is None or column.field.type == "json":
            raise _Unsupported
        return self.reach(column, rest[1:])

    def reach(self, column: Column, steps: list[str]) -> _Operand:
        n = self.count
        field, kind_ = column.field, column_kind(column.field)
        scalar = "str" if field.type == "str" else ("bool" if field.type == "bool" else "num")
        if not field.shape:
            if steps:  # (into a value that is no array: nothing there)
                return _Operand(n, scalar, present=np.zeros(n, dtype=bool), values=None)
            if kind_ == "text":
                return _Operand(n, scalar, values=_strings(column))
            return _Operand(n, scalar, values=_typed(column.values))
        if not all(s.isascii() and s.isdigit() for s in steps):
            raise _Unsupported  # (a key into an array of numbers: MongoDB reaches nothing)
        index = [int(s) for s in steps]
        shape = list(field.shape)
        if kind_ == "dense":
            if len(index) > len(shape) or any(i >= d for i, d in zip(index, shape, strict=False)):
                return _Operand(n, scalar, present=np.zeros(n, dtype=bool))
            at: tuple[Any, ...] = (slice(None), *index)
            values = _typed(column.values)[at]
            left = shape[len(index) :]
            if not left:
                return _Operand(n, scalar, values=values)
            lengths = np.full(n, left[0], dtype=np.int64)
            if len(left) == 1 and not index:
                return _Operand(n, scalar, elements=values, lengths=lengths)
            return _Operand(n, scalar, lengths=lengths)
        assert column.offsets is not None
        offsets = column.offsets
        lengths = np.diff(offsets)
        rows = shape[1:]
        if not index:
            if not rows:
                flat = _typed(column.values)
                return _Operand(n, scalar, flat=flat, offsets=offsets, lengths=lengths)
            return _Operand(n, scalar, lengths=lengths)
        first, more = index[0], index[1:]
        if (
            len(more) > len(rows)
            or any(i >= d for i, d in zip(more, rows, strict=False))
            or first >= len(column.values)  # (no record has that many: nor past 64 bits)
        ):
            return _Operand(n, scalar, present=np.zeros(n, dtype=bool))
        present = lengths > first
        rows_at = np.where(present, offsets[:-1] + first, 0)
        where: tuple[Any, ...] = (rows_at, *more)
        values = _typed(column.values)[where]
        left = rows[len(more) :]
        if not left:
            return _Operand(n, scalar, values=values, present=present)
        return _Operand(n, scalar, present=present, lengths=np.where(present, left[0], -1))

    # -- conditions

    def operators(self, operand: _Operand, spec: Mapping[str, Any]) -> np.ndarray:
        out = np.ones(self.count, dtype=bool)
        options = spec.get("$options")
        for op, arg in spec.items():
            if op != "$options":
                out &= self.operator(operand, op, arg, options)
        return out

    def operator(self, operand: _Operand, op: str, arg: Any, options: Any) -> np.ndarray:
        if op in ("$gte", "$lte") and arg is None:
            return self.equals(operand, None)
        if op in ("$gt", "$gte", "$lt", "$lte"):
            return self.compare(operand, op, arg)
        if op == "$eq":
            return self.equals(operand, arg)
        if op == "$ne":
            return ~self.equals(operand, arg)
        if op in ("$in", "$nin"):
            within = np.zeros(self.count, dtype=bool)
            for value in arg:
                within |= self.equals(operand, value)
            return within if op == "$in" else ~within
        if op == "$exists":
            want = not (arg is None or arg is False or (type(arg) in (int, float) and arg == 0))
            return operand.exists() if want else ~operand.exists()
        if op == "$size":
            return operand.sized(int(arg))
        if op == "$all":
            if not arg:
                return operand.none()
            out = np.ones(self.count, dtype=bool)
            for value in arg:
                if isinstance(value, Mapping):
                    raise _Unsupported
                out &= self.equals(operand, value)
            return out
        if op == "$not":
            if not isinstance(arg, Mapping):
                raise _Unsupported
            return ~self.operators(operand, arg)
        if op == "$regex":
            if not isinstance(arg, str) or not isinstance(options, str | None):
                raise _Unsupported
            return self.regex(operand, arg, options or "")
        raise _Unsupported  # ($elemMatch)

    def equals(self, operand: _Operand, value: Any) -> np.ndarray:
        if value is None:
            return ~operand.exists()
        if isinstance(value, list | Mapping | re.Pattern):
            raise _Unsupported
        return operand.any(lambda v: _compare(v, operand.kind, "$eq", value))

    def compare(self, operand: _Operand, op: str, value: Any) -> np.ndarray:
        return operand.any(lambda v: _compare(v, operand.kind, op, value))

    def regex(self, operand: _Operand, pattern: str, options: str) -> np.ndarray:
        if operand.kind != "str":
            return operand.none()
        flags = 0
        for letter in options:
            flags |= {"i": re.I, "m": re.M, "s": re.S, "x": re.X}.get(letter, 0)
        pcre = _PCRE_END.sub(
            lambda m: m.group(1) + ("\\Z" if m.group(2) == "z" else "(?=\\n?\\Z)"), pattern
        )
        rx = re.compile(pcre, flags)
        return operand.any(
            lambda v: np.fromiter((rx.search(s) is not None for s in v), bool, len(v))
        )


def _typed(values: np.ndarray) -> np.ndarray:
    return values.view(np.bool_) if values.dtype == np.uint8 else values


def _strings(column: Column) -> np.ndarray:
    from .columns import BatchColumn

    items = BatchColumn(column.field, column.values, column.offsets).items()
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "$eq": lambda a, b: a == b,
    "$gt": lambda a, b: a > b,
    "$gte": lambda a, b: a >= b,
    "$lt": lambda a, b: a < b,
    "$lte": lambda a, b: a <= b,
}


def _compare(values: np.ndarray, kind_: str, op: str, value: Any) -> np.ndarray:
    """``values op value`` as MongoDB compares them: false where ``value`` is of another kind
    (numbers are one kind: ints and floats compared by their exact values)."""
    count = values.shape
    want = {"num": 1, "str": 2, "bool": 3}[kind_]
    if kind(value) != want:
        return np.zeros(count, dtype=bool)
    test = _OPS[op]
    if kind_ == "str":
        return np.fromiter((test(s, value) for s in values.reshape(-1)), bool).reshape(count)
    if kind_ == "bool":
        return np.asarray(test(values, value))
    if isinstance(value, float) and math.isnan(value):
        return np.zeros(count, dtype=bool)  # (no value stored is NaN)
    if values.dtype.kind == "i":
        if isinstance(value, float):
            if math.isinf(value):
                value = INT64[1] + 1 if value > 0 else INT64[0] - 1
            elif value.is_integer():
                value = int(value)
            else:  # between two ints: compared with those
                if op == "$eq":
                    return np.zeros(count, dtype=bool)
                value = math.floor(value) if op in ("$gt", "$lte") else math.ceil(value)
        if value > INT64[1] or value < INT64[0]:
            above = value > INT64[1]
            result = {"$eq": False, "$gt": not above, "$gte": not above}.get(op, above)
            return np.full(count, result, dtype=bool)
        return np.asarray(test(values, value))
    if isinstance(value, int) and abs(value) > EXACT:
        raise _Unsupported  # (a float and an int past 2**53: compared exactly elsewhere)
    return np.asarray(test(values, float(value)))
