"""The writer claim of a Mongo collection: one writer at a time, across hosts.

NOTE [ The Mongo writer claim ]

The claim is the document ``"<collection>:writer"`` in ``__fastdata__`` (``names.claim_id``).
A writer inserts it (the unique ``_id`` makes one insert win), naming itself (host, PID, start
time, the machine's boot id and the process's start time: ``stores/locks.py``) and an expiry. A
heartbeat thread renews the expiry every quarter of its lifetime; every batch the writer sends
checks first that the claim is still its own (``_check_claim``), so a writer that lost it writes
nothing more.

Another writer may take the claim over (one ``replace_one`` matching the old token, so only one
of several can) when:

- it has expired: expiry is written and compared on the server's clock (``hello``'s
  ``localTime``), so writers on hosts whose clocks disagree agree on it;
- or its holder is a process of the taker's own host that no longer runs (no process with its
  PID and start time, or the machine restarted): then at once, whatever the expiry.

Assumed: host names are unique among the writers of one server; a writer that is stopped (not
killed) for longer than the claim's lifetime loses the claim, and is told so before its next
batch.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import (
    SAME_COMMAND,
    StoreLockedError,
    option,
)
from .. import names
from ..locks import describe_holder, holder, holder_gone

log = logging.getLogger(__name__)
T = TypeVar("T")


class Claimed:
    """The claim, for :class:`~fastdata.stores.mongo.writer.MongoWriter` (which provides
    ``collection``, ``location``, ``claim_ttl_s``, ``_run`` and ``_meta_coll``)."""

    _token = ""
    _heartbeat: threading.Thread | None = None
    _stop: threading.Event | None = None
    _lost = ""

    if TYPE_CHECKING:
        collection: str
        location: str
        _conn: Any

        @property
        def claim_ttl_s(self) -> float: ...

        def _meta_coll(self) -> Any: ...

        def _run(self, what: str, fn: Callable[[], T], *, first: bool = False) -> T: ...

    def _lock(self) -> None:
        from pymongo.errors import DuplicateKeyError

        claim_id = names.claim_id(self.collection)
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
                f"{ttl / 4:g} s): then run ",
                SAME_COMMAND,
                " with ",
                option("resume"),
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
        return server_now(self._conn)

    def _check_claim(self) -> None:
        if self._lost:
            raise StoreLockedError(
                f"{self.location}: this conversion lost its claim on the collection "
                f"({self._lost}); nothing more is written: run ",
                SAME_COMMAND,
                " with ",
                option("resume"),
                " once no other conversion writes it",
            )

    def _unlock(self) -> None:
        if self._heartbeat is None or self._stop is None:
            return
        self._stop.set()
        self._heartbeat.join()
        self._heartbeat = None
        from pymongo.errors import PyMongoError

        try:
            self._meta_coll().delete_one(
                {"_id": names.claim_id(self.collection), "token": self._token}
            )
        except PyMongoError as exc:
            log.warning(
                "%s: could not release the writer claim (%s); it expires in %g s",
                self.location,
                exc,
                self.claim_ttl_s,
            )


def server_now(conn: Any) -> float:
    """The server's clock, in seconds since the epoch: a claim's expiry is written and compared
    in it, so writers on hosts whose clocks disagree agree on it."""
    from datetime import UTC

    from pymongo.errors import OperationFailure

    try:
        now = conn.db().client.admin.command("hello").get("localTime")
    except (OperationFailure, NotImplementedError):
        now = None
    if now is None:  # a server that does not say: this host's clock
        return time.time()
    return float(now.replace(tzinfo=UTC).timestamp() if now.tzinfo is None else now.timestamp())


def live_claim(conn: Any, collection: str) -> str:
    """Who holds the writer claim of ``collection`` now, described ("": nobody: no claim, an
    expired one, or one whose process on this host is gone)."""
    held = conn.db()[names.META_COLLECTION].find_one({"_id": names.claim_id(collection)})
    if not isinstance(held, dict):
        return ""
    expires = held.get("expires")
    if not isinstance(expires, int | float) or expires <= server_now(conn) or holder_gone(held):
        return ""
    return describe_holder(held)
