"""Many byte strings kept as one buffer and an offsets array.

A numpy array of ``bytes_`` takes the width of its longest entry for every entry: one absurdly
long path in an index of a million makes it gigabytes. Here memory is what the strings hold plus
8 bytes each, and nothing per entry is a Python object (workers get one buffer, not a list).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["PackedStrings"]


class PackedStrings:
    """An immutable sequence of byte strings, packed."""

    def __init__(self, items: Sequence[bytes]) -> None:
        lengths = np.fromiter((len(b) for b in items), dtype=np.int64, count=len(items))
        self._offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._offsets[1:])
        self._data = b"".join(items)

    @classmethod
    def from_buffer(cls, data: bytes, offsets: np.ndarray) -> PackedStrings:
        """Strings already packed: ``data`` and ``len + 1`` ascending offsets into it."""
        self = cls.__new__(cls)
        self._data, self._offsets = data, np.asarray(offsets, dtype=np.int64)
        return self

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> bytes:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self._data[self._offsets[index] : self._offsets[index + 1]]

    def buffer(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Entries ``start .. stop-1`` as one uint8 array and their ``stop - start + 1`` offsets
        into it (views where possible)."""
        lo, hi = int(self._offsets[start]), int(self._offsets[stop])
        data = np.frombuffer(self._data, dtype=np.uint8)[lo:hi]
        return data, self._offsets[start : stop + 1] - lo

    def slice_list(self, start: int, stop: int) -> list[bytes]:
        """Entries ``start .. stop-1`` as a list (one pass, no per-entry bounds checks)."""
        data, ends = self._data, self._offsets[start : stop + 1].tolist()
        return [data[a:b] for a, b in itertools.pairwise(ends)]

    @property
    def nbytes(self) -> int:
        """Memory held: the strings and their offsets."""
        return len(self._data) + self._offsets.nbytes
