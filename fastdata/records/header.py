"""A record: one image's bytes and its header (name, label, size, CRC-32, format, fields),
the same in LMDB and MongoDB; the checksums, and the checks that a record's bytes and fields
are the ones its header describes."""

from __future__ import annotations

import json
import json.scanner
import logging
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np

from ..errors import RecordError
from ..fields import Schema, canonical

try:  # the same CRC-32 as zlib's, 4x as fast (measured); installed with fastdata
    from isal.isal_zlib import crc32 as _crc32

    CHECKSUM_IMPLEMENTATION = "ISA-L (isal)"
except ImportError as _missing:  # pragma: no cover - a platform without an isal wheel
    _crc32 = zlib.crc32
    CHECKSUM_IMPLEMENTATION = "zlib"
    logging.getLogger(__name__).info(
        "CRC-32 through zlib, about 4x slower than ISA-L: %s; pip install isal", _missing
    )


_scan_json = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))  # (the stub's type is off)
"""json's own scanner, called directly: ``json.loads`` less its checks of the encoding and of
the whitespace around the value, which no header holds (a third of a header's parse)."""


def decode_json(text: str) -> Any:
    try:
        value, end = _scan_json(text, 0)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 of the bytes, as stored in every record (detects truncation and bit rot)."""
    return _crc32(data) & 0xFFFFFFFF


def checksums(items: list[bytes | memoryview]) -> np.ndarray:
    """:func:`checksum` of each, as one int64 array."""
    return np.fromiter(map(_crc32, items), np.int64, len(items)) & 0xFFFFFFFF


_new = object.__new__

_SIZE_BOUND = 1 << 63
"""A record's size is below it: sizes are held as int64 (an append's array of them, a block's),
so a header that gives a larger one is damaged."""


def name_bytes(name: str) -> bytes:
    """A record name as bytes: UTF-8, with the bytes of a name that is not valid UTF-8 kept as
    they were (``surrogateescape``). No name holds a NUL byte (no file name can), so a list of
    them is stored joined by NULs."""
    return name.encode("utf-8", "surrogateescape")


DAMAGED_SCAN_END = -2
"""A header's ``scan_end`` where it gives one that is not an offset in the record's bytes (of
another type, negative, past them). It is fastdata's own hint (NOTE [ Scan ends ] in
:mod:`fastdata.images.codec`), not part of the image or its description: the record reads as
one without it (each read searches the scan), so that an export keeps its image, and
``fastdata verify`` names it, and a copy refuses it, as they do a wrong one."""


@dataclass(frozen=True)
class RecordHeader:
    """Everything about a record except its image bytes.

    Attributes:
        name: the image's path relative to the source folder, ``/``-separated.
        label: its class index.
        size: length of the stored image bytes.
        crc32: CRC-32 of the stored image bytes.
        format: the sniffed image format (``jpeg``, ``png``, ...).
        repaired: whether ``FF D9`` was appended to a JPEG that lacked it; the original file is
            then the stored bytes minus their last two.
        fields: the record's field values (see :mod:`fastdata.fields`), None in a store
            without fields.
        fields_crc32: CRC-32 of the values' canonical encoding (``fields.canonical``); -1
            without fields.
        scan_end: where a JPEG's first scan ends in the stored bytes (the offset of the marker
            after it, found once as the record was written: NOTE [ Scan ends ] in
            :mod:`fastdata.images.codec`); -1 where it is not recorded (not a JPEG, a record
            written before fastdata recorded it, another tool's); :data:`DAMAGED_SCAN_END`
            where the header gives one that is not an offset in the bytes.
    """

    name: str
    label: int
    size: int
    crc32: int
    format: str
    repaired: bool = False
    fields: dict[str, Any] | None = None
    fields_crc32: int = -1
    scan_end: int = -1
    encoded_fields: bytes | None = field(default=None, repr=False, compare=False)
    """``canonical(fields)`` where it is at hand already (a conversion has it from the scan),
    so that it is not encoded again; not part of the header's value."""

    def to_json(self) -> bytes:
        """Compact JSON (non-ASCII names are escaped, so any name round-trips; field values
        are their canonical UTF-8 encoding)."""
        # formatted directly (one per image, on the conversion's hot path); only the name needs
        # JSON escaping, and the format is one of sniff()'s plain names
        head = (
            f'{{"name":{json.dumps(self.name)},"label":{int(self.label)},"size":{int(self.size)},'
            f'"crc32":{int(self.crc32)},"format":{json.dumps(self.format)},'
            f'"repaired":{"true" if self.repaired else "false"}'
        ).encode("ascii")
        if self.scan_end >= 0:
            head += b',"scan_end":%d' % self.scan_end
        if self.fields is None:
            return head + b"}"
        encoded = self.encoded_fields
        return b'%s,"fields":%s,"fields_crc32":%d}' % (
            head,
            canonical(self.fields) if encoded is None else encoded,
            self.fields_crc32,
        )

    def to_dict(self) -> dict[str, Any]:
        """The header as a document (what a MongoDB record holds beside its image)."""
        d = asdict(self)
        del d["encoded_fields"]
        if self.fields is None:
            del d["fields"], d["fields_crc32"]
        if self.scan_end < 0:
            del d["scan_end"]
        return d

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str, where: str = "record") -> RecordHeader:
        try:
            d = decode_json(raw if isinstance(raw, str) else str(raw, "utf-8"))
        except (ValueError, RecursionError) as exc:
            why = "nested too deep" if isinstance(exc, RecursionError) else exc
            raise RecordError(f"{where}: record header is not valid JSON ({why})") from None
        return cls.from_dict(d, where)

    @classmethod
    def from_dict(cls, d: Any, where: str = "record") -> RecordHeader:
        """Check every field's type before trusting it (a damaged header is a RecordError)."""
        if type(d) is dict:  # the usual header, checked in one expression (every read's path)
            name, label, size = d.get("name"), d.get("label"), d.get("size")
            crc, fmt, repaired = d.get("crc32"), d.get("format"), d.get("repaired", False)
            ends = d.get("scan_end", -1)
            if (
                type(name) is str
                and type(label) is int
                and type(size) is int
                and type(crc) is int
                and type(fmt) is str
                and type(ends) is int
                and 0 <= size < _SIZE_BOUND
                and 0 <= crc < 1 << 32
                and -1 <= ends < size
            ):
                values = d.get("fields")
                fcrc: Any = -1 if values is None else d.get("fields_crc32")
                if values is None or (
                    type(values) is dict and isinstance(fcrc, int) and 0 <= fcrc < 1 << 32
                ):
                    # made as the dataclass would make it, less its frozen __setattr__ per field:
                    # every header a verify, an export or a copy reads is made here
                    header = _new(cls)
                    header.__dict__.update(
                        name=name,
                        label=label,
                        size=size,
                        crc32=crc,
                        format=fmt,
                        repaired=bool(repaired),
                        fields=values,
                        fields_crc32=int(fcrc),
                        scan_end=ends,
                        encoded_fields=None,
                    )
                    return header
                raise RecordError(f"{where}: malformed record header ('fields' or 'fields_crc32')")
        if not isinstance(d, dict):
            raise RecordError(f"{where}: malformed record header (not an object)")
        types = {"name": str, "label": int, "size": int, "crc32": int, "format": str}
        for key, kind in types.items():
            value = d.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise RecordError(
                    f"{where}: malformed record header ({key!r} missing or not a {kind.__name__})"
                )
        if not 0 <= d["size"] < _SIZE_BOUND or not 0 <= d["crc32"] < 1 << 32:
            raise RecordError(f"{where}: malformed record header (size or crc32 out of range)")
        ends = d.get("scan_end", -1)
        if not isinstance(ends, int) or isinstance(ends, bool) or not -1 <= ends < d["size"]:
            ends = DAMAGED_SCAN_END  # (fastdata's own hint: the record is whole without it)
        values, fcrc = d.get("fields"), d.get("fields_crc32", -1)
        if values is not None and not (
            isinstance(values, dict) and isinstance(fcrc, int) and 0 <= fcrc < 1 << 32
        ):
            raise RecordError(f"{where}: malformed record header ('fields' or 'fields_crc32')")
        return cls(
            name=d["name"],
            label=d["label"],
            size=d["size"],
            crc32=d["crc32"],
            format=d["format"],
            repaired=bool(d.get("repaired", False)),
            fields=values,
            fields_crc32=int(fcrc) if values is not None else -1,
            scan_end=int(ends),
        )


