"""One filter language for every store: the MongoDB query document, checked once and run the
same way on LMDB (here, over each record's header) as a MongoDB server runs it.

A record is queried as the document a MongoDB store holds for it::

    {"_id": 7, "name": "cat/7.jpg", "label": 1, "size": 5120, "crc32": ..., "format": "jpeg",
     "repaired": false, "fields": {"caption": "...", "boxes": [[...], ...]}}

Supported: field paths with dots (``fields.boxes.0.2``: into documents, into arrays by index,
and across an array's documents), ``$eq $ne $gt $gte $lt $lte $in $nin $exists $size $all
$elemMatch $not $regex`` (with ``$options`` of ``imsx``), and ``$and $or $nor`` over filters.
MongoDB's rules are followed where they surprise: a comparison between values of different
types matches nothing (``1`` is not ``true``, ``"3"`` is not ``3``; ints and floats are one
type), a condition on an array field matches when the array or any of its elements does,
``{"x": None}`` matches a missing ``x``, and ``$ne`` / ``$nin`` match where the field is missing.

Anything else (``$where``, ``$expr``, ``$type``, ``$mod``, ``$text``...) is refused by
:func:`check_query`, naming the operator, before any record is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import Phrase, QueryError
from .query_values import (
    ABSENT,
    COMPARE,
    MISSING,
    expanded,
    hashable,
    kind,
    present,
    resolve,
    same,
)

__all__ = ["OPERATORS", "check_query", "compile_query", "record_document"]

OPERATORS = (
    "$all",
    "$and",
    "$elemMatch",
    "$eq",
    "$exists",
    "$gt",
    "$gte",
    "$in",
    "$lt",
    "$lte",
    "$ne",
    "$nin",
    "$nor",
    "$not",
    "$options",
    "$or",
    "$regex",
    "$size",
)
"""Every operator a query may use, on every backend."""

MOST_DEPTH = 100
"""The deepest a query may nest (documents and lists), as a MongoDB server limits it."""

RECORD_KEYS = ("_id", "name", "label", "size", "crc32", "format", "repaired", "fields")
"""The keys of a record's document a query may name (``fields.<name>`` for a field)."""

Predicate = Callable[[Any], bool]


WHERE = Phrase("--where", "where=")
"""The query's name, in the reader's words."""


def check_query(query: Any, fields: Sequence[str], where: str = "") -> dict[str, Any]:
    """The query, checked: a document of conditions on the keys of :data:`RECORD_KEYS`, on
    ``fields.<name>`` for the store's ``fields``, and of the supported operators only; numpy
    scalars in it become Python numbers (what a MongoDB driver could send).

    Raises:
        QueryError: one line naming the operator, key or field, and what to use instead.
    """
    compile_query(query, fields, where)
    return _plain(query)  # (not too deep: compile_query took it)


def compile_query(query: Any, fields: Sequence[str] = (), where: str = "") -> Predicate:
    """A predicate over a record's document (:func:`record_document`) that is true where the
    query matches it, as a MongoDB server would match the same document.

    Raises:
        QueryError: as :func:`check_query`.
    """
    try:
        return _Compiler(fields, where).filter(_plain(query))
    except RecursionError:
        raise _Compiler(fields, where).error(
            f"the query is nested deeper than {MOST_DEPTH} levels"
        ) from None


def record_document(index: int, header: Any) -> dict[str, Any]:
    """A record as the document a query is matched against (a header's values, and its index
    as ``_id``, as a MongoDB store keeps them)."""
    return {
        "_id": index,
        "name": header.name,
        "label": header.label,
        "size": header.size,
        "crc32": header.crc32,
        "format": header.format,
        "repaired": header.repaired,
        "fields": header.fields if header.fields is not None else MISSING,
    }


def _plain(value: Any, depth: int = 0) -> Any:
    """The query with numpy scalars and tuples as the plain values a driver would send.

    Raises:
        RecursionError: nested deeper than :data:`MOST_DEPTH`.
    """
    if depth > MOST_DEPTH:
        raise RecursionError
    if isinstance(value, Mapping):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    item = getattr(value, "item", None)
    if item is not None and type(value).__module__ == "numpy" and getattr(value, "ndim", 1) == 0:
        return item()
    return value


