"""Scan an ImageFolder tree (``root/<class>/.../<image>``) into samples and classes.

The result matches what ``torchvision.datasets.ImageFolder`` sees: classes are the sorted names of
the root's immediate subfolders, images are found recursively below each of them, and the order is
deterministic. Hidden files and folders (names starting with ``.``) are skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SourceError

__all__ = ["IMG_EXTENSIONS", "FolderScan", "Sample", "scan_folder"]

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
    """

    name: str
    label: int


@dataclass(frozen=True)
class FolderScan:
    """What :func:`scan_folder` found.

    Attributes:
        root: the scanned folder.
        classes: class names, sorted.
        samples: every image, in deterministic order (by class, then by path).
        skipped_files: files below the class folders that are not images (wrong extension).
    """

    root: Path
    classes: list[str]
    samples: list[Sample]
    skipped_files: int = 0
    class_to_idx: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_to_idx", {c: i for i, c in enumerate(self.classes)})

    def path_of(self, sample: Sample) -> Path:
        """Return the absolute path of a sample's file."""
        return self.root.joinpath(*sample.name.split("/"))

    def fingerprint(self) -> str:
        """A digest of the sample list, so a resumed conversion can tell the folder is unchanged."""
        digest = hashlib.sha256()
        for name in self.classes:
            digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
        for sample in self.samples:
            digest.update(f"{sample.label}\0{sample.name}\0".encode("utf-8", "surrogateescape"))
        return digest.hexdigest()


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _walk(top: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        dirnames[:] = [d for d in dirnames if not _is_hidden(d)]
        yield dirpath, dirnames, filenames


def scan_folder(root: str | os.PathLike[str]) -> FolderScan:
    """Scan ``root/<class>/...`` for images.

    Args:
        root: the folder whose immediate subfolders are the classes.

    Returns:
        The classes and samples, sorted, with the count of non-image files skipped.

    Raises:
        SourceError: the root does not exist, is not a folder, has no class folders, or holds no
            images.
    """
    root_path = Path(root)
    if not root_path.exists():
        raise SourceError(f"{root_path}: no such folder; give the root of an image folder tree")
    if not root_path.is_dir():
        raise SourceError(f"{root_path}: not a folder; give the root of an image folder tree")
    classes = sorted(
        entry.name
        for entry in os.scandir(root_path)
        if entry.is_dir() and not _is_hidden(entry.name)
    )
    if not classes:
        raise SourceError(
            f"{root_path}: no class folders found; images must be laid out as "
            f"{root_path}/<class>/<image>"
        )
    samples: list[Sample] = []
    skipped = 0
    for label, cls in enumerate(classes):
        # Sorted by directory path, then file name: the order ImageFolder produces.
        walked = sorted(
            (dirpath, filenames) for dirpath, dirnames, filenames in _walk(root_path / cls)
        )
        for dirpath, filenames in walked:
            rel_dir = Path(dirpath).relative_to(root_path).as_posix()
            for fname in sorted(filenames):
                if _is_hidden(fname):
                    continue
                if fname.lower().endswith(IMG_EXTENSIONS):
                    samples.append(Sample(f"{rel_dir}/{fname}", label))
                else:
                    skipped += 1
    if not samples:
        raise SourceError(
            f"{root_path}: no images found in its {len(classes)} class folder(s); "
            f"accepted extensions: {' '.join(IMG_EXTENSIONS)}"
        )
    return FolderScan(root_path, classes, samples, skipped)
