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
    def from_joined(cls, joined: bytes, separator: int = 0) -> PackedStrings:
        """Strings joined by a separator byte (that none of them holds), packed without it."""
        if not joined:
            return cls([])
        raw = np.frombuffer(joined, dtype=np.uint8)
        cuts = np.flatnonzero(raw == separator)
        offsets = np.empty(len(cuts) + 2, dtype=np.int64)
        offsets[0] = 0
        offsets[1:-1] = cuts - np.arange(len(cuts))
        offsets[-1] = len(raw) - len(cuts)
        return cls.from_buffer(np.delete(raw, cuts).tobytes(), offsets)

    def joined(self, start: int = 0, stop: int | None = None, separator: int = 0) -> bytes:
        """Entries ``start .. stop-1`` joined by a separator byte (no object per entry)."""
        data, offsets = self.buffer(start, len(self) if stop is None else stop)
        if len(offsets) <= 2:
            return data.tobytes()
        return np.insert(data, offsets[1:-1], separator).tobytes()

    _hashes: np.ndarray | None = None

    def hashes(self) -> np.ndarray:
        """Python's ``hash`` of every entry, as one int64 array (built a slice at a time, once:
        a store's names are looked up several times in one append or one check)."""
        if self._hashes is None:
            out = np.empty(len(self), dtype=np.int64)
            step = 1 << 16
            for start in range(0, len(self), step):
                part = self.slice_list(start, min(len(self), start + step))
                out[start : start + len(part)] = [hash(b) for b in part]
            out.setflags(write=False)
            self._hashes = out
        return self._hashes

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

    def take(self, indices: np.ndarray) -> list[bytes]:
        """The entries at ``indices`` (in range), as a list."""
        data = self._data
        starts = self._offsets[indices].tolist()
        ends = self._offsets[np.asarray(indices) + 1].tolist()
        return [data[a:b] for a, b in zip(starts, ends, strict=True)]

    def slice_list(self, start: int, stop: int) -> list[bytes]:
        """Entries ``start .. stop-1`` as a list (one pass, no per-entry bounds checks)."""
        data, ends = self._data, self._offsets[start : stop + 1].tolist()
        return [data[a:b] for a, b in itertools.pairwise(ends)]

    @property
    def nbytes(self) -> int:
        """Memory held: the strings and their offsets."""
        return len(self._data) + self._offsets.nbytes

    def find(self, wanted: PackedStrings) -> np.ndarray:
        """For each entry of ``wanted``, its index here (the first, if it is here twice), or -1:
        matched by hash in one sorted array (8 bytes an entry, no object per entry held) and
        confirmed byte for byte."""
        out = np.full(len(wanted), -1, dtype=np.int64)
        if not len(self) or not len(wanted):
            return out
        keys = self.hashes()
        order = np.argsort(keys, kind="stable")
        ranked = keys[order]
        probes = wanted.hashes()
        at = np.minimum(np.searchsorted(ranked, probes), len(ranked) - 1)
        step = 1 << 16
        for lo in range(0, len(wanted), step):
            hi = min(len(wanted), lo + step)
            hits = lo + np.flatnonzero(ranked[at[lo:hi]] == probes[lo:hi])
            names = wanted.take(hits)
            firsts = self.take(order[at[hits]])
            for i, name, first in zip(hits.tolist(), names, firsts, strict=True):
                if first == name:
                    out[i] = order[at[i]]
                    continue
                k = int(at[i]) + 1  # another entry with the same hash: look on
                while k < len(ranked) and ranked[k] == probes[i]:
                    if self[int(order[k])] == name:
                        out[i] = order[k]
                        break
                    k += 1
        return out

    def repeats(self) -> np.ndarray:
        """For each entry, the index of the first entry equal to it (its own index when it is
        the first): one sort by hash, entries whose hashes meet compared byte for byte, each
        group of equal hashes in one pass (O(n log n) however many entries repeat)."""
        n = len(self)
        first = np.arange(n, dtype=np.int64)
        if n < 2:
            return first
        keys = self.hashes()
        order = np.argsort(keys, kind="stable")  # equal hashes stay in index order
        ranked = keys[order]
        starts = np.flatnonzero(np.diff(ranked) != 0) + 1
        bounds = np.concatenate([[0], starts, [n]])
        sizes = np.diff(bounds)
        for g in np.flatnonzero(sizes > 1).tolist():
            members = order[bounds[g] : bounds[g + 1]].tolist()
            seen: dict[bytes, int] = {}
            for i in members:
                first[i] = seen.setdefault(self[i], i)
        return first
