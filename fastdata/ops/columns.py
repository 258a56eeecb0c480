"""``fastdata columns``: build an LMDB store's columns (:mod:`fastdata.columns`) and its index of
names again from its records, in place: for a store written before fastdata kept them, or whose
columns or index ``verify`` found damaged."""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass

from ..errors import StoreError, StoreLockedError, UsageError


@dataclass(frozen=True)
class ColumnsReport:
    """What :func:`build_columns` built: the store, its records, each field's column (its
    values' bytes), and how long it took."""

    location: str
    count: int
    fields: dict[str, int]
    seconds: float


def build_columns(store: str | os.PathLike[str]) -> ColumnsReport:
    """Build the columns of the LMDB store at ``store`` and its index of names from its records'
    headers (the source of truth), in place, while readers read on; then read every column
    back, each block checked against its checksum, and the index, before reporting. A store
    without fields has no columns to build (its index of names is built all the same).

    Raises:
        UsageError: a MongoDB store (its server runs queries: ``fastdata index``).
        StoreError: no complete store there, or something unfinished in the way (named, with
            the command that finishes it); a record whose fields cannot be read.
        StoreLockedError: another writer holds the store.
    """
    from ..stores.lmdb.reader import LMDBStore
    from ..stores.lmdb.writer import LMDBWriter
    from ..stores.uri import is_mongo_uri

    if is_mongo_uri(store):
        raise UsageError(
            f"{store}: a MongoDB store keeps no columns: its server runs queries; have it "
            "index a key a query names (the command fastdata index, with the store's collection)"
        )
    started = time.perf_counter()
    LMDBStore(store).close()  # (a store to read first: a folder of images, or none, said so)
    writer = LMDBWriter(store)
    try:
        with writer:
            meta = writer.build_columns()
    except StoreLockedError:
        raise StoreLockedError(
            f"{store}: another writer holds the store (a conversion, an append or a copy); run "
            f"`fastdata columns {shlex.quote(os.path.abspath(store))}` again once it has finished"
        ) from None
    reader = LMDBStore(store)
    try:
        if meta.count and reader.names_index() is None:
            raise StoreError(f"{store}: the index of names did not read back whole")
        sizes = {}
        for field in meta.schema.fields:
            if not meta.count:  # (no records: no blocks, nothing to read back)
                sizes[field.name] = 0
                continue
            column = reader.field_column(field.name)
            if column is None or len(column) != meta.count:
                raise StoreError(f"{store}: the column of {field.name!r} did not read back whole")
            sizes[field.name] = column.values.nbytes + (
                column.offsets.nbytes if column.offsets is not None else 0
            )
    finally:
        reader.close()
    return ColumnsReport(os.fspath(store), meta.count, sizes, time.perf_counter() - started)
