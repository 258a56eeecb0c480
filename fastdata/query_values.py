"""How a record's values are reached by a query's path and compared, as MongoDB reaches and
compares them (:mod:`fastdata.query` compiles queries over these)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "ABSENT",
    "COMPARE",
    "MISSING",
    "Indexed",
    "expanded",
    "hashable",
    "kind",
    "order",
    "present",
    "resolve",
    "same",
]

MISSING = object()
"""A record without fields, as its document holds it (no ``fields`` key)."""
ABSENT = object()
"""Where a path ends in a document without its key (``null`` matches it)."""


def resolve(doc: Any, path: list[str], indexed: bool = False) -> list[Any]:
    """The values ``path`` reaches in ``doc``, as MongoDB reaches them: into documents by key,
    into arrays by index, and across an array's documents; :data:`ABSENT` where it ends in a
    document without the key, or in a value that is no document or array (what ``null``
    matches too), nothing where it ends in an array of other values or an empty one. A value
    reached by an array's index last is not looked into, should it be an array itself."""
    if not path:
        return [Indexed(doc) if indexed and type(doc) is list else doc]
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        value = doc.get(head, MISSING)
        return [ABSENT] if value is MISSING else resolve(value, rest)
    if isinstance(doc, list):
        out: list[Any] = []
        if head.isascii() and head.isdigit():  # (as MongoDB: ASCII 0-9 only)
            i = int(head)
            out += resolve(doc[i], rest, indexed=True) if i < len(doc) else [ABSENT]
        for element in doc:
            if isinstance(element, dict):
                out += resolve(element, path)
        return out
    return [ABSENT]


class Indexed:
    """An array reached by an index (``fields.a.0`` of ``[[1, 2]]``): compared whole, its
    elements not looked into."""

    __slots__ = ("value",)

    def __init__(self, value: list[Any]) -> None:
        self.value = value


def expanded(found: list[Any], absent: bool = False) -> list[Any]:
    """The values reached, and the elements of those that are arrays (``absent``: with the
    :data:`ABSENT` marks of the documents without the key)."""
    out: list[Any] = []
    for v in found:
        if v is ABSENT:
            if absent:
                out.append(v)
            continue
        if type(v) is Indexed:
            out.append(v.value)
            continue
        out.append(v)
        if type(v) is list:
            out.extend(v)
    return out


def present(found: list[Any], absent: bool = False) -> list[Any]:
    """The values reached, themselves (``absent``: with the :data:`ABSENT` marks)."""
    return [v.value if type(v) is Indexed else v for v in found if absent or v is not ABSENT]


def hashable(v: Any) -> bool:
    """A value ``$in`` looks up in a set: null, a string, a boolean, a number but NaN."""
    return v is None or type(v) in (str, bool, int) or (type(v) is float and v == v)


def kind(v: Any) -> int:
    """MongoDB's type bracket of a value: values compare only within one."""
    if v is None:
        return 0
    if isinstance(v, bool):
        return 3
    if isinstance(v, int | float):
        return 1
    if isinstance(v, str):
        return 2
    if isinstance(v, dict):
        return 4
    if isinstance(v, list):
        return 5
    return 6


def same(a: Any, b: Any) -> bool:
    """Equality as MongoDB's: numbers by value (NaN equals NaN), documents key by key in order,
    arrays element by element; values of different kinds never."""
    ka = kind(a)
    if ka != kind(b):
        return False
    if ka == 1:
        return a == b or (math.isnan(a) and math.isnan(b))
    if ka == 4:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if ka == 5:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def order(a: Any, b: Any, test: Callable[[int], bool]) -> bool:
    """``test`` of the comparison of ``a`` with ``b`` (-1, 0, 1), false where their kinds
    differ, as MongoDB's ``$gt``, ``$lt``... (no order across types in a query)."""
    ka = kind(a)
    if ka != kind(b) or ka in (4, 6):
        return False
    if ka == 0:
        return test(0)
    if ka == 1 and (math.isnan(a) or math.isnan(b)):
        return math.isnan(a) and math.isnan(b) and test(0)
    if ka == 5:
        return False  # (an array is compared element by element, by expanded)
    return test((a > b) - (a < b))


COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": lambda v, q: order(v, q, lambda c: c > 0),
    "$gte": lambda v, q: order(v, q, lambda c: c >= 0),
    "$lt": lambda v, q: order(v, q, lambda c: c < 0),
    "$lte": lambda v, q: order(v, q, lambda c: c <= 0),
}
