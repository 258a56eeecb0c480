"""Which records a ``where`` selects (``StoreReader.matching``): a query document answered by
the store's columns where they can (:mod:`fastdata.query_columns`), otherwise over each
record's header, as a MongoDB server would answer it; or a predicate over each record's
fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .reader import StoreReader

__all__ = ["select"]


def select(reader: StoreReader, where: Any) -> np.ndarray:
    """The indices (in order, one int64 array) of the records of ``reader`` that ``where``
    selects (see ``StoreReader.matching``)."""
    from ..query import check_query, compile_query, record_document
    from ..query_columns import column_mask

    if isinstance(where, Mapping) or not callable(where):
        query = check_query(where, reader.meta.schema.names, reader.location)
        mask = column_mask(  # (the columns read for it let go after: a view keeps indices)
            query, len(reader), reader.labels, lambda name: reader.field_column(name, keep=False)
        )
        if mask is not None:  # (the store's columns answered it)
            return np.flatnonzero(mask).astype(np.int64)
        test = compile_query(query, reader.meta.schema.names, reader.location)
        return np.fromiter(
            (i for i, h in enumerate(reader.iter_headers()) if test(record_document(i, h))),
            np.int64,
        )
    found = []
    for i, h in enumerate(reader.iter_headers()):
        try:
            if where(h.fields or {}):
                found.append(i)
        except Exception as exc:
            fields = ", ".join(h.fields or {}) or "none"
            exc.add_note(
                f"{reader.location}: where= raised this on record {i} ({h.name}; its fields: "
                f"{fields})"
            )
            raise
    return np.asarray(found, dtype=np.int64)
