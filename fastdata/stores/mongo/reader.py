"""The reader of a complete fastdata store in a Mongo collection."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...errors import (
    RecordError,
    StoreDamagedError,
    StoreError,
    StoreNotFoundError,
    option,
)
from ...packed import PackedStrings
from ...query import check_query
from ...records import (
    Progress,
    Record,
    RecordHeader,
    SkippedFile,
    StoreMeta,
    bytes_problem,
    check_labels,
    name_bytes,
    skipped_file,
)
from ..existing import incomplete_error
from ..names import META_COLLECTION, aside_collection, aside_owner_collection, bucket, progress_id
from ..reader import StoreReader, append_note
from ..uri import command_words
from . import queries
from .claim import live_claim
from .connection import MongoTarget, gridfs_of
from .layout import (
    doc_id,
    load_skipped,
    names_from_bson,
    record_names_in,
    skipped_ids,
)


class MongoStore(MongoTarget, StoreReader):
    """Reads a complete fastdata store from a MongoDB collection.

    Args:
        uri: ``mongodb://[user:password@]host:port/DB``.
        collection: the store's collection.
        database: the database, when the URI names none.
        options: read preference, timeouts and retries.

    Raises:
        StoreNotFoundError: no such store.
        IncompleteStoreError: a conversion into it did not finish; the message says how to resume.
        StoreError: the server stayed unreachable within the retry budget.
    """

    def _opening(self) -> None:
        self._bucket = bucket(self.collection, "")
        try:
            self._meta, self._labels = self._run(
                "reading the metadata", self._load_meta, first=True
            )
        finally:
            self._conn.close()  # nothing that cannot cross a fork stays open after __init__
        self._opened(self._meta)

    # The metadata and labels are read again in each process that receives the reader pickled
    # (a worker): a pickle holds the address and the store's id, not one label per record.

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_meta"] = state["_labels"] = None
        return state

    def _loaded(self) -> None:
        if self.__dict__.get("_meta") is None:
            meta, labels = self._run("reading the metadata", self._load_meta)
            seen = self._as_opened(meta, labels)
            if seen is None:
                raise self._replaced(meta.id)
            self._meta, self._labels = seen

    def record_check(self) -> str | None:
        count, ids = self.meta.count, sorted(self._ids)

        def look() -> tuple[int, Any]:
            coll = self._conn.db()[self.collection]
            mine = {"$in": [*ids, None]} if "" in ids else {"$in": ids}
            n = coll.count_documents({"_id": {"$lt": count}, "store": mine})
            return n, coll.find_one({"_id": count - 1}, {"_id": 1}) if count else True

        n, last = self._run("counting the records", look)
        if n != count or last is None:
            return f"{n} of the records 0 .. {count - 1} are in the collection"
        return None

    def interrupted(self) -> list[str]:
        """An unfinished append to the collection, or a replacement left aside."""
        meta = self.meta
        coll, aside = self.collection, aside_collection(self.collection)

        def look() -> dict[str, Any]:
            found = self._conn.db()[META_COLLECTION].find(
                {"_id": {"$in": [progress_id(coll), progress_id(aside)]}}
            )
            return {d["_id"]: names_from_bson(d) for d in found}

        docs = self._run("looking for unfinished writes", look)
        target = command_words(self.uri, coll)

        notes = []
        building = docs.get(progress_id(aside))
        if building is not None:
            replacement = self._progress_of(building)
            notes.append(
                f"a replacement (--overwrite) was interrupted after {replacement.done}; "
                f"{replacement.finish_advice(target)}"
            )
        pending = docs.get(progress_id(coll))
        if pending is not None and (
            pending.get("base_id", "") == self._id and pending.get("first_index", 0) == meta.count
        ):
            try:
                appending = self._progress_of(pending)
            except StoreError:  # (the base id and count read: an append of this store)
                appending = Progress.of_a_damaged_append(meta.count, meta.id)
            notes.append(append_note(appending, target, replacing=bool(notes)))
        return notes

    def skipped_files(self) -> list[SkippedFile]:
        meta = self.meta

        def load() -> list[SkippedFile]:
            db = self._conn.db()
            if meta.id and db[META_COLLECTION].find_one(skipped_ids(meta.id), {"_id": 1}):
                return load_skipped(db, meta.id, meta.skipped_count, self.location)
            # the first layout kept the list in the metadata document
            doc = db[META_COLLECTION].find_one({"_id": self.collection}, {"skipped": 1}) or {}
            items = names_from_bson(doc).get("skipped") or []
            if not meta.skipped_count:
                return []
            if not isinstance(items, list) or len(items) < meta.skipped_count:
                return load_skipped(db, meta.id, meta.skipped_count, self.location)
            return [skipped_file(i, self.location) for i in items[: meta.skipped_count]]

        return self._run("reading the skipped list", load)

    def _progress_of(self, doc: dict[str, Any]) -> Progress:
        """A stopped run's saved progress, with its skipped list (whether it can resume)."""
        state = names_from_bson({k: v for k, v in doc.items() if k != "_id"})
        db, store_id = self._conn.db(), str(state.get("store_id", ""))
        return Progress.from_json(
            json.dumps(state, default=str),
            self.location,
            lambda count: load_skipped(db, store_id, count, self.location),
        )

    def _load_meta(self) -> tuple[StoreMeta, np.ndarray]:
        db = self._conn.db()
        doc = db[META_COLLECTION].find_one({"_id": self.collection})
        if doc is None:
            saved = db[META_COLLECTION].find_one({"_id": progress_id(self.collection)})
            if saved is not None:
                progress = self._progress_of(saved)
                owner = aside_owner_collection(self.collection)
                if owner is not None:  # (a replacement being built: its store's resume)
                    raise incomplete_error(
                        f"{self.location} (the replacement of collection {owner} being built)",
                        progress,
                        command_words(self.uri, owner),
                        writing=live_claim(self._conn, owner),
                    )
                building = db[META_COLLECTION].find_one(
                    {"_id": progress_id(aside_collection(self.collection))}
                )
                aside = self._progress_of(building) if building is not None else None
                target = command_words(self.uri, self.collection)
                writing = live_claim(self._conn, self.collection)
                raise incomplete_error(self.location, progress, target, aside, writing)
            if db[self.collection].find_one({}, {"_id": 1}) is not None:
                raise StoreError(
                    f"{self.location}: the collection holds documents but no fastdata metadata; "
                    "fastdata convert did not write it (for the img_name/bson_img layout, "
                    "give ",
                    option("index_file", None),
                    ")",
                )
            raise StoreNotFoundError(
                f"{self.location}: no fastdata store here; create one with "
                f"`fastdata convert SRC {command_words(self.uri, self.collection)}`"
            )
        doc = names_from_bson(doc)
        meta = StoreMeta.from_dict(doc, self.location)
        found = doc.get("gridfs_bucket", bucket(self.collection, ""))
        if not isinstance(found, str):
            raise StoreError(f"{self.location}: damaged metadata ('gridfs_bucket')")
        self._bucket = found
        if "labels_gridfs_id" in doc:
            raw = self._download(db, doc["labels_gridfs_id"], 4 * meta.count, "the labels")
        else:
            raw = doc.get("labels", b"")
            if not isinstance(raw, bytes):
                raise StoreDamagedError(
                    f"{self.location}: damaged metadata ('labels' is not binary)",
                    store=self.command_target,
                )
        return meta, check_labels(raw, meta, self.location)

    def _download(self, db: Any, file_id: Any, size: int, what: str) -> bytes:
        """A GridFS file of ``size`` bytes; any other length is damage, and is not read."""
        from gridfs.errors import CorruptGridFile, NoFile

        try:
            stream = gridfs_of(db, self._bucket).open_download_stream(file_id)
        except NoFile:
            raise RecordError(
                f"{self.location}: {what}: GridFS file {file_id!r} is missing (or the store was "
                "replaced)",
                store=self.command_target,
            ) from None
        if stream.length != size:
            raise RecordError(
                f"{self.location}: {what}: GridFS file {file_id!r} holds {stream.length} bytes, "
                f"the record says {size}",
                store=self.command_target,
            )
        try:
            return bytes(stream.read())
        except CorruptGridFile as exc:  # (chunks missing or of the wrong size)
            raise RecordError(
                f"{self.location}: {what}: GridFS file {file_id!r} is damaged ({exc})",
                store=self.command_target,
            ) from None

    def _fetch(self, indices: list[int], fields: dict[str, int] | None) -> list[dict[str, Any]]:
        def query() -> list[dict[str, Any]]:
            db = self._conn.db()
            wanted = sorted(set(indices))
            found = {
                d["_id"]: d for d in db[self.collection].find({"_id": {"$in": wanted}}, fields)
            }
            for i, doc in found.items():
                self._check_document(db, i, doc)  # another store's document: replaced
            missing = [i for i in wanted if i not in found]
            if missing:
                self._check_still_here(db)  # (a smaller store took its place: replaced too)
                raise RecordError(
                    f"{self.location}: record {missing[0]} is missing", store=self.command_target
                )
            return [found[i] for i in indices]

        span = f"{min(indices)}-{max(indices)}" if indices else "none"
        return self._run(f"reading records {span}", query)

    def _check_store(self, doc: dict[str, Any]) -> None:
        """Refuse a document of another store than the one opened (it was replaced)."""
        # documents of the first layout carry no store id: they are the id-less store's
        if self._ids and doc.get("store", "") not in self._ids:
            raise self._replaced(f"{doc.get('store')!r}, found in record {doc.get('_id')}")

    def _check_still_here(self, db: Any) -> None:
        """Raise StoreReplacedError when the collection's metadata is no longer the store this
        reader opened, nor one grown from it (read when a record it asks for is missing)."""
        if not self._ids:
            return  # a store of the first layout: no id to compare
        doc = db[META_COLLECTION].find_one({"_id": self.collection}, {"id": 1, "appended_from": 1})
        now = doc.get("id") if doc is not None else None
        grew = doc.get("appended_from") if doc is not None else None
        if now != self._id and not (isinstance(grew, list) and self._id in grew):
            raise self._replaced(repr(now) if doc is not None else "no store")

    def _check_document(self, db: Any, index: int, doc: dict[str, Any]) -> None:
        """Check a document's store id and the type of its image before using it; fetch an image
        kept in GridFS."""
        self._check_store(doc)
        data = doc.get("data")
        if isinstance(data, bytes):
            return
        if data is None and isinstance(doc.get("gridfs_id"), str):
            size = doc.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise RecordError(f"{self.location}: record {index}: damaged ('size')")
            doc["data"] = self._download(db, doc["gridfs_id"], size, f"record {index}")
            return
        found = (
            "missing"
            if data is None
            else "a number"
            if isinstance(data, (int, float))
            else "text"
            if isinstance(data, str)
            else f"a {type(data).__name__}"
        )
        raise RecordError(
            f"{self.location}: record {index}: its image ('data') is {found}, not binary",
            store=self.command_target,
        )

    def iter_headers(
        self, stop: int | None = None, batch_size: int = 1024
    ) -> Iterator[RecordHeader]:
        """The headers alone: documents read without their image bytes."""
        n = len(self) if stop is None else stop
        fields = {"data": 0, "gridfs_id": 0}
        for start in range(0, n, batch_size):
            end = min(n, start + batch_size)

            def query(start: int = start, end: int = end) -> list[dict[str, Any]]:
                found = self._conn.db()[self.collection].find(
                    {"_id": {"$gte": start, "$lt": end}}, fields
                )
                return sorted(found, key=doc_id)

            docs = self._run(f"reading headers {start}-{end - 1}", query)
            if [d["_id"] for d in docs] != list(range(start, end)):
                raise RecordError(
                    f"{self.location}: records {start}-{end - 1} are not all there",
                    store=self.command_target,
                )
            for doc in docs:
                self._check_store(doc)
                yield self._header(doc, doc["_id"])

    def matching(self, where: Any) -> np.ndarray:
        """A query (:mod:`fastdata.query`, checked first: the same language as on every
        backend) is run by the server over this store's records; a predicate as in every
        backend."""
        if callable(where):
            return super().matching(where)
        where = check_query(where, self.meta.schema.names, self.location)
        n = len(self)
        # (records past the last, an interrupted append's, are left out here, not by an _id
        # range in the query: the server would answer it from the _id index, not the field's)
        query: dict[str, Any] = where

        def run() -> list[Any]:
            found = []
            for d in self._conn.db()[self.collection].find(query, {"_id": 1, "store": 1}):
                if type(d.get("_id")) is int and 0 <= d["_id"] < n:
                    self._check_store(d)
                    found.append(d["_id"])
            return found

        found = self._run(f"selecting records with where={where!r:.200}", run)
        # a store replaced since it was opened: its records are not these (a document of another
        # store found above is named; the metadata says so where the query found none)
        self._run("reading the metadata", lambda: self._check_still_here(self._conn.db()))
        if n >= queries.SCAN_WORTH_SAYING:
            words = command_words(self.uri, self.collection)
            coll = self._conn.db()[self.collection]
            queries.say_if_scanned(self.location, coll, n, words, query, where)
        return np.unique(np.asarray([int(i) for i in found if type(i) is int], dtype=np.int64))

    def create_index(self, key: str) -> str:
        """The server's index on ``key`` (``fields.score``, ``label``), made if it is missing
        (a no-op where it exists); its name."""
        check_query({key: {"$exists": True}}, self.meta.schema.names, self.location)
        if key.split(".", 1)[0] == "_id":
            return "_id_"  # (every collection has it)

        def make() -> str:
            return str(self._conn.db()[self.collection].create_index([(key, 1)]))

        return self._run(f"creating the index on {key}", make)

    def record_names(self) -> PackedStrings:
        """The names alone, in one query that returns no image bytes."""
        n = len(self)
        found = self._run(
            "reading the record names",
            lambda: record_names_in(self._conn.db()[self.collection], n),
        )
        names = []
        for i, name in enumerate(found):
            if not isinstance(name, str):
                raise RecordError(
                    f"{self.location}: record {i} has no name", store=self.command_target
                )
            names.append(name_bytes(name))
        return PackedStrings(names)

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        fields = {"data": 1, "gridfs_id": 1, "size": 1, "store": 1}
        if check:  # (NOTE [ Checked reads ] in stores/reader.py)
            fields.update(crc32=1, name=1)
        docs = self._fetch(idx, fields)
        if check:
            self._checked(idx, docs)
        return [(bytes(d["data"]), int(self._labels[i])) for d, i in zip(docs, idx, strict=True)]

    def read_data_ends(self, indices: Sequence[int]) -> tuple[list[bytes], list[int]]:
        idx = self.check_indices(indices)
        fields = {"data": 1, "gridfs_id": 1, "size": 1, "store": 1, "crc32": 1, "name": 1}
        docs = self._fetch(idx, {**fields, "scan_end": 1})  # (NOTE [ Checked reads ])
        ends = self._checked(idx, docs)
        return [bytes(d["data"]) for d in docs], ends

    def _checked(self, idx: list[int], docs: list[dict[str, Any]]) -> list[int]:
        """Raise the error of the first record whose bytes are not the ones its document
        describes (its ``size`` and ``crc32``); where none, each one's scan end as its document
        gives it (-1 where it gives none, or one that is not an offset in its bytes: those are
        searched, and ``fastdata verify`` names them)."""
        ends = []
        for i, doc in zip(idx, docs, strict=True):
            data, size, crc = doc["data"], doc.get("size"), doc.get("crc32")
            if not (isinstance(size, int) and isinstance(crc, int) and 0 <= crc < 1 << 32) or (
                isinstance(size, bool) or isinstance(crc, bool)
            ):  # (BSON gives 64-bit integers as a subclass of int)
                raise RecordError(
                    f"{self.location}: record {i}: damaged ('size' or 'crc32')",
                    store=self.command_target,
                )
            why = bytes_problem(size, crc, data)
            if why is not None:
                raise self.mismatch(i, str(names_from_bson(doc).get("name")), why)
            end = doc.get("scan_end", -1)
            ok = isinstance(end, int) and not isinstance(end, bool) and -1 <= end < size
            ends.append(int(end) if ok else -1)
        return ends

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)
        fields = {"data": 1, "gridfs_id": 1, "size": 1, "store": 1, "name": 1}
        return [
            (str(names_from_bson(d).get("name")), bytes(d["data"]), int(self._labels[i]))
            for d, i in zip(self._fetch(idx, fields), idx, strict=True)
        ]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        out = []
        for doc, i in zip(self._fetch(idx, None), idx, strict=True):
            out.append(Record(i, self._header(doc, i), bytes(doc["data"])))
        return out

    def _header(self, doc: dict[str, Any], index: int) -> RecordHeader:
        """Record ``index``'s header, from its document; a damaged one names this store."""
        try:
            return RecordHeader.from_dict(names_from_bson(doc), f"{self.location}: record {index}")
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise
