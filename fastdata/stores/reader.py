"""What every backend's reader provides: records by index, read in one round trip per batch,
handles opened lazily once per process and dropped when pickled; the identity it opened, and
how a store grown by appends is seen as it was opened."""

from __future__ import annotations

import abc
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import RecordError, StoreReplacedError
from ..packed import PackedStrings
from ..records import Progress, Record, RecordHeader, SkippedFile, StoreMeta, name_bytes

if TYPE_CHECKING:
    import numpy as np

    from ..columns import BatchColumn, Column

__all__ = [
    "Foreign",
    "ScanBlock",
    "ScanItem",
    "StoreReader",
    "append_note",
    "scan_item",
]

ScanItem = tuple[int, "RecordHeader | None", "bytes | memoryview", "str | None"]
"""A record as a full check reads it: its index, header, bytes, and why it cannot be read."""


def scan_item(
    location: str, i: int, head: bytes | memoryview, data: bytes | memoryview
) -> ScanItem:
    """Record ``i`` of the store at ``location`` as a full check reads it, from its header's
    bytes and its own."""
    try:
        header = RecordHeader.from_json(head)
    except RecordError:
        try:  # again, to name the record (not formatted for every record read)
            RecordHeader.from_json(head, f"{location}: record {i}")
        except RecordError as exc:
            return i, None, b"", exc.without_hint()
        raise  # (it cannot pass the second time)
    return i, header, data, None


@dataclass(frozen=True)
class Foreign:
    """Something in a store that fastdata did not write and reads around (another tool's
    content): not damage. A full check finds it beside the damage (:meth:`StoreReader.
    scan_records`), and tells it apart by its type; ``page`` places it among the damage."""

    what: str
    page: int = -1

    def __str__(self) -> str:
        return self.what


class ScanBlock:
    """Records ``start .. start + len - 1`` as a full check reads them, side by side: every
    one there, with its header's bytes and its own (a backend that reads whole runs of records
    gives them so, to be checked all at once; :meth:`items` gives them one at a time)."""

    __slots__ = ("data", "heads", "location", "start")

    def __init__(
        self,
        location: str,
        start: int,
        heads: list[bytes | memoryview],
        data: list[bytes | memoryview],
    ) -> None:
        self.location, self.start, self.heads, self.data = location, start, heads, data

    def __len__(self) -> int:
        return len(self.heads)

    def items(self) -> Iterator[ScanItem]:
        for j, (head, data) in enumerate(zip(self.heads, self.data, strict=True)):
            yield scan_item(self.location, self.start + j, head, data)


def append_note(pending: Progress, target: str, *, replacing: bool) -> str:
    """What ``info`` says of an interrupted append (``target``: the store as command-line
    words): the command that finishes it, unless a replacement of the store is under way, which
    takes the store's place (the append's records with it) and which a writer finishes first."""
    said = "an append was interrupted" + (f" after {pending.done}" if pending.source else "")
    if replacing:
        return f"{said}; the replacement above takes the store's place, this append with it"
    return f"{said}; {pending.finish_advice(target)}"


