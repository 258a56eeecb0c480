"""The schema both backends share: one record per image, and the store's metadata.

A record is the same thing in LMDB and MongoDB; the backends differ only in where the bytes live.
Image bytes are stored as they are; everything else is plain JSON or little-endian integers, so any
LMDB or Mongo client can read a store without fastdata (``docs/format.md`` writes the format down).
Nothing is pickled.
"""

from __future__ import annotations

import json
import json.scanner
import logging
import os
import re
import shlex
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

import numpy as np

from .errors import RecordError, StoreDamagedError, StoreError, option
from .fields import Schema, canonical

try:  # the same CRC-32 as zlib's, 4x as fast (measured); installed with fastdata
    from isal.isal_zlib import crc32 as _crc32

    CHECKSUM_IMPLEMENTATION = "ISA-L (isal)"
except ImportError as _missing:  # pragma: no cover - a platform without an isal wheel
    _crc32 = zlib.crc32
    CHECKSUM_IMPLEMENTATION = "zlib"
    logging.getLogger(__name__).info(
        "CRC-32 through zlib, about 4x slower than ISA-L: %s; pip install isal", _missing
    )

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LABEL_DTYPE",
    "Progress",
    "CHECKSUM_IMPLEMENTATION",
    "Record",
    "RecordHeader",
    "SkippedFile",
    "StoreMeta",
    "check_labels",
    "checksum",
    "checksums",
    "class_count",
    "bytes_problem",
    "first_mismatch",
    "name_bytes",
    "new_store_id",
    "plain_headers",
    "skipped_file",
]

FORMAT_NAME = "fastdata"
FORMAT_VERSION = 1
LABEL_DTYPE = "<i4"
"""How labels are stored, in both backends: one little-endian int32 per record."""


_scan_json = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))  # (the stub's type is off)
"""json's own scanner, called directly: ``json.loads`` less its checks of the encoding and of
the whitespace around the value, which no header holds (a third of a header's parse)."""


def _decode_json(text: str) -> Any:
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


def new_store_id() -> str:
    """A fresh store identity: 32 random hex digits."""
    return uuid.uuid4().hex


_new = object.__new__


def name_bytes(name: str) -> bytes:
    """A record name as bytes: UTF-8, with the bytes of a name that is not valid UTF-8 kept as
    they were (``surrogateescape``). No name holds a NUL byte (no file name can), so a list of
    them is stored joined by NULs."""
    return name.encode("utf-8", "surrogateescape")


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
    """

    name: str
    label: int
    size: int
    crc32: int
    format: str
    repaired: bool = False
    fields: dict[str, Any] | None = None
    fields_crc32: int = -1
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
        return d

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str, where: str = "record") -> RecordHeader:
        try:
            d = _decode_json(raw if isinstance(raw, str) else str(raw, "utf-8"))
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
            if (
                type(name) is str
                and type(label) is int
                and type(size) is int
                and type(crc) is int
                and type(fmt) is str
                and size >= 0
                and 0 <= crc < 1 << 32
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
        if d["size"] < 0 or not 0 <= d["crc32"] < 1 << 32:
            raise RecordError(f"{where}: malformed record header (size or crc32 out of range)")
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
        )


_NAME_CHARS = rb'[^"\\\x00-\x1f\x80-\xff]*'
_PLAIN = re.compile(
    rb'^\{"name":"('
    + _NAME_CHARS
    + rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
    + _NAME_CHARS
    + rb')*)","label":(-?(?:0|[1-9][0-9]{0,9})),"size":(0|[1-9][0-9]{0,15}),'
    rb'"crc32":(0|[1-9][0-9]{0,9}),"format":"[0-9A-Za-z]*","repaired":false\}$',
    re.MULTILINE,
)
"""A header as :meth:`RecordHeader.to_json` writes it for a record without fields and not
repaired, one per line: every one it matches is a header that :meth:`RecordHeader.from_json`
reads alike. (A repaired record is checked more closely: read one at a time.)"""


def plain_headers(
    heads: list[bytes | memoryview],
) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray] | None:
    """Many headers read at once, where each is one without fields, not repaired, as fastdata
    writes it: their names joined by NULs (as :func:`name_bytes` gives them), and their labels,
    sizes and checksums; None if any is not (then each is read with
    :meth:`RecordHeader.from_json`, which accepts or names it).

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
    names, labels, sizes, crcs = zip(*found, strict=True)
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
    return (
        joined,
        np.fromiter(map(int, labels), np.int64, n),
        np.fromiter(map(int, sizes), np.int64, n),
        crc_values,
    )


