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
import time
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
    StoreExistsError,
    StoreNotFoundError,
)
from ..records import Progress, Record, RecordHeader, StoreMeta
from .base import StoreReader, StoreWriter

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
    """

    read_preference: str | None = None
    timeout_s: float = 10.0
    socket_timeout_s: float = 120.0
    retry_budget_s: float = 60.0


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
            f"{mask_uri(uri)}: no database named; put it in the URI (mongodb://host:port/DB) "
            "or pass database="
        )
    return str(name)


class _Connection:
    """A per-process client for one URI, made on first use, dropped when pickled or forked."""

    def __init__(self, uri: str, database: str | None, options: MongoOptions) -> None:
        self.uri = uri
        self.database = _database_name(uri, database)
        self.options = options
        self._client: Any = None
        self._pid = -1

    def db(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            # A client inherited across fork is left alone (never used, never closed here).
            self._client = _make_client(self.uri, self.options)
            self._pid = os.getpid()
        return self._client[self.database]

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_pid"] = -1
        return state

    def retry(self, what: str, location: str, fn: Callable[[], T], *, first: bool = False) -> T:
        """Run ``fn``, retrying transient network errors within the retry budget.

        With ``first`` (the first contact with the server), there is one attempt: a server that
        cannot be reached at all is reported after ``timeout_s``, not after the retry budget.
        """
        from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

        budget = 0.0 if first else self.options.retry_budget_s
        deadline = time.monotonic() + budget
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
                        f"{budget + self.options.timeout_s:g} s: {type(exc).__name__}: "
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


def _gridfs(db: Any, collection: str) -> Any:
    from gridfs import GridFSBucket

    return GridFSBucket(db, bucket_name=f"{collection}.gridfs")


def _gridfs_id(collection: str, index: int) -> str:
    return f"{collection}:{index}"


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

    Batches go in as unordered ``insert_many`` calls with integer ``_id``s, so a resumed
    conversion that repeats a batch hits duplicate keys, which are skipped: nothing is duplicated.
    A batch is sent from a background thread, followed by the progress that covers it, while the
    next batch is read: ``write`` waits only for the batch before (and raises its error).

    Args:
        uri: ``mongodb://[user:password@]host:port/DB``.
        collection: the collection to create.
        database: the database, when the URI names none.
        options: timeouts and retries.
    """

    def start(self, progress: Progress, *, overwrite: bool, resume: bool) -> Progress:
        db = self._conn.db()
        meta_coll = db[META_COLLECTION]

        def look() -> tuple[bool, Any, Any]:
            has_docs = db[self.collection].find_one({}, {"_id": 1}) is not None
            meta = meta_coll.find_one({"_id": self.collection}, {"_id": 1})
            saved = meta_coll.find_one({"_id": f"{self.collection}:progress"})
            return has_docs or meta is not None or saved is not None, meta, saved

        exists, meta, saved = self._run("checking the collection", look, first=True)
        if exists and overwrite:
            self._run("dropping the old store", self._drop)
            exists, meta, saved = False, None, None
        if exists and not resume:
            if meta is not None:
                raise StoreExistsError(
                    f"{self.location}: a store exists already; pass --overwrite to replace it"
                )
            if saved is not None:
                raise StoreExistsError(
                    f"{self.location}: holds an interrupted conversion; pass --resume to "
                    "continue it or --overwrite to start over"
                )
            raise StoreExistsError(
                f"{self.location}: the collection holds documents; pass --overwrite to replace "
                "it (it is dropped) or choose another --collection"
            )
        if resume and saved is not None:
            saved.pop("_id", None)
            restored = Progress.from_json(json.dumps(saved), self.location)
            if restored.fingerprint != progress.fingerprint:
                raise StoreError(
                    f"{self.location}: the source folder {progress.source} changed since this "
                    "conversion started; convert again with --overwrite"
                )
            return restored
        return progress

    def _drop(self) -> None:
        db = self._conn.db()
        db[self.collection].drop()
        db[f"{self.collection}.gridfs.files"].drop()
        db[f"{self.collection}.gridfs.chunks"].drop()
        db[META_COLLECTION].delete_many(
            {"_id": {"$in": [self.collection, f"{self.collection}:progress"]}}
        )

    def _upload(self, bucket: Any, file_id: str, data: bytes) -> None:
        from gridfs.errors import NoFile

        with suppress(NoFile):  # a resumed conversion may have uploaded it, possibly in part
            bucket.delete(file_id)
        bucket.upload_from_stream_with_id(file_id, file_id, data)

    def documents(self, records: Sequence[Record]) -> list[dict[str, Any]]:
        """The records' documents; images over GRIDFS_THRESHOLD are uploaded to GridFS here."""
        from bson import Binary

        docs = []
        for rec in records:
            doc: dict[str, Any] = {"_id": rec.index, **asdict(rec.header)}
            if len(rec.data) > GRIDFS_THRESHOLD:
                file_id = _gridfs_id(self.collection, rec.index)
                bucket = _gridfs(self._conn.db(), self.collection)
                self._run(
                    f"uploading record {rec.index} to GridFS",
                    functools.partial(self._upload, bucket, file_id, rec.data),
                )
                doc["gridfs_id"] = file_id
            else:
                doc["data"] = Binary(rec.data)
            docs.append(doc)
        return docs

    _sender: ThreadPoolExecutor | None = None
    _inflight: Future[None] | None = None

    def _wait(self) -> None:
        """Wait for the batch in flight; raise its error."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def write(self, records: Sequence[Record], progress: Progress) -> None:
        docs = self.documents(records)
        state = json.loads(progress.to_json())  # as it is now: the caller goes on changing it
        self._wait()
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="fastdata-mongo-writer")
        self._inflight = self._sender.submit(self._send, docs, state)

    def _send(self, docs: list[dict[str, Any]], state: dict[str, Any]) -> None:
        """Insert ``docs`` in requests of moderate size, then save ``state``."""
        from pymongo.errors import BulkWriteError

        coll = self._conn.db()[self.collection]

        def insert(group: list[dict[str, Any]]) -> None:
            try:
                coll.insert_many(group, ordered=False)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors", [])
                if any(e.get("code") != 11000 for e in errors):  # 11000: duplicate key
                    raise StoreError(
                        f"{self.location}: writing records failed: {errors[0].get('errmsg')}"
                    ) from None

        for group in _insert_groups(docs):
            what = f"inserting records {group[0]['_id']}-{group[-1]['_id']}"
            self._run(what, functools.partial(insert, group))
        self._run(
            "saving progress",
            lambda: self._conn.db()[META_COLLECTION].replace_one(
                {"_id": f"{self.collection}:progress"}, state, upsert=True
            ),
        )

    def finish(self, meta: StoreMeta, labels: np.ndarray) -> None:
        from bson import Binary

        self._wait()
        db = self._conn.db()
        doc: dict[str, Any] = {"_id": self.collection, **meta.to_dict()}
        raw = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()
        if len(raw) > LABELS_INLINE_MAX:
            file_id = f"{self.collection}:labels"
            self._run(
                "uploading labels", lambda: self._upload(_gridfs(db, self.collection), file_id, raw)
            )
            doc["labels_gridfs_id"] = file_id
        else:
            doc["labels"] = Binary(raw)
        # One index build over the finished collection costs less than maintaining it per insert.
        self._run("creating the index on name", lambda: db[self.collection].create_index("name"))
        self._run(
            "writing metadata",
            lambda: db[META_COLLECTION].replace_one({"_id": self.collection}, doc, upsert=True),
        )

    def close(self) -> None:
        """Wait for the batch in flight (an error in it is logged: the caller is already failing
        or has called ``finish``, which raises it), then close the connection."""
        try:
            self._wait()
        except Exception as exc:
            log.error("%s: the last batch was not written: %s", self.location, exc)
        finally:
            if self._sender is not None:
                self._sender.shutdown()
                self._sender = None
            super().close()


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

    def __init__(
        self,
        uri: str,
        collection: str,
        *,
        database: str | None = None,
        options: MongoOptions | None = None,
    ) -> None:
        super().__init__(uri, collection, database=database, options=options)
        try:
            self._meta, self._labels = self._run(
                "reading the metadata", self._load_meta, first=True
            )
        finally:
            self._conn.close()  # nothing that cannot cross a fork stays open after __init__

    def _load_meta(self) -> tuple[StoreMeta, np.ndarray]:
        db = self._conn.db()
        doc = db[META_COLLECTION].find_one({"_id": self.collection})
        if doc is None:
            saved = db[META_COLLECTION].find_one({"_id": f"{self.collection}:progress"})
            if saved is not None:
                raise IncompleteStoreError(
                    f"{self.location}: incomplete store: its conversion stopped after "
                    f"{saved.get('next_sample')} of {saved.get('total')} images; finish it with "
                    f"`fastdata convert {saved.get('source')} {mask_uri(self.uri)} "
                    f"--collection {self.collection} --resume`"
                )
            raise StoreNotFoundError(
                f"{self.location}: no fastdata store here; create one with "
                f"`fastdata convert SRC {mask_uri(self.uri)} --collection {self.collection}`"
            )
        meta = StoreMeta.from_dict(doc, self.location)
        if "labels_gridfs_id" in doc:
            raw = _gridfs(db, self.collection).open_download_stream(doc["labels_gridfs_id"]).read()
        else:
            raw = bytes(doc.get("labels", b""))
        labels = np.frombuffer(raw, dtype=LABEL_DTYPE).astype(np.int64)
        if len(labels) != meta.count:
            raise StoreError(
                f"{self.location}: {len(labels)} labels for {meta.count} records; the store is "
                "damaged, convert it again with --overwrite"
            )
        labels.setflags(write=False)
        return meta, labels

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
                    "convert it again with --overwrite"
                )
            for doc in found.values():
                if "data" not in doc and "gridfs_id" in doc:
                    stream = _gridfs(db, self.collection).open_download_stream(doc["gridfs_id"])
                    doc["data"] = stream.read()
            return [found[i] for i in indices]

        span = f"{min(indices)}-{max(indices)}" if indices else "none"
        return self._run(f"reading records {span}", query)

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        docs = self._fetch(idx, {"data": 1, "gridfs_id": 1})
        return [(bytes(d["data"]), int(self._labels[i])) for d, i in zip(docs, idx)]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        out = []
        for doc, i in zip(self._fetch(idx, None), idx):
            header = RecordHeader.from_dict(doc, f"{self.location}: record {i}")
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
        # One fixed-width byte array and one int array, not two lists of Python objects.
        self._names = np.array([p.encode("utf-8") for p in paths], dtype=np.bytes_)
        self._labels = np.asarray(labels, dtype=np.int64)
        self._labels.setflags(write=False)
        self._meta = StoreMeta(
            count=len(paths),
            classes=_legacy_classes(paths, self._labels),
            source=str(path),
            format="img_name/bson_img",
            version=0,
        )

    def _fetch(self, idx: list[int]) -> list[tuple[str, bytes, bool]]:
        from ..jpeg import JpegState, inspect_jpeg

        names = [bytes(self._names[i]).decode("utf-8") for i in idx]

        def query() -> dict[str, bytes]:
            coll = self._conn.db()[self.collection]
            docs = coll.find(
                {"img_name": {"$in": sorted(set(names))}}, {"img_name": 1, "bson_img": 1}
            )
            return {d["img_name"]: bytes(d["bson_img"]) for d in docs}

        span = f"{min(idx)}-{max(idx)}" if idx else "none"
        found = self._run(f"reading images {span}", query)
        out = []
        for name in names:
            if name not in found:
                raise RecordError(f"{self.location}: no document with img_name {name!r}")
            data = found[name]
            repaired = data[:2] == b"\xff\xd8" and inspect_jpeg(data)[0] is JpegState.MISSING_EOI
            out.append((name, data + b"\xff\xd9" if repaired else data, repaired))
        return out

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        return [(data, int(self._labels[i])) for (_, data, _), i in zip(self._fetch(idx), idx)]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..jpeg import checksum, sniff

        idx = self.check_indices(indices)
        out = []
        for (name, data, repaired), i in zip(self._fetch(idx), idx):
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


def _legacy_classes(paths: Sequence[str], labels: np.ndarray) -> list[str]:
    n = int(labels.max()) + 1 if len(labels) else 0
    names: dict[int, str] = {}
    for p, label in zip(paths, labels.tolist()):
        first = p.split("/", 1)[0] if "/" in p else None
        if first is None or names.setdefault(label, first) != first:
            return [str(i) for i in range(n)]
    if len(set(names.values())) != len(names):
        return [str(i) for i in range(n)]
    return [names.get(i, str(i)) for i in range(n)]
