"""The schema both backends share: one record per image, and the store's metadata.

A record is the same thing in LMDB and MongoDB; the backends differ only in where the bytes live.
Image bytes are stored as they are; everything else is plain JSON or little-endian integers, so any
LMDB or Mongo client can read a store without fastdata (``docs/format.md`` writes the format down).
Nothing is pickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import RecordError, StoreError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Progress",
    "Record",
    "RecordHeader",
    "SkippedFile",
    "StoreMeta",
    "record_key",
]

FORMAT_NAME = "fastdata"
FORMAT_VERSION = 1


def record_key(index: int) -> bytes:
    """The key of record ``index``: zero-padded decimal, so keys sort in index order."""
    return b"%010d" % index


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
    """

    name: str
    label: int
    size: int
    crc32: int
    format: str
    repaired: bool = False

    def to_json(self) -> bytes:
        """Compact ASCII JSON (non-ASCII names are escaped, so any name round-trips)."""
        # formatted directly (one per image, on the conversion's hot path); only the name needs
        # JSON escaping, and the format is one of sniff()'s plain names
        return (
            f'{{"name":{json.dumps(self.name)},"label":{int(self.label)},"size":{int(self.size)},'
            f'"crc32":{int(self.crc32)},"format":{json.dumps(self.format)},'
            f'"repaired":{"true" if self.repaired else "false"}}}'
        ).encode("ascii")

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str, where: str = "record") -> RecordHeader:
        try:
            d = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
        except ValueError as exc:
            raise RecordError(f"{where}: record header is not valid JSON ({exc})") from exc
        return cls.from_dict(d, where)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "record") -> RecordHeader:
        try:
            return cls(
                name=str(d["name"]),
                label=int(d["label"]),
                size=int(d["size"]),
                crc32=int(d["crc32"]),
                format=str(d["format"]),
                repaired=bool(d.get("repaired", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{where}: malformed record header ({exc!r})") from exc


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
    """A source file left out of the store, and why."""

    name: str
    reason: str


@dataclass
class Progress:
    """Where a conversion stands; saved with every committed batch so it can resume.

    Attributes:
        source: the folder being converted.
        fingerprint: digest of the folder's sample list (see ``FolderScan.fingerprint``).
        total: samples in the folder.
        next_sample: samples handled so far (stored or skipped), in scan order.
        count: records stored so far (their indices are ``0 .. count-1``).
        repairs: records whose JPEG end-of-image marker was appended.
        total_bytes: image bytes stored so far.
        skipped: files left out so far.
        boot_id: the boot of the machine that saved this progress (a writer may refuse to resume
            after a restart).
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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode("ascii")

    @classmethod
    def from_json(cls, raw: bytes | str, where: str) -> Progress:
        try:
            d = json.loads(raw)
            d["skipped"] = [SkippedFile(**s) for s in d.get("skipped", [])]
            return cls(**d)
        except (ValueError, TypeError) as exc:
            raise StoreError(f"{where}: unreadable conversion progress ({exc})") from exc


@dataclass(frozen=True)
class StoreMeta:
    """A complete store's metadata. Written last: its presence marks the store complete.

    The labels (one integer per record) are stored beside it as one little-endian int32 array,
    not inside it; see the backends.
    """

    count: int
    classes: list[str]
    repairs: int = 0
    total_bytes: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    source: str = ""
    created: str = ""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

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
    def from_dict(cls, d: dict[str, Any], where: str) -> StoreMeta:
        if d.get("format") != FORMAT_NAME:
            raise StoreError(f"{where}: not a fastdata store (format {d.get('format')!r})")
        version = int(d.get("version", 0))
        if version > FORMAT_VERSION:
            raise StoreError(
                f"{where}: store format version {version} is newer than this fastdata reads "
                f"({FORMAT_VERSION}); upgrade fastdata"
            )
        return cls(
            count=int(d["count"]),
            classes=[str(c) for c in d["classes"]],
            repairs=int(d.get("repairs", 0)),
            total_bytes=int(d.get("total_bytes", 0)),
            skipped=[SkippedFile(**s) for s in d.get("skipped", [])],
            source=str(d.get("source", "")),
            created=str(d.get("created", "")),
            version=version,
        )

    @classmethod
    def from_json(cls, raw: bytes | str, where: str) -> StoreMeta:
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise StoreError(f"{where}: metadata is not valid JSON ({exc})") from exc
        return cls.from_dict(d, where)
