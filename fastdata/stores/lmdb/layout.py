"""The keys and files of an LMDB store (``docs/format.md``): where each thing lives."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import (
    StoreError,
)
from ...records import SkippedFile
from ..names import DATA_FILE as DATA_FILE  # re-exported: every name is stores/names.py's
from ..names import EPOCH_FILE as EPOCH_FILE


def record_key(index: int) -> bytes:
    """The key of record ``index``: zero-padded decimal, so keys sort in index order."""
    return b"%010d" % index


META_KEY = b"__fastdata__"
LABELS_KEY = b"__labels__"
NAMES_KEY = b"__names__"
PROGRESS_KEY = b"#progress"
SKIPPED_PREFIX = b"#skipped/"
LEN_KEY = b"__len__"
KEYS_KEY = b"__keys__"
COLUMNS_KEY = b"__columns__"
"""The index of the store's columns (``fastdata.columns.ColumnIndex``), where it has them."""
COLUMN_PREFIX = COLUMNS_KEY + b"/"
# The files and folders of a store folder are named in stores/names.py (and only there).
EPOCH_BYTES = 4096
INITIAL_MAP_SIZE = 1 << 30


def header_key(index: int) -> bytes:
    """The key of record ``index``'s header: ``#`` + its record key.

    Headers and progress sort before the records (``#`` < ``0``) and the metadata after them
    (``_`` > ``9``), so every record can be appended at the end of the B-tree (``MDB_APPEND``),
    which writes at the speed of a plain file append.
    """
    return b"#" + record_key(index)


def column_key(field: str, block: int) -> bytes:
    """The key of block ``block`` of ``field``'s column (a field's name is ASCII, without
    ``/``: ``fields.check_name``)."""
    return b"%s%s/%06d" % (COLUMN_PREFIX, field.encode("ascii"), block)


def skipped_key(n: int) -> bytes:
    """The key of the ``n``-th skipped file's entry."""
    return SKIPPED_PREFIX + record_key(n)


def skipped_entries(skipped: Sequence[SkippedFile], start: int) -> list[tuple[bytes, bytes]]:
    """The ``(key, JSON)`` items of ``skipped[start:]``."""
    return [
        (skipped_key(n), json.dumps(f.to_dict()).encode("ascii"))
        for n, f in enumerate(skipped[start:], start)
    ]


def record_key_list(count: int) -> bytes:
    """``record_key(0) + b"\\n" + ... + record_key(count - 1)``, digit by digit in one array
    (11 bytes a record; no object per key)."""
    if count <= 0:
        return b""
    if count > 10**10:
        raise StoreError(f"{count} records: more than 10-digit keys can number")
    out = np.empty((count, 11), dtype=np.uint8)
    out[:, 10] = ord("\n")
    rest = np.arange(count, dtype=np.int64)
    digit = np.empty(count, dtype=np.int64)
    for column in range(9, -1, -1):
        np.remainder(rest, 10, out=digit)
        out[:, column] = digit
        rest //= 10
    out[:, :10] += ord("0")
    return out.reshape(-1)[:-1].tobytes()


def records_problem(txn: Any, entries: int, count: int, *, exact: bool) -> str | None:
    """What is wrong with the records of a store of ``count`` records, seen in ``txn`` (the
    environment holding ``entries`` keys, by LMDB's count), or None: the last record and header
    are there, nothing lies past them (``exact``: a writer finishing; an interrupted append may
    have left records past the end of a complete store), and records and headers add up to
    ``2 * count`` once every other key is counted. O(1) but for the skipped entries, where
    LMDB's count adds up; where it does not (another tool's keys beside fastdata's, or a count
    that another tool changed), the records and headers are counted one by one."""
    if count and (txn.get(record_key(count - 1)) is None or txn.get(header_key(count - 1)) is None):
        return f"record {count - 1} (the last) is missing"
    if exact and (key := past_the_last(txn, count)) is not None:
        return f"a record past the last ({key.decode('ascii', 'replace')})"
    held = _held(txn, entries)
    if held < 2 * count or (exact and held != 2 * count):
        records = _count_keys(txn, record_key(0), record_key(count), len(record_key(0)))
        headers = _count_keys(txn, header_key(0), header_key(count), len(header_key(0)))
        if records != count or headers != count:
            return (
                f"{records} records and {headers} headers for {count} records (a record or a "
                "header missing)"
            )
    return None


def past_the_last(txn: Any, count: int) -> bytes | None:
    """The first key shaped like a record or a header (a digit, or ``#`` and a digit, first)
    that sorts at or past record ``count``'s, if any: where a store of ``count`` records holds
    nothing, and where an append puts its records."""
    cursor = txn.cursor()
    for first in (record_key(count), header_key(count)):
        if cursor.set_range(first):
            key = bytes(cursor.key())
            if is_past_the_last(key, count):
                return key
    return None


def is_past_the_last(key: bytes, count: int) -> bool:
    """Whether ``key`` is shaped like a record or a header and sorts at or past record
    ``count``'s (see :func:`past_the_last`)."""
    if key[:1].isdigit():
        return key >= record_key(count)
    return key[:1] == b"#" and key[1:2].isdigit() and key >= header_key(count)


OWN_KEYS = frozenset({PROGRESS_KEY, LABELS_KEY, NAMES_KEY, LEN_KEY, KEYS_KEY, META_KEY})
"""The keys of a store's own records (its metadata, progress, labels, names, length)."""
_OWN_KEYS = OWN_KEYS


