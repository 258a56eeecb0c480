"""What every backend provides: a writer that commits batches and writes metadata last, and a
reader that fetches records by index. Converters, datasets and the CLI talk only to these."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from ..records import Progress, Record, StoreMeta

if TYPE_CHECKING:
    import numpy as np

__all__ = ["StoreReader", "StoreWriter"]


class StoreWriter(abc.ABC):
    """Writes records in committed batches, then the metadata that marks the store complete.

    Use as a context manager; leaving it early (an error, Ctrl-C) keeps every committed batch and
    the progress saved with it, so the conversion can resume.
    """

    location: str
    """The store's path or URI (password masked), for messages."""

    @abc.abstractmethod
    def start(self, progress: Progress, *, overwrite: bool, resume: bool) -> Progress:
        """Prepare the store for writing.

        Args:
            progress: the state of a fresh conversion.
            overwrite: replace an existing store.
            resume: continue the interrupted conversion the store holds, if any.

        Returns:
            The progress to continue from: ``progress`` itself for a fresh start, or what the store
            saved when resuming.

        Raises:
            StoreExistsError: a store is there and neither ``overwrite`` nor ``resume`` was given.
        """

    @abc.abstractmethod
    def write(self, records: Sequence[Record], progress: Progress) -> None:
        """Store ``records`` and ``progress`` together, atomically where the backend allows."""

    @abc.abstractmethod
    def finish(self, meta: StoreMeta, labels: np.ndarray) -> None:
        """Write the labels and the metadata, last."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's handles."""

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StoreReader(abc.ABC):
    """Reads a complete store by record index.

    Readers open their handles lazily, once per process, and pickle without them, so a reader
    (and a dataset holding one) can cross into ``DataLoader`` workers under fork or spawn.
    """

    location: str
    """The store's path or URI (password masked), for messages."""

    # Readers of fastdata stores load both when they open; readers of other layouts override.
    _meta: StoreMeta
    _labels: np.ndarray

    def __len__(self) -> int:
        """The number of records."""
        return self._meta.count

    @property
    def meta(self) -> StoreMeta:
        """The store's metadata (count, classes, repairs, ...)."""
        return self._meta

    @property
    def labels(self) -> np.ndarray:
        """One int64 label per record, in index order (read-only)."""
        return self._labels

    @abc.abstractmethod
    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        """``(image bytes, label)`` of the given records, in the order asked, in one round trip.

        Raises:
            IndexError: an index is out of range.
        """

    def read_data(self, indices: Sequence[int]) -> list[bytes]:
        """The stored image bytes of the given records, in the order asked."""
        return [data for data, _ in self.read_samples(indices)]

    @abc.abstractmethod
    def read_records(self, indices: Sequence[int]) -> list[Record]:
        """Whole records (header and bytes) of the given indices, in the order asked."""

    def iter_records(self, batch_size: int = 256) -> Iterator[Record]:
        """Every record in index order, fetched ``batch_size`` at a time."""
        n = len(self)
        for start in range(0, n, batch_size):
            yield from self.read_records(range(start, min(n, start + batch_size)))

    def check_indices(self, indices: Sequence[int]) -> list[int]:
        """Normalise negative indices and raise IndexError for any out of range."""
        n = len(self)
        out = []
        for i in indices:
            j = int(i)
            if j < 0:
                j += n
            if not 0 <= j < n:
                raise IndexError(f"{self.location}: index {i} out of range for {n} records")
            out.append(j)
        return out

    @abc.abstractmethod
    def close(self) -> None:
        """Release this process's handle (it reopens on the next read)."""
