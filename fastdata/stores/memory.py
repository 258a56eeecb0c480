"""A reader over records held in memory: a store's metadata and labels, and its bytes if any
(for tests and for datasets built without a store)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..records import Record, RecordHeader, StoreMeta
from .reader import StoreReader

__all__ = ["MemoryReader"]


class MemoryReader(StoreReader):
    """A reader over records held in memory, built from metadata and labels (and, optionally,
    the records' bytes): the seam for code and tests that need a reader without a store.

    Args:
        meta: the store's metadata (its ``count`` and ``classes``).
        labels: one label per record.
        data: each record's bytes; by default ``b"x"`` for every record.
    """

    location = "memory"
    has_checksums = False

    def __init__(self, meta: StoreMeta, labels: Any, data: Sequence[bytes] | None = None) -> None:
        import numpy as np

        self._meta = meta
        self._labels = np.asarray(labels, dtype=np.int64)
        self._data = data
        self._opened(meta)
        self.reads = 0
        """How many times records were read (one per ``read_samples`` call)."""

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        self.reads += 1  # (no checksums: nothing to check)
        idx = self.check_indices(indices)
        return [(self._bytes(i), int(self._labels[i])) for i in idx]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from .. import records

        self.reads += 1
        out = []
        for i in self.check_indices(indices):
            data = self._bytes(i)
            header = RecordHeader(
                f"{i}", int(self._labels[i]), len(data), records.checksum(data), "unknown"
            )
            out.append(Record(i, header, data))
        return out

    def _bytes(self, i: int) -> bytes:
        return b"x" if self._data is None else bytes(self._data[i])

    def close(self) -> None:
        return None
