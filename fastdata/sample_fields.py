"""How a dataset gives a sample's field values to its caller: by name, in a dict that knows the
schema they were read by (:class:`FieldValues`), each value as its field's type says
(:func:`field_reader`: numbers with a shape as numpy arrays, a float as a float)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["FieldBatch", "FieldValues", "field_reader"]


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


class FieldBatch(Sequence[Any]):
    """A batch of samples with their field values, read from a store's columns: the samples
    as a list gives them (``(image, target, values)``, or a dict each with ``as_dict``), made
    when one is first looked at, and the batch's values as arrays for a collate function
    (:meth:`arrays`), which never makes them one by one.

    Args:
        images, targets: one per sample.
        columns: each field's values for the batch (``fastdata.columns.BatchColumn``).
        schema: the :class:`~fastdata.fields.Schema` of those fields (the values' types).
        as_dict: samples are dicts (``image``, ``target`` and the fields).
    """

    def __init__(
        self,
        images: list[Any],
        targets: list[Any],
        columns: dict[str, Any],
        schema: Any,
        as_dict: bool = False,
    ) -> None:
        self.images, self.targets, self.columns = images, targets, columns
        self.schema, self.as_dict = schema, as_dict
        self._samples: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: Any) -> Any:
        return self.samples()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.samples())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FieldBatch | list | tuple):
            return self.samples() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FieldBatch({self.samples()!r})"

    def samples(self) -> list[Any]:
        """The samples, each as a dataset reading the records' headers gives it."""
        if self._samples is None:
            names = list(self.columns)
            per_field = [self.columns[name].items() for name in names]
            out: list[Any] = []
            for j, (image, target) in enumerate(zip(self.images, self.targets, strict=True)):
                values = FieldValues(zip(names, (items[j] for items in per_field), strict=True))
                values.schema = self.schema
                if self.as_dict:
                    out.append(FieldValues(image=image, target=target, **values))
                    out[-1].schema = self.schema
                else:
                    out.append((image, target, values))
            self._samples = out
        return self._samples

    def arrays(self, pad: bool = False) -> dict[str, Any]:
        """The batch's values by name, as ``collate_fields`` batches them: numbers of one shape
        as one numpy array, variable-length numbers as a list of arrays (with ``pad``: one array
        padded with zeros and ``<name>_mask``), strings and JSON as lists."""
        out: dict[str, Any] = {}
        for name, column in self.columns.items():
            values, mask = column.batched(pad)
            out[name] = values
            if mask is not None:
                if f"{name}_mask" in self.columns:
                    raise ValueError(
                        f"fields: padding {name!r} makes its mask {name}_mask, which is a field "
                        "of the store too: read the fields without padding (pad_fields=False), "
                        "or leave one of them out of fields="
                    )
                out[f"{name}_mask"] = mask
        return out
