"""An LMDB store's columns (:mod:`fastdata.columns`): written by the writer as it finishes a
store (built from the records' headers, the blocks an append left whole kept), read by a reader
one field at a time, every block checked against the index it was read with; and the index of
names, which ``fastdata columns`` builds again with them."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable
from typing import Any

from ...columns import BLOCK, Column, ColumnIndex, build_block
from ...errors import RecordError, StoreDamagedError, StoreError
from ...fields import Schema
from ...records.header import RecordHeader, checksum, decode_json, name_bytes
from .layout import COLUMN_PREFIX, COLUMNS_KEY, column_key, header_key, keys_from
from .lease import Lease

Commit = Callable[[Callable[[Any], None]], None]


def finish_columns(
    env: Any, commit: Commit, schema: Schema, count: int, where: str
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Build the columns of a store of ``count`` records as the writer finishes it: the items
    to write with its metadata (the blocks a reader of the store as it was may read, and the
    index), and the keys to delete there. Blocks no reader can be reading (past those the
    columns held) are written now, a transaction each, so that memory holds one block at a
    time. A store without fields has no columns (those it had are deleted).

    Raises:
        StoreError: a record whose header or fields cannot be read (named).
    """
    with env.begin() as txn:
        raw = txn.get(COLUMNS_KEY)
        existing = keys_from(txn, COLUMN_PREFIX)
    old = None
    if raw is not None:
        try:
            old = ColumnIndex.from_json(raw, where)
        except StoreError:
            old = None
    if not schema or not count:
        return [], existing + ([COLUMNS_KEY] if raw is not None else [])
    usable = old is not None and old.fields == schema.fields and old.block == BLOCK
    if raw is not None and not (usable and old is not None and old.count <= count):
        commit(lambda txn: txn.delete(COLUMNS_KEY))  # (no reader reads the columns it named)
        old, usable = None, False
    keep = old.count // BLOCK if usable and old is not None else 0
    read_by_readers = len(next(iter(old.blocks.values()), [])) if old is not None else 0
    blocks: dict[str, list[tuple[int, int]]] = {
        f.name: list(old.blocks[f.name][:keep]) if old is not None else [] for f in schema.fields
    }
    final: list[tuple[bytes, bytes]] = []
    total = -(-count // BLOCK)
    for b in range(keep, total):
        lo, hi = b * BLOCK, min(count, (b + 1) * BLOCK)
        values = _field_values(env, schema, lo, hi, where)
        items = []
        for field in schema.fields:
            try:
                data = build_block(field, values[field.name])
            except ValueError as exc:
                raise StoreError(
                    f"{where}: field {field.name!r} of records {lo}..{hi - 1}: {exc}; run "
                    f"`fastdata verify {_words(where)}` to find the record"
                ) from None
            blocks[field.name].append((checksum(data), len(data)))
            items.append((column_key(field.name, b), data))
        if b < read_by_readers:
            final.extend(items)
        else:
            commit(lambda txn, items=items: txn.cursor().putmulti(items))  # type: ignore[misc]
    wanted = {column_key(f.name, b) for f in schema.fields for b in range(total)}
    final.append((COLUMNS_KEY, ColumnIndex(count, schema.fields, blocks, BLOCK).to_json()))
    return final, [k for k in existing if k not in wanted]


def _words(path: str) -> str:
    """The store at ``path`` as the words of a command."""
    return shlex.quote(os.path.abspath(path))


def _field_values(env: Any, schema: Schema, lo: int, hi: int, where: str) -> dict[str, list[Any]]:
    """Each field's values in the headers of records ``lo .. hi-1``."""
    names = schema.names
    out: dict[str, list[Any]] = {name: [] for name in names}
    columns = [out[name] for name in names]
    with env.begin(buffers=True) as txn:
        cursor = txn.cursor()
        i = lo
        if cursor.set_range(header_key(lo)):
            for key, raw in cursor.iternext():
                if i >= hi or bytes(key) != header_key(i):
                    break
                try:
                    values = decode_json(str(raw, "utf-8"))["fields"]
                    for name, column in zip(names, columns, strict=True):
                        column.append(values[name])
                except (ValueError, KeyError, TypeError, RecursionError):
                    raise StoreError(
                        f"{where}: record {i}: its header or its fields cannot be read; run "
                        f"`fastdata verify {_words(where)}`"
                    ) from None
                i += 1
        if i < hi:
            raise StoreError(
                f"{where}: record {i}: its header is missing; run `fastdata verify {_words(where)}`"
            )
    return out


def index_of_names(env: Any, count: int, where: str) -> bytes:
    """The index of names of a store of ``count`` records, built from their headers (the
    source of truth): each record's name, joined by NULs (see ``name_bytes``).

    Raises:
        StoreError: a record whose header is missing or cannot be read (named).
    """
    names: list[bytes] = []
    with env.begin(buffers=True) as txn:
        cursor = txn.cursor()
        if count and cursor.set_range(header_key(0)):
            for key, raw in cursor.iternext():
                i = len(names)
                if i >= count or bytes(key) != header_key(i):
                    break
                try:
                    names.append(name_bytes(RecordHeader.from_json(raw, where).name))
                except (RecordError, UnicodeEncodeError):
                    raise StoreError(
                        f"{where}: record {i}: its header cannot be read; run "
                        f"`fastdata verify {_words(where)}`"
                    ) from None
    if len(names) < count:
        raise StoreError(
            f"{where}: record {len(names)}: its header is missing; run "
            f"`fastdata verify {_words(where)}`"
        )
    return b"\0".join(names)


def names_problem(raw: bytes | None, count: int, target: str) -> list[str]:
    """What is wrong with a store's index of names as a whole (``raw``; None: it has none, as
    stores written before it existed), said with the command that builds it again: one that
    does not hold a name for each of its ``count`` records (reads then take each name from
    its record's header, and appends too, more slowly)."""
    if raw is None:
        return []
    held = raw.count(b"\0") + 1 if raw else 0
    if held == count:
        return []
    return [
        f"its index of names holds {held} name{'' if held == 1 else 's'} for {count} records; "
        f"build it again from the records with `fastdata columns {target}`"
    ]


def read_index(lease: Lease, where: str, target: str = "") -> tuple[bytes, ColumnIndex] | None:
    """The store's column index (its bytes, and read), or None where it has none
    (``target``: the store as the words of a command, for the one a damaged index names)."""
    raw = lease.values([COLUMNS_KEY], lambda _: f"{where}: the columns' index")[0]
    if raw is None:
        return None
    return raw, ColumnIndex.from_json(raw, where, target)


def read_column(lease: Lease, name: str, count: int, where: str, target: str) -> Column | None:
    """Field ``name``'s column for the first ``count`` records, every block read checked
    against its checksum; None where the store has no columns or they cover fewer records
    (written before an append that did not build them).

    Raises:
        StoreDamagedError: a block that is not the one the index names (the field and the
            records named, and the command that builds the columns again).
    """
    for _ in range(8):  # (an append may write the index between the two reads: read again)
        found = read_index(lease, where, target)
        if found is None:
            return None
        raw, index = found
        field = index.field(name)
        if field is None or index.count < count:
            return None
        total = -(-count // index.block)
        keys = [COLUMNS_KEY] + [column_key(name, b) for b in range(total)]
        got = lease.values(keys, lambda n: f"{where}: column {name!r}, block {n - 1}")
        if got[0] != raw:
            continue
        blocks: list[bytes] = []
        for b, data in enumerate(got[1:]):
            crc, size = index.blocks[name][b]
            lo = b * index.block
            if data is None or len(data) != size or checksum(data) != crc:
                what = "missing" if data is None else "not the one its index names"
                raise StoreDamagedError(
                    f"{where}: the column of field {name!r} for records {lo}.."
                    f"{lo + index.block_count(b) - 1} is {what}; build the columns again from "
                    f"the records with `fastdata columns {target}`",
                    store=target,
                )
            blocks.append(data)
        counts = [index.block_count(b) for b in range(total)]
        try:
            column = Column.from_blocks(field, blocks, counts)
        except ValueError as exc:
            raise StoreDamagedError(
                f"{where}: the column of field {name!r} is damaged ({exc}); build the columns "
                f"again with `fastdata columns {target}`",
                store=target,
            ) from None
        column.store = target
        return column.first(count)
    raise StoreError(f"{where}: appends kept changing the columns while they were read")


def columns_problems(
    lease: Lease,
    schema: Schema,
    count: int,
    headers: Iterable[RecordHeader],
    column: Callable[[str], Column | None],
    where: str,
    target: str,
) -> list[str]:
    """What is wrong with the store's columns, each said once with the command that builds
    them again: an index or a block that is damaged, or a value that is not the one its
    record's header holds (the header is the source of truth). A store without columns, or
    with columns written before an append that did not build them, has none (``info`` says
    so: reads go by the headers)."""
    rebuild = f"build them again from the records with `fastdata columns {target}`"
    try:
        found = read_index(lease, where, target)
    except StoreError as exc:
        return [f"its columns: {exc.without_hint()}"]
    if found is None or found[1].count < count:
        return []
    index = found[1]
    if index.fields != schema.fields:
        return [f"its columns were built for other fields than the store's; {rebuild}"]
    problems, columns = [], {}
    for field in schema.fields:
        try:
            columns[field.name] = column(field.name)
        except StoreError as exc:
            problems.append(f"its columns: {exc.without_hint()}")
    block: list[RecordHeader] = []
    start = 0
    for i, header in enumerate(headers):
        block.append(header)
        if len(block) == index.block or i == count - 1:
            problems += _block_problems(block, start, columns, rebuild)
            start, block = i + 1, []
    return problems


def _block_problems(
    headers: list[RecordHeader], lo: int, columns: dict[str, Column | None], rebuild: str
) -> list[str]:
    """The first record of ``headers`` (records ``lo ..``) whose value in each column is not
    its header's."""
    out = []
    for name, column in columns.items():
        if column is None:
            continue
        values = [h.fields.get(name) if h.fields is not None else None for h in headers]
        hi = lo + len(headers)
        try:
            want = build_block(column.field, values)
        except ValueError:
            continue  # (a record whose fields are damaged: the records' check names it)
        if want == column.encoded(lo, hi):
            continue
        for j, value in enumerate(values):
            try:
                one = build_block(column.field, [value])
            except ValueError:
                continue
            if one != column.encoded(lo + j, lo + j + 1):
                out.append(
                    f"the column of field {name!r} does not hold record {lo + j}'s value "
                    f"({headers[j].name}: its header, the source of truth, does); {rebuild}"
                )
                break
    return out