class StoreReader(abc.ABC):
    """Reads a complete store by record index.

    Readers open their handles lazily, once per process, and pickle without them, so a reader
    (and a dataset holding one) can cross into ``DataLoader`` workers under fork or spawn.
    """

    location: str
    """The store's path or URI (password masked), for messages."""

    has_checksums = True
    """Whether records carry a checksum written with them (stores of other tools have none: their
    readers compute one from the bytes they return, which proves nothing)."""

    # Readers of fastdata stores load both when they open; readers of other layouts override.
    _meta: StoreMeta
    _labels: np.ndarray

    # What this reader opened: its id, the ids of the stores it grew from, its size. A store
    # that grew by appends since is still this one, read as it was (see ``_as_opened``).
    _id = ""
    _ids: frozenset[str] = frozenset()
    _count = 0
    _n_classes = 0

    def _opened(self, meta: StoreMeta) -> None:
        self._id, self._ids = meta.id, meta.ids
        self._count, self._n_classes = meta.count, len(meta.classes)

    def _as_opened(
        self, meta: StoreMeta, labels: np.ndarray
    ) -> tuple[StoreMeta, np.ndarray] | None:
        """The store's metadata and labels now, seen as this reader opened it: unchanged, or
        grown by appends (its first records and classes are the ones opened); None when it was
        replaced by another store."""
        if meta.id == self._id:
            return meta, labels
        if self._is_opened(meta):
            self._ids = meta.ids
            view = replace(
                meta, count=self._count, classes=meta.classes[: self._n_classes], id=self._id
            )
            return view, labels[: self._count]
        return None

    def _is_opened(self, meta: StoreMeta) -> bool:
        """Whether ``meta`` is the store this reader opened: the same, or grown from it by
        appends (see ``_as_opened``)."""
        # a store of the first format had no id: it is "" in the list of the store it grew into
        return meta.id == self._id or (self._id in meta.appended_from and meta.count >= self._count)

    def _replaced(self, now: str) -> StoreReplacedError:
        """The error of a reader whose store was replaced since it opened it (``now``: what is
        there instead), the same in every backend."""
        return StoreReplacedError(
            f"{self.location}: the store was replaced since this dataset opened it (store id "
            f"{self._id or '(none)'}, now {now or '(none)'}); its records no longer match the "
            "labels held here: create the dataset (and its DataLoader) again"
        )

    def _loaded(self) -> None:
        """Read again what a pickle left out (readers that pickle without their metadata and
        labels read them in each process that unpickles them)."""
        return None

    def __len__(self) -> int:
        """The number of records."""
        self._loaded()
        return self._meta.count

    @property
    def meta(self) -> StoreMeta:
        """The store's metadata (count, classes, repairs, ...)."""
        self._loaded()
        return self._meta

    @property
    def labels(self) -> np.ndarray:
        """One int64 label per record, in index order (read-only)."""
        self._loaded()
        return self._labels

    def record_check(self) -> str | None:
        """What is wrong with the set of records the store holds (one missing, one past the
        end), found without reading them, or None; backends that cannot tell return None."""
        return None

    def foreign_content(self) -> list[str]:
        """What the store holds that fastdata did not write and that is no damage (a count that
        another tool changed, say), each said as what it is; none by default. A full check
        finds more on its way (:class:`Foreign`)."""
        return []

    @classmethod
    def damaged_pages(cls, target: str) -> list[str]:
        """The damaged pages of the store at ``target``, checked without opening it as a store
        (for a store too damaged to open); none where the backend keeps no pages of its own.

        Raises:
            StoreError: the store's file is too damaged to check (its header, or cut short).
        """
        return []

    def interrupted(self) -> list[str]:
        """What was left unfinished at the store (an append, a replacement built aside), each
        with the command that finishes it; none by default."""
        return []

    def skipped_files(self) -> list[SkippedFile]:
        """The source files the conversion left out, with the reason (``meta.skipped_count`` of
        them). Kept apart from the metadata: opening a store never reads this list."""
        return []

    # NOTE [ Checked reads ]
    #
    # A record's header keeps the size and CRC-32 of its bytes, written by the writer from the
    # bytes it stored. A read with check=True (the default) compares each record's bytes with
    # them before it gives them, and raises the error of ``mismatch`` (a RecordError naming the
    # store, the record and the `fastdata verify` command) for the first that differs: a damaged
    # LMDB page can send LMDB's lookup to another record's pages, or to a page of the tree, whose
    # bytes it then gives as the value, and bit rot changes bytes in place; only a check tells.
    # The header is read in the same transaction or query as the bytes; its size and checksum
    # are read from the headers of a batch at once (records.first_mismatch), and the CRC-32 is
    # ISA-L's. Decoding datasets always check (the cost is well under 1% of a decode); raw reads
    # may pass check=False (docs/stores.md, "Reads are checked", gives the cost). Stores of other
    # tools carry no checksums (has_checksums): there is nothing to check, and check is ignored.

    @abc.abstractmethod
    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        """``(image bytes, label)`` of the given records, in the order asked, in one round trip;
        ``check``: each record's bytes checked against its header first (NOTE [ Checked reads ]).

        Raises:
            IndexError: an index is out of range.
            RecordError: (``check``) a record's bytes are not the ones stored.
        """

    def read_sample(self, index: int, *, check: bool = True) -> tuple[bytes, int]:
        """``(image bytes, label)`` of one record; backends with a shorter path for one record
        than for a batch take it.

        Raises:
            IndexError: the index is out of range.
            RecordError: (``check``) its bytes are not the ones stored.
        """
        return self.read_samples([index], check=check)[0]

    @property
    def command_target(self) -> str:
        """The store as the words of a command that names it (quoted for the shell): what the
        commands printed in messages give."""
        return shlex.quote(self.location)

    def mismatch(self, index: int, name: str, why: str) -> RecordError:
        """The error of record ``index`` (``name``) whose bytes are not the ones stored
        (``why``), found by a checked read."""
        return RecordError(
            f"{self.location}: record {index} ({name}) fails its checksum ({why})",
            store=self.command_target,
        )

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        """``(name, image bytes, label)`` of the given records, in the order asked: the bytes
        with the name that errors about them must give."""
        return [
            (r.header.name, r.data, int(self.labels[r.index])) for r in self.read_records(indices)
        ]

    def read_data(self, indices: Sequence[int], *, check: bool = True) -> list[bytes]:
        """The stored image bytes of the given records, in the order asked (``check``: see
        :meth:`read_samples`)."""
        return [data for data, _ in self.read_samples(indices, check=check)]

    def read_samples_ends(
        self, indices: Sequence[int]
    ) -> tuple[list[tuple[bytes, int]], list[int]]:
        """:meth:`read_samples`, checked, and with them where each JPEG's first scan ends as
        its record's header gives it (-1 where none is recorded: NOTE [ Scan ends ] in
        :mod:`fastdata.images.codec`): what a decoding dataset reads. Backends whose checked
        read has the headers at hand give the ends; others give -1 for each."""
        idx = self.check_indices(indices)
        data, ends = self.read_data_ends(idx)
        return list(zip(data, self.labels.take(idx).tolist(), strict=True)), ends

    def read_data_ends(self, indices: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """:meth:`read_data`, checked, and each record's scan end (see
        :meth:`read_samples_ends`)."""
        return self.read_data(indices, check=True), [-1] * len(indices)

    @abc.abstractmethod
    def read_records(self, indices: Sequence[int]) -> list[Record]:
        """Whole records (header and bytes) of the given indices, in the order asked, as
        stored: the bytes are not checked against the size and CRC-32 their header keeps
        (``records.bytes_problem`` does that; the datasets, ``export``, ``copy`` and
        ``verify`` check every record they read)."""

    @contextmanager
    def sequential(self) -> Iterator[None]:
        """Tell the backend that the block reads records in index order (a scan), so it can
        read ahead; random access is what it is tuned for otherwise."""
        yield

    def iter_headers(
        self, stop: int | None = None, batch_size: int = 1024
    ) -> Iterator[RecordHeader]:
        """The headers of records ``0 .. stop-1`` (all by default), in index order; backends
        that can read them without the image bytes do."""
        n = len(self) if stop is None else stop
        for start in range(0, n, batch_size):
            for rec in self.read_records(range(start, min(n, start + batch_size))):
                yield rec.header

    def record_names(self) -> PackedStrings:
        """Every record's name, ``name_bytes``-encoded, in index order, packed (what an append
        compares a source with); backends with an index of names read it at once."""
        return PackedStrings([name_bytes(h.name) for h in self.iter_headers()])

    def names_disagree(self, indices: np.ndarray) -> str:
        """Where the names :meth:`record_names` gives for records ``indices`` are not those
        their headers hold (the first one, said; "" where they agree): a backend whose
        names come from an index kept beside the records checks them against the headers.
        Others read the headers themselves: they always agree."""
        return ""

    def record_sizes(self) -> np.ndarray:
        """The size of the source file of every record (its stored size, less a repair), in
        index order, as one int64 array (what an append compares a source file with)."""
        import numpy as np

        out = np.empty(len(self), dtype=np.int64)
        for i, h in enumerate(self.iter_headers()):
            out[i] = h.size - 2 * h.repaired
        return out

    def iter_records(self, batch_size: int = 256) -> Iterator[Record]:
        """Every record in index order, fetched ``batch_size`` at a time."""
        n = len(self)
        with self.sequential():
            for start in range(0, n, batch_size):
                yield from self.read_records(range(start, min(n, start + batch_size)))

    def matching(self, where: Any) -> np.ndarray:
        """The indices (in order, as one int64 array) of the records that match ``where``: a
        query document (:mod:`fastdata.query`: MongoDB's language, run the same way on every
        backend), or a predicate called once per record with its field values (a dict; empty
        in a store without fields) for what a query cannot say.

        Raises:
            QueryError: a query with an operator, key or field this store cannot take, or a
                ``where`` that is neither a query nor a predicate (before any record is read).
        """
        from .selecting import select

        return select(self, where)

    def columns_cover(self) -> int | None:
        """How many of the records the store's columns cover (all of them: reads and queries
        go by the columns; fewer: by the records' headers); None where the backend keeps no
        columns or the store has no fields."""
        return None

    def columns_problems(self) -> list[str]:
        """What is wrong with what the store keeps beside its records, built from them: its
        columns and its index of names (each said with the command that builds them again);
        none where it keeps none."""
        return []

    def field_column(self, name: str, *, keep: bool = True) -> Column | None:
        """Field ``name``'s values for every record as one column (:mod:`fastdata.columns`),
        where the store keeps them; None where it does not (each record's header holds them).
        ``keep``: kept for the next reads in this process (``False``: a query's)."""
        return None

    def field_batch(
        self, indices: Sequence[int], names: Sequence[str]
    ) -> dict[str, BatchColumn] | None:
        """The values of fields ``names`` of records ``indices``, a column per field, read from
        the store's columns; None where it keeps none for one of them."""
        import numpy as np

        columns = {name: self.field_column(name) for name in names}
        if not columns or any(c is None for c in columns.values()):
            return None
        n = len(self)
        try:
            idx = np.asarray(indices, dtype=np.int64)
        except OverflowError:  # (past 64 bits: out of range)
            idx = np.asarray(self.check_indices(indices), dtype=np.int64)  # (IndexError)
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            idx = np.asarray(self.check_indices(indices), dtype=np.int64)  # (or IndexError)
        return {name: c.gather(idx) for name, c in columns.items() if c is not None}

    def create_index(self, key: str) -> str:
        """Have the backend's server index ``key`` (a record key a query names: ``label``,
        ``fields.score``), so that a query on it reads only what it selects; the index's name.

        Raises:
            QueryError: a key no record of this store has.
            UsageError: a backend without a server (LMDB: a query reads the headers).
        """
        from ..errors import UsageError
        from ..query import check_query

        check_query({key: {"$exists": True}}, self.meta.schema.names, self.location)
        raise UsageError(
            f"{self.location}: an LMDB store has no server to keep an index: it keeps every "
            f"field as a column, which a query reads (`fastdata info {self.command_target}` says "
            f"whether it has them; `fastdata columns {self.command_target}` builds them)"
        )

    def identity(self) -> dict[str, Any]:
        """What a position in this reader's records means something for (a loader's saved
        state): the store (its id, new for every conversion) and how many records it held when
        this reader read them; a view adds which of them it holds."""
        return {"store": self.meta.id or self.location, "records": len(self)}

    def check_indices(self, indices: Sequence[int]) -> list[int]:
        """Normalise negative indices and raise IndexError for any out of range."""
        n = len(self)
        return [i if 0 <= i < n else self._wrapped(i, n) for i in map(int, indices)]

    def _wrapped(self, i: int, n: int) -> int:
        if -n <= i < 0:
            return i + n
        raise IndexError(f"{self.location}: index {i} out of range for {n} records")

    def _labels_of(self, idx: list[int]) -> list[int]:
        """The labels of the records ``idx`` (checked indices), as Python ints."""
        labels = self._labels
        if len(idx) <= 8:
            item = labels.item
            return [item(i) for i in idx]
        return labels.take(idx).tolist()

    def names_index(self) -> PackedStrings | None:
        """The store's index of names (one per record, in index order), where it keeps one
        apart from the records' headers and it is whole; None otherwise. A full check compares
        it with the headers: appends go by it."""
        return None

    scans_in_parallel = False
    """Whether :meth:`scan_records` of parts of the store may run in several processes at once,
    each its own part (a check then takes the machine's cores)."""

    def scan_records(
        self, damage: list[Any], batch_size: int = 256, *, start: int = 0, stop: int | None = None
    ) -> Iterator[ScanItem | ScanBlock]:
        """Records ``start .. stop-1`` (all by default) in index order, for a full check
        (``fastdata verify``): ``(index, header, bytes, None)``, or ``(index, None, b"", why)``
        for one that cannot be read (reading goes on after it), or runs of them in a
        :class:`ScanBlock`. Damage to the store's own
        structure (an LMDB file's pages) found on the way is added to ``damage`` by the time the
        iteration ends, each one named by its ``str()`` and placed by its ``page`` (a number),
        and so is another tool's content found on the way, as :class:`Foreign` (not damage);
        backends with no structure of their own to check add none."""
        from ..errors import FastdataError

        total = len(self) if stop is None else stop
        with self.sequential():
            for first in range(start, total, batch_size):
                indices = range(first, min(total, first + batch_size))
                try:
                    records = self.read_records(indices)
                except FastdataError:
                    for i in indices:  # one at a time, to find the ones that fail
                        try:
                            [rec] = self.read_records([i])
                        except FastdataError as exc:
                            yield i, None, b"", str(exc)
                            continue
                        yield i, rec.header, rec.data, None
                    continue
                for rec in records:
                    yield rec.index, rec.header, rec.data, None

    @abc.abstractmethod
    def close(self) -> None:
        """Release this process's handle (it reopens on the next read)."""