def _own_key(key: bytes, records: int, skipped: int) -> bool:
    """Whether ``key`` is one fastdata writes in a store of ``records`` records (and headers)
    and ``skipped`` skipped entries."""
    if key in _OWN_KEYS or key == COLUMNS_KEY or key.startswith(COLUMN_PREFIX):
        return True
    number, bound = key, records
    if key.startswith(SKIPPED_PREFIX):
        number, bound = key[len(SKIPPED_PREFIX) :], skipped
    elif key[:1] == b"#":
        number = key[1:]
    return len(number) == 10 and number.isdigit() and int(number) < bound


def foreign_keys(txn: Any, entries: int, records: int, skipped: int) -> list[bytes]:
    """The keys of the store's main database that fastdata did not write, seen in ``txn``: all
    but its own keys, the records and headers ``0 .. records-1`` and the skipped entries
    ``0 .. skipped-1`` (``records`` and ``skipped`` take in an interrupted append's). O(1)
    but for the skipped entries where LMDB's count of keys (``entries``) adds up with those;
    elsewhere every key is looked at."""
    if _held(txn, entries) == 2 * records and _skipped_keys(txn) in (0, skipped):
        return []
    keys = txn.cursor().iternext(keys=True, values=False)
    return [bytes(k) for k in keys if not _own_key(bytes(k), records, skipped)]


FOREIGN_KEYS_NAMED = 10
"""Keys of another tool that ``verify`` names one by one (it counts the rest)."""


def said_foreign(keys: list[bytes], count: int) -> list[str]:
    """Keys that fastdata did not write (:func:`foreign_keys`) in a store of ``count`` records,
    as ``verify`` names them."""
    out = []
    for key in keys[:FOREIGN_KEYS_NAMED]:
        what = f"another tool's key {key.decode('ascii', 'backslashreplace')!r}"
        if is_past_the_last(key, count):
            what += ", shaped like a record past the last: an append refuses it"
        out.append(what)
    if len(keys) > FOREIGN_KEYS_NAMED:
        out.append(f"... and {len(keys) - FOREIGN_KEYS_NAMED:,} more keys of another tool")
    return out


def miscounted(txn: Any, entries: int, count: int) -> str | None:
    """LMDB's count of the keys in the store's main database (``entries``, from its header),
    where it is not the number of keys there are, said as what it is: a count that another tool
    (or damage) changed, which LMDB keeps for its statistics alone (every record still reads).
    The keys are counted one by one only where the count does not add up with the records."""
    if _held(txn, entries) == 2 * count:
        return None
    there = sum(1 for _ in txn.cursor().iternext(keys=True, values=False))
    if there == entries:
        return None
    return (
        f"LMDB's header counts {entries} keys in the store, and it holds {there}: the count was "
        "changed (by another tool, or damage to the header); LMDB keeps it for its statistics "
        "alone, and every record reads"
    )


def _held(txn: Any, entries: int) -> int:
    """LMDB's count of keys less the skipped entries and the store's own keys: the records and
    headers, by that count."""
    fixed = sum(txn.get(k) is not None for k in _OWN_KEYS)
    return entries - _skipped_keys(txn) - fixed - column_keys(txn)


def column_keys(txn: Any) -> int:
    """The keys of the store's columns (their index and their blocks), counted one by one (a
    few per field and 65,536 records)."""
    return len(keys_from(txn, COLUMNS_KEY)) if txn.get(COLUMNS_KEY) is not None else 0


def _skipped_keys(txn: Any) -> int:
    """The keys that begin like a skipped entry's, counted one by one."""
    return len(keys_from(txn, SKIPPED_PREFIX))


def appended_run(txn: Any, count: int, skipped: int) -> tuple[int, int]:
    """Where what an append to a store of ``count`` records and ``skipped`` skipped entries
    wrote ends: the first index from ``count`` on with neither a record nor a header, and the
    first skipped entry from ``skipped`` on that is not there. An append writes its indices
    one after another, so a key past a gap (``0000000099`` of another tool) is not its."""
    end = count
    while txn.get(record_key(end)) is not None or txn.get(header_key(end)) is not None:
        end += 1
    ends = skipped
    while txn.get(skipped_key(ends)) is not None:
        ends += 1
    return end, ends


def keys_past(txn: Any, count: int, skipped: int) -> list[bytes]:
    """The keys of the records and headers from index ``count`` on, and of the skipped entries
    from ``skipped`` on, up to the first gap (:func:`appended_run`): what an append to a store
    of ``count`` records wrote."""
    end, ends = appended_run(txn, count, skipped)
    out = [key for i in range(count, end) for key in (record_key(i), header_key(i))]
    return out + [skipped_key(n) for n in range(skipped, ends)]


def keys_from(txn: Any, prefix: bytes) -> list[bytes]:
    """The keys that begin with ``prefix``, in order."""
    cursor = txn.cursor()
    out = []
    if cursor.set_range(prefix):
        for raw in cursor.iternext(keys=True, values=False):
            key = bytes(raw)
            if not key.startswith(prefix):
                break
            out.append(key)
    return out


def _count_keys(txn: Any, low: bytes, high: bytes, width: int) -> int:
    """The keys of ``width`` bytes in ``[low, high)``, counted one by one."""
    cursor = txn.cursor()
    n = 0
    if cursor.set_range(low):
        for raw in cursor.iternext(keys=True, values=False):
            key = bytes(raw)
            if key >= high:
                break
            n += len(key) == width
    return n
