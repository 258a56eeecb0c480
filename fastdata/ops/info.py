"""A store's vital statistics, as ``fastdata info`` shows them."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..images.decode import decoder_name
from ..records import CHECKSUM_IMPLEMENTATION
from ..stores.reader import StoreReader

__all__ = ["store_info"]


def store_info(
    reader: StoreReader, *, list_skipped: bool = False, where: Any = None
) -> dict[str, Any]:
    """Count, classes with their sizes, bytes, repairs, skipped files (their count; with
    ``list_skipped`` also the list, under ``skipped_files``), format version and the store's id
    (new for every conversion: it changes when the store is replaced); with a query ``where``
    (:mod:`fastdata.query`), the records it selects, under ``where``: the query, their count
    and their count per class."""
    meta = reader.meta
    labels = reader.labels if meta.labelled else np.zeros(0, dtype=np.int64)
    per_class = np.bincount(labels, minlength=len(meta.classes))
    facts: dict[str, Any] = {
        "location": reader.location,
        "format": meta.format,
        "version": meta.version,
        "count": meta.count,
        "classes": len(meta.classes),
        "images_per_class": {c: int(n) for c, n in zip(meta.classes, per_class, strict=True)},
        "total_bytes": meta.total_bytes,
        "mean_bytes": meta.total_bytes // meta.count if meta.count else 0,
        "repaired": meta.repairs,
        "skipped": meta.skipped_count,
        "source": meta.source,
        "created": meta.created,
        "id": meta.id,
        "updated": meta.updated,
        "class_order": meta.class_order,
        "appends": len(meta.appended_from),
        "layout": meta.layout,
        "copied_from": meta.copied_from,
        "labelled": meta.labelled,
        "fields": list(meta.fields),
        "sidecars": list(meta.sidecars),
        "checksums": reader.has_checksums,
        "decoder": decoder_name(),
        "checksum_implementation": CHECKSUM_IMPLEMENTATION,
    }
    facts["columns"] = reader.columns_cover()
    facts["interrupted"] = reader.interrupted()
    if where is not None:
        chosen = reader.matching(where)
        picked = np.bincount(labels[chosen], minlength=len(meta.classes))
        facts["where"] = {
            "query": where,
            "count": len(chosen),
            "images_per_class": {c: int(n) for c, n in zip(meta.classes, picked, strict=False)},
        }
    if list_skipped:
        facts["skipped_files"] = [
            {"name": s.name, "reason": s.reason} for s in reader.skipped_files()
        ]
    return facts
