"""What a source found: which files are images (:data:`IMG_EXTENSIONS`), one image
(:class:`Sample`), every image packed (:class:`Samples`, built by :class:`SampleBuilder`), and
the scan a conversion reads (:class:`FolderScan`, made by a folder's scan or a manifest's), with
the samples' field values checked against its schema (:func:`checked_fields`).
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

import numpy as np

from ..fields import Schema, canonical
from ..packed import PackedStrings
from ..records import SkippedFile

__all__ = [
    "IMG_EXTENSIONS",
    "FolderScan",
    "Sample",
    "SampleBuilder",
    "Samples",
    "checked_fields",
]

IMG_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".bmp",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)


@dataclass(frozen=True)
class Sample:
    """One image found in the folder.

    Attributes:
        name: the path relative to the root, with ``/`` separators (``cat/0001.jpg``).
        label: the index of the image's class.
        fields: the canonical encoding of the sample's field values (``fastdata.fields``), or
            None when the source has no fields.
    """

    name: str
    label: int
    fields: bytes | None = None


def _encode(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


class Samples(Sequence[Sample]):
    """Every image of a scan, packed: names in one buffer with an offsets array, labels in an
    int32 array; about the name's length plus 12 bytes per image, nothing per image a Python
    object. Indexing gives a :class:`Sample`; slicing gives a view."""

    def __init__(
        self,
        names: PackedStrings,
        labels: np.ndarray,
        start: int = 0,
        stop: int | None = None,
        fields: PackedStrings | None = None,
    ) -> None:
        self._names, self._labels, self._fields = names, labels, fields
        self._start, self._stop = start, len(labels) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Sample: ...

    @overload
    def __getitem__(self, index: slice) -> Samples: ...

    def __getitem__(self, index: int | slice) -> Sample | Samples:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("Samples slices take no step")
            return Samples(
                self._names,
                self._labels,
                self._start + start,
                self._start + max(start, stop),
                self._fields,
            )
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        i = self._start + index % len(self)
        name = self._names[i].decode("utf-8", "surrogateescape")
        if self._fields is None:
            return Sample(name, int(self._labels[i]))
        return Sample(name, int(self._labels[i]), self._fields[i])

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def name_bytes(self) -> list[bytes]:
        """Every name, UTF-8 encoded (see :func:`fastdata.records.name_bytes`), in order."""
        return self._names.slice_list(self._start, self._stop)

    @property
    def packed_names(self) -> PackedStrings:
        """The names, UTF-8 encoded, packed (a copy when this is a slice)."""
        if self._start == 0 and self._stop == len(self._names):
            return self._names
        data, offsets = self._names.buffer(self._start, self._stop)
        return PackedStrings.from_buffer(data.tobytes(), offsets)

    def select(self, keep: np.ndarray) -> Samples:
        """The samples ``keep`` marks (a bool per sample), packed anew."""
        data, offsets = self._names.buffer(self._start, self._stop)
        lengths = np.diff(offsets)
        kept = np.zeros(int(np.count_nonzero(keep)) + 1, dtype=np.int64)
        np.cumsum(lengths[keep], out=kept[1:])
        names = PackedStrings.from_buffer(data[np.repeat(keep, lengths)].tobytes(), kept)
        fields = None
        if self._fields is not None:
            fields = PackedStrings(
                [v for v, k in zip(self.field_bytes(), keep.tolist(), strict=True) if k]
            )
        return Samples(names, self.labels[keep].copy(), fields=fields)

    @property
    def has_fields(self) -> bool:
        return self._fields is not None

    def field_bytes(self) -> list[bytes]:
        """Every sample's encoded field values, in order (empty without fields)."""
        if self._fields is None:
            return []
        return self._fields.slice_list(self._start, self._stop)

    def joined_names(self, keep: np.ndarray | None = None) -> bytes:
        """The names (those ``keep`` marks, a bool per sample), UTF-8, joined by NUL bytes,
        built from the packed buffer without an object per name."""
        if keep is not None:
            return self.select(keep).joined_names()
        return self._names.joined(self._start, self._stop)

    @property
    def labels(self) -> np.ndarray:
        """The labels, in order (a read-only view)."""
        view = self._labels[self._start : self._stop]
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """Memory held by the names and labels."""
        return self._names.nbytes + self._labels.nbytes


