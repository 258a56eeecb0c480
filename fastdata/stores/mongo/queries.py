"""What the server makes of a store's queries: whether it answered one from an index on its
keys, said once where it read a large collection whole (``fastdata index`` makes the index)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["SCAN_WORTH_SAYING", "indexed", "query_keys", "say_if_scanned"]

log = logging.getLogger(__name__)

SCAN_WORTH_SAYING = 100_000
"""Records from which a query answered by reading the whole collection is worth a warning."""
SAID_SCANNED: set[tuple[str, tuple[str, ...]]] = set()


def query_keys(query: Any) -> set[str]:
    """The record keys a (checked) query names."""
    out: set[str] = set()
    stack = [query]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if key in ("$and", "$or", "$nor"):
                    stack.append(value)
                elif not key.startswith("$"):
                    out.add(key)
    return out


def indexed(plan: Any, keys: set[str]) -> bool:
    """Whether a query plan (``explain``'s ``winningPlan``) reads an index on one of ``keys``."""
    stack = [plan]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            pattern = item.get("keyPattern")
            if isinstance(pattern, dict) and keys & set(pattern):
                return True
            stack.extend(item.values())
    return False


def say_if_scanned(
    location: str, collection: Any, records: int, words: str, query: dict[str, Any], where: Any
) -> None:
    """Log, once per collection and set of keys, that the server answered ``query`` (``where``,
    as the user gave it) by reading the whole ``collection`` of ``records`` records: its plan
    reads no index on a key of the query. ``words``: the store as command-line words, for the
    ``fastdata index`` command that makes the index."""
    keys = sorted(query_keys(where))
    said = (location, tuple(keys))
    if said in SAID_SCANNED or not keys:
        return
    try:
        plan = collection.find(query, {"_id": 1}).explain()
    except Exception:  # (a server that does not explain: nothing to say)
        return
    if not indexed(plan.get("queryPlanner", {}).get("winningPlan", {}), set(keys)):
        SAID_SCANNED.add(said)
        log.warning(
            "%s: the server read the whole collection (%d records) for a query on %s; "
            "`fastdata index %s %s` creates the index it needs",
            location,
            records,
            ", ".join(keys),
            words,
            keys[0],
        )