_SIZE_AND_CHECKSUM = re.compile(
    rb'^\{"name":"'
    + _NAME_CHARS
    + rb'(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
    + _NAME_CHARS
    + rb')*","label":-?(?:0|[1-9][0-9]{0,9}),"size":(0|[1-9][0-9]{0,15}),'
    rb'"crc32":(0|[1-9][0-9]{0,9}),"format":"',
    re.MULTILINE,
)
"""The size and checksum of a header as :meth:`RecordHeader.to_json` writes it (with fields or
without), one per line: what a checked read compares a record's bytes with."""


def first_mismatch(
    heads: Sequence[bytes | memoryview],
    data: Sequence[bytes | memoryview],
    where: Callable[[int], str],
) -> tuple[int, str] | None:
    """The first record whose bytes are not the ones its header describes (their size and
    CRC-32), among records read with their headers' bytes: its position and what differs; None
    where every one's are. What a checked read does before it gives a record's bytes.

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
        found = [(h.size, h.crc32) for h in parsed]
    for j, ((size, crc), value) in enumerate(zip(found, data, strict=True)):
        why = bytes_problem(int(size), int(crc), value)
        if why is not None:
            return j, why
    return None


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


@dataclass(frozen=True)
class SkippedFile:
    """A source file left out of the store, and why.

    ``size`` and ``mtime_ns`` are the file's as it was when it was left out (-1 when unknown):
    an append reads it again only once either changed.
    """

    name: str
    reason: str
    size: int = -1
    mtime_ns: int = -1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "reason": self.reason}
        if self.size >= 0:
            d["size"], d["mtime_ns"] = self.size, self.mtime_ns
        return d


@dataclass
class Progress:
    """Where a conversion stands; saved with every committed batch so it can resume.

    Attributes:
        source: the folder or manifest being converted, resolved (for a copy: the source store
            as command-line words, quoted for the shell).
        fingerprint: digest of the folder's sample list (see ``FolderScan.fingerprint``).
        total: samples in the folder.
        next_sample: samples handled so far (stored or skipped), in scan order.
        count: records stored so far (their indices are ``0 .. count-1``).
        repairs: records whose JPEG end-of-image marker was appended.
        total_bytes: image bytes stored so far.
        skipped: files left out so far. Saved apart from the progress, each once (the
            progress saves only their count), so a commit costs the same however many there are.
        boot_id: the boot of the machine that saved this progress (a writer may refuse to resume
            after a restart).
        store_id: the identity the store will carry (see ``StoreMeta.id``), fixed when the
            conversion starts.
        verify_decode: whether images were fully decoded: a resume must do the same.
        first_index: the index of the first record this run writes (0, or for an append the
            count of the store it grows).
        base_id: for an append, the id of the complete store it grows ("" for a conversion).
        max_file_bytes: the file size limit the run skips above (0: the default, or not
            recorded); a resume keeps it.
    """

    source: str
    fingerprint: str
    total: int
    next_sample: int = 0
    count: int = 0
    repairs: int = 0
    total_bytes: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    boot_id: str = ""
    store_id: str = ""
    verify_decode: bool = False
    first_index: int = 0
    base_id: str = ""
    max_file_bytes: int = 0
    fields: str = ""
    """The run's fields as ``--fields`` declares them (its resume gives them again)."""
    sidecars: str = ""
    """The run's ``--sidecars``, comma-separated."""

    @property
    def next_index(self) -> int:
        """The index of the next record to write."""
        return self.first_index + self.count

    def to_json(self) -> bytes:
        """The progress without its skipped list, which the backends save apart (see above)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "skipped"}
        d["skipped_count"] = len(self.skipped)
        return json.dumps(d).encode("ascii")

    @classmethod
    def from_json(
        cls,
        raw: bytes | str | memoryview,
        where: str,
        load_skipped: Callable[[int], list[SkippedFile]] | None = None,
    ) -> Progress:
        """Parse a saved progress; ``load_skipped(count)`` reads its skipped list back (without
        it the list is left empty: fine for messages, not for resuming)."""
        try:
            d = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
            count = d.pop("skipped_count", None)
            if "skipped" in d:  # saved inside the progress by earlier versions
                d["skipped"] = [skipped_file(s, where) for s in d["skipped"]]
            elif count is not None:
                if type(count) is not int or count < 0:
                    raise ValueError(f"'skipped_count' is {count!r}")
                d["skipped"] = load_skipped(count) if load_skipped is not None else []
            progress = cls(**d)
        except (ValueError, TypeError, AttributeError) as exc:
            raise StoreError(
                f"{where}: unreadable conversion progress ({exc}); convert again with ",
                option("overwrite"),
            ) from exc
        ints = (
            progress.total,
            progress.next_sample,
            progress.count,
            progress.total_bytes,
            progress.first_index,
        )
        if (
            not all(type(v) is int and v >= 0 for v in ints)
            or not (progress.count <= progress.next_sample <= progress.total)
            or not isinstance(progress.fields, str)
            or not isinstance(progress.sidecars, str)
        ):
            raise StoreError(
                f"{where}: damaged conversion progress (counts out of range); convert again with ",
                option("overwrite"),
            )
        return progress

    @property
    def is_copy(self) -> bool:
        return self.fingerprint.startswith("store:")

    def options(self) -> list[str]:
        """The run's options, as the command-line flags that give them."""
        return [
            *(["--append"] if self.base_id else []),
            *(["--verify-decode"] if self.verify_decode else []),
            *([f"--max-file-size {self.max_file_bytes}"] if self.max_file_bytes else []),
            *([f"--sidecars {shlex.quote(self.sidecars)}"] if self.sidecars else []),
            *([f"--fields {shlex.quote(self.fields)}"] if self.fields else []),
        ]

    def resume_command(self, destination: str) -> str:
        """The command that finishes this run into ``destination`` (``DST [--collection C]``),
        with the options it was started with."""
        verb = "copy" if self.is_copy else "convert"
        flags = "".join(f" {flag}" for flag in self.options())
        source = self.source if self.is_copy else shlex.quote(self.source)  # a copy's: words
        return f"fastdata {verb} {source} {destination}{flags} --resume"

    def resumable_as_recorded(self, other: Progress) -> bool:
        """Whether the run this progress records may still be finished by its own resume
        command, although ``other`` differs from it: ``other`` names another source (the
        recorded one may be as it was), or differs only in an option, or it is a copy (of a
        store named by its id). Not when the same source changed since."""
        if self.is_copy:  # a copy: of a store named elsewhere; not when that store changed
            return self.source != other.source
        return self.fingerprint == other.fingerprint or (
            os.path.realpath(self.source) != os.path.realpath(other.source)
        )

    def same_conversion(self, other: Progress) -> str | None:
        """What differs between the conversion this progress records and ``other``, or None.

        A resume continues only the same conversion: same source folder (resolved), same file
        list, same options (an option ``other`` leaves as None takes the recorded value).
        """
        if self.is_copy or other.is_copy:  # a copy: the source store's id, wherever it is now
            if self.fingerprint != other.fingerprint:
                if self.source == other.source:
                    return (
                        f"the store it copies ({self.source}) changed since (an append, or a "
                        "replacement)"
                    )
                return f"it copies another store ({self.source}), not {other.source}"
            return None
        if os.path.realpath(self.source) != os.path.realpath(other.source):
            return f"it was started from {self.source}, not {other.source}"
        if self.fingerprint != other.fingerprint:
            mine = (self.fields, self.sidecars)
            if any(mine) and mine != (other.fields, other.sidecars):
                flags = [f for f in self.options() if f.startswith(("--fields", "--sidecars"))]
                return f"it was started with {' '.join(flags)}"
            return f"the source {other.source} changed since it started"
        given = other.max_file_bytes
        if given and given != (self.max_file_bytes or given):
            return f"it was started with --max-file-size {self.max_file_bytes}"
        if other.verify_decode is not None and self.verify_decode != other.verify_decode:
            flag = "with" if self.verify_decode else "without"
            return f"it was started {flag} --verify-decode"
        return None


