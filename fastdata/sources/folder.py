"""Scan an ImageFolder tree (``root/<class>/.../<image>``) into samples and classes (the files
themselves are read later, by :func:`fastdata.sources.reading.read_file`; sidecars by
:mod:`fastdata.sources.sidecars`).

The result matches what ``torchvision.datasets.ImageFolder`` sees: classes are the sorted names of
the root's immediate subfolders, images are found recursively below each of them (links to folders
followed, each folder once), and the order is deterministic. Hidden files and folders (names
starting with ``.``) are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import SourceError
from ..fields import Field, Schema
from ..records import SkippedFile
from .reading import file_kind, os_reason
from .samples import IMG_EXTENSIONS, FolderScan, SampleBuilder, Samples, checked_fields
from .sidecars import SIDECAR_HINTS, Sidecars, beside_images, sidecar_list

__all__ = ["NAMED_NON_IMAGES", "scan_folder"]

NAMED_NON_IMAGES = 20
"""Non-image files named in a scan (the rest are counted)."""


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


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
    the others are inferred from the values (``fastdata.field_inference.SchemaBuilder``; with
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
    sidecars = sidecar_list(sidecars)
    walk = _Walk(root_path, classes, sidecars)
    samples = SampleBuilder()
    side = Sidecars(sidecars, fields, closed) if sidecars else None
    seen: set[str] = set()
    for label, cls in enumerate(classes):
        # Sorted by folder path, then file name: the order ImageFolder produces.
        for rel, entries in sorted(walk.folders(cls), key=lambda f: f[0]):
            names = {e.name for e in entries} if side is not None else set()
            if side is None and len(seen) < len(SIDECAR_HINTS):
                seen |= beside_images(entries)
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


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False
