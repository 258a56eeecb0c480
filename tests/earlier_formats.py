"""Stores as the first versions of fastdata wrote them, built with plain ``lmdb`` and ``pymongo``
from the fields ``docs/format.md`` lists (what later versions must go on reading):

- metadata without ``id``, ``fingerprint``, ``skipped_count``, ``appended_from``, ``layout``,
  ``copied_from`` or ``updated``, the skipped list inside it as ``"skipped": [{name, reason}]``;
- LMDB: no ``__names__``, no ``#skipped/...`` entries;
- MongoDB: documents without ``store``, no ``gridfs_bucket`` in the metadata.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import lmdb

SKIPPED = [{"name": "b/broken.jpg", "reason": "not a recognised image format"}]


def _records(folder: Path) -> tuple[list[str], list[tuple[str, int, bytes]]]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    records = [
        (f"{c}/{f.name}", label, f.read_bytes())
        for label, c in enumerate(classes)
        for f in sorted((folder / c).iterdir())
        if f.name != "broken.jpg"
    ]
    return classes, records


def _meta(folder: Path, classes: list[str], records: list[Any]) -> dict[str, Any]:
    return {
        "count": len(records),
        "classes": classes,
        "class_to_idx": {c: i for i, c in enumerate(classes)},
        "repairs": 0,
        "total_bytes": sum(len(r[2]) for r in records),
        "skipped": SKIPPED,
        "source": str(folder),
        "created": "2026-11-21T06:00:00+00:00",
        "format": "fastdata",
        "version": 1,
        "checksum": "crc32",
    }


def _header(name: str, label: int, data: bytes) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "size": len(data),
        "crc32": zlib.crc32(data),
        "format": "jpeg",
        "repaired": False,
    }


def write_first_lmdb(folder: Path, store: Path) -> None:
    import numpy as np

    classes, records = _records(folder)
    env = lmdb.open(str(store), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, (name, label, data) in enumerate(records):
            txn.put(b"%010d" % i, data)
            txn.put(b"#%010d" % i, json.dumps(_header(name, label, data)).encode())
        txn.put(b"__labels__", np.array([r[1] for r in records], "<i4").tobytes())
        txn.put(b"__len__", str(len(records)).encode())
        txn.put(b"__keys__", b"\n".join(b"%010d" % i for i in range(len(records))))
        txn.put(b"__fastdata__", json.dumps(_meta(folder, classes, records)).encode())
    env.close()


def write_first_mongo(folder: Path, db: Any, collection: str) -> None:
    import numpy as np
    from bson import Binary

    classes, records = _records(folder)
    db[collection].insert_many(
        [
            {"_id": i, **_header(name, label, data), "data": Binary(data)}
            for i, (name, label, data) in enumerate(records)
        ]
    )
    labels = np.array([r[1] for r in records], "<i4").tobytes()
    meta = {"_id": collection, **_meta(folder, classes, records), "labels": Binary(labels)}
    db["__fastdata__"].insert_one(meta)