class _Compiler:
    def __init__(self, fields: Sequence[str], where: str, *, inside: bool = False) -> None:
        self.fields = list(fields)
        self.where = where
        self.inside = inside  # (an array's documents, under $elemMatch: any key)

    def error(self, text: str, *more: str | Phrase) -> QueryError:
        """``where`` (the store), the query's name, what is wrong."""
        head = f"{self.where}: " if self.where else ""
        return QueryError(head, WHERE, f": {text}", *more)

    def filter(self, query: Any) -> Predicate:
        """A filter document: every condition in it holds."""
        if not isinstance(query, Mapping):
            kind = type(query).__name__
            raise self.error(
                f"a query is a document (a dict), not a{'n' * (kind[0] in 'aeiou')} {kind}"
            )
        parts: list[Predicate] = []
        for key, value in query.items():
            if not isinstance(key, str):
                raise self.error(f"a query's keys are strings, not {key!r}")
            if key in ("$and", "$or", "$nor"):
                parts.append(self.logical(key, value))
            elif key.startswith("$"):
                raise self.unsupported(key, "at the top of a query")
            else:
                self.check_path(key)
                parts.append(self.condition(key.split("."), value))
        if len(parts) == 1:
            return parts[0]
        return lambda doc: all(p(doc) for p in parts)

    def unsupported(self, op: str, place: str = "") -> QueryError:
        where = f" {place}" if place else ""
        return self.error(
            f"{op}{where} is not an operator fastdata's queries take (the same on every store); "
            f"they take {' '.join(op for op in OPERATORS if op != '$options')} ($options goes "
            "with $regex)",
            Phrase("", "; for anything else, pass a predicate (where=lambda f: ...)"),
        )

    def logical(self, op: str, value: Any) -> Predicate:
        if not isinstance(value, list) or not value:
            raise self.error(f"{op} takes a non-empty list of filter documents")
        subs = [self.filter(v) for v in value]
        if op == "$and":
            return lambda doc: all(s(doc) for s in subs)
        if op == "$or":
            return lambda doc: any(s(doc) for s in subs)
        return lambda doc: not any(s(doc) for s in subs)

    def check_path(self, key: str) -> None:
        if self.inside:
            return
        head, _, rest = key.partition(".")
        if head == "fields" and rest:
            name = rest.split(".", 1)[0]
            if name not in self.fields:
                known = ", ".join(self.fields) or "none"
                raise self.error(f"{key!r}: the store has no field {name!r}; its fields: {known}")
            return
        if head in RECORD_KEYS and (head == "fields" or not rest):
            return
        if head in self.fields:
            raise self.error(f"{key!r}: use 'fields.{key}': the fields are under 'fields'")
        raise self.error(
            f"{key!r} is no key of a record; a query names {', '.join(RECORD_KEYS[:-1])} or "
            f"'fields.<name>' ({', '.join(self.fields) or 'no fields in this store'})"
        )

    def condition(self, path: list[str], value: Any) -> Predicate:
        """``{path: value}``: an operator document, or a value to equal."""
        mixed = isinstance(value, Mapping) and not _is_operators(value)
        if mixed and any(isinstance(k, str) and k.startswith("$") for k in value):
            raise self.error(
                f"{'.'.join(path)!r}: {list(value)}: a condition is all operators or a value to "
                "equal"
            )
        if path == ["label"] and not self.inside and _names_a_class(value):
            raise self.error(
                f"'label' is a record's class index (an int: 0 for the first class), not its "
                f"name ({value!r}); fastdata info lists the classes in their order"
            )
        test = self.operators(value) if _is_operators(value) else self.equals(value)
        return lambda doc: test(resolve(doc, path))

    def operators(
        self, spec: Mapping[str, Any], expand: bool = True
    ) -> Callable[[list[Any]], bool]:
        """An operator document (``{"$gt": 3, "$lt": 9}``): over the values a path reaches
        (``expand``: and the elements of those that are arrays, as a path's values are; not an
        array's own elements under ``$elemMatch``)."""
        tests: list[Callable[[list[Any]], bool]] = []
        options = spec.get("$options")
        if options is not None and "$regex" not in spec:
            raise self.error("$options goes with $regex")
        for op, arg in spec.items():
            if op == "$options":
                continue
            if not op.startswith("$"):
                raise self.error(
                    f"{op!r} beside operators: a condition is all operators or a value to equal"
                )
            tests.append(self.operator(op, arg, options, expand))
        if len(tests) == 1:
            return tests[0]
        return lambda found: all(t(found) for t in tests)

    def operator(
        self, op: str, arg: Any, options: Any, expand: bool = True
    ) -> Callable[[list[Any]], bool]:
        spread = expanded if expand else present
        if op in ("$gte", "$lte") and arg is None:
            return self.equals(None, expand)  # (null is the least and the greatest null)
        if op in COMPARE:
            _check_value(self, op, arg)
            if isinstance(arg, list | Mapping):
                raise self.error(
                    f"{op} with an array or a document: MongoDB orders those by BSON's rules, "
                    "which fastdata's queries do not follow; compare their elements or fields"
                )
            compare = COMPARE[op]
            return lambda found: any(compare(v, arg) for v in spread(found))
        if op == "$eq":
            return self.equals(arg, expand)
        if op == "$ne":
            equals = self.equals(arg, expand)
            return lambda found: not equals(found)
        if op in ("$in", "$nin"):
            if not isinstance(arg, list):
                raise self.error(f"{op} takes a list")
            if any(isinstance(a, Mapping) and _is_operators(a) for a in arg):
                raise self.error(f"{op} takes values, not operators")
            within = self.among(arg, expand)
            return within if op == "$in" else (lambda found: not within(found))
        if op == "$exists":
            want = not (arg is None or arg is False or (type(arg) in (int, float) and arg == 0))
            return lambda found: bool(present(found)) == want
        if op == "$size":
            if isinstance(arg, bool) or not isinstance(arg, int | float) or arg != int(arg):
                raise self.error("$size takes a whole number")
            if arg < 0:
                raise self.error("$size takes a whole number, not a negative one")
            n = int(arg)
            return lambda found: any(type(v) is list and len(v) == n for v in present(found))
        if op == "$all":
            if not isinstance(arg, list):
                raise self.error("$all takes a list")
            if not arg:
                return lambda found: False
            matches = [isinstance(a, Mapping) and list(a) == ["$elemMatch"] for a in arg]
            if any(matches) and not all(matches):
                raise self.error("$all takes values, or $elemMatch conditions, not both")
            if any(
                isinstance(a, Mapping) and _is_operators(a)
                for a, m in zip(arg, matches, strict=True)
                if not m
            ):
                raise self.error("$all takes values or $elemMatch conditions, not other operators")
            parts = [
                self.operators(a, expand) if m else self.equals(a, expand)
                for a, m in zip(arg, matches, strict=True)
            ]
            return lambda found: all(p(found) for p in parts)
        if op == "$elemMatch":
            if not isinstance(arg, Mapping):
                raise self.error("$elemMatch takes a document")
            inner: Callable[[Any], bool]
            if _is_operators(arg) and not any(k in ("$and", "$or", "$nor") for k in arg):
                values = self.operators(arg, expand=False)  # (an element: its own elements
                inner = lambda el: values([el])  # noqa: E731 -- are not looked into)
            elif not arg:  # (an element that is a document or an array)
                inner = lambda el: isinstance(el, dict | list)  # noqa: E731
            else:
                element = _Compiler(self.fields, self.where, inside=True).filter(arg)
                inner = lambda el: isinstance(el, dict) and element(el)  # noqa: E731
            return lambda found: any(
                type(v) is list and any(inner(el) for el in v) for v in present(found)
            )
        if op == "$not":
            if isinstance(arg, re.Pattern):
                rx = self.regex(arg.pattern, arg.flags)
                return lambda found: not rx(found)
            if not isinstance(arg, Mapping) or not _is_operators(arg) or not arg:
                raise self.error("$not takes an operator document ({'$gt': 3}) or a regex")
            test = self.operators(arg, expand)
            return lambda found: not test(found)
        if op == "$regex":
            if isinstance(arg, re.Pattern):
                return self.regex(arg.pattern, arg.flags | _flags(self, options), expand)
            if not isinstance(arg, str):
                raise self.error("$regex takes a string")
            return self.regex(arg, _flags(self, options), expand)
        raise self.unsupported(op)

    def regex(self, pattern: str, flags: int, expand: bool = True) -> Callable[[list[Any]], bool]:
        """A pattern as MongoDB's (PCRE's) ``\\z`` and ``\\Z`` read it, in Python's ``re``."""
        spread = expanded if expand else present
        pcre = _PCRE_END.sub(
            lambda m: m.group(1) + ("\\Z" if m.group(2) == "z" else "(?=\\n?\\Z)"), pattern
        )
        try:
            rx = re.compile(pcre, flags & (re.I | re.M | re.S | re.X))
        except re.error as exc:
            raise self.error(f"$regex {pattern!r} does not compile ({exc})") from None
        return lambda found: any(type(v) is str and rx.search(v) is not None for v in spread(found))

    def equals(self, value: Any, expand: bool = True) -> Callable[[list[Any]], bool]:
        """Equality as MongoDB's: the value itself, or an element of an array; None also
        where the path ends in a document without it."""
        _check_value(self, "$eq", value)
        spread = expanded if expand else present
        if isinstance(value, re.Pattern):
            return self.regex(value.pattern, value.flags, expand)
        if value is None:
            return lambda found: any(v is ABSENT or v is None for v in spread(found, True))
        return lambda found: any(same(v, value) for v in spread(found))

    def among(self, values: list[Any], expand: bool = True) -> Callable[[list[Any]], bool]:
        """``$in``'s test: equal to one of ``values`` (plain numbers, strings, booleans and
        null looked up in a set, by MongoDB's kind and value: ``1`` is ``1.0``, not ``true``)."""
        spread = expanded if expand else present
        plain = {(kind(v), v) for v in values if hashable(v)}
        others = [self.equals(v, expand) for v in values if not hashable(v)]
        absent = (0, None) in plain

        def within(found: list[Any]) -> bool:
            for v in spread(found, absent):
                if v is ABSENT or (hashable(v) and (kind(v), v) in plain):
                    return True
            return any(t(found) for t in others)

        return within


