"""How a Mongo store's things are laid out and encoded (their names are ``stores/names.py``'s):
the skipped-list documents, insert groups, BSON-safe names."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from ...errors import (
    StoreDamagedError,
)
from ...records import (
    SkippedFile,
    skipped_file,
)
from ..names import META_COLLECTION as META_COLLECTION  # every name is stores/names.py's
from ..names import skipped_id, skipped_range

CLAIM_TTL_S = 60.0
"""A writer claim lasts this long without renewal (renewed every quarter of it)."""
GRIDFS_THRESHOLD = 15 << 20
"""Images larger than this go to GridFS (a BSON document holds at most 16 MiB)."""
INSERT_DOCS = 128
INSERT_BYTES = 16 << 20
"""One insert request carries at most this many documents and bytes of images: measured, one
request per 32 MiB batch took 1.3x as long as requests of 128 documents."""
LABELS_INLINE_MAX = 8 << 20
"""Label arrays larger than this are stored in GridFS instead of the metadata document."""
USER_ENV = "FASTDATA_MONGO_USER"
PASSWORD_ENV = "FASTDATA_MONGO_PASSWORD"


def insert_groups(docs: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """``docs`` cut into runs of at most INSERT_DOCS documents and INSERT_BYTES of images."""
    group: list[dict[str, Any]] = []
    size = 0
    for doc in docs:
        n = len(doc.get("data", b""))
        if group and (len(group) >= INSERT_DOCS or size + n > INSERT_BYTES):
            yield group
            group, size = [], 0
        group.append(doc)
        size += n
    if group:
        yield group


SKIPPED_PER_DOC = 1000
"""Skipped files per document of a skipped list (names are at most 4 kB: under 5 MB a document)."""


def skipped_ids(store_id: str) -> dict[str, Any]:
    """The filter of the skipped-list documents of one store."""
    return skipped_range(store_id)


def skipped_chunks(store_id: str, items: Sequence[SkippedFile], saved: int) -> list[dict[str, Any]]:
    """The skipped-list documents that hold items from ``saved`` on (the last one saved may be
    partly filled: it is written again, whole)."""
    first = saved // SKIPPED_PER_DOC
    return [
        {
            "_id": skipped_id(store_id, k),
            "items": to_bson(
                [f.to_dict() for f in items[k * SKIPPED_PER_DOC : (k + 1) * SKIPPED_PER_DOC]]
            ),
        }
        for k in range(first, -(-len(items) // SKIPPED_PER_DOC))
    ]


def load_skipped(db: Any, store_id: str, count: int, where: str) -> list[SkippedFile]:
    """The first ``count`` entries of a store's skipped list."""
    items: list[Any] = []
    for doc in db[META_COLLECTION].find(skipped_ids(store_id)).sort("_id", 1):
        found = doc.get("items")
        if isinstance(found, list):
            items.extend(found)
        if len(items) >= count:
            break
    if len(items) < count:
        raise StoreDamagedError(
            f"{where}: damaged metadata (the skipped list holds {len(items)} of its {count} "
            "entries)"
        )
    return [
        skipped_file(names_from_bson(i) if isinstance(i, dict) else i, where) for i in items[:count]
    ]


def record_names_in(coll: Any, count: int) -> list[Any]:
    """The names of records ``0 .. count-1`` of collection ``coll``, in one query that returns
    no image bytes (None, or what else a document holds, where it holds no name)."""
    found = {d["_id"]: d.get("name") for d in coll.find({"_id": {"$lt": count}}, {"name": 1})}
    return [names_from_bson({"name": found.get(i)})["name"] for i in range(count)]


def doc_id(doc: dict[str, Any]) -> Any:
    return doc["_id"]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def to_bson(value: Any) -> Any:
    """``value`` with every string that is not valid UTF-8 (a file name with other bytes) as BSON
    binary of its bytes: BSON strings must be UTF-8. Mapping keys that are not (``class_to_idx``,
    which readers derive from ``classes``) are left out."""
    from bson import Binary

    if isinstance(value, str):
        return value if _utf8(value) else Binary(os.fsencode(value))
    if isinstance(value, list):
        return [to_bson(v) for v in value]
    if isinstance(value, dict):
        return {k: to_bson(v) for k, v in value.items() if not isinstance(k, str) or _utf8(k)}
    return value


def names_from_bson(doc: dict[str, Any]) -> dict[str, Any]:
    """A document's names (``name``, ``source``, ``classes``, skipped names) back as strings."""

    def text(value: Any) -> Any:
        return os.fsdecode(value) if isinstance(value, bytes) else value

    out = dict(doc)
    for key in ("name", "source"):
        if key in out:
            out[key] = text(out[key])
    if isinstance(out.get("classes"), list):
        out["classes"] = [text(c) for c in out["classes"]]
    if isinstance(out.get("skipped"), list):
        out["skipped"] = [
            {**item, "name": text(item.get("name"))} if isinstance(item, dict) else item
            for item in out["skipped"]
        ]
    if "fields" in out and isinstance(out["fields"], dict):
        out["fields"] = _plain(out["fields"])
    return out


def _plain(value: Any) -> Any:
    """Field values as JSON gives them: BSON's 64-bit integers (``bson.int64.Int64``, an int
    of another type) as plain ints, in lists and objects too (iteratively: a damaged document
    may nest deeply)."""
    if type(value) is dict:
        out: Any = {}
    elif type(value) is list:
        out = []
    else:
        return int(value) if isinstance(value, int) and type(value) not in (int, bool) else value
    stack = [(value, out)]
    while stack:
        source, target = stack.pop()
        items = source.items() if type(source) is dict else enumerate(source)
        for key, item in items:
            if type(item) is dict or type(item) is list:
                inner: Any = {} if type(item) is dict else []
                stack.append((item, inner))
                item = inner
            elif isinstance(item, int) and type(item) not in (int, bool):
                item = int(item)
            if type(target) is dict:
                target[key] = item
            else:
                target.append(item)
    return out