@dataclass(frozen=True)
class StoreMeta:
    """A complete store's metadata. Written last: its presence marks the store complete.

    ``id`` is the store's identity, new for every conversion (an ``--overwrite`` gives the store a
    new one): readers remember it and refuse to go on reading a store that was replaced.
    ``fingerprint`` is the source folder's (see ``Progress``).

    A store that grew by ``--append`` gets a new ``id`` too, and lists the ids it had before in
    ``appended_from`` (oldest first): its first records are still those stores' records, so a
    reader that opened one of them goes on reading. ``class_order`` is ``"sorted"`` (ImageFolder's
    order) until an append adds a class, which goes at the end: then ``"appended"``. ``layout`` says
    how the source named its images (``"folder"``: ``<class>/<image>``; ``"manifest"``: the paths
    a manifest gave). ``copied_from`` is the id of the store a ``fastdata copy`` read, ``updated``
    when the store last changed.

    The labels (one integer per record) are stored beside it as one little-endian int32 array,
    not inside it; see the backends.
    """

    count: int
    classes: list[str]
    repairs: int = 0
    total_bytes: int = 0
    skipped_count: int = 0
    source: str = ""
    created: str = ""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    id: str = ""
    fingerprint: str = ""
    appended_from: list[str] = field(default_factory=list)
    class_order: str = "sorted"
    layout: str = "folder"
    copied_from: str = ""
    updated: str = ""
    fields: list[dict[str, Any]] = field(default_factory=list)
    """The field schema (``fastdata.fields.Schema.to_list``): name, type and shape of each
    field every record carries; empty in a store of images and classes only."""
    sidecars: list[str] = field(default_factory=list)
    """For a store converted from a folder with sidecar files: their extensions (``json``,
    ``txt``), so that ``export`` writes them back."""
    labelled: bool = True
    """Whether records have classes; a store converted from a manifest without labels (an
    image-text set) has none: ``classes`` is empty and every label is -1."""
    written: list[list[Any]] = field(default_factory=list)
    """When the records were written: ``[first index, ISO time]`` for the conversion and for
    each append that added records, in order (an append compares a file's modification time
    with its own record's). Empty in stores written before it existed."""

    def written_at(self) -> tuple[Any, Any]:
        """``(first indices, timestamps)`` of the runs that wrote the records, as two numpy
        arrays (a store that does not say was written at ``created``)."""
        import numpy as np

        runs = self.written or [[0, self.created or self.updated]]
        starts = np.array([int(r[0]) for r in runs], dtype=np.int64)
        times = np.array([_timestamp(str(r[1])) for r in runs], dtype=np.float64)
        return starts, times

    @property
    def schema(self) -> Any:
        """The field schema as a :class:`fastdata.fields.Schema`."""
        from .fields import Schema

        return Schema.from_list(self.fields, "store metadata")

    @property
    def ids(self) -> frozenset[str]:
        """Every id under which this store's first records were read: its own and the ids of
        the stores it grew from."""
        return frozenset([self.id, *self.appended_from])

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class_to_idx"] = self.class_to_idx
        d["checksum"] = "crc32"
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode("ascii")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> StoreMeta:
        """Check every field's type and range before trusting it.

        Raises:
            StoreError: not fastdata metadata, a newer version, or a damaged field.
        """
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise StoreError(f"{where}: not a fastdata store (format {found!r})")
        version = d.get("version", 0)
        if type(version) is not int:
            raise _damaged(where, "version")
        if version > FORMAT_VERSION:
            raise StoreError(
                f"{where}: store format version {version} is newer than this fastdata reads "
                f"({FORMAT_VERSION}); upgrade fastdata"
            )
        count, classes = d.get("count"), d.get("classes")
        if type(count) is not int or count < 0:
            raise _damaged(where, "count")
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise _damaged(where, "classes")
        legacy = d.get("skipped")  # the list itself, in the metadata of earlier versions
        if legacy is not None and not isinstance(legacy, list):
            raise _damaged(where, "skipped")
        numbers = {
            "skipped_count": d.get("skipped_count", len(legacy or ())),
            "repairs": d.get("repairs", 0),
            "total_bytes": d.get("total_bytes", 0),
        }
        for key, value in numbers.items():
            if type(value) is not int or value < 0:
                raise _damaged(where, key)
        for key in ("source", "created", "id", "fingerprint", "copied_from", "updated"):
            if not isinstance(d.get(key, ""), str):
                raise _damaged(where, key)
        appended_from = d.get("appended_from", [])
        if not isinstance(appended_from, list) or not all(
            isinstance(i, str) for i in appended_from
        ):
            raise _damaged(where, "appended_from")
        if d.get("class_order", "sorted") not in ("sorted", "appended"):
            raise _damaged(where, "class_order")
        if d.get("layout", "folder") not in ("folder", "manifest"):
            raise _damaged(where, "layout")
        written = d.get("written", [])
        if not isinstance(written, list) or not all(
            isinstance(r, list)
            and len(r) == 2
            and type(r[0]) is int
            and r[0] >= 0
            and isinstance(r[1], str)
            for r in written
        ):
            raise _damaged(where, "written")
        schema = d.get("fields", [])
        if schema:
            from .fields import Schema

            Schema.from_list(schema, where)
        labelled = d.get("labelled", True)
        if type(labelled) is not bool:
            raise _damaged(where, "labelled")
        sidecars = d.get("sidecars", [])
        if not isinstance(sidecars, list) or not all(isinstance(x, str) for x in sidecars):
            raise _damaged(where, "sidecars")
        return cls(
            sidecars=list(sidecars),
            fields=list(schema),
            labelled=labelled,
            count=count,
            classes=list(classes),
            repairs=d.get("repairs", 0),
            total_bytes=d.get("total_bytes", 0),
            skipped_count=numbers["skipped_count"],
            source=d.get("source", ""),
            created=d.get("created", ""),
            version=version,
            id=d.get("id", ""),
            fingerprint=d.get("fingerprint", ""),
            appended_from=list(appended_from),
            class_order=d.get("class_order", "sorted"),
            layout=d.get("layout", "folder"),
            copied_from=d.get("copied_from", ""),
            updated=d.get("updated", ""),
            written=[list(r) for r in written],
        )

    @classmethod
    def from_json(cls, raw: bytes | str | memoryview, where: str) -> StoreMeta:
        try:
            d = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
        except (ValueError, RecursionError) as exc:
            why = "nested too deep" if isinstance(exc, RecursionError) else exc
            raise StoreError(f"{where}: metadata is not valid JSON ({why})") from None
        return cls.from_dict(d, where)


