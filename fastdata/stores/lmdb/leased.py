"""The base of every reader of an LMDB file: a share of this process's environment (a lease),
taken on first use in each process, dropped when pickled (NOTE [ Checked once ] in ``env.py``)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..reader import StoreReader
from .env import data_path, open_reader
from .layout import (
    FOREIGN_KEYS_NAMED,
    appended_run,
    foreign_keys,
    miscounted,
    records_problem,
    said_foreign,
)
from .lease import Lease
from .look import interrupted_notes, peek
from .pages import Tree

__all__ = ["LeasedReader"]


class LeasedReader(StoreReader):
    """A reader that holds a share of this process's environment, taken on first use in each
    process, dropped when pickled, given back when closed or garbage-collected."""

    path: str
    _lease: Lease | None

    @contextmanager
    def sequential(self) -> Iterator[None]:
        with self._env().sequential():
            yield

    def _env(self) -> Lease:
        lease = self._lease
        if lease is None or not lease.usable:
            lease = open_reader(self.path)
            try:
                self._check_identity(lease)
            except BaseException:
                lease.release()
                raise
            self._lease = lease
        return lease

    def record_check(self) -> str | None:
        lease = self._env()
        entries = int(lease.env.stat()["entries"])
        count = self.meta.count
        return lease.read(lambda txn: records_problem(txn, entries, count, exact=False), self.path)

    def foreign_content(self) -> list[str]:
        lease = self._env()
        entries = int(lease.env.stat()["entries"])
        count, skipped = self.meta.count, self.meta.skipped_count
        _, pending, _ = peek(self.path)  # (its records and skipped entries are fastdata's)
        if pending is not None and not pending.source:  # (an append whose progress is
            # damaged: the indices past the store up to the first gap are its own)
            count, skipped = lease.read(lambda txn: appended_run(txn, count, skipped), self.path)
        elif pending is not None:
            count, skipped = max(count, pending.next_index), max(skipped, len(pending.skipped))
        found = lease.read(lambda txn: miscounted(txn, entries, self.meta.count), self.path)
        keys = lease.read(lambda txn: foreign_keys(txn, entries, count, skipped), self.path)
        if keys:  # (a named database is a key of the main tree too: the full check names it)
            named = self._named_databases(keys[: 2 * FOREIGN_KEYS_NAMED])
            keys = [k for k in keys if k not in named]
        return ([found] if found else []) + said_foreign(keys, count)

    def _named_databases(self, keys: list[bytes]) -> set[bytes]:
        """Those of ``keys`` that are named databases (another tool's), as the file's tree
        marks them: each looked up down the tree, without LMDB."""
        with Tree(data_path(self.path)) as tree:
            for key in keys:
                for _ in tree.entries(key, key + b"\0"):
                    pass
            return {name for name, _ in tree.databases}

    def interrupted(self) -> list[str]:
        """An unfinished append in the store, or a replacement left in ``.replacement/``."""
        return interrupted_notes(self.path)

    @property
    def command_target(self) -> str:
        return shlex.quote(os.path.abspath(self.path))

    def _check_identity(self, lease: Lease) -> None:
        """Raise StoreReplacedError when ``lease`` is not the store this reader opened."""

    def close(self) -> None:
        """Release this process's share of the environment; the next read takes it again."""
        lease, self._lease = self._lease, None
        if lease is not None and lease.usable:
            lease.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lease"] = None
        return state
