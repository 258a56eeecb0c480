"""A store's field values kept as columns beside its records: one array per field per block of
:data:`BLOCK` records, so that a query over a field (:mod:`fastdata.query_columns`) and a batch
of its values (:class:`BatchColumn`) are numpy operations, not a header parsed per record.

Every field has a column; what a block of one holds depends on its type:

- ``dense``: numbers of one shape (``int``, ``float``, ``bool``, ``float[4]``): one array of
  ``count x shape``;
- ``ragged``: numbers whose first dimension varies (``float[-1,4]``): each record's length
  (int64), then every record's rows, one after the other;
- ``text``: strings (their UTF-8 bytes) and JSON (its canonical encoding): each record's length
  in bytes (int64), then the bytes.

Ints are int64, floats float64 (the values as stored: a query compares them exactly), bools one
byte. A block's bytes are little-endian, covered by a CRC-32 that the columns' index
(:class:`ColumnIndex`, stored beside them) lists. The records' headers stay the source of
truth: a block is built from them (:func:`build_block`), and ``verify`` builds it again and
compares.
"""

from __future__ import annotations

import codecs
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from .errors import StoreDamagedError, StoreError
from .fields import Field, Schema

__all__ = ["BLOCK", "BatchColumn", "Column", "ColumnIndex", "build_block", "column_kind"]

BLOCK = 1 << 16
"""Records a block of a column holds (the last block of a store fewer)."""
COLUMNS_VERSION = 1
_DTYPES: dict[str, np.dtype[Any]] = {
    "int": np.dtype("<i8"),
    "float": np.dtype("<f8"),
    "bool": np.dtype("u1"),
}
_LENGTH: np.dtype[Any] = np.dtype("<i8")


def column_kind(field: Field) -> str:
    """How ``field``'s values are kept: ``dense``, ``ragged`` or ``text``."""
    if field.type in _DTYPES:
        return "dense" if field.fixed else "ragged"
    return "text"


def _row_shape(field: Field) -> tuple[int, ...]:
    """The shape of one value (dense) or of one row of a value (ragged)."""
    return field.shape if column_kind(field) == "dense" else field.shape[1:]


def _row_bytes(field: Field) -> int:
    return _DTYPES[field.type].itemsize * int(np.prod(_row_shape(field), dtype=np.int64))


def build_block(field: Field, values: Sequence[Any]) -> bytes:
    """The block of ``field``'s column holding ``values`` (one per record, as their headers
    hold them, checked against the schema when they were written).

    Raises:
        ValueError: a value that is not one of ``field``'s (a damaged header), with the
            position of the first that is not.
    """
    kind = column_kind(field)
    if kind == "text":
        encode = _text_encoder(field)
        parts = [encode(v) for v in values]
        lengths = np.fromiter(map(len, parts), _LENGTH, len(parts))
        return lengths.tobytes() + b"".join(parts)
    dtype = _DTYPES[field.type]
    if kind == "dense":
        arr = _numbers(values, dtype, (len(values), *field.shape))
        return arr.tobytes()
    lengths = np.fromiter(map(_length, values), _LENGTH, len(values))
    rows = [row for value in values for row in value]
    arr = _numbers(rows, dtype, (len(rows), *field.shape[1:]))
    return lengths.tobytes() + arr.tobytes()


def _length(value: Any) -> int:
    if type(value) is not list:
        raise ValueError(f"{type(value).__name__}, not a list")
    return len(value)


