"""What the benchmark scripts share: cold page caches and a work folder."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def evict(path: str | os.PathLike[str]) -> None:
    """Drop a file's pages from the page cache (pages this process has mapped stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_folder(root: str | os.PathLike[str]) -> None:
    """Drop every file below ``root`` from the page cache."""
    os.sync()
    for folder, _, files in os.walk(root):
        for name in files:
            evict(os.path.join(folder, name))


def add_workdir_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, help="where to build folders and stores")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")


@contextmanager
def workdir(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """``--workdir`` (kept), or a temporary folder removed at the end unless ``--keep``."""
    work = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
