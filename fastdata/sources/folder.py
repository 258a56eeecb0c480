"""Scan an ImageFolder tree (``root/<class>/.../<image>``) into samples and classes, and read
its files safely (:func:`read_file`: no FIFO waited on, no size trusted).

The result matches what ``torchvision.datasets.ImageFolder`` sees: classes are the sorted names of
the root's immediate subfolders, images are found recursively below each of them (links to folders
followed, each folder once), and the order is deterministic. Hidden files and folders (names
starting with ``.``) are skipped.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from ..errors import SourceError, option
from ..fields import (
    Field,
    Schema,
    SchemaBuilder,
    canonical,
    check_name,
    parse_text_value,
    unique_keys,
)
from ..packed import PackedStrings
from ..records import SkippedFile

__all__ = ["IMG_EXTENSIONS", "FolderScan", "Sample", "Samples", "read_file", "scan_folder"]

NAMED_NON_IMAGES = 20
"""Non-image files named in a scan (the rest are counted)."""

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


class _SampleBuilder:
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


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def os_reason(exc: OSError, what: str = "unreadable") -> str:
    """A short reason for a file or folder that could not be used."""
    if exc.errno == errno.ENAMETOOLONG:
        return "path too long for the operating system"
    if exc.errno == errno.ELOOP:
        return "a link loop"
    if exc.errno == errno.ENOENT:
        return "vanished, or a broken link"
    return f"{what}: {exc.strerror or exc}"


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_file(path: str, limit: int, raise_with: str = "--max-file-size") -> bytes | str:
    """The bytes of the regular file at ``path``, or why it cannot be used.

    The file is opened without blocking (a FIFO would wait forever for a writer) and checked with
    ``fstat`` before anything is read: FIFOs, sockets and devices, directly or through a link, are
    refused, and so is a file over ``limit`` bytes (the reason ends with ``raise_with``, what
    raises the limit); no more than ``limit`` bytes are ever read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return os_reason(exc)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({file_kind(st.st_mode)})"
        if st.st_size > limit:
            return _too_large(st.st_size, limit, raise_with)
        # One read of what fstat said plus one byte: a regular file that gives exactly its size
        # has ended (os.read allocates what it asks for, so never more than the limit + 1).
        data = os.read(fd, st.st_size + 1)
        if len(data) != st.st_size:  # it grew or shrank since, or the file system reads short
            data = _read_rest(fd, data, limit)
    except OSError as exc:
        return os_reason(exc)
    finally:
        os.close(fd)
    if len(data) > limit:
        return _too_large(len(data), limit, raise_with)
    return data


def _read_rest(fd: int, first: bytes, limit: int) -> bytes:
    """``first`` and what follows it in ``fd`` up to its end or ``limit + 1`` bytes in all."""
    parts, total = [first], len(first)
    while first and total <= limit:
        first = os.read(fd, min(limit + 1 - total, 1 << 24))
        parts.append(first)
        total += len(first)
    return b"".join(parts)


def _too_large(size: int, limit: int, raise_with: str) -> str:
    return f"too large ({size} bytes; the limit is {limit}: {raise_with})"


class _Walk:
    """An iterative walk of class folders: links to folders are followed, every folder is
    scanned once (by device and inode), any depth; what cannot be used is listed, not dropped."""

    def __init__(self, root: Path, classes: list[str], sidecars: Sequence[str] = ()) -> None:
        self.root = root
        self.sidecar_suffixes = tuple(f".{ext}" for ext in sidecars)
        self.unusable: list[SkippedFile] = []
        self.non_images = 0
        self.non_image_names: list[str] = []
        self.seen: dict[tuple[int, int], str] = {}
        for name in ["", *classes]:  # a link back to the root or to a class is a loop
            st = os.stat(root / name) if name else os.stat(root)
            self.seen.setdefault((st.st_dev, st.st_ino), name or ".")

    def folders(self, cls: str) -> list[tuple[str, list[os.DirEntry[str]]]]:
        """``(relative path, file entries)`` of every folder under class ``cls``."""
        out = []
        stack = [(str(self.root / cls), cls, True)]
        while stack:
            path, rel, is_class = stack.pop()
            if not is_class:
                try:
                    st = os.stat(path)
                except OSError as exc:
                    self.unusable.append(
                        SkippedFile(rel + "/", os_reason(exc, "unreadable folder"))
                    )
                    continue
                key = (st.st_dev, st.st_ino)
                if key in self.seen:
                    self.unusable.append(
                        SkippedFile(
                            rel + "/",
                            f"a link to a folder scanned already ({self.seen[key]}): its images "
                            "are converted once",
                        )
                    )
                    continue
                self.seen[key] = rel
            try:
                with os.scandir(path) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                self.unusable.append(SkippedFile(rel + "/", os_reason(exc, "unreadable folder")))
                continue
            files = []
            for entry in entries:
                if _is_hidden(entry.name):
                    continue
                try:
                    is_dir = entry.is_dir()  # follows links
                except OSError:
                    is_dir = False
                if is_dir:
                    stack.append((entry.path, f"{rel}/{entry.name}", False))
                else:
                    files.append(entry)
            out.append((rel, files))
        return out

    def image(self, rel: str, entry: os.DirEntry[str]) -> bool:
        """Whether ``entry`` is an image to convert; a non-image is counted, an image that is not
        a regular file (a FIFO, a device, a broken link, directly or through a link) is listed."""
        if not entry.name.lower().endswith(IMG_EXTENSIONS):
            if self.sidecar_suffixes and entry.name.endswith(self.sidecar_suffixes):
                return False  # read with its image
            self.non_images += 1
            if len(self.non_image_names) < NAMED_NON_IMAGES:
                self.non_image_names.append(f"{rel}/{entry.name}")
            return False
        name = f"{rel}/{entry.name}"
        try:
            if entry.is_file():  # follows links
                return True
            mode = entry.stat().st_mode
        except OSError as exc:
            self.unusable.append(SkippedFile(name, os_reason(exc)))
            return False
        self.unusable.append(SkippedFile(name, f"not a regular file ({file_kind(mode)})"))
        return False


