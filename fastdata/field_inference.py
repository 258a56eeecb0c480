"""A schema inferred from the values a source gives (:class:`SchemaBuilder`): each field's type
is the kind of value most rows give it, declared fields (``--fields``) first; a field only some
rows give is refused, not guessed at. What a field is and which values it takes is
:mod:`fastdata.fields`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import SourceError, option
from .fields import EXACT, EXACT32, MAX_RANK, Field, Schema

__all__ = ["SchemaBuilder"]


class SchemaBuilder:
    """Infers a schema from the values a source gives: each field's type is the kind most of
    its rows give (:func:`_kind_of`; one odd row, first or not, is that row's problem, listed
    as unusable, not every other row's). Declared fields (``--fields``) come first and win.
    Ints and floats count as one: a field with both is a ``float`` one, its ints read as floats
    (JSON writes ``1.0`` as ``1``), unless an int is one no float holds exactly. What only
    ``json`` holds (objects, null, lists of other things than numbers) counts as one kind;
    empty lists count with the lists most rows give. No other type is widened.

    A field the source gives in some rows only is not guessed at: :meth:`build` refuses the
    source, naming the field and a row without it (declared fields are checked row by row
    instead, and a row without one is unusable). ``closed``: the declared fields are all there
    are (an append's, the store's); a row with another is unusable, not a new field."""

    def __init__(self, declared: Sequence[Field] = (), closed: bool = False) -> None:
        self.closed = closed
        self.declared = {f.name: f for f in declared}
        self.kinds: dict[str, dict[Any, list[Any]]] = {}
        """Inferred fields: per kind of their values (:func:`_kind_of`), ``[rows, field,
        whether an int there is too large for a float]``."""
        self.rows = 0
        self.seen: dict[str, int] = {}
        """Inferred fields: how many rows have each."""
        self.first_without: dict[str, str] = {}
        """Inferred fields: the first row without each (when some row has none)."""
        self.first_with: dict[str, str] = {}
        """Inferred fields: the first row with each."""
        self._first_row = ""

    def see(self, values: Mapping[str, Any], where: str = "") -> None:
        """Take one row's values; ``where`` names the row in :meth:`build`'s refusal."""
        self.rows += 1
        if self.rows == 1:
            self._first_row = where
        inferred = 0
        for name, value in values.items():
            if name in self.declared or self.closed:
                continue
            inferred += 1
            count = self.seen.get(name)
            if count is None:
                self.seen[name] = 1
                self.kinds[name] = {}
                self.first_with[name] = where
                if self.rows > 1:
                    self.first_without[name] = self._first_row
            else:
                self.seen[name] = count + 1
            key, field, big = _kind_of(name, value)
            kinds = self.kinds[name]
            slot = kinds.get(key)
            if slot is None:
                kinds[key] = [1, field, big]
            else:
                slot[0] += 1
                slot[2] = slot[2] or big
        if inferred < len(self.seen) and len(self.first_without) < len(self.seen):
            # (once every field has been missing somewhere, nothing is left to note)
            for name in self.seen:
                if name not in values:
                    self.first_without.setdefault(name, where)

    def _chosen(self, name: str) -> Field:
        """The field of the kind most of ``name``'s rows give (the first seen of equals)."""
        kinds = {k: list(slot) for k, slot in self.kinds[name].items()}
        for key in list(kinds):
            # ints where floats are too: one kind, floats (unless an int is one no float holds)
            real: Any = None
            if key is int:
                real = float
            elif type(key) is tuple and key[1] == "int":
                real = ("list", "float", key[2])
            if real in kinds and not kinds[key][2]:
                kinds[real][0] += kinds.pop(key)[0]
        # what only json holds (objects, null, lists of anything but numbers) is one kind
        only_json = [k for k in (dict, type(None), ("list", "json", ())) if k in kinds]
        for key in only_json[1:]:
            kinds[only_json[0]][0] += kinds.pop(key)[0]
        empty = kinds.pop(EMPTY, None)  # empty lists go with the lists most rows give
        if empty is not None:
            lists = [k for k in kinds if type(k) is tuple]
            if lists:
                kinds[max(lists, key=lambda k: kinds[k][0])][0] += empty[0]
            else:
                kinds[EMPTY] = [empty[0], Field(name, "float", (-1,)), False]
        _, field, _ = max(kinds.values(), key=lambda slot: slot[0])
        return field

    def build(self, where: str = "the source") -> Schema:
        """The schema of every row seen.

        Raises:
            SourceError: a field that only some rows have (``where`` names the source).
        """
        out = [*self.declared.values(), *(self._chosen(name) for name in self.seen)]
        schema = Schema(out)
        for name, count in self.seen.items():
            if count < self.rows:
                rarest = min(self.seen, key=lambda k: self.seen[k])
                like = difflib.get_close_matches(rarest, [k for k in self.seen if k != rarest], 1)
                # (a misspelling when the two never meet: their rows add up to all of them)
                if like and self.seen[rarest] + self.seen[like[0]] == self.rows:
                    raise SourceError(
                        f"{where}: {self.seen[rarest]:,} row(s) give the field {rarest!r} and "
                        f"{self.seen[like[0]]:,} give {like[0]!r}: a misspelling? Every row "
                        f"must give the same fields (the first row with {rarest!r}: "
                        f"{self.first_with.get(rarest, 'a row')})"
                    )
                if count * 2 < self.rows:  # a stray key, most likely
                    raise SourceError(
                        f"{where}: field {name!r} is in {count:,} of {self.rows:,} rows only "
                        f"(the first: {self.first_with.get(name, 'a row')}). A field must be "
                        "in every row: remove it from the rows that give it, or give it to "
                        "every row"
                    )
                spec = self._chosen(name).spec
                raise SourceError(
                    f"{where}: field {name!r} is in {count:,} of {self.rows:,} rows "
                    f"({self.first_without.get(name, 'a row')} has none). A field must be in "
                    "every row: add it where it is missing, or declare it (",
                    option("fields", spec),
                    ") to list the rows without it as unusable",
                )
        return schema


EMPTY = ("list", None, ())
"""The kind of an empty list (it says nothing of its numbers)."""


def _kind_of(name: str, value: Any) -> tuple[Any, Field, bool]:
    """What a value is, for counting which kind most rows give: ``(key, the field it implies,
    whether it holds an int no float holds exactly)``. Numbers' lists are keyed by their number
    type and their dimensions after the first (``("list", "float", (4,))``: boxes); null is a
    kind of its own, whose field is ``json`` (the one type that holds it)."""
    t = type(value)
    if t is list:
        if not value:
            return EMPTY, Field(name, "float", (-1,)), False
        shape, kind, big = _list_shape(value)
        if shape is None or kind is None:
            return ("list", "json", ()), Field(name, "json"), False
        return ("list", kind, shape[1:]), Field(name, kind, (-1, *shape[1:])), big
    if t is int:
        return int, Field(name, "int"), not -EXACT <= value <= EXACT
    scalar = _SCALARS.get(t)
    return t, Field(name, scalar if scalar is not None else "json"), False


_SCALARS = {bool: "bool", float: "float", str: "str"}
"""The field type of a scalar's Python type (ints apart: see :func:`_kind_of`)."""


def _list_shape(value: list[Any]) -> tuple[tuple[int, ...] | None, str | None, bool]:
    """The shape and number type of a rectangular nested list of numbers, and whether it holds
    an int no float holds exactly; ``(None, None, False)`` for any other list."""
    shape: list[int] = []
    level: list[Any] = [value]
    for _ in range(MAX_RANK):
        if all(isinstance(v, list) for v in level):
            lengths = {len(v) for v in level}
            if len(lengths) != 1 or 0 in lengths:
                return None, None, False
            shape.append(lengths.pop())
            level = [x for v in level for x in v]
            continue
        if any(isinstance(v, list) for v in level):
            return None, None, False
        kinds = {type(v) for v in level}
        if kinds == {bool}:
            return tuple(shape), "bool", False
        if kinds <= {int, float} and kinds:
            if float in kinds:
                return tuple(shape), "float", False
            # (float lists are read as float32: exact for ints up to 2**24 only)
            return tuple(shape), "int", not -EXACT32 <= min(level) <= max(level) <= EXACT32
        return None, None, False
    return None, None, False
