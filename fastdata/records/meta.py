"""A complete store's metadata (written last: its presence marks the store complete), and the
labels stored beside it, checked before they are used."""

from __future__ import annotations

import json
import json.scanner
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import StoreDamagedError, StoreError

FORMAT_NAME = "fastdata"
FORMAT_VERSION = 1
LABEL_DTYPE = "<i4"
"""How labels are stored, in both backends: one little-endian int32 per record."""


def new_store_id() -> str:
    """A fresh store identity: 32 random hex digits."""
    return uuid.uuid4().hex


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

        runs = self.written or [[0, self.created or self.updated]]
        starts = np.array([int(r[0]) for r in runs], dtype=np.int64)
        times = np.array([_timestamp(str(r[1])) for r in runs], dtype=np.float64)
        return starts, times

    @property
    def schema(self) -> Any:
        """The field schema as a :class:`fastdata.fields.Schema`."""
        from ..fields import Schema

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
            raise damaged_metadata(where, "version")
        if version > FORMAT_VERSION:
            raise StoreError(
                f"{where}: store format version {version} is newer than this fastdata reads "
                f"({FORMAT_VERSION}); upgrade fastdata"
            )
        count, classes = d.get("count"), d.get("classes")
        if type(count) is not int or count < 0:
            raise damaged_metadata(where, "count")
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise damaged_metadata(where, "classes")
        legacy = d.get("skipped")  # the list itself, in the metadata of earlier versions
        if legacy is not None and not isinstance(legacy, list):
            raise damaged_metadata(where, "skipped")
        numbers = {
            "skipped_count": d.get("skipped_count", len(legacy or ())),
            "repairs": d.get("repairs", 0),
            "total_bytes": d.get("total_bytes", 0),
        }
        for key, value in numbers.items():
            if type(value) is not int or value < 0:
                raise damaged_metadata(where, key)
        for key in ("source", "created", "id", "fingerprint", "copied_from", "updated"):
            if not isinstance(d.get(key, ""), str):
                raise damaged_metadata(where, key)
        appended_from = d.get("appended_from", [])
        if not isinstance(appended_from, list) or not all(
            isinstance(i, str) for i in appended_from
        ):
            raise damaged_metadata(where, "appended_from")
        if d.get("class_order", "sorted") not in ("sorted", "appended"):
            raise damaged_metadata(where, "class_order")
        if d.get("layout", "folder") not in ("folder", "manifest"):
            raise damaged_metadata(where, "layout")
        written = d.get("written", [])
        if not isinstance(written, list) or not all(
            isinstance(r, list)
            and len(r) == 2
            and type(r[0]) is int
            and r[0] >= 0
            and isinstance(r[1], str)
            for r in written
        ):
            raise damaged_metadata(where, "written")
        schema = d.get("fields", [])
        if schema:
            from ..fields import Schema

            Schema.from_list(schema, where)
        labelled = d.get("labelled", True)
        if type(labelled) is not bool:
            raise damaged_metadata(where, "labelled")
        sidecars = d.get("sidecars", [])
        if not isinstance(sidecars, list) or not all(isinstance(x, str) for x in sidecars):
            raise damaged_metadata(where, "sidecars")
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
            raise StoreDamagedError(f"{where}: metadata is not valid JSON ({why})") from None
        return cls.from_dict(d, where)


def _timestamp(text: str) -> float:
    """An ISO time as seconds since the epoch (0 when it is not one: compared as "long ago",
    which makes an append read the file rather than trust it)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return 0.0


def damaged_metadata(where: str, field_name: str) -> StoreError:
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