_NAME_CHARS = rb'[^"\\\x00-\x1f\x80-\xff]*'
_PLAIN = re.compile(
    rb'^\{"name":"('
    + _NAME_CHARS
    + rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
    + _NAME_CHARS
    + rb')*)","label":(-?(?:0|[1-9][0-9]{0,9})),"size":(0|[1-9][0-9]{0,15}),'
    rb'"crc32":(0|[1-9][0-9]{0,9}),"format":"[0-9A-Za-z]*","repaired":false'
    rb'(?:,"scan_end":(0|[1-9][0-9]{0,15}))?\}$',
    re.MULTILINE,
)
"""A header as :meth:`RecordHeader.to_json` writes it for a record without fields and not
repaired, one per line: every one it matches is a header that :meth:`RecordHeader.from_json`
reads alike. (A repaired record is checked more closely: read one at a time.)"""


def plain_headers(
    heads: list[bytes | memoryview],
) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Many headers read at once, where each is one without fields, not repaired, as fastdata
    writes it: their names joined by NULs (as :func:`name_bytes` gives them), and their labels,
    sizes, checksums and scan ends (-1 where none is recorded); None if any is not (then each is
    read with :meth:`RecordHeader.from_json`, which accepts or names it).

    It parses them in one pass over the headers joined by newlines, which no header as written
    holds: the count of newlines shows that none does, so each line is one header, and the
    pattern, anchored at both ends of a line, matches a line at most once."""
    n = len(heads)
    text = b"\n".join(heads)
    if text.count(b"\n") != n - 1:
        return None
    found = _PLAIN.findall(text)
    if len(found) != n or not n:
        return None
    names, labels, sizes, crcs, ends = zip(*found, strict=True)
    joined = b"\0".join(names)
    if b"\\" in joined:  # (an escaped character: names read one at a time)
        try:
            text_names = [json.loads(b'"%s"' % name) for name in names]
            joined = "\0".join(text_names).encode("utf-8", "surrogateescape")
        except (ValueError, UnicodeEncodeError):
            return None
        if joined.count(b"\0") != n - 1:  # (a name holding a NUL: compared one at a time)
            return None
    crc_values = np.fromiter(map(int, crcs), np.int64, n)
    if crc_values.max() >> 32:  # (one of 10 digits past 32 bits: named one at a time)
        return None
    size_values = np.fromiter(map(int, sizes), np.int64, n)
    end_values = np.fromiter((int(e) if e else -1 for e in ends), np.int64, n)
    if (end_values >= size_values).any():  # (not an offset in its bytes: named one at a time)
        return None
    return (joined, np.fromiter(map(int, labels), np.int64, n), size_values, crc_values, end_values)


_SIZE_AND_CHECKSUM = re.compile(
    rb'^\{"name":"'
    + _NAME_CHARS
    + rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
    + _NAME_CHARS
    + rb')*","label":-?(?:0|[1-9][0-9]{0,9}),"size":(0|[1-9][0-9]{0,15}),'
    rb'"crc32":(0|[1-9][0-9]{0,9}),"format":"[0-9A-Za-z]*","repaired":(?:false|true)'
    rb'(?:,"scan_end":(0|[1-9][0-9]{0,15}))?([^\n]*)',
    re.MULTILINE,
)
"""The size, checksum and scan end (where one is recorded) of a header as
:meth:`RecordHeader.to_json` writes it (with fields or without), one per line, and the rest of
the line: what a checked read compares a record's bytes with, and what it passes on to a
decode. (The rest of the line is taken whole: the search for the next line's start then skips
it at once, where it would try every byte of a header's fields: 2.7x the time for 256 headers
with a caption and 5 boxes.)