def scan_folder(
    root: str | os.PathLike[str],
    *,
    sidecars: Sequence[str] = (),
    fields: Sequence[Field] = (),
    closed: bool = False,
) -> FolderScan:
    """Scan ``root/<class>/...`` for images.

    With ``sidecars`` (extensions: ``json``, ``txt``, ...), each image ``x.jpg`` carries fields
    from the files beside it, WebDataset's way: ``x.json`` holds an object whose keys are fields,
    ``x.txt`` (any other extension) a UTF-8 string, the field named by the extension. An image
    whose sidecar is missing, unreadable or of another type than the others' is listed as
    unusable with the reason. ``fields`` declares types (``fastdata.fields.parse_field_specs``);
    the others are inferred from the values (``fastdata.fields.SchemaBuilder``; with
    ``closed`` there are no others: an image whose sidecar gives another field is unusable).

    Only the folder tree is read; files are not opened. Links to folders are followed, each folder
    is scanned once (a link loop neither repeats images nor hangs), at any depth. Image files that
    cannot be used (not regular files, in unreadable folders, paths too long) are listed in
    ``FolderScan.unusable`` with their reason.

    Args:
        root: the folder whose immediate subfolders are the classes.

    Returns:
        The classes and samples, sorted, with the count of non-image files skipped.

    Raises:
        SourceError: the root does not exist, is not a folder, has no class folders, or holds no
            images.
    """
    root_path = Path(root).expanduser()
    if not root_path.exists():
        raise SourceError(f"{root_path}: no such folder; give the root of an image folder tree")
    if not root_path.is_dir():
        raise SourceError(f"{root_path}: not a folder; give the root of an image folder tree")
    try:
        with os.scandir(root_path) as it:
            classes = sorted(
                entry.name for entry in it if not _is_hidden(entry.name) and _is_dir(entry)
            )
    except OSError as exc:
        raise SourceError(f"{root_path}: {os_reason(exc, 'cannot read the folder')}") from None
    if not classes:
        raise SourceError(
            f"{root_path}: no class folders found; images must be laid out as "
            f"{root_path}/<class>/<image>"
        )
    sidecars = _sidecar_list(sidecars)
    walk = _Walk(root_path, classes, sidecars)
    samples = _SampleBuilder()
    side = _Sidecars(sidecars, fields, closed) if sidecars else None
    seen: set[str] = set()
    for label, cls in enumerate(classes):
        # Sorted by folder path, then file name: the order ImageFolder produces.
        for rel, entries in sorted(walk.folders(cls), key=lambda f: f[0]):
            names = {e.name for e in entries} if side is not None else set()
            if side is None and len(seen) < len(SIDECAR_HINTS):
                seen |= _beside_images(entries)
            for entry in entries:
                if walk.image(rel, entry):
                    name = f"{rel}/{entry.name}"
                    if side is None:
                        samples.add(name, label)
                        continue
                    raw = side.read(entry.path, name, names)
                    if isinstance(raw, str):
                        walk.unusable.append(SkippedFile(name, raw))
                    else:
                        samples.add(name, label, raw)
    if not len(samples) and not walk.unusable:
        raise SourceError(
            f"{root_path}: no images found in its {len(classes)} class folder(s); "
            f"accepted extensions: {' '.join(IMG_EXTENSIONS)}"
        )
    built = samples.build()
    schema = Schema()
    if side is not None and len(built):
        schema = side.builder.build(f"{root_path} (--sidecars {','.join(sidecars)})")
        if schema or closed:  # (closed and none: any field a sidecar gives is one too many)
            built = checked_fields(built, schema, walk.unusable)
        if not schema:  # (every sidecar an empty object: no fields, and none in the records)
            built = Samples(built.packed_names, built.labels.copy())
    if not len(built):
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in walk.unusable[:3])
        raise SourceError(
            f"{root_path}: no usable image in its {len(classes)} class folder(s) ({reasons})"
        )
    return FolderScan(
        root_path,
        classes,
        built,
        walk.non_images,
        walk.unusable,
        walk.non_image_names,
        schema=schema,
        sidecars=tuple(sidecars),
        sidecars_seen=tuple(sorted(seen)),
    )