def _numbers(values: Sequence[Any], dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    """The values (checked against the schema when their record was written) as one array."""
    try:
        arr = np.array(values, dtype=dtype) if values else np.zeros(shape, dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"values that are not numbers of one shape ({exc})") from None
    if arr.shape != shape:
        raise ValueError(f"values of shape {arr.shape[1:]}, not {shape[1:]}")
    return arr


def _text_encoder(field: Field) -> Any:
    if field.type == "str":
        return lambda v: v.encode("utf-8") if type(v) is str else _not(v, "a string")
    return lambda v: json.dumps(
        v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _not(value: Any, what: str) -> bytes:
    raise ValueError(f"{type(value).__name__}, not {what}")


@dataclass(frozen=True)
class ColumnIndex:
    """What a store's columns hold: the fields (as the schema had them when they were built),
    how many records they cover, and each block's CRC-32 and length, by field."""

    count: int
    fields: tuple[Field, ...]
    blocks: Mapping[str, list[tuple[int, int]]]
    block: int = BLOCK

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": COLUMNS_VERSION,
                "count": self.count,
                "block": self.block,
                "fields": [f.to_dict() for f in self.fields],
                "blocks": {name: [list(b) for b in blocks] for name, blocks in self.blocks.items()},
            },
            separators=(",", ":"),
        ).encode("ascii")

    @classmethod
    def from_json(cls, raw: bytes, where: str, target: str = "") -> ColumnIndex:
        """The index, every number checked before it is used (``target``: the store as the
        words of the command that builds it again).

        Raises:
            StoreError: a damaged index, or one of a later version.
        """
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not an object")
            if d.get("version") != COLUMNS_VERSION:
                raise ValueError(f"version {d.get('version')!r}, this fastdata reads 1")
            count, block = d.get("count"), d.get("block")
            if type(count) is not int or type(block) is not int or count < 0 or block < 1:
                raise ValueError("count or block size")
            fields = Schema.from_list(d.get("fields"), where).fields
            blocks = d.get("blocks")
            if not isinstance(blocks, dict) or set(blocks) != {f.name for f in fields}:
                raise ValueError("the blocks of each field")
            want = -(-count // block)
            out: dict[str, list[tuple[int, int]]] = {}
            for name, items in blocks.items():
                if not isinstance(items, list) or len(items) != want:
                    raise ValueError(f"{name!r}: {want} blocks expected")
                pairs = []
                for item in items:
                    if not (
                        isinstance(item, list)
                        and len(item) == 2
                        and all(type(x) is int for x in item)
                        and 0 <= item[0] < 1 << 32
                        and item[1] >= 0
                    ):
                        raise ValueError(f"{name!r}: a block's checksum or length")
                    pairs.append((item[0], item[1]))
                out[name] = pairs
        except RecursionError:  # (nested deeper than json's parser goes)
            failed = "nested too deep"
        except (ValueError, StoreError) as exc:
            failed = str(exc)
        else:
            return cls(count, fields, out, block)
        raise StoreError(
            f"{where}: the index of the store's columns is damaged ({failed}); rebuild them "
            f"from the records with `fastdata columns {target or shlex.quote(where)}`"
        )

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    def block_count(self, index: int) -> int:
        """Records in block ``index``."""
        return min(self.block, self.count - index * self.block)


class Column:
    """One field's values for every record of a store, from its blocks: numbers of one shape
    as one array, others as one array of values (or bytes) and each record's offset in it."""

    store = ""
    """The store the column was read from, as command words (for the error of a damaged JSON
    value, found only when it is parsed)."""

    def __init__(self, field: Field, values: np.ndarray, offsets: np.ndarray | None) -> None:
        self.field = field
        self.values = values
        """dense: ``count x shape``; ragged: ``rows x row shape``; text: uint8 bytes."""
        self.offsets = offsets
        """ragged and text: where each record's values begin (``count + 1``, the last is the
        end); dense: None."""

    def __len__(self) -> int:
        return len(self.values) if self.offsets is None else len(self.offsets) - 1

    @classmethod
    def from_blocks(cls, field: Field, blocks: Sequence[bytes], counts: Sequence[int]) -> Column:
        """The column read back from its blocks (each checked against its checksum already),
        each holding ``counts[k]`` records.

        Raises:
            ValueError: a block whose length does not add up with its records (which no
                checksum will have missed, but nothing sized by a stored length is trusted).
        """
        kind = column_kind(field)
        if kind == "dense":
            dtype, shape = _DTYPES[field.type], field.shape
            row = _row_bytes(field)
            for k, (raw, n) in enumerate(zip(blocks, counts, strict=True)):
                if len(raw) != n * row:
                    raise ValueError(f"block {k}: {len(raw)} bytes for {n} records")
            joined = b"".join(blocks)
            values = np.frombuffer(joined, dtype).reshape(-1, *shape)
            _check_bools(field, values)
            return cls(field, values, None)
        lengths, payloads = [], []
        for k, (raw, n) in enumerate(zip(blocks, counts, strict=True)):
            if len(raw) < n * 8:
                raise ValueError(f"block {k}: {len(raw)} bytes for {n} records")
            part = np.frombuffer(raw, _LENGTH, n)
            row = 1 if kind == "text" else _row_bytes(field)
            payload = len(raw) - n * 8
            if n and (part.min() < 0 or part.max() > payload):
                raise ValueError(f"block {k}: a record's length out of range")
            if int(part.sum()) * row != payload:
                raise ValueError(f"block {k}: its lengths do not add up to its bytes")
            lengths.append(part)
            payloads.append(memoryview(raw)[n * 8 :])
        offsets = np.zeros(sum(counts) + 1, dtype=np.int64)
        if len(offsets) > 1:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        joined = b"".join(payloads)
        if kind == "text":
            text = np.frombuffer(joined, np.uint8)
            _check_text(text, offsets)
            return cls(field, text, offsets)
        dtype = _DTYPES[field.type]
        values = np.frombuffer(joined, dtype).reshape(-1, *field.shape[1:])
        _check_bools(field, values)
        return cls(field, values, offsets)

    def first(self, count: int) -> Column:
        """The column of the first ``count`` records (a store read as it was before an
        append)."""
        if len(self) == count:
            return self
        if self.offsets is None:
            return self._same(Column(self.field, self.values[:count], None))
        offsets = self.offsets[: count + 1]
        return self._same(Column(self.field, self.values[: offsets[-1]], offsets))

    def _same(self, other: Column) -> Column:
        other.store = self.store
        return other

    def encoded(self, lo: int, hi: int) -> bytes:
        """Records ``lo .. hi-1`` as a block holds them (what :func:`build_block` gives for
        their values)."""
        if self.offsets is None:
            return self.values[lo:hi].tobytes()
        lengths = np.diff(self.offsets[lo : hi + 1]).astype(_LENGTH)
        return lengths.tobytes() + self.values[self.offsets[lo] : self.offsets[hi]].tobytes()

    def gather(self, indices: np.ndarray) -> BatchColumn:
        """The values of records ``indices`` (checked in range by the caller), as a batch."""
        if self.offsets is None:
            return BatchColumn(self.field, self.values[indices], None, self.store)
        starts = self.offsets[indices]
        lengths = self.offsets[indices + 1] - starts
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        where = np.repeat(starts - offsets[:-1], lengths) + np.arange(total, dtype=np.int64)
        return BatchColumn(self.field, self.values[where], offsets, self.store)


def _check_bools(field: Field, values: np.ndarray) -> None:
    """Booleans are the bytes 0 and 1 (any other byte seen as a bool is neither)."""
    if field.type == "bool" and values.size and int(values.max()) > 1:
        raise ValueError("a boolean that is neither 0 nor 1")


def _check_text(text: np.ndarray, offsets: np.ndarray) -> None:
    """The values are UTF-8, each record's beginning at a character's: what decoding a
    record's value takes (a pass over the bytes, a megabyte decoded at a time)."""
    if not text.size or int(text.max()) < 0x80:
        return  # (ASCII: every byte a character)
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = text.data
    try:
        for at in range(0, len(view), 1 << 20):
            decoder.decode(view[at : at + (1 << 20)])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError("bytes that are not UTF-8") from None
    starts = offsets[:-1][offsets[:-1] < len(text)]
    if np.any((text[starts] & 0xC0) == 0x80):
        raise ValueError("a record's value that begins inside a character")


class BatchColumn:
    """One field's values for a batch of records, as :class:`Column` keeps them, and each
    record's value as a dataset gives it (:meth:`items`, the same as
    :func:`fastdata.sample_fields.field_reader` gives from a header)."""

    def __init__(
        self, field: Field, values: np.ndarray, offsets: np.ndarray | None, store: str = ""
    ) -> None:
        self.field, self.values, self.offsets = field, values, offsets
        self.store = store

    def __len__(self) -> int:
        return len(self.values) if self.offsets is None else len(self.offsets) - 1

    def items(self) -> list[Any]:
        """Each record's value: numbers with a shape as numpy arrays (int64, float32, bool),
        scalars as Python numbers, strings as ``str``, JSON as read by ``json.loads``."""
        field, values, offsets = self.field, self.values, self.offsets
        kind = column_kind(field)
        if kind == "text":
            data = values.tobytes()
            cuts = offsets.tolist()  # type: ignore[union-attr]
            if field.type == "str":
                if data.isascii():  # (bytes are characters: one decode, sliced)
                    text = data.decode("ascii")
                    return [text[a:b] for a, b in pairwise(cuts)]
                return [data[a:b].decode("utf-8") for a, b in pairwise(cuts)]
            try:
                return [json.loads(data[a:b]) for a, b in pairwise(cuts)]
            except (ValueError, RecursionError):
                raise StoreDamagedError(
                    f"{self.store or 'the store'}: the column of field {field.name!r} holds a "
                    "value that is not JSON, whatever its checksum; build the columns again from "
                    f"the records with `fastdata columns {self.store or 'STORE'}`",
                    store=self.store,
                ) from None
        typed = self.typed()
        if kind == "dense":
            return typed.tolist() if not field.shape else list(typed)
        cuts = offsets.tolist()  # type: ignore[union-attr]
        return [typed[a:b] for a, b in pairwise(cuts)]

    def typed(self) -> np.ndarray:
        """The values as a dataset's arrays are typed: ints int64, bools bool, floats float64
        for a scalar and float32 in a list (as ``field_reader`` gives them)."""
        field, values = self.field, self.values
        if field.type == "bool":
            return values.view(np.bool_)
        if field.type == "float" and field.shape:
            return values.astype(np.float32)
        return values

    def batched(self, pad: bool) -> tuple[Any, Any]:
        """The batch as ``collate_fields`` gives it: ``(values, mask)``, where the values are
        one array for numbers of one shape (and, with ``pad``, for variable-length numbers,
        padded with zeros to the longest, the mask True where a value is; otherwise a list of
        arrays, and no mask), a list for strings and JSON."""
        kind = column_kind(self.field)
        if kind == "dense":
            return self.typed(), None
        if kind == "text" or not pad:
            return self.items(), None
        assert self.offsets is not None
        lengths = np.diff(self.offsets)
        longest = int(lengths.max()) if len(lengths) else 0
        typed = self.typed()
        out = np.zeros((len(lengths), longest, *typed.shape[1:]), dtype=typed.dtype)
        mask = np.arange(longest)[None, :] < lengths[:, None]
        out[mask] = typed
        return out, mask
