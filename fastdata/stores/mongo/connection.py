"""Talking to the server: options, the per-process client (made on first use, dropped across
fork and pickle), retries within a budget, and the collection a writer or reader addresses."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import Phrase, StoreDamagedError, StoreError, UsageError
from ..uri import command_words, mask_uri
from .layout import CLAIM_TTL_S, PASSWORD_ENV, USER_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        client_factory: makes the client, called as ``client_factory(uri, options)`` once per
            process (by default a ``pymongo.MongoClient`` with the timeouts above); a client it
            gives is closed with the store unless ``close_client`` is false.
        close_client: close the client when the store is closed (false for a client the caller
            shares, e.g. one ``mongomock`` client across stores in tests).
    """

    read_preference: str | None = None
    timeout_s: float = 10.0
    socket_timeout_s: float = 120.0
    retry_budget_s: float = 60.0
    claim_ttl_s: float = CLAIM_TTL_S
    client_factory: Callable[[str, MongoOptions], Any] | None = None
    close_client: bool = True


def _make_client(uri: str, options: MongoOptions) -> Any:
    """A new client: the options' factory's, or a MongoClient with their timeouts."""
    if options.client_factory is not None:
        return options.client_factory(uri, options)
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
    from pymongo.errors import PyMongoError
    from pymongo.uri_parser import parse_uri

    try:
        parsed = parse_uri(uri)
    except (ValueError, PyMongoError) as exc:  # InvalidURI, ConfigurationError: malformed
        raise UsageError(f"{mask_uri(uri)}: not a usable MongoDB URI ({_short(exc)})") from None
    name = parsed.get("database")
    if not name:
        raise UsageError(
            f"{mask_uri(uri)}: no database named; put it in the URI: mongodb://host:port/DB"
        )
    if parsed.get("collection"):  # (MongoDB reads /a.b as the database a, the collection b)
        raise UsageError(
            f"{mask_uri(uri)}: the URI names the database {name!r} and after the dot a "
            f"collection {parsed['collection']!r} (a database name holds no dot); give the "
            "collection with ",
            Phrase("--collection NAME", "collection=NAME"),
            " and the database alone in the URI",
        )
    if str(name) in SYSTEM_DATABASES:
        raise UsageError(
            f"{mask_uri(uri)}: {name!r} is one of MongoDB's own databases (admin, local, "
            "config), which hold the server's users, replication and sharding; name another "
            "database in the URI"
        )
    return str(name)


SYSTEM_DATABASES = frozenset({"admin", "local", "config"})


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
        self._renewed = 0  # clients replaced after they stopped finding the server
        self._lock = threading.RLock()  # threads that read at once share one client

    def db(self) -> Any:
        with self._lock:
            return self._client_here()[self.database]

    def _client_here(self) -> Any:
        """This process's client, made on first use (call with the lock held)."""
        if self._client is None or self._pid != os.getpid():
            # A client inherited across fork is left alone (never used, never closed here).
            from pymongo.errors import ConfigurationError, InvalidURI

            try:
                self._client = _make_client(self.uri, self.options)
            except (ValueError, TypeError, InvalidURI, ConfigurationError) as exc:
                raise UsageError(
                    f"{mask_uri(self.uri)}: not a usable MongoDB URI ({_short(exc)})"
                ) from None
            self._pid = os.getpid()
            if self.options.close_client:
                self._closer = weakref.finalize(self, _close_client, self._client, self._pid)
        return self._client

    def close(self) -> None:
        with self._lock:
            if self._closer is not None and self._pid == os.getpid():
                self._closer()
            self._client = None
            self._closer = None

    def _renew(self) -> None:
        """Replace this process's client by a new one on the next use.

        A client keeps its own view of the deployment, and that view can go wrong for good
        while the server is away (seen in a test: after a server restart during an epoch, a
        reader's every attempt for 300 s failed with "No replica set members available" while
        the server was up); a new client looks at the server afresh."""
        with self._lock:
            if self._pid == os.getpid() and self._client is not None:
                self._renewed += 1
                self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_closer"] = None
        state["_pid"] = -1
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def retry(self, what: str, location: str, fn: Callable[[], T], *, first: bool = False) -> T:
        """Run ``fn``, retrying transient network errors within the retry budget.

        With ``first`` (the first contact with the server), there is one attempt: a server that
        cannot be reached at all is reported after ``timeout_s``, not after the retry budget.
        """
        from pymongo.errors import (
            ConnectionFailure,
            InvalidOperation,
            OperationFailure,
            PyMongoError,
            ServerSelectionTimeoutError,
        )

        budget = 0.0 if first else self.options.retry_budget_s
        started = time.monotonic()
        deadline = started + budget
        delay = 0.2
        attempt = unselected = 0
        while True:
            attempt += 1
            try:
                return fn()
            except InvalidOperation as exc:
                # another thread's retry below closed the client this attempt was using
                if not self._renewed or time.monotonic() + delay > deadline:
                    raise StoreError(f"{location}: {what} failed: {_short(exc)}") from None
                time.sleep(delay)
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
                unselected = unselected + 1 if isinstance(exc, ServerSelectionTimeoutError) else 0
                if unselected >= 3:  # a whole selection timeout, three times: look afresh
                    self._renew()
                    unselected = 0
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


def gridfs_of(db: Any, bucket: str) -> Any:
    from gridfs import GridFSBucket

    return GridFSBucket(db, bucket_name=bucket)


class MongoTarget:
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

    @property
    def command_target(self) -> str:
        """The collection as the words of a command that names it (``URI --collection C``)."""
        return command_words(self.uri, self.collection)

    def _run(self, what: str, fn: Callable[[], T], *, first: bool = False) -> T:
        """``fn``, retried as a server's work is; the damage it finds named as this
        collection's (a reader's metadata, skipped list and documents are checked there)."""
        try:
            return self._conn.retry(what, self.location, fn, first=first)
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise

    def close(self) -> None:
        self._conn.close()