MAX_SIDECAR_BYTES = 1 << 20
"""A sidecar file larger than this makes its image unusable (nothing larger is read)."""
SIDECAR_LIMIT = "a sidecar holds at most 1 MiB; keep larger values in files of their own"


SIDECAR_HINTS = ("json", "txt", "cls")


def _beside_images(entries: list[os.DirEntry[str]]) -> set[str]:
    """The extensions of :data:`SIDECAR_HINTS` that a file named like an image has here."""
    stems = {e.name.rpartition(".")[0] for e in entries if e.name.lower().endswith(IMG_EXTENSIONS)}
    found = set()
    for e in entries:
        stem, _, ext = e.name.rpartition(".")
        if ext in SIDECAR_HINTS and stem in stems:
            found.add(ext)
    return found


def _sidecar_list(sidecars: Sequence[str]) -> list[str]:
    out: list[str] = []
    for ext in sidecars:
        ext = ext.strip().lstrip(".")
        if not ext:
            continue
        if f".{ext.lower()}" in IMG_EXTENSIONS:
            raise SourceError(
                option("sidecars", None), f": {ext!r} is an image extension, not a sidecar's"
            )
        if ext != "json":
            why = check_name(ext, "--sidecars")
            if why is not None:
                raise SourceError(why)
        if ext not in out:
            out.append(ext)
    return out


class _Sidecars:
    """Reads the sidecar files of each image into its raw field values (JSON text, checked
    against the schema once every image has been seen: see :func:`checked_fields`)."""

    def __init__(self, sidecars: list[str], declared: Sequence[Field], closed: bool) -> None:
        self.sidecars = sidecars
        self.builder = SchemaBuilder(declared, closed)
        self.typed = {f.name: f for f in declared if f.type != "str"}
        """Text sidecars declared of another type (``--fields cls:int``): parsed as such."""

    def read(self, image_path: str, name: str, siblings: set[str]) -> bytes | str:
        base = os.path.basename(image_path).rpartition(".")[0]
        folder = os.path.dirname(image_path)
        values: dict[str, Any] = {}
        for ext in self.sidecars:
            file = f"{base}.{ext}"
            if file not in siblings:
                if os.path.isdir(os.path.join(folder, file)):
                    return f"its sidecar {file} is a folder, not a file"
                return f"its sidecar {file} is missing (--sidecars {','.join(self.sidecars)})"
            data = read_file(os.path.join(folder, file), MAX_SIDECAR_BYTES, SIDECAR_LIMIT)
            if isinstance(data, str):
                return f"its sidecar {file}: {data}"
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"its sidecar {file} is not valid UTF-8 (byte {exc.start})"
            if ext != "json":
                if ext in values:
                    return f"field {ext!r} comes from {file} and from {base}.json"
                typed = self.typed.get(ext)
                if typed is None:
                    values[ext] = text
                    continue
                value, why = parse_text_value(typed, text.removeprefix("\ufeff"))
                if why is not None:
                    return f"its sidecar {file}: {why}"
                values[ext] = value
                continue
            try:
                obj = json.loads(text.removeprefix("\ufeff"), object_pairs_hook=unique_keys)
            except (ValueError, RecursionError) as exc:
                return f"its sidecar {file} is not valid JSON ({type(exc).__name__}: {exc})"
            if not isinstance(obj, dict):
                return f"its sidecar {file} does not hold a JSON object"
            for key, value in obj.items():
                why = check_name(key, file)
                if why is not None:
                    return why
                if key in values:
                    return f"field {key!r} comes from {file} and from {base}.{key}"
                values[key] = value
        self.builder.see(values, name)
        return json.dumps(values).encode("utf-8", "surrogatepass")


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


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
