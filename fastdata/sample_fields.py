"""How a dataset gives a sample's field values to its caller: by name, in a dict that knows the
schema they were read by (:class:`FieldValues`), each value as its field's type says
(:func:`field_reader`: numbers with a shape as numpy arrays, a float as a float)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["FieldValues", "field_reader"]


class FieldValues(dict[str, Any]):
    """A sample's field values by name (a plain ``dict`` to its reader), with the
    :class:`~fastdata.fields.Schema` they were read by, so that ``fast_collate`` batches them
    by the store's types whether or not it is told the schema (``create_loader`` tells it)."""

    schema: Any = None


def field_reader(field: Any) -> Callable[[Any], Any]:
    """How a stored value of ``field`` is given to the caller: numbers with a shape as a
    numpy array (int64, float32 or bool; a variable first dimension may be 0), a scalar float
    as a float (a document may hold it as an int: the same value, which the field's checksum
    and ``verify`` accept), everything else as stored."""
    if field.type == "float" and not field.shape:
        return _as_float
    if field.type not in ("int", "float", "bool") or not field.shape:
        return _same
    dtype = {"int": np.int64, "float": np.float32, "bool": np.bool_}[field.type]
    empty = (0, *field.shape[1:])

    def read(value: Any) -> Any:
        return np.asarray(value, dtype=dtype) if value else np.zeros(empty, dtype=dtype)

    return read


def _same(value: Any) -> Any:
    return value


def _as_float(value: Any) -> Any:
    return float(value) if type(value) is int else value