A scan end found so is passed on only where nothing after it can give the key again as JSON
reads it: the header ends there, or only fields follow that hold neither ``"scan_end"`` nor an
escape (``\\u0073can_end`` spells the key too). A header that gives it twice (JSON, and
:meth:`RecordHeader.from_json`, take the last, which ``fastdata verify`` checks) or as
anything but a plain offset (``4856.0``) reads as one without: its scan is searched (NOTE
[ Scan ends ] in :mod:`fastdata.images.codec`), never trusted at an offset nothing checked."""


def first_mismatch(
    heads: Sequence[bytes | memoryview],
    data: Sequence[bytes | memoryview],
    where: Callable[[int], str],
) -> tuple[tuple[int, str] | None, list[int]]:
    """The first record whose bytes are not the ones its header describes (their size and
    CRC-32), among records read with their headers' bytes: its position and what differs; None
    where every one's are. What a checked read does before it gives a record's bytes. With it,
    where all pass, each header's scan end (-1 where none is recorded: NOTE [ Scan ends ] in
    :mod:`fastdata.images.codec`), which a decode of the bytes takes.

    The headers are read together where each is as :meth:`RecordHeader.to_json` writes it (one
    pattern over them all, joined by newlines, which no such header holds); otherwise each is
    read whole, which names what is wrong with one that is not a header.

    Raises:
        RecordError: a header that is not one (``where(n)`` names the ``n``-th).
    """
    n = len(heads)
    text = b"\n".join(heads)
    found = _SIZE_AND_CHECKSUM.findall(text) if text.count(b"\n") == n - 1 else []
    if len(found) != n:  # (anchored at each line's start: one match a line at most)
        parsed = [RecordHeader.from_json(head, where(j)) for j, head in enumerate(heads)]
        found = [(h.size, h.crc32, max(h.scan_end, -1), None) for h in parsed]
    ends = []
    for j, ((size, crc, end, rest), value) in enumerate(zip(found, data, strict=True)):
        why = bytes_problem(int(size), int(crc), value)
        if why is not None:
            return (j, why), []
        if rest is None:  # (read whole)
            ends.append(end)
        elif end and (
            rest == b"}"
            or (
                rest.startswith(b',"fields":')
                and rest.find(b"\\") < 0
                and rest.find(b'"scan_end"') < 0
            )
        ):  # (nothing after it gives the key again: see _SIZE_AND_CHECKSUM)
            ends.append(int(end))
        else:
            ends.append(-1)
    return None, ends


def bytes_problem(size: int, crc: int, data: bytes | memoryview) -> str | None:
    """What differs between a record's bytes and the size and CRC-32 its header gives (None:
    nothing): what a checked read says of a record that fails."""
    if len(data) != size:
        return f"{len(data)} bytes, its header says {size}"
    if _crc32(data) & 0xFFFFFFFF != crc:
        return "its CRC-32 is not its header's: its bytes are not the ones stored"
    return None


@dataclass(frozen=True)
class Record:
    """One image as stored: its index, header and bytes."""

    index: int
    header: RecordHeader
    data: bytes

    def original_bytes(self) -> bytes:
        """The bytes of the source file, byte for byte (a repair is undone)."""
        return self.data[:-2] if self.header.repaired else self.data


def fields_problem(h: RecordHeader, schema: Schema | None) -> str | None:
    """What is wrong with a record's field values: missing, not matching the schema (a value
    of another type, a field too many or too few), or not those its checksum was computed
    over; None when nothing is. Whatever reads fields out of a store to write them elsewhere
    (``copy``, ``export``) checks this first, as ``verify`` does."""
    if h.fields is None:
        return "its fields are missing" if schema else None
    if not schema:
        return "it has fields, but the store's schema lists none"
    values, why = schema.check(h.fields)
    if why is not None:
        return f"fields: {why}"
    assert values is not None
    if checksum(canonical(values)) != h.fields_crc32:
        return "fields checksum mismatch"
    return None
