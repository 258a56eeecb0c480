"""One open LMDB environment, as the registry (``env.py``) keeps it: the environment, the data
file it maps (device and inode, the span of this process's map, its size), and a reader's
append epoch and guard past the end of the file."""

from __future__ import annotations

import mmap
import os
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import lmdb

from ...errors import StoreError
from . import guard

__all__ = ["Entry"]


@dataclass(eq=False)
class Entry:
    key: tuple[int, int]
    path: str
    env: Any
    writable: bool
    span: tuple[int, int] | None
    """Addresses of the data file's bytes in this process's map (Linux), for value checks."""
    size: int
    fd: int | None = None
    """The data file, open for read-ahead requests (readers only)."""
    refs: int = 0
    epoch_map: mmap.mmap | None = None
    epoch_view: memoryview | None = None
    """The append epoch (see "the append epoch" in ``env.py``), mapped (readers only)."""
    covered: int = 0
    """Where the zeros covering the map past the file's end begin (NOTE [ Past the end of the
    file ] in ``guard.py``); 0: nothing is covered."""
    map_end: int = 0
    leaves: Any = None
    """The tree's pages that LMDB meets on its way to a key, checked (``leaves.Leaves``: the
    branches when the file was opened, a leaf when a key under it is first wanted): LMDB is
    never asked for a key under a damaged one (NOTE [ Damaged branches ] in ``lease.py``).
    None in a writer's environment."""

    def damage_of(
        self, keys: Any, more: int = 0, ahead: bool = False, cold: bool = True
    ) -> list[Any]:
        """For each of ``keys``, the damaged page LMDB would meet on its way to it (None:
        none), as the tree is now (its checks begun again after an append); ``more``: other
        leaves not read yet to check beside them, of those in memory."""
        leaves = self.leaves
        if leaves is None:
            return [None] * len(keys)
        epoch = self.epoch()
        if leaves.epoch != epoch:  # (an append wrote new branches and leaves)
            from .leaves import Leaves

            fresh = Leaves(leaves.data_file, epoch)
            leaves.close()
            self.leaves = leaves = fresh
        mapped = self.span[0] if self.span is not None else None
        return leaves.damage_of(keys, more, mapped, ahead, cold)

    def epoch(self) -> int:
        """The append epoch now; -1 in a writer's environment."""
        view = self.epoch_view
        return -1 if view is None else int(view[0])

    def larger_now(self) -> bool:
        """Whether the data file is larger than when its bounds were last taken, looked at
        only (:meth:`grown` takes the new bounds, once)."""
        if self.fd is None:
            return False
        try:
            return os.fstat(self.fd).st_size > self.size
        except OSError:
            return False

    def grown(self) -> bool:
        """Whether the data file grew since it was opened (an append); if so, the bounds that
        values are checked against are updated (NOTE [ Past the end of the file ], rule 5)."""
        if self.fd is None:
            return False
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return False
        if size <= self.size:
            return False
        if self.span is not None:
            if self.covered:
                covered = guard.uncover(self.span[0], self.covered, self.map_end, size, self.fd)
                if covered is None:
                    raise StoreError(
                        f"{self.path}: the store grew and its new part could not be mapped; "
                        "open the dataset again"
                    )
                self.covered = covered
            self.span = (self.span[0], self.span[0] + min(size, self.map_length))
        self.size = size
        return True

    def cover(self) -> None:
        """Cover the map past the end of the file with zeros (NOTE [ Past the end of the file
        ], rule 2)."""
        if self.span is None or self.writable:
            return
        got = guard.cover(self.span[0], self.size, self.map_length)
        if got is not None:
            self.covered, self.map_end = got

    @property
    def map_length(self) -> int:
        info = self.env.info()
        return int(info["map_size"])

    def close(self) -> None:
        if self.leaves is not None:
            self.leaves.close()
            self.leaves = None
        with suppress(lmdb.Error):
            self.env.close()
        if self.epoch_view is not None:
            self.epoch_view.release()
            self.epoch_view = None
        if self.epoch_map is not None:
            self.epoch_map.close()
            self.epoch_map = None
        if self.fd is not None:
            with suppress(OSError):
                os.close(self.fd)
            self.fd = None