class SampleBuilder:
    """Collects samples into the packed form, a folder at a time."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array("q")
        self._labels = array("i")
        self._fields: list[bytes] | None = None

    def add(self, name: str, label: int, fields: bytes | None = None) -> None:
        self._data += _encode(name)
        self._ends.append(len(self._data))
        self._labels.append(label)
        if fields is not None:
            if self._fields is None:
                self._fields = []
            self._fields.append(fields)

    def __len__(self) -> int:
        return len(self._labels)

    def build(self) -> Samples:
        offsets = np.zeros(len(self._ends) + 1, dtype=np.int64)
        offsets[1:] = np.frombuffer(self._ends, dtype=np.int64)
        names = PackedStrings.from_buffer(bytes(self._data), offsets)
        labels = np.frombuffer(self._labels, dtype=np.int32).copy()
        fields = None
        if self._fields is not None:
            if len(self._fields) != len(self._labels):
                raise ValueError("some samples were added with fields and some without")
            fields = PackedStrings(self._fields)
        return Samples(names, labels, fields=fields)


@dataclass(frozen=True)
class FolderScan:
    """What :func:`scan_folder` found.

    Attributes:
        root: the scanned folder.
        classes: class names, sorted.
        samples: every image, in deterministic order (by class, then by path), packed (see
            :class:`Samples`).
        skipped_files: files below the class folders that are not images (wrong extension).
        non_image_names: the first :data:`NAMED_NON_IMAGES` of them (relative paths).
        unusable: image files and folders that cannot be converted, with the reason (not a
            regular file, unreadable folder, path too long, a link to a folder scanned already).
        layout: ``"folder"`` (names are ``<class>/.../<image>``) or ``"manifest"`` (names are
            the paths a manifest gave, relative to its folder or absolute).
        source: what was scanned, links resolved: the folder, or the manifest file.
    """

    root: Path
    classes: list[str]
    samples: Samples
    skipped_files: int = 0
    unusable: list[SkippedFile] = field(default_factory=list)
    non_image_names: list[str] = field(default_factory=list)
    layout: str = "folder"
    source: str = ""
    schema: Schema = field(default_factory=Schema)
    """The fields every sample carries (manifest columns or keys, sidecar files); empty
    without."""
    sidecars: tuple[str, ...] = ()
    """The sidecar extensions read beside each image (``json``, ``txt``, ...)."""
    labelled: bool = True
    """Whether samples have classes (a manifest without labels has none: every label -1)."""
    unused_columns: tuple[str, ...] = ()
    """A CSV manifest's columns that are neither path, label nor a field (not stored)."""
    sidecars_seen: tuple[str, ...] = ()
    """Extensions (``json``, ``txt``, ``cls``) of files that sit beside an image under its
    name, in a folder scanned without ``sidecars``: its fields, it may be."""
    class_to_idx: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_to_idx", {c: i for i, c in enumerate(self.classes)})
        if not self.source:
            object.__setattr__(self, "source", os.path.realpath(self.root))

    def file_path(self, name: str) -> str:
        """The path of the file of the sample named ``name`` (relative to the root, or
        absolute), as a string: the conversion's hot path builds one per image."""
        return os.path.join(self.root, name) if os.sep == "/" else str(self.path_of_name(name))

    def path_of_name(self, name: str) -> Path:
        return Path(name) if name.startswith("/") else self.root.joinpath(*name.split("/"))

    def path_of(self, sample: Sample) -> Path:
        """Return the absolute path of a sample's file."""
        return self.path_of_name(sample.name)

    def fingerprint(self) -> str:
        """A digest of the sample list, so a resumed conversion can tell the folder is unchanged."""
        digest = hashlib.sha256()
        for name in self.classes:
            digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
        for sample in self.samples:
            digest.update(f"{sample.label}\0".encode() + _encode(sample.name) + b"\0")
        if self.schema:
            digest.update(repr(self.schema.to_list()).encode() + b"\0")
            for values in self.samples.field_bytes():
                digest.update(values + b"\0")
        return digest.hexdigest()


def checked_fields(
    samples: Samples, schema: Schema, unusable: list[SkippedFile], note: str = ""
) -> Samples:
    """Every sample's field values (JSON) checked against ``schema`` and kept in their
    canonical encoding; samples whose values do not fit are left out and added to ``unusable``,
    the reason followed by ``note``."""
    keep = np.ones(len(samples), dtype=bool)
    out: list[bytes] = []
    for i, (name, raw) in enumerate(zip(samples.name_bytes(), samples.field_bytes(), strict=True)):
        values, why = schema.check(json.loads(raw))
        if why is None and values is not None:
            out.append(canonical(values))
            continue
        keep[i] = False
        unusable.append(SkippedFile(name.decode("utf-8", "surrogateescape"), f"{why}{note}"))
    kept = samples if keep.all() else samples.select(keep)
    return Samples(kept.packed_names, kept.labels.copy(), fields=PackedStrings(out))
