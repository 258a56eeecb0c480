"""The MongoDB backend: a writer, a reader, and a reader for the `img_name`/`bson_img` layout.

A store is one collection with one document per image::

    {"_id": 17, "name": "cat/0017.jpg", "label": 0, "size": 118233, "crc32": 2874011234,
     "format": "jpeg", "repaired": false, "data": BinData(...)}

Images too large for one document (over ``GRIDFS_THRESHOLD``) live in the GridFS bucket
``<collection>.gridfs`` under the id ``"<collection>:<index>"``, and their document carries
``"gridfs_id"`` instead of ``"data"``. The metadata (same fields as the LMDB store's, plus the
labels as one little-endian int32 array) is the document ``{"_id": "<collection>"}`` in the
collection ``__fastdata__``, written last; conversion progress is ``"<collection>:progress"`` there.

Clients are created lazily, once per process, and never cross a fork or a pickle. Network errors
are retried with a bounded, growing backoff; when the server stays away the error names the URI
(password masked) and what was being read.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import (
    IncompleteStoreError,
    RecordError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StoreReplacedError,
)
from ..packed import PackedStrings
from ..records import (
    Progress,
    Record,
    RecordHeader,
    SkippedFile,
    StoreMeta,
    check_labels,
    class_count,
    name_bytes,
    skipped_file,
)
from .locks import describe_holder, holder, holder_gone
from .policy import Completion, Existing, StoreWriter
from .reader import StoreReader

__all__ = [
    "LegacyMongoStore",
    "MongoOptions",
    "MongoStore",
    "MongoWriter",
    "is_mongo_uri",
    "mask_uri",
]

log = logging.getLogger(__name__)

META_COLLECTION = "__fastdata__"
ASIDE_SUFFIX = ".__replacement__"
"""A replacement is built in ``<collection>.__replacement__`` and renamed into place."""
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
LABEL_DTYPE = np.dtype("<i4")
USER_ENV = "FASTDATA_MONGO_USER"
PASSWORD_ENV = "FASTDATA_MONGO_PASSWORD"

T = TypeVar("T")


def is_mongo_uri(target: object) -> bool:
    """Whether ``target`` is a MongoDB connection string."""
    return isinstance(target, str) and target.startswith(("mongodb://", "mongodb+srv://"))


def mask_uri(uri: str) -> str:
    """The URI with its password replaced by ``***`` (safe for logs and errors)."""
    return re.sub(r"^(mongodb(?:\+srv)?://)([^:@/]+):([^@/]*)@", r"\1\2:***@", uri)


@dataclass(frozen=True)
class MongoOptions:
    """How to talk to the server.

    Attributes:
        read_preference: e.g. ``"secondaryPreferred"`` on a replica set; None keeps the URI's.
        timeout_s: server selection and connection timeout of one attempt.
        socket_timeout_s: how long one operation may wait for the server's answer.
        retry_budget_s: how long transient network errors are retried (backoff from 0.2 s,
            doubling, at most 5 s between attempts) before an error is raised.
        claim_ttl_s: how long a writer's claim on a collection lasts without renewal (a writer
            renews it every quarter of that; a killed one blocks others this long at most).
    """

    read_preference: str | None = None
    timeout_s: float = 10.0
    socket_timeout_s: float = 120.0
    retry_budget_s: float = 60.0
    claim_ttl_s: float = CLAIM_TTL_S


def _make_client(uri: str, options: MongoOptions) -> Any:
    """A new MongoClient (tests substitute mongomock here)."""
    import pymongo

    kwargs: dict[str, Any] = {
        "serverSelectionTimeoutMS": int(options.timeout_s * 1000),
        "connectTimeoutMS": int(options.timeout_s * 1000),
        "socketTimeoutMS": int(options.socket_timeout_s * 1000),
        "appname": "fastdata",
    }
    if options.read_preference:
        kwargs["readPreference"] = options.read_preference
    if "@" not in uri.split("//", 1)[-1].split("/", 1)[0] and os.environ.get(USER_ENV):
        kwargs["username"] = os.environ[USER_ENV]
        kwargs["password"] = os.environ.get(PASSWORD_ENV, "")
    return pymongo.MongoClient(uri, **kwargs)


def _database_name(uri: str, database: str | None) -> str:
    if database:
        return database
    from pymongo.uri_parser import parse_uri

    name = parse_uri(uri).get("database")
    if not name:
        raise StoreError(
            f"{mask_uri(uri)}: no database named; put it in the URI: mongodb://host:port/DB"
        )
    return str(name)


def _close_client(client: Any, pid: int) -> None:
    if os.getpid() == pid:  # a forked child leaves its parent's client alone
        client.close()


class _Connection:
    """A per-process client for one URI, made on first use, dropped when pickled or forked, and
    closed when closed or garbage-collected (its sockets and monitor threads go with it)."""

    def __init__(self, uri: str, database: str | None, options: MongoOptions) -> None:
        self.uri = uri
        self.database = _database_name(uri, database)
        self.options = options
        self._client: Any = None
        self._pid = -1
        self._closer: weakref.finalize | None = None

    def db(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            # A client inherited across fork is left alone (never used, never closed here).
            self._client = _make_client(self.uri, self.options)
            self._pid = os.getpid()
            self._closer = weakref.finalize(self, _close_client, self._client, self._pid)
        return self._client[self.database]

    def close(self) -> None:
        if self._closer is not None and self._pid == os.getpid():
            self._closer()
        self._client = None
        self._closer = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_closer"] = None
        state["_pid"] = -1
        return state

    def retry(self, what: str, location: str, fn: Callable[[], T], *, first: bool = False) -> T:
        """Run ``fn``, retrying transient network errors within the retry budget.

        With ``first`` (the first contact with the server), there is one attempt: a server that
        cannot be reached at all is reported after ``timeout_s``, not after the retry budget.
        """
        from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

        budget = 0.0 if first else self.options.retry_budget_s
        started = time.monotonic()
        deadline = started + budget
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except OperationFailure as exc:
                hint = (
                    "check the user and password (in the URI, or FASTDATA_MONGO_USER and "
                    "FASTDATA_MONGO_PASSWORD)"
                    if exc.code in (13, 18)  # Unauthorized, AuthenticationFailed
                    else "the server refused the operation"
                )
                raise StoreError(f"{location}: {what} failed: {_short(exc)}; {hint}") from None
            except ConnectionFailure as exc:
                if time.monotonic() + delay > deadline:
                    raise StoreError(
                        f"{location}: {what} failed after {attempt} attempt(s) in "
                        f"{time.monotonic() - started:.1f} s: {type(exc).__name__}: "
                        f"{_short(exc)}; check that the server is running and reachable"
                    ) from None
                log.warning("%s: %s failed (%s); retrying in %.1f s", location, what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            except PyMongoError as exc:
                raise StoreError(f"{location}: {what} failed: {_short(exc)}") from None


def _short(exc: BaseException) -> str:
    text = str(exc).split(", full error:")[0].split(" (configured timeouts:")[0]
    text = text.split(", Timeout:")[0]
    return text if len(text) < 300 else text[:300] + "..."


def _location(uri: str, collection: str) -> str:
    return f"{mask_uri(uri)} collection {collection}"


def _gridfs(db: Any, bucket: str) -> Any:
    from gridfs import GridFSBucket

    return GridFSBucket(db, bucket_name=bucket)


def _bucket(collection: str, store_id: str) -> str:
    """The GridFS bucket of one store: named by its id, so a replacement never needs to move it
    (stores written before ids existed used ``<collection>.gridfs``)."""
    return f"{collection}.gridfs.{store_id}" if store_id else f"{collection}.gridfs"


def _is_bucket_of(name: str, collection: str) -> bool:
    return (
        re.fullmatch(re.escape(collection) + r"\.gridfs(\.[0-9a-f]{32})?\.(files|chunks)", name)
        is not None
    )


class _MongoTarget:
    """A collection on a server, as the writer and the readers address it."""

    def __init__(
        self,
        uri: str,
        collection: str,
        *,
        database: str | None = None,
        options: MongoOptions | None = None,
    ) -> None:
        self.uri = uri
        self.collection = collection
        self.options = options or MongoOptions()
        self._conn = _Connection(uri, database, self.options)
        self.location = _location(uri, collection)
        self._opening()

    def _opening(self) -> None:
        """What a target does when it is created (a reader reads the store's metadata)."""

    def _run(self, what: str, fn: Callable[[], T], *, first: bool = False) -> T:
        return self._conn.retry(what, self.location, fn, first=first)

    def close(self) -> None:
        self._conn.close()


# --------------------------------------------------------------------------- writer


def _insert_groups(docs: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
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


class MongoWriter(_MongoTarget, StoreWriter):
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
    ``options``; the claim's lifetime is ``options.claim_ttl_s``).
    """

    _token = ""
    _heartbeat: threading.Thread | None = None
    _stop: threading.Event | None = None
    _lost = ""
    _store_id = ""
    _sender: ThreadPoolExecutor | None = None
    _inflight: Future[None] | None = None

    @property
    def claim_ttl_s(self) -> float:
        return self.options.claim_ttl_s

    @property
    def _aside_name(self) -> str:
        return f"{self.collection}{ASIDE_SUFFIX}"

    def _name(self) -> str:
        return self._aside_name if self._aside else self.collection

    _base_bucket = ""
    """The GridFS bucket of the complete store in place (an append writes into it)."""

    @property
    def _bucket_name(self) -> str:
        if self._appending and self._base_bucket:
            return self._base_bucket
        return _bucket(self.collection, self._store_id)

    @property
    def command_target(self) -> str:
        return f"{mask_uri(self.uri)} --collection {self.collection}"

    def _meta_coll(self) -> Any:
        return self._conn.db()[META_COLLECTION]

    # -- the writer claim

    def _lock(self) -> None:
        from pymongo.errors import DuplicateKeyError

        claim_id = f"{self.collection}:writer"
        token = secrets.token_hex(8)
        ttl = self.claim_ttl_s

        def take() -> dict[str, Any] | None:
            meta = self._meta_coll()
            for _ in range(10):
                now = self._server_now()
                doc = {"_id": claim_id, "token": token, **holder(), "expires": now + ttl}
                try:
                    meta.insert_one(doc)
                    return None
                except DuplicateKeyError:
                    held = meta.find_one({"_id": claim_id})
                if held is None or held.get("token") == token:
                    continue  # released meanwhile, or our own insert, retried
                expires = held.get("expires")
                gone = holder_gone(held)
                if isinstance(expires, (int, float)) and expires > now and not gone:
                    return {**held, "now": now}
                # expired, or its process is gone: take it over, unless another writer did first
                if meta.replace_one(
                    {"_id": claim_id, "token": held.get("token")}, doc
                ).matched_count:
                    log.warning(
                        "%s: took over the writer claim of %s (%s)",
                        self.location,
                        describe_holder(held),
                        "that process is gone" if gone else "it expired",
                    )
                    return None
            return {"token": "?"}

        held = self._run("claiming the collection for writing", take, first=True)
        if held is not None:
            left = held.get("expires", 0) - held["now"] if "expires" in held else ttl
            raise StoreLockedError(
                f"{self.location}: another conversion is writing this collection "
                f"({describe_holder(held)}); wait for it to finish. If that process is gone, its "
                f"claim expires in {max(0.0, left):.0f} s (a running writer renews it every "
                f"{ttl / 4:g} s): then run the same command with --resume"
            )
        self._token = token
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._renew, args=(claim_id,), name="fastdata-mongo-claim", daemon=True
        )
        self._heartbeat.start()

    def _renew(self, claim_id: str) -> None:
        """Renew the claim every quarter of its lifetime until told to stop."""
        from pymongo.errors import PyMongoError

        assert self._stop is not None, "_lock() starts the heartbeat"
        expires = time.monotonic() + self.claim_ttl_s
        while not self._stop.wait(self.claim_ttl_s / 4):
            try:
                new = self._server_now() + self.claim_ttl_s
                result = self._meta_coll().update_one(
                    {"_id": claim_id, "token": self._token}, {"$set": {"expires": new}}
                )
                if not result.matched_count:
                    self._lost = "another writer took it over after it expired"
                    return
                expires = time.monotonic() + self.claim_ttl_s
            except PyMongoError as exc:
                log.warning("%s: renewing the writer claim failed: %s", self.location, exc)
                if time.monotonic() > expires:
                    self._lost = "it expired while the server could not be reached"
                    return

    def _server_now(self) -> float:
        """The server's clock, in seconds since the epoch: a claim's expiry is written and
        compared in it, so writers on hosts whose clocks disagree agree on it."""
        from datetime import UTC

        from pymongo.errors import OperationFailure

        try:
            now = self._conn.db().client.admin.command("hello").get("localTime")
        except (OperationFailure, NotImplementedError):
            now = None
        if now is None:  # a server that does not say: this host's clock
            return time.time()
        return float(now.replace(tzinfo=UTC).timestamp() if now.tzinfo is None else now.timestamp())

    def _check_claim(self) -> None:
        if self._lost:
            raise StoreLockedError(
                f"{self.location}: this conversion lost its claim on the collection "
                f"({self._lost}); nothing more is written: run the same command with --resume "
                "once no other conversion writes it"
            )

    def _unlock(self) -> None:
        if self._heartbeat is None or self._stop is None:
            return
        self._stop.set()
        self._heartbeat.join()
        self._heartbeat = None
        from pymongo.errors import PyMongoError

        try:
            self._meta_coll().delete_one({"_id": f"{self.collection}:writer", "token": self._token})
        except PyMongoError as exc:
            log.warning(
                "%s: could not release the writer claim (%s); it expires in %g s",
                self.location,
                exc,
                self.claim_ttl_s,
            )

    # -- the policy's steps (see StoreWriter.start)

    def _inspect(self) -> Existing:
        coll, aside = self.collection, self._aside_name

        def look() -> tuple[dict[Any, Any], bool]:
            db = self._conn.db()
            ids = [coll, f"{coll}:progress", aside, f"{aside}:progress"]
            docs = {d["_id"]: d for d in db[META_COLLECTION].find({"_id": {"$in": ids}})}
            return docs, db[coll].find_one({}, {"_id": 1}) is not None

        docs, has_docs = self._run("checking the collection", look)
        meta = progress = appending = None
        other = ""
        if coll in docs:
            try:
                meta = StoreMeta.from_dict(_names_from_bson(docs[coll]), self.location)
            except StoreError as exc:
                other = f"holds a store with damaged metadata ({exc})"
            bucket = docs[coll].get("gridfs_bucket")
            self._base_bucket = bucket if isinstance(bucket, str) else ""
            saved = docs.get(f"{coll}:progress")
            if (
                meta is not None
                and saved is not None
                and saved.get("base_id", "") == meta.id
                and 0 < saved.get("first_index", 0) == meta.count
            ):
                appending = self._progress(saved)
        elif f"{coll}:progress" in docs:
            progress = self._progress(docs[f"{coll}:progress"])
        elif has_docs:
            other = "the collection holds documents but no fastdata store"
        aside_progress = docs.get(f"{aside}:progress")
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
        state = _names_from_bson({k: v for k, v in doc.items() if k != "_id"})

        def load(count: int) -> list[SkippedFile]:
            store_id = str(state.get("store_id", ""))
            return self._run(
                "reading the skipped list",
                lambda: _load_skipped(self._conn.db(), store_id, count, self.location),
            )

        return Progress.from_json(json.dumps(state, default=str), self.location, load)

    def _state(self, progress: Progress) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The progress document (BSON-safe, its skipped list saved apart, so it stays small
        however many files are skipped), and the skipped-list documents not saved yet."""
        state = json.loads(progress.to_json())
        chunks = _skipped_chunks(
            self._store_id, progress.skipped, self._take_skipped(progress.skipped)
        )
        return _to_bson(state), chunks

    def _open(self, progress: Progress, *, new: bool) -> None:
        self._store_id = progress.store_id
        if new:
            name = self._name()
            if not self._appending:
                self._run("clearing the destination", functools.partial(self._drop, name))
            self._run(
                "saving progress", functools.partial(self._save, name, *self._state(progress))
            )

    def _save(self, name: str, state: dict[str, Any], chunks: list[dict[str, Any]]) -> None:
        """Save the skipped-list documents, then the progress that counts them."""
        meta = self._meta_coll()
        for chunk in chunks:
            meta.replace_one({"_id": chunk["_id"]}, chunk, upsert=True)
        meta.replace_one({"_id": f"{name}:progress"}, state, upsert=True)

    def _drop(self, name: str) -> None:
        """Drop collection ``name``, its metadata, progress and skipped lists, and the buckets of
        no store."""
        db = self._conn.db()
        for doc in db[META_COLLECTION].find({"_id": {"$in": [name, f"{name}:progress"]}}):
            for key in ("id", "store_id"):
                if isinstance(doc.get(key), str) and doc[key]:
                    db[META_COLLECTION].delete_many(_skipped_ids(doc[key]))
        db[name].drop()
        db[META_COLLECTION].delete_many({"_id": {"$in": [name, f"{name}:progress"]}})
        self._drop_orphan_buckets()

    def _drop_orphan_buckets(self) -> None:
        db = self._conn.db()
        live = {
            d["gridfs_bucket"]
            if isinstance(d.get("gridfs_bucket"), str)
            else _bucket(self.collection, d.get("id", ""))
            for d in db[META_COLLECTION].find(
                {"_id": {"$in": [self.collection, self._aside_name]}},
                {"id": 1, "gridfs_bucket": 1},
            )
        }
        live.add(self._bucket_name)
        for name in db.list_collection_names():
            if _is_bucket_of(name, self.collection) and name.rsplit(".", 1)[0] not in live:
                db[name].drop()

    def _kept_skipped(self, base: StoreMeta) -> int:
        return 0  # the skipped list is kept under the store's id: the new id gets all of it

    def _discard_append(self, base: StoreMeta, pending: Progress) -> None:
        def discard() -> None:
            db = self._conn.db()
            db[self.collection].delete_many({"_id": {"$gte": base.count}})
            if pending.store_id:
                db[META_COLLECTION].delete_many(_skipped_ids(pending.store_id))
                if self._base_bucket:
                    prefix = {"_id": {"$regex": f"^{re.escape(pending.store_id)}:"}}
                    bucket = _gridfs(db, self._base_bucket)
                    for f in db[f"{self._base_bucket}.files"].find(prefix, {"_id": 1}):
                        bucket.delete(f["_id"])
            db[META_COLLECTION].delete_one({"_id": f"{self.collection}:progress"})

        self._run("discarding the interrupted append", discard)

    def open_reader(self) -> StoreReader:
        return MongoStore(
            self.uri, self.collection, database=self._conn.database, options=self.options
        )

    def _discard_aside(self) -> None:
        self._run("discarding the interrupted replacement", lambda: self._drop(self._aside_name))

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
                db[META_COLLECTION].delete_many(_skipped_ids(old["id"]))
            if aside in db.list_collection_names():
                db.client.admin.command(
                    "renameCollection",
                    f"{db.name}.{aside}",
                    to=f"{db.name}.{coll}",
                    dropTarget=True,
                )
            doc["_id"] = coll
            db[META_COLLECTION].replace_one({"_id": coll}, doc, upsert=True)
            db[META_COLLECTION].delete_many(
                {"_id": {"$in": [aside, f"{aside}:progress", f"{coll}:progress"]}}
            )
            self._store_id = str(doc.get("id", ""))
            self._drop_orphan_buckets()

        # Each step can be repeated: a replacement killed half-way is finished by the next writer.
        self._run("moving the new store into place", promote)
        self._aside = False

    # -- records

    def documents(self, records: Sequence[Record]) -> list[dict[str, Any]]:
        """The records' documents; images over GRIDFS_THRESHOLD are uploaded to GridFS here."""
        from bson import Binary

        docs = []
        bucket_name = self._bucket_name
        for rec in records:
            doc: dict[str, Any] = {
                "_id": rec.index,
                **_to_bson(asdict(rec.header)),
                "store": self._store_id,
            }
            if len(rec.data) > GRIDFS_THRESHOLD:
                file_id = f"{self._store_id}:{rec.index}"
                bucket = _gridfs(self._conn.db(), bucket_name)
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
                    raise StoreError(
                        f"{self.location}: writing records failed: {errors[0].get('errmsg')}; "
                        "fix the cause (free space on the server?) and run the same command "
                        "with --resume"
                    ) from None

        for group in _insert_groups(docs):
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
        for chunk in _skipped_chunks(self._store_id, skipped, self._take_skipped(skipped)):
            save = functools.partial(
                db[META_COLLECTION].replace_one, {"_id": chunk["_id"]}, chunk, upsert=True
            )
            self._run("saving the skipped list", save)
        if self._skipped_stale > len(skipped):
            first = -(-len(skipped) // SKIPPED_PER_DOC)
            stale = [
                f"skipped:{self._store_id}:{k:09d}"
                for k in range(first, -(-self._skipped_stale // SKIPPED_PER_DOC))
            ]
            self._run(
                "shortening the skipped list",
                lambda: db[META_COLLECTION].delete_many({"_id": {"$in": stale}}),
            )
        doc: dict[str, Any] = {"_id": name, **_to_bson(meta.to_dict()), "gridfs_bucket": bucket}
        raw = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()
        if len(raw) > LABELS_INLINE_MAX:
            file_id = f"{self._store_id}:labels"
            self._run("uploading labels", lambda: self._upload(_gridfs(db, bucket), file_id, raw))
            doc["labels_gridfs_id"] = file_id
        else:
            doc["labels"] = Binary(raw)
        # One index build over the finished collection costs less than maintaining it per insert.
        self._run("creating the index on name", lambda: db[name].create_index("name"))
        self._run(
            "writing metadata",
            lambda: db[META_COLLECTION].replace_one({"_id": name}, doc, upsert=True),
        )
        if not self._aside:
            self._run(
                "clearing the progress",
                lambda: db[META_COLLECTION].delete_one({"_id": f"{name}:progress"}),
            )
        if self._appending and self.base is not None and self.base.id:
            base_id = self.base.id  # its skipped list is now under the new id, whole
            self._run(
                "clearing the old skipped list",
                lambda: db[META_COLLECTION].delete_many(_skipped_ids(base_id)),
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


SKIPPED_PER_DOC = 1000
"""Skipped files per document of a skipped list (names are at most 4 kB: under 5 MB a document)."""


def _skipped_ids(store_id: str) -> dict[str, Any]:
    """The filter of the skipped-list documents of one store (``skipped:<id>:<n>``)."""
    return {"_id": {"$gte": f"skipped:{store_id}:", "$lt": f"skipped:{store_id};"}}


def _skipped_chunks(
    store_id: str, items: Sequence[SkippedFile], saved: int
) -> list[dict[str, Any]]:
    """The skipped-list documents that hold items from ``saved`` on (the last one saved may be
    partly filled: it is written again, whole)."""
    first = saved // SKIPPED_PER_DOC
    return [
        {
            "_id": f"skipped:{store_id}:{k:09d}",
            "items": _to_bson(
                [f.to_dict() for f in items[k * SKIPPED_PER_DOC : (k + 1) * SKIPPED_PER_DOC]]
            ),
        }
        for k in range(first, -(-len(items) // SKIPPED_PER_DOC))
    ]


def _load_skipped(db: Any, store_id: str, count: int, where: str) -> list[SkippedFile]:
    """The first ``count`` entries of a store's skipped list."""
    items: list[Any] = []
    for doc in db[META_COLLECTION].find(_skipped_ids(store_id)).sort("_id", 1):
        found = doc.get("items")
        if isinstance(found, list):
            items.extend(found)
        if len(items) >= count:
            break
    if len(items) < count:
        raise StoreError(
            f"{where}: damaged metadata (the skipped list holds {len(items)} of its {count} "
            "entries); run `fastdata verify` on the store and convert it again"
        )
    return [
        skipped_file(_names_from_bson(i) if isinstance(i, dict) else i, where)
        for i in items[:count]
    ]


def _doc_id(doc: dict[str, Any]) -> Any:
    return doc["_id"]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _to_bson(value: Any) -> Any:
    """``value`` with every string that is not valid UTF-8 (a file name with other bytes) as BSON
    binary of its bytes: BSON strings must be UTF-8. Mapping keys that are not (``class_to_idx``,
    which readers derive from ``classes``) are left out."""
    from bson import Binary

    if isinstance(value, str):
        return value if _utf8(value) else Binary(os.fsencode(value))
    if isinstance(value, list):
        return [_to_bson(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_bson(v) for k, v in value.items() if not isinstance(k, str) or _utf8(k)}
    return value


def _names_from_bson(doc: dict[str, Any]) -> dict[str, Any]:
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
    return out


# --------------------------------------------------------------------------- readers


class MongoStore(_MongoTarget, StoreReader):
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
        self._bucket = _bucket(self.collection, "")
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
                raise StoreReplacedError(
                    f"{self.location}: the collection was replaced since this dataset opened it "
                    f"(store id {self._id or '(none)'}, now {meta.id or '(none)'}); create the "
                    "dataset (and its DataLoader) again"
                )
            self._meta, self._labels = seen

    def skipped_files(self) -> list[SkippedFile]:
        meta = self.meta

        def load() -> list[SkippedFile]:
            db = self._conn.db()
            if meta.id and db[META_COLLECTION].find_one(_skipped_ids(meta.id), {"_id": 1}):
                return _load_skipped(db, meta.id, meta.skipped_count, self.location)
            # the first layout kept the list in the metadata document
            doc = db[META_COLLECTION].find_one({"_id": self.collection}, {"skipped": 1}) or {}
            items = _names_from_bson(doc).get("skipped") or []
            if not meta.skipped_count:
                return []
            if not isinstance(items, list) or len(items) < meta.skipped_count:
                return _load_skipped(db, meta.id, meta.skipped_count, self.location)
            return [skipped_file(i, self.location) for i in items[: meta.skipped_count]]

        return self._run("reading the skipped list", load)

    def _load_meta(self) -> tuple[StoreMeta, np.ndarray]:
        db = self._conn.db()
        doc = db[META_COLLECTION].find_one({"_id": self.collection})
        if doc is None:
            saved = db[META_COLLECTION].find_one({"_id": f"{self.collection}:progress"})
            if saved is not None:
                command = Progress(
                    source=str(saved.get("source")),
                    fingerprint=str(saved.get("fingerprint", "")),
                    total=0,
                    verify_decode=bool(saved.get("verify_decode")),
                    base_id=str(saved.get("base_id", "")),
                ).resume_command(f"{mask_uri(self.uri)} --collection {self.collection}")
                raise IncompleteStoreError(
                    f"{self.location}: incomplete store: its conversion stopped after "
                    f"{saved.get('next_sample')} of {saved.get('total')} images; finish it with "
                    f"`{command}`"
                )
            if db[self.collection].find_one({}, {"_id": 1}) is not None:
                raise StoreError(
                    f"{self.location}: the collection holds documents but no fastdata metadata; "
                    "it was not written by `fastdata convert` (for the img_name/bson_img layout, "
                    "give --index-file)"
                )
            raise StoreNotFoundError(
                f"{self.location}: no fastdata store here; create one with "
                f"`fastdata convert SRC {mask_uri(self.uri)} --collection {self.collection}`"
            )
        doc = _names_from_bson(doc)
        meta = StoreMeta.from_dict(doc, self.location)
        bucket = doc.get("gridfs_bucket", _bucket(self.collection, ""))
        if not isinstance(bucket, str):
            raise StoreError(f"{self.location}: damaged metadata ('gridfs_bucket')")
        self._bucket = bucket
        if "labels_gridfs_id" in doc:
            raw = self._download(db, doc["labels_gridfs_id"], 4 * meta.count, "the labels")
        else:
            raw = doc.get("labels", b"")
            if not isinstance(raw, bytes):
                raise StoreError(
                    f"{self.location}: damaged metadata ('labels' is not binary); run "
                    "`fastdata verify` on the store and convert it again"
                )
        return meta, check_labels(raw, meta, self.location)

    def _download(self, db: Any, file_id: Any, size: int, what: str) -> bytes:
        """A GridFS file of ``size`` bytes; any other length is damage, and is not read."""
        from gridfs.errors import NoFile

        try:
            stream = _gridfs(db, self._bucket).open_download_stream(file_id)
        except NoFile:
            raise RecordError(
                f"{self.location}: {what}: GridFS file {file_id!r} is missing; the store is "
                "damaged or was replaced, run `fastdata verify` on it"
            ) from None
        if stream.length != size:
            raise RecordError(
                f"{self.location}: {what}: GridFS file {file_id!r} holds {stream.length} bytes, "
                f"the record says {size}; the store is damaged, run `fastdata verify` on it"
            )
        return bytes(stream.read())

    def _fetch(self, indices: list[int], fields: dict[str, int] | None) -> list[dict[str, Any]]:
        def query() -> list[dict[str, Any]]:
            db = self._conn.db()
            wanted = sorted(set(indices))
            found = {
                d["_id"]: d for d in db[self.collection].find({"_id": {"$in": wanted}}, fields)
            }
            missing = [i for i in wanted if i not in found]
            if missing:
                raise RecordError(
                    f"{self.location}: record {missing[0]} is missing; the store is damaged, "
                    "run `fastdata verify` on it and convert it again"
                )
            for i, doc in found.items():
                self._check_document(db, i, doc)
            return [found[i] for i in indices]

        span = f"{min(indices)}-{max(indices)}" if indices else "none"
        return self._run(f"reading records {span}", query)

    def _check_document(self, db: Any, index: int, doc: dict[str, Any]) -> None:
        """Check a document's store id and the type of its image before using it; fetch an image
        kept in GridFS."""
        # documents of the first layout carry no store id: they are the id-less store's
        if self._ids and doc.get("store", "") not in self._ids:
            raise StoreReplacedError(
                f"{self.location}: record {index} belongs to another store (id "
                f"{doc.get('store')!r}, not {self._id}): the collection was replaced since "
                "this dataset opened it; create the dataset (and its DataLoader) again"
            )
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
            f"{self.location}: record {index}: its image ('data') is {found}, not binary; the "
            "store is damaged, run `fastdata verify` on it and convert it again"
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
                return sorted(found, key=_doc_id)

            docs = self._run(f"reading headers {start}-{end - 1}", query)
            if [d["_id"] for d in docs] != list(range(start, end)):
                raise RecordError(
                    f"{self.location}: records {start}-{end - 1} are not all there; the store "
                    "is damaged, run `fastdata verify` on it"
                )
            for doc in docs:
                where = f"{self.location}: record {doc['_id']}"
                yield RecordHeader.from_dict(_names_from_bson(doc), where)

    def record_names(self) -> PackedStrings:
        """The names alone, in one query that returns no image bytes."""
        n = len(self)

        def query() -> dict[int, Any]:
            docs = self._conn.db()[self.collection].find({"_id": {"$lt": n}}, {"name": 1})
            return {d["_id"]: d.get("name") for d in docs}

        found = self._run("reading the record names", query)
        names = []
        for i in range(n):
            name = _names_from_bson({"name": found.get(i)})["name"]
            if not isinstance(name, str):
                raise RecordError(
                    f"{self.location}: record {i} has no name; the store is damaged, run "
                    "`fastdata verify` on it"
                )
            names.append(name_bytes(name))
        return PackedStrings(names)

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        docs = self._fetch(idx, {"data": 1, "gridfs_id": 1, "size": 1, "store": 1})
        return [(bytes(d["data"]), int(self._labels[i])) for d, i in zip(docs, idx, strict=True)]

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)
        fields = {"data": 1, "gridfs_id": 1, "size": 1, "store": 1, "name": 1}
        return [
            (str(_names_from_bson(d).get("name")), bytes(d["data"]), int(self._labels[i]))
            for d, i in zip(self._fetch(idx, fields), idx, strict=True)
        ]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        out = []
        for doc, i in zip(self._fetch(idx, None), idx, strict=True):
            header = RecordHeader.from_dict(_names_from_bson(doc), f"{self.location}: record {i}")
            out.append(Record(i, header, bytes(doc["data"])))
        return out


class LegacyMongoStore(_MongoTarget, StoreReader):
    """Reads collections in the common layout written by other tools, without converting them.

    Documents hold ``img_name`` (the image's path) and ``bson_img`` (its bytes); a JSON index file
    ``{"path_list": [...], "label_list": [...]}`` gives the order and the labels. JPEGs whose
    end-of-image marker is missing are repaired as they are read. Class names are the first
    path component of each image when that is consistent with the labels, else the label numbers.

    Args:
        uri, collection, database, options: as for :class:`MongoStore`.
        index_file: the JSON index.
    """

    has_checksums = False

    def __init__(
        self,
        uri: str,
        collection: str,
        index_file: str | os.PathLike[str],
        *,
        database: str | None = None,
        options: MongoOptions | None = None,
    ) -> None:
        super().__init__(uri, collection, database=database, options=options)
        path = Path(index_file)
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            paths, labels = index["path_list"], index["label_list"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{path}: not a usable index file ({exc}); expected JSON with "
                '"path_list" and "label_list"'
            ) from exc
        if len(paths) != len(labels):
            raise StoreError(
                f"{path}: {len(paths)} paths but {len(labels)} labels; the index is damaged"
            )
        # One packed buffer and one int array, not two lists of Python objects.
        try:
            self._names = PackedStrings([p.encode("utf-8", "surrogateescape") for p in paths])
            self._labels = np.asarray(labels, dtype=np.int64)
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise StoreError(
                f'{path}: not a usable index file ({exc}); "path_list" must hold strings and '
                '"label_list" integers'
            ) from None
        self._labels.setflags(write=False)
        self._meta = StoreMeta(
            count=len(paths),
            classes=_legacy_classes(paths, self._labels, str(path)),
            source=str(path),
            format="img_name/bson_img",
            version=0,
        )

    def _fetch(self, idx: list[int]) -> list[tuple[str, bytes, bool]]:
        from ..images.codec import repair_if_cut

        names = [self._names[i].decode("utf-8", "surrogateescape") for i in idx]

        def query() -> dict[str, bytes]:
            coll = self._conn.db()[self.collection]
            docs = coll.find(
                {"img_name": {"$in": sorted(set(names))}}, {"img_name": 1, "bson_img": 1}
            )
            out = {}
            for d in docs:
                if not isinstance(d.get("bson_img"), bytes):
                    raise RecordError(
                        f"{self.location}: the document of {d.get('img_name')!r} holds no "
                        "binary 'bson_img'; the collection is damaged"
                    )
                out[d["img_name"]] = d["bson_img"]
            return out

        span = f"{min(idx)}-{max(idx)}" if idx else "none"
        found = self._run(f"reading images {span}", query)
        out = []
        for name in names:
            if name not in found:
                raise RecordError(f"{self.location}: no document with img_name {name!r}")
            data, repaired = repair_if_cut(found[name])
            out.append((name, data, repaired))
        return out

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        return [
            (data, int(self._labels[i]))
            for (_, data, _), i in zip(self._fetch(idx), idx, strict=True)
        ]

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)
        return [
            (name, data, int(self._labels[i]))
            for (name, data, _), i in zip(self._fetch(idx), idx, strict=True)
        ]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..images.codec import sniff
        from ..records import checksum

        idx = self.check_indices(indices)
        out = []
        for (name, data, repaired), i in zip(self._fetch(idx), idx, strict=True):
            header = RecordHeader(
                name,
                int(self._labels[i]),
                len(data),
                checksum(data),
                sniff(data) or "unknown",
                repaired,
            )
            out.append(Record(i, header, data))
        return out


def _legacy_classes(paths: Sequence[str], labels: np.ndarray, where: str) -> list[str]:
    n = class_count(labels, where)
    names: dict[int, str] = {}
    for p, label in zip(paths, labels.tolist(), strict=True):
        first = p.split("/", 1)[0] if "/" in p else None
        if first is None or names.setdefault(label, first) != first:
            return [str(i) for i in range(n)]
    if len(set(names.values())) != len(names):
        return [str(i) for i in range(n)]
    return [names.get(i, str(i)) for i in range(n)]
