"""Storage backends. :func:`open_store` picks one from a path or URI."""

from __future__ import annotations

import os

from .base import StoreReader, StoreWriter

__all__ = ["StoreReader", "StoreWriter", "open_store", "open_writer"]


def open_store(target: str | os.PathLike[str], *, allow_pickle: bool = False) -> StoreReader:
    """Open the store at ``target`` (an LMDB path) for reading."""
    from .lmdb_store import open_lmdb

    return open_lmdb(target, allow_pickle=allow_pickle)


def open_writer(target: str | os.PathLike[str] | StoreWriter) -> StoreWriter:
    """A writer for ``target``: an LMDB folder path, or a writer given as it is."""
    if isinstance(target, StoreWriter):
        return target
    from .lmdb_store import LMDBWriter

    return LMDBWriter(target)