def _timestamp(text: str) -> float:
    """An ISO time as seconds since the epoch (0 when it is not one: compared as "long ago",
    which makes an append read the file rather than trust it)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return 0.0


def skipped_file(item: Any, where: str) -> SkippedFile:
    """One entry of a saved skipped list (``{"name": ..., "reason": ...}``), checked."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise _damaged(where, "skipped")
    size, mtime = item.get("size", -1), item.get("mtime_ns", -1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, mtime)):
        size = mtime = -1  # (BSON gives its 64-bit integers as a subclass of int)
    return SkippedFile(item["name"], str(item.get("reason", "")), int(size), int(mtime))


def _damaged(where: str, field_name: str) -> StoreError:
    return StoreDamagedError(
        f"{where}: the store's metadata is damaged ({field_name!r} missing or of the wrong type)"
    )


def check_labels(raw: bytes | memoryview | None, meta: StoreMeta, where: str) -> Any:
    """The labels array stored beside ``meta``, checked: one per record, each a class index.

    Returns:
        A read-only int64 numpy array.

    Raises:
        StoreError: missing, of the wrong length, or a label outside the class list.
    """
    import numpy as np

    data = bytes(raw) if raw is not None else b""
    if len(data) != 4 * meta.count:
        raise StoreDamagedError(
            f"{where}: the store breaks the invariant 'one label per record' ({len(data) // 4} "
            f"labels for {meta.count} records)"
        )
    labels = np.frombuffer(data, dtype="<i4").astype(np.int64)
    if not meta.labelled:
        if len(labels) and (labels != -1).any():
            bad = int(np.flatnonzero(labels != -1)[0])
            raise StoreDamagedError(
                f"{where}: record {bad} has label {int(labels[bad])} in a store without classes "
                "(every label is -1)"
            )
        labels.setflags(write=False)
        return labels
    if len(labels) and (labels.min() < 0 or labels.max() >= len(meta.classes)):
        bad = int(np.flatnonzero((labels < 0) | (labels >= len(meta.classes)))[0])
        raise StoreDamagedError(
            f"{where}: record {bad} has label {int(labels[bad])}, outside the "
            f"{len(meta.classes)} classes"
        )
    labels.setflags(write=False)
    return labels


MAX_CLASSES = 1 << 20
"""Stores from other tools have no class list; one is made from their labels, up to this many."""


def class_count(labels: Any, where: str) -> int:
    """The number of classes implied by integer ``labels`` of a store without a class list.

    Raises:
        StoreError: a label is negative or absurdly large (a damaged store), which would
            otherwise size a list of class names.
    """
    if not len(labels):
        return 0
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= MAX_CLASSES:
        raise StoreError(
            f"{where}: label {low if low < 0 else high} is out of range (0 to {MAX_CLASSES - 1}); "
            "the store or its index is damaged"
        )
    return high + 1


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
