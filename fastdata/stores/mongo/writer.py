"""The Mongo writer: records inserted in batches from a background thread, the progress after
them, the metadata last; a replacement built aside and renamed over."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import numpy as np

from ...errors import (
    Phrase,
    StoreDamagedError,
    StoreError,
    WriteFailedError,
    option,
)
from ...fields import canonical
from ...packed import PackedStrings
from ...records import (
    LABEL_DTYPE,
    Progress,
    Record,
    SkippedFile,
    StoreMeta,
    name_bytes,
)
from .. import names
from ..existing import Existing
from ..names import META_COLLECTION, progress_id
from ..policy import Completion, StoreWriter
from ..reader import StoreReader
from .buckets import buckets_named, drop_buckets
from .claim import Claimed
from .connection import MongoTarget, gridfs_of
from .layout import (
    GRIDFS_THRESHOLD,
    LABELS_INLINE_MAX,
    SKIPPED_PER_DOC,
    insert_groups,
    load_skipped,
    names_from_bson,
    record_names_in,
    skipped_chunks,
    skipped_ids,
    to_bson,
)
from .reader import MongoStore

log = logging.getLogger(__name__)


BSON_PER_JSON = 8
"""BSON takes at most about this many bytes for a byte of the fields' JSON (a list of small
ints: ``0,`` is 2 bytes in JSON, 12 in BSON); fields that may pass the limit are measured."""


class MongoWriter(MongoTarget, Claimed, StoreWriter):
    """Writes a fastdata store into a MongoDB collection.

    The writer lock is a claim document (``"<collection>:writer"`` in ``__fastdata__``) that names
    its holder and expires ``claim_ttl_s`` after its last renewal; a heartbeat thread renews it,
    so a writer killed on any machine blocks others for at most that long. A fresh store is
    written in place; a store that replaces another is built in ``<collection>.__replacement__``
    and renamed over it (``renameCollection`` with ``dropTarget``) when complete. Every document
    carries its store's id, so a reader never mixes two stores' documents.

    Batches go in as unordered ``insert_many`` calls with integer ``_id``s, so a resumed
    conversion that repeats a batch hits duplicate keys, which are skipped: nothing is duplicated.
    A batch is sent from a background thread, followed by the progress that covers it, while the
    next batch is read: ``write`` waits only for the batch before (and raises its error).

    Takes the arguments of every Mongo target (``uri``, ``collection``, ``database``,
    ``options``; the claim's lifetime is ``options.claim_ttl_s``). Every collection and document
    it names comes from ``stores/names.py``.

    Raises:
        ReservedNameError: ``collection`` is a name fastdata keeps for its own (NOTE [ Reserved
            names ] in ``stores/names.py``), refused before anything is written.
    """

    _store_id = ""
    _sender: ThreadPoolExecutor | None = None
    _inflight: Future[None] | None = None

    @property
    def claim_ttl_s(self) -> float:
        return self.options.claim_ttl_s

    def _opening(self) -> None:
        names.check_collection(self.collection, self.location, self._conn.database)

    @property
    def _aside_name(self) -> str:
        return names.aside_collection(self.collection)

    def _name(self) -> str:
        return self._aside_name if self.building_aside else self.collection

    _base_bucket = ""
    """The GridFS bucket of the complete store in place (an append writes into it)."""

    @property
    def _bucket_name(self) -> str:
        if self.appending and self._base_bucket:
            return self._base_bucket
        return names.bucket(self.collection, self._store_id)

    @property
    def store_target(self) -> tuple[str, str | None]:
        return self.uri, self.collection

    def _nothing_here(self) -> bool:
        found = self._inspect()  # reads only
        return found.empty and found.appending is None

    def _meta_coll(self) -> Any:
        return self._conn.db()[META_COLLECTION]

    # -- the policy's steps (see StoreWriter.start)

    def _inspect(self) -> Existing:
        coll, aside = self.collection, self._aside_name

        def look() -> tuple[dict[Any, Any], bool]:
            db = self._conn.db()
            ids = [coll, progress_id(coll), aside, progress_id(aside)]
            docs = {d["_id"]: d for d in db[META_COLLECTION].find({"_id": {"$in": ids}})}
            return docs, db[coll].find_one({}, {"_id": 1}) is not None

        docs, has_docs = self._run("checking the collection", look)
        meta = progress = appending = None
        other: tuple[str | Phrase, ...] = ()
        if coll in docs:
            try:
                meta = StoreMeta.from_dict(names_from_bson(docs[coll]), self.location)
            except StoreError as exc:
                if isinstance(exc, StoreDamagedError):
                    exc.in_store(self.command_target)
                other = ("holds a store with damaged metadata (", *exc.said(), ")")
            # as a reader finds it: a store of the first format names none, and has one
            bucket = docs[coll].get("gridfs_bucket", names.bucket(coll, ""))
            self._base_bucket = bucket if isinstance(bucket, str) else ""
            saved = docs.get(progress_id(coll))
            if (
                meta is not None
                and saved is not None
                and saved.get("base_id", "") == meta.id
                and 0 < saved.get("first_index", 0) == meta.count
            ):
                try:
                    appending = self._progress(saved)
                except StoreError:  # (the base id and count read: an append of this store)
                    appending = Progress.of_a_damaged_append(meta.count, meta.id)
        elif progress_id(coll) in docs:
            progress = self._progress(docs[progress_id(coll)])
        elif has_docs:
            other = ("the collection holds documents but no fastdata store",)
        aside_progress = docs.get(progress_id(aside))
        return Existing(
            meta,
            progress,
            self._progress(aside_progress) if aside_progress else None,
            aside in docs,
            other,
            appending,
        )

    def _progress(self, doc: dict[str, Any]) -> Progress:
        """A saved progress, with its skipped list gathered from its own documents."""
        state = names_from_bson({k: v for k, v in doc.items() if k != "_id"})

        def load(count: int) -> list[SkippedFile]:
            store_id = str(state.get("store_id", ""))
            return self._run(
                "reading the skipped list",
                lambda: load_skipped(self._conn.db(), store_id, count, self.location),
            )

        return Progress.from_json(json.dumps(state, default=str), self.location, load)

    def _state(self, progress: Progress) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The progress document (BSON-safe, its skipped list saved apart, so it stays small
        however many files are skipped), and the skipped-list documents not saved yet."""
        state = json.loads(progress.to_json())
        chunks = skipped_chunks(
            self._store_id, progress.skipped, self._take_skipped(progress.skipped)
        )
        return to_bson(state), chunks

    def _open(self, progress: Progress, *, new: bool) -> None:
        self._store_id = progress.store_id
        if new:
            name = self._name()
            if not self.appending:
                self._run("clearing the destination", functools.partial(self._drop, name))
            self._run(
                "saving progress", functools.partial(self._save, name, *self._state(progress))
            )

    def _save(self, name: str, state: dict[str, Any], chunks: list[dict[str, Any]]) -> None:
        """Save the skipped-list documents, then the progress that counts them."""
        meta = self._meta_coll()
        for chunk in chunks:
            meta.replace_one({"_id": chunk["_id"]}, chunk, upsert=True)
        meta.replace_one({"_id": progress_id(name)}, state, upsert=True)

    def _drop(self, name: str) -> None:
        """Drop collection ``name``, its metadata, progress and skipped lists, and the GridFS
        buckets they name that no other store of this collection uses (NOTE [ Whose GridFS
        bucket ]): the buckets first, so a drop cut short leaves the documents that name them."""
        db = self._conn.db()
        own = [name, progress_id(name)]
        docs = list(db[META_COLLECTION].find({"_id": {"$in": own}}))
        rest = [n for n in self._store_documents() if n not in own]
        others = db[META_COLLECTION].find({"_id": {"$in": rest}})
        drop_buckets(db, self._buckets_named(docs) - self._buckets_named(others), *self._where)
        for doc in docs:
            for key in ("id", "store_id"):
                if isinstance(doc.get(key), str) and doc[key]:
                    db[META_COLLECTION].delete_many(skipped_ids(doc[key]))
        db[name].drop()
        db[META_COLLECTION].delete_many({"_id": {"$in": own}})

    def _buckets_named(self, docs: Any) -> set[str]:
        return buckets_named(docs, self.collection, self._aside_name)

    @property
    def _where(self) -> tuple[str, str]:
        return self.collection, self.location

    def _store_documents(self) -> list[str]:
        """The ids of the metadata and progress documents of this collection and of its
        replacement, in ``__fastdata__``."""
        coll, aside = self.collection, self._aside_name
        return [coll, progress_id(coll), aside, progress_id(aside)]

    def _kept_skipped(self, base: StoreMeta) -> int:
        return 0  # the skipped list is kept under the store's id: the new id gets all of it

    def _discard_append(self, base: StoreMeta, pending: Progress) -> None:
        def discard() -> None:
            db = self._conn.db()
            db[self.collection].delete_many({"_id": {"$gte": base.count}})
            if pending.store_id:
                db[META_COLLECTION].delete_many(skipped_ids(pending.store_id))
                if self._base_bucket:
                    prefix = names.gridfs_records_of(pending.store_id)
                    bucket = gridfs_of(db, self._base_bucket)
                    for f in db[f"{self._base_bucket}.files"].find(prefix, {"_id": 1}):
                        bucket.delete(f["_id"])
            db[META_COLLECTION].delete_one({"_id": progress_id(self.collection)})

        self._run("discarding the interrupted append", discard)

    def written_names(self, count: int) -> PackedStrings:
        found = self._run(
            "reading back the records' names",
            lambda: record_names_in(self._conn.db()[self._name()], count),
        )
        if not all(isinstance(name, str) for name in found):
            i = next(i for i, name in enumerate(found) if not isinstance(name, str))
            raise StoreError(
                f"{self.location}: record {i} has no name; convert again with ", option("overwrite")
            )
        return PackedStrings([name_bytes(name) for name in found])

    def open_reader(self) -> StoreReader:
        return MongoStore(
            self.uri, self.collection, database=self._conn.database, options=self.options
        )

    def _discard_aside(self) -> None:
        self._run("discarding the interrupted replacement", lambda: self._drop(self._aside_name))

    def _discard_new(self) -> None:
        self._wait()
        name = self._name()
        self._run("removing the store that holds no record", lambda: self._drop(name))

    def _promote(self) -> None:
        self._wait()
        coll, aside = self.collection, self._aside_name

        def promote() -> None:
            db = self._conn.db()
            doc = db[META_COLLECTION].find_one({"_id": aside})
            if doc is None:
                raise StoreError(f"{self.location}: the replacement lost its metadata")
            old = db[META_COLLECTION].find_one({"_id": coll}, {"id": 1})
            if old is not None and isinstance(old.get("id"), str) and old["id"] != doc.get("id"):
                db[META_COLLECTION].delete_many(skipped_ids(old["id"]))
            if aside in db.list_collection_names():
                db.client.admin.command(
                    "renameCollection",
                    f"{db.name}.{aside}",
                    to=f"{db.name}.{coll}",
                    dropTarget=True,
                )
            # the buckets of the store replaced and of a conversion in place that was killed,
            # while the documents that name them are still there
            replaced = db[META_COLLECTION].find({"_id": {"$in": [coll, progress_id(coll)]}})
            gone = self._buckets_named(replaced) - self._buckets_named([doc])
            drop_buckets(db, gone, *self._where)
            doc["_id"] = coll
            db[META_COLLECTION].replace_one({"_id": coll}, doc, upsert=True)
            db[META_COLLECTION].delete_many(
                {"_id": {"$in": [aside, progress_id(aside), progress_id(coll)]}}
            )
            self._store_id = str(doc.get("id", ""))

        # Each step can be repeated: a replacement killed half-way is finished by the next writer.
        self._run("moving the new store into place", promote)

    # -- records

    def documents(self, records: Sequence[Record]) -> list[dict[str, Any]]:
        """The records' documents; images over GRIDFS_THRESHOLD are uploaded to GridFS here."""
        from bson import Binary, encode

        docs = []
        bucket_name = self._bucket_name
        for rec in records:
            doc: dict[str, Any] = {
                "_id": rec.index,
                **to_bson(rec.header.to_dict()),
                "store": self._store_id,
            }
            fields = rec.header.fields
            beside = 0  # the document's other bytes: its fields may be megabytes too
            if fields:
                encoded = rec.header.encoded_fields
                beside = len(encoded if encoded is not None else canonical(fields))
                if len(rec.data) + BSON_PER_JSON * beside > GRIDFS_THRESHOLD:
                    # near the limit: measured as BSON, which may take several times the bytes
                    beside = len(encode({"fields": to_bson(fields)}))
                    if beside > GRIDFS_THRESHOLD:
                        raise StoreError(
                            f"{self.location}: record {rec.index} ({rec.header.name}): its "
                            f"fields take {beside:,} bytes as BSON, more than a MongoDB "
                            "document holds beside its header (16 MiB): convert it to LMDB, "
                            "or keep those values in files of their own"
                        )
            if len(rec.data) + beside > GRIDFS_THRESHOLD:
                file_id = names.gridfs_record_id(self._store_id, rec.index)
                bucket = gridfs_of(self._conn.db(), bucket_name)
                self._run(
                    f"uploading record {rec.index} to GridFS",
                    functools.partial(self._upload, bucket, file_id, rec.data),
                )
                doc["gridfs_id"] = file_id
            else:
                doc["data"] = Binary(rec.data)
            docs.append(doc)
        return docs

    def _upload(self, bucket: Any, file_id: str, data: bytes) -> None:
        from gridfs.errors import NoFile

        with suppress(NoFile):  # a resumed conversion may have uploaded it, possibly in part
            bucket.delete(file_id)
        bucket.upload_from_stream_with_id(file_id, file_id, data)

    def _wait(self) -> None:
        """Wait for the batch in flight; raise its error."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def write(self, records: Sequence[Record], progress: Progress) -> None:
        self._check_claim()
        docs = self.documents(records)
        state, chunks = self._state(progress)  # as it is now: the caller goes on changing it
        self._wait()
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="fastdata-mongo-writer")
        self._inflight = self._sender.submit(self._send, docs, state, chunks)

    def _send(
        self, docs: list[dict[str, Any]], state: dict[str, Any], chunks: list[dict[str, Any]]
    ) -> None:
        """Insert ``docs`` in requests of moderate size, then save the progress ``state``."""
        from pymongo.errors import BulkWriteError

        name = self._name()
        coll = self._conn.db()[name]

        def insert(group: list[dict[str, Any]]) -> None:
            try:
                coll.insert_many(group, ordered=False)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors", [])
                if any(e.get("code") != 11000 for e in errors):  # 11000: duplicate key
                    raise WriteFailedError(
                        f"{self.location}: writing records failed: {errors[0].get('errmsg')}"
                    ) from None

        for group in insert_groups(docs):
            what = f"inserting records {group[0]['_id']}-{group[-1]['_id']}"
            self._run(what, functools.partial(insert, group))
        self._check_claim()
        self._run("saving progress", functools.partial(self._save, name, state, chunks))

    def _count_records(self, count: int) -> str | None:
        """The collection holds exactly the documents ``0 .. count-1`` (ids are unique: the
        count and the first and last id settle it)."""
        self._wait()
        name = self._name()

        def look() -> tuple[int, Any, Any]:
            coll = self._conn.db()[name]
            n = coll.count_documents({})
            lo = coll.find_one({}, {"_id": 1}, sort=[("_id", 1)])
            hi = coll.find_one({}, {"_id": 1}, sort=[("_id", -1)])
            return n, lo and lo["_id"], hi and hi["_id"]

        n, lo, hi = self._run("counting the records", look)
        if n != count or (count and (lo != 0 or hi != count - 1)):
            return f"{n} documents with ids {lo} to {hi} for {count} records"
        return None

    def _write_meta(self, done: Completion) -> None:
        from bson import Binary

        meta, labels, skipped = done.meta, done.labels, done.skipped
        self._wait()
        self._check_claim()
        db = self._conn.db()
        name = self._name()
        bucket = self._bucket_name
        for chunk in skipped_chunks(self._store_id, skipped, self._take_skipped(skipped)):
            save = functools.partial(
                db[META_COLLECTION].replace_one, {"_id": chunk["_id"]}, chunk, upsert=True
            )
            self._run("saving the skipped list", save)
        if self._skipped_stale > len(skipped):
            first = -(-len(skipped) // SKIPPED_PER_DOC)
            stale = [
                names.skipped_id(self._store_id, k)
                for k in range(first, -(-self._skipped_stale // SKIPPED_PER_DOC))
            ]
            self._run(
                "shortening the skipped list",
                lambda: db[META_COLLECTION].delete_many({"_id": {"$in": stale}}),
            )
        doc: dict[str, Any] = {"_id": name, **to_bson(meta.to_dict()), "gridfs_bucket": bucket}
        raw = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()
        if len(raw) > LABELS_INLINE_MAX:
            file_id = names.gridfs_labels_id(self._store_id)
            self._run("uploading labels", lambda: self._upload(gridfs_of(db, bucket), file_id, raw))
            doc["labels_gridfs_id"] = file_id
        else:
            doc["labels"] = Binary(raw)
        # One index build over the finished collection costs less than maintaining it per insert.
        self._run("creating the index on name", lambda: db[name].create_index("name"))
        self._run(
            "writing metadata",
            lambda: db[META_COLLECTION].replace_one({"_id": name}, doc, upsert=True),
        )
        if not self.building_aside:
            self._run(
                "clearing the progress",
                lambda: db[META_COLLECTION].delete_one({"_id": progress_id(name)}),
            )
        if self.appending and self.base is not None and self.base.id:
            base_id = self.base.id  # its skipped list is now under the new id, whole
            self._run(
                "clearing the old skipped list",
                lambda: db[META_COLLECTION].delete_many(skipped_ids(base_id)),
            )

    def close(self) -> None:
        """Wait for the batch in flight (an error in it is logged: the caller is already failing
        or has called ``finish``, which raises it), release the claim, close the connection."""
        try:
            self._wait()
        except Exception as exc:
            log.error("%s: the last batch was not written: %s", self.location, exc)
        finally:
            if self._sender is not None:
                self._sender.shutdown()
                self._sender = None
            self._unlock()
            super().close()
