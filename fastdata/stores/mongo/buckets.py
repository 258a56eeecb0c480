"""Which GridFS buckets are fastdata's own, and dropping them.

NOTE [ Whose GridFS bucket ]

A bucket shaped like a store's (``<collection>.gridfs[.<id>]``) may be another tool's: GridFS
buckets are named by their users, and ``<collection>.gridfs`` is also where stores of the first
format kept their images. So a writer drops a bucket only when it can show the bucket is its own:

- one of fastdata's documents in ``__fastdata__`` names it: a store's metadata
  (``gridfs_bucket``; none: ``<collection>.gridfs``), or a progress (``store_id``), which is
  saved before the first file is uploaded, so the bucket of a conversion killed at any point is
  named too;
- and every file in it (and every chunk) has an id fastdata makes (``names.is_gridfs_file_id``).

A bucket is dropped before the documents that name it are removed, so a drop cut short is done
again by the next writer. Any other bucket is left as it is (and logged), and fastdata never
writes into one: a new store's bucket is named by its new id. Buckets that an earlier version
left behind and no document names any more stay too: nothing shows they are not a user's.

Sites: ``MongoWriter._drop`` and ``MongoWriter._promote`` (``stores/mongo/writer.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .. import names

log = logging.getLogger(__name__)

__all__ = ["buckets_named", "drop_buckets"]


def buckets_named(docs: Iterable[Mapping[str, Any]], collection: str, aside: str) -> set[str]:
    """The buckets that ``docs`` name: metadata and progress documents of the store in
    ``collection`` or of its replacement (the collection ``aside``)."""
    out: set[str] = set()
    for doc in docs:
        if doc.get("_id") in (collection, aside):
            found = doc.get("gridfs_bucket", names.bucket(collection, ""))
        else:
            store_id = doc.get("store_id")
            found = names.bucket(collection, store_id) if store_id else None
        if isinstance(found, str) and names.is_bucket_of(found + ".files", collection):
            out.add(found)
    return out


def drop_buckets(db: Any, buckets: Iterable[str], collection: str, location: str) -> None:
    """Drop those of ``buckets`` (named by fastdata's documents) that hold only files fastdata
    writes for ``collection``; leave any other as it is (``location``: the store, for the log)."""
    present = set(db.list_collection_names())
    for bucket in sorted(buckets):
        files, chunks = f"{bucket}.files", f"{bucket}.chunks"
        if files not in present and chunks not in present:
            continue
        ids = [f["_id"] for f in db[files].find({}, {"_id": 1})]
        ids += [c.get("files_id") for c in db[chunks].find({}, {"files_id": 1, "_id": 0})]
        foreign = [i for i in ids if not names.is_gridfs_file_id(i, collection)]
        if foreign:
            log.warning(
                "%s: left the GridFS bucket %s as it is: it holds files fastdata did not write "
                "(%r among them)",
                location,
                bucket,
                foreign[0],
            )
            continue
        db[files].drop()
        db[chunks].drop()
