"""LMDB's data file as fastdata meets it: what :mod:`.pages` finds (it reads and checks the file
without LMDB), turned into fastdata's errors, and the zeros a finished store keeps after its last
page."""

from __future__ import annotations

import os
import shlex

from ...errors import StoreDamagedError, StoreError
from .pages import (
    FormatError,
    Header,
    NotRegular,
    Tree,
    Truncated,
    Unreadable,
)
from .pages import check_file as check_pages_file

__all__ = ["SLACK", "check_file", "file_error", "open_tree", "pad", "walk"]

SLACK = 128 << 10
"""Zero bytes kept after the last page of a finished store: LMDB reading a damaged page near the
end of the file then reads zeros (and reports the page as corrupt) instead of faulting."""


def file_error(path: str, exc: FormatError) -> StoreError:
    """What :mod:`.pages` found wrong with the data file at ``path``, as a fastdata error."""
    if isinstance(exc, NotRegular):
        return StoreError(f"{path}: not a regular file, so not an LMDB data file")
    if isinstance(exc, Unreadable):
        return StoreError(f"{path}: cannot read: {exc.reason}")
    if isinstance(exc, Truncated):
        return StoreError(
            f"{path}: the file is truncated: {exc.size} bytes, but its last page ends at byte "
            f"{exc.end} (an interrupted copy or a full disk); copy or convert the store again"
        )
    return StoreDamagedError(f"{path}: damaged LMDB file: {exc.reason}", store=shlex.quote(path))


def check_file(path: str, *, for_lmdb: bool = False) -> Header:
    """The data file's header, checked against its size before anything maps it (see
    :func:`.pages.check_file`).

    Raises:
        StoreError: unreadable, not an LMDB file, truncated, or damaged.
    """
    try:
        return check_pages_file(path, for_lmdb=for_lmdb)
    except FormatError as exc:
        raise file_error(path, exc) from None


def open_tree(path: str, *, limit: int = 100) -> Tree:
    """The data file's B-tree, for a walk that checks every page (:class:`.pages.Tree`).

    Raises:
        StoreError: the file's header is damaged or the file is truncated.
    """
    try:
        return Tree(path, limit=limit)
    except FormatError as exc:
        raise file_error(path, exc) from None


def walk(path: str, *, limit: int = 100) -> list[str]:
    """What is wrong with the pages of the data file at ``path`` (at most ``limit`` pages).

    Raises:
        StoreError: the file's header is damaged or the file is truncated (nothing to walk).
    """
    with open_tree(path, limit=limit) as tree:
        for _ in tree.entries(values=False):
            pass
        return [str(d) for d in tree.damage]


def pad(path: str) -> None:
    """Make sure :data:`SLACK` zero bytes follow the last page (a sparse extension)."""
    head = check_file(path)
    want = head.used_bytes + SLACK
    if os.path.getsize(path) < want:
        os.truncate(path, want)