def _names_a_class(value: Any) -> bool:
    """Whether a condition on ``label`` compares it with a string (a class's name): a label is
    an int, so it would match nothing, on every backend."""
    if isinstance(value, str):
        return True
    if isinstance(value, Mapping) and _is_operators(value):
        return any(
            isinstance(arg, str) or (isinstance(arg, list) and any(isinstance(a, str) for a in arg))
            for op, arg in value.items()
            if op in ("$eq", "$in", "$gt", "$gte", "$lt", "$lte", "$ne", "$nin")
        )
    return False


def _is_operators(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and k.startswith("$") for k in value)
    )


def _flags(compiler: _Compiler, options: Any) -> int:
    if options is None:
        return 0
    if not isinstance(options, str) or set(options) - set("imsx"):
        raise compiler.error(f"$options {options!r}: fastdata's queries take i, m, s and x")
    return sum({"i": re.I, "m": re.M, "s": re.S, "x": re.X}[c] for c in set(options))


def _check_value(compiler: _Compiler, op: str, value: Any) -> None:
    """A value a record could hold (JSON's kinds), checked all the way down."""
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is int and not -(1 << 63) <= v < 1 << 63:
            raise compiler.error(
                f"{op} compares with {v}, beyond 64 bits: no record holds such an integer"
            )
        if v is None or isinstance(v, str | bool | int | re.Pattern):
            continue
        if isinstance(v, float):
            continue
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, Mapping):
            if any(not isinstance(k, str) for k in v):
                raise compiler.error(f"{op}: a document's keys are strings")
            stack.extend(v.values())
        else:
            raise compiler.error(
                f"{op} compares with {type(v).__name__} {v!r:.60}, which no record holds "
                "(records hold strings, numbers, booleans, null, lists and documents)"
            )


_PCRE_END = re.compile(r"((?:^|[^\\])(?:\\\\)*)\\([zZ])")
"""PCRE's ``\\z`` (the very end) and ``\\Z`` (the end, or before a last newline), which
Python's ``re`` spells ``\\Z`` and ``(?=\\n?\\Z)``."""
