"""Records as a full check reads them from the data file: two walks of the tree (the headers'
keys and the bytes' keys sort apart) side by side, with a place in each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .layout import record_key
from .pages import Leaves, Tree

__all__ = ["BLOCK_BYTES", "Walk", "in_place", "none_at"]


class Walk:
    """One walk's entries (:meth:`~.pages.tree.Tree.leaves`), with a place in
    them."""

    def __init__(self, tree: Tree, runs: Iterator[Leaves]) -> None:
        self.tree, self._runs = tree, runs
        self.run: Leaves | None = None
        self.at = 0
        self._next()

    def _next(self) -> None:
        self.run, self.at = next(self._runs, None), 0

    @property
    def key(self) -> bytes | None:
        """The key here (None: past the last)."""
        return None if self.run is None else self.run.keys[self.at]

    def value(self) -> bytes | memoryview | None:
        """The value here (None if its overflow pages are damaged)."""
        assert self.run is not None
        return self.tree.value(self.run, self.at)

    def values(self, n: int) -> list[bytes | memoryview | None]:
        """The values of the ``n`` entries from here, within this run; fewer where values on
        pages of their own reach :data:`BLOCK_BYTES`, and up to the first whose pages are
        damaged (None, last)."""
        run, a = self.run, self.at
        assert run is not None
        if np.max(run.firsts[a : a + n]) < 0:  # (all on their pages)
            buf = run.buf
            starts = np.asarray(run.starts[a : a + n])
            ends = (starts + np.asarray(run.sizes[a : a + n])).tolist()
            return [buf[s:e] for s, e in zip(starts.tolist(), ends, strict=True)]
        held = np.cumsum(np.asarray(run.sizes[a : a + n], np.int64))
        n = min(n, int(np.searchsorted(held, BLOCK_BYTES, side="left")) + 1)
        return self.tree.values(run, a, a + n)

    def skip(self, n: int) -> None:
        """Move on ``n`` entries (within this run)."""
        assert self.run is not None
        self.at += n
        if self.at >= len(self.run):
            self._next()


KEY_WIDTH = len(record_key(0))
"""A record's key: its index in decimal digits, of this many (a header's: ``#`` and those)."""
DIGITS = 10 ** np.arange(KEY_WIDTH - 1, -1, -1, dtype=np.int64)
BLOCK_BYTES = 64 << 20
"""A block of records with values on pages of their own holds at most about this many bytes of
them (plus one value)."""


def in_place(heads: Walk, datas: Walk, i: int, stop: int) -> int:
    """How many records from ``i`` (before ``stop``) the two walks hold next, in their places:
    record ``j``'s header under ``#`` + its key and its bytes under its key, one after the
    other, each walk within its run (0 where the next is not so)."""
    hr, dr = heads.run, datas.run
    if hr is None or dr is None or hr.rows is None or dr.rows is None:
        return 0
    if hr.rows.shape[1] != KEY_WIDTH + 1 or dr.rows.shape[1] != KEY_WIDTH or stop > 10**10:
        return 0
    n = min(len(hr) - heads.at, len(dr) - datas.at, stop - i)
    want = (np.arange(i, i + n, dtype=np.int64)[:, None] // DIGITS % 10 + 48).astype(np.uint8)
    head_keys = hr.rows[heads.at : heads.at + n]
    same = (dr.rows[datas.at : datas.at + n] == want).all(axis=1)
    same &= (head_keys[:, 1:] == want).all(axis=1) & (head_keys[:, 0] == ord("#"))
    return n if same.all() else int(same.argmin())


def none_at(values: list[Any]) -> int:
    """Where the first None is in values from :meth:`Walk.values` (it can only be last)."""
    return len(values) - 1 if values and values[-1] is None else len(values)
