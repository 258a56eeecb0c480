"""Readers of a complete fastdata LMDB store, one lease of this process's environment each."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np

from ...columns import Column
from ...errors import (
    IncompleteStoreError,
    RecordError,
    StoreDamagedError,
    StoreError,
)
from ...packed import PackedStrings
from ...records import (
    Record,
    RecordHeader,
    SkippedFile,
    StoreMeta,
    check_labels,
    first_mismatch,
    name_bytes,
    skipped_file,
)
from ..reader import Foreign, ScanBlock, ScanItem, scan_item
from . import file as lmdb_file
from .columns import columns_problems, names_problem, read_column, read_index
from .env import data_path, open_reader
from .layout import (
    LABELS_KEY,
    META_KEY,
    NAMES_KEY,
    header_key,
    record_key,
    skipped_key,
)
from .lease import Lease
from .leased import LeasedReader
from .look import read_skipped
from .pages import Tree
from .walks import Walk, in_place, none_at


class LMDBStore(LeasedReader):
    """Reads a complete fastdata LMDB store. Use :func:`open_lmdb` to open any LMDB store.

    The metadata and the labels are read when the store opens, and again in each process that
    receives the reader pickled (a worker): a pickle holds the path and the store's id, not one
    label per record.
    """

    @classmethod
    def damaged_pages(cls, target: str) -> list[str]:
        """Every page of the data file's B-tree checked, reading the file itself (never mapped:
        a damaged page is then a reason, not the end of the process)."""
        data_file = data_path(target)
        return lmdb_file.walk(data_file) if os.path.isfile(data_file) else []

    def __init__(self, path: str | os.PathLike[str], lease: Lease | None = None) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._lease = lease or open_reader(self.path)
        self._meta, self._labels = self._load(self._lease)
        self._opened(self._meta)

    def _load(self, lease: Lease, *, labels: bool = True) -> tuple[StoreMeta, np.ndarray]:
        """The metadata and the labels; with ``labels=False``, the metadata alone (the labels
        returned are then empty): what a worker that has the labels already checks."""

        def get(txn: Any) -> tuple[bytes | None, bytes | None]:
            raw_meta = lease.value(txn.get(META_KEY), f"{self.path}: the metadata")
            if not labels:
                return raw_meta, None
            return raw_meta, lease.value(txn.get(LABELS_KEY), f"{self.path}: the labels")

        if labels:
            lease.ask_for([META_KEY, LABELS_KEY])
        raw_meta, raw_labels = lease.read(get, self.path)
        if raw_meta is None:
            raise IncompleteStoreError(f"{self.path}: store metadata missing")
        try:
            meta = StoreMeta.from_json(raw_meta, self.path)
            if not labels:
                return meta, np.empty(0, dtype=np.int64)
            return meta, check_labels(raw_labels, meta, self.path)
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise

    def skipped_files(self) -> list[SkippedFile]:
        lease = self._env()
        where = self.path
        count = self.meta.skipped_count

        def get(txn: Any) -> list[SkippedFile] | bytes | None:
            if txn.get(skipped_key(0)) is not None or not count:
                return read_skipped(lease, txn, count, where)
            return lease.value(txn.get(META_KEY), f"{where}: the metadata")

        try:
            found = lease.read(get, where)
            if isinstance(found, list):
                return found
            legacy = json.loads(found or b"{}").get("skipped", [])  # (earlier versions: there)
            return [skipped_file(item, where) for item in legacy]
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise

    def _check_identity(self, lease: Lease) -> None:
        # A forked worker, or a reader reopened, holds the labels already: only the metadata is
        # read to check them (the labels are 8 bytes a record, which each worker would copy).
        unpickled = self.__dict__.get("_meta") is None
        try:
            meta, labels = self._load(lease, labels=unpickled)
        except IncompleteStoreError:
            raise self._replaced("(none: an unfinished store)") from None
        if not self._is_opened(meta):
            raise self._replaced(meta.id)
        if unpickled:  # what the pickle left out
            seen = self._as_opened(meta, labels)
            assert seen is not None  # (it is the store opened: checked above)
            self._meta, self._labels = seen

    def _loaded(self) -> None:
        if self.__dict__.get("_meta") is None:
            self._env()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_meta"] = state["_labels"] = None  # read again where it is unpickled
        state["_columns"] = {}  # (read again where they are needed: a fork shares them)
        return state

    def columns_problems(self) -> list[str]:
        lease = self._env()

        def headers() -> Iterator[RecordHeader]:
            try:
                yield from self.iter_headers()
            except RecordError:
                return  # (a damaged header: the records' check names it)

        names = names_problem(self._names_value(), len(self), self.command_target)
        return names + columns_problems(
            lease,
            self.meta.schema,
            len(self),
            headers(),
            self.field_column,
            self.path,
            self.command_target,
        )

    def columns_cover(self) -> int | None:
        if not self.meta.schema:
            return None
        found = read_index(self._env(), self.path, self.command_target)
        return 0 if found is None else min(found[1].count, len(self))

    def field_column(self, name: str, *, keep: bool = True) -> Column | None:
        """Field ``name``'s column, read once in this process (every block checked), and kept:
        memory of its values' size (8 bytes a number, a string's bytes and 8), which worker
        processes forked after it was read share. ``keep=False`` (a query's): not kept, unless
        it was already."""
        cache: dict[str, Column | None] = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            if not keep:
                return self._read_column(name)
            cache[name] = self._read_column(name)
        return cache[name]

    def _read_column(self, name: str) -> Column | None:
        field = self.meta.schema.get(name)
        if field is None:
            return None
        column = read_column(self._env(), name, len(self), self.path, self.command_target)
        return column if column is not None and column.field == field else None  # (another
        # schema's: not this store's)

    def iter_headers(
        self, stop: int | None = None, batch_size: int = 1024
    ) -> Iterator[RecordHeader]:
        """The headers alone (they sort apart from the image bytes), read from the data file
        page by page and every page checked (``pages.Tree``), not with LMDB's cursor: a
        cursor steps from leaf to leaf, and LMDB ends the process on a page there that is not
        a leaf (NOTE [ Damaged branches ] in ``lease.py``)."""
        n = len(self) if stop is None else stop
        if n <= 0:
            return
        with lmdb_file.open_tree(self._file_path()) as tree:
            i = 0
            for run in tree.leaves(header_key(0), header_key(n)):
                buf, starts, sizes = run.buf, run.starts.tolist(), run.sizes.tolist()
                for j, (key, first) in enumerate(zip(run.keys, run.firsts.tolist(), strict=True)):
                    if key != header_key(i):
                        break
                    at = starts[j]
                    raw = buf[at : at + sizes[j]] if first < 0 else tree.value(run, j)
                    if raw is None:
                        break
                    yield self._header(raw, i)
                    i += 1
                else:
                    continue
                break
            if i < n:
                where = f"{self.path}: record {i}"
                damage = tree.covering(header_key(i))
                what = f"lies under damaged {damage}" if damage is not None else "is missing"
                raise RecordError(f"{where}: its header {what}", store=self.command_target)

    def _file_path(self) -> str:
        """The data file this reader has open (the one it read its metadata from, even where
        the store was replaced since), by a path that opens it again."""
        fd = self._env().entry.fd
        own = f"/proc/self/fd/{fd}"
        return own if fd is not None and os.path.exists(own) else data_path(self.path)

    def record_names(self) -> PackedStrings:
        names = self.names_index()
        if names is None:
            return super().record_names()  # written before the index existed, or damaged
        return names

    def names_index(self) -> PackedStrings | None:
        names = PackedStrings.from_joined(self._names_value() or b"")
        return names if len(names) == len(self) and len(self) else None

    def names_disagree(self, indices: np.ndarray) -> str:
        index = self.names_index() if len(indices) else None
        if index is None:  # (none to check, or the names are read from the headers)
            return ""
        lease = self._env()
        for lo in range(0, len(indices), 4096):
            part: list[int] = indices[lo : lo + 4096].tolist()

            def where(j: int, part: list[int] = part) -> str:
                return f"{self.path}: record {part[j]}"

            heads = lease.values([header_key(i) for i in part], where)
            for i, head in zip(part, heads, strict=True):
                name = self._header(head, i).name if head is not None else None
                if name is None or index[i] != name_bytes(name):
                    said = index[i].decode("utf-8", "surrogateescape")
                    return f"record {i} is {name}, the index says {said}"
        return ""

    def _names_value(self) -> bytes | None:
        """The index of names as stored (None: the store has none)."""
        lease = self._env()
        lease.ask_for([NAMES_KEY])
        return lease.read(
            lambda txn: lease.value(txn.get(NAMES_KEY), f"{self.path}: the names"), self.path
        )

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        return list(zip(self._data(idx, check), self._labels_of(idx), strict=True))

    def read_sample(self, index: int, *, check: bool = True) -> tuple[bytes, int]:
        lease = self._lease
        if lease is None or not lease.usable:
            lease = self._env()  # (which loads what a pickle left out)
        n = self._meta.count
        i = index if 0 <= index < n else self._wrapped(index, n)
        key = b"%010d" % i
        if not check:
            data = lease.value_at(key)
            if data is not None:
                return data, self._labels.item(i)
        else:
            pair = lease.values_at((key, b"#" + key))
            if pair is not None:
                self._checked([i], pair[:1], pair[1:])
                return pair[0], self._labels.item(i)
        return self.read_samples([i], check=check)[0]  # the path that handles every other case

    def read_data(self, indices: Sequence[int], *, check: bool = True) -> list[bytes]:
        return self._data(self.check_indices(indices), check)

    def read_data_ends(self, indices: Sequence[int]) -> tuple[list[bytes], list[int]]:
        ends: list[int] = []
        return self._data(self.check_indices(indices), True, ends), ends

    def _data(self, idx: list[int], check: bool, ends: list[int] | None = None) -> list[bytes]:
        """The bytes of the records ``idx`` (checked indices), in one transaction; ``check``:
        each checked against its header first (read in the same transaction), and then each
        one's scan end, as its header gives it, put in ``ends`` where one is given."""
        keys = [b"%010d" % i for i in idx]  # record_key, inline: this is every raw read's path
        if check:
            keys += [b"#" + k for k in keys]  # (then each header_key)
        n = len(idx)
        found = self._env().values(keys, lambda j: f"{self.path}: record {idx[j % n]}")
        if None in found:
            j = found.index(None)
            where = f"{self.path}: record {idx[j % n]}"
            raise RecordError(
                f"{where}{'' if j < n else ': its header'} is missing", store=self.command_target
            )
        data = cast("list[bytes]", found[:n])  # none is None
        if check:
            found_ends = self._checked(idx, data, cast("list[bytes]", found[n:]))
            if ends is not None:
                ends += found_ends
        return data

    def _checked(self, idx: list[int], data: list[bytes], heads: list[bytes]) -> list[int]:
        """Raise the error of the first of the records ``idx`` whose bytes are not the ones
        their header describes (NOTE [ Checked reads ] in ``stores/reader.py``); where none,
        each one's scan end as its header gives it."""
        try:
            bad, ends = first_mismatch(heads, data, lambda j: f"{self.path}: record {idx[j]}")
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise
        if bad is not None:
            j, why = bad
            raise self.mismatch(idx[j], self._header(heads[j], idx[j]).name, why)
        return ends

    def _header(self, raw: bytes | memoryview, index: int) -> RecordHeader:
        """Record ``index``'s header, from its bytes; a damaged one names this store."""
        try:
            return RecordHeader.from_json(raw, f"{self.path}: record {index}")
        except StoreDamagedError as exc:
            exc.in_store(self.command_target)
            raise

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        keys = [b"%010d" % i for i in idx]  # record_key, inline
        n = len(keys)
        found = self._env().values(
            [*keys, *(b"#" + k for k in keys)],  # then each header_key
            lambda j: f"{self.path}: record {idx[j % n]}",
        )
        out = []
        for j, i in enumerate(idx):
            data, head = found[j], found[n + j]
            if data is None or head is None:
                raise RecordError(
                    f"{self.path}: record {i}{'' if data is None else ': its header'} is missing",
                    store=self.command_target,
                )
            out.append(Record(i, self._header(head, i), data))
        return out

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)  # in an unpickled reader, this loads the labels
        labels = self._labels[idx].tolist()
        return [
            (r.header.name, r.data, label)
            for r, label in zip(self.read_records(indices), labels, strict=True)
        ]

    scans_in_parallel = True

    def scan_records(
        self, damage: list[Any], batch_size: int = 256, *, start: int = 0, stop: int | None = None
    ) -> Iterator[ScanItem | ScanBlock]:
        """Read from the data file itself, in one pass: every page of the B-tree is checked
        (:class:`~.pages.tree.Tree`) and every record's header and bytes taken
        from the pages as they are read, so that nothing is read twice and nothing damaged is
        handed to LMDB. Runs of records whose keys are all in place come as a
        :class:`~fastdata.stores.reader.ScanBlock`. An append that begins meanwhile may reuse
        the pages read (see "appends"): then the check is refused, to be run again."""
        lease = self._env()
        before = lease.entry.epoch()
        found: list[Foreign] = []
        with lmdb_file.open_tree(data_path(self.path)) as tree:
            if tree.file_key != lease.entry.key:
                raise self._replaced("(another data file)")
            yield from self._paired(tree, start, len(self) if stop is None else stop)
            if start == 0:  # the other keys' pages and values (checked with the first part)
                for low, high in ((None, b"#0"), (b"#:", b"0"), (b":", None)):
                    for _ in tree.entries(low, high):
                        pass
            if start == 0:  # (the walk of every key that is no record's)
                found.extend(_named(name, page) for name, page in tree.databases)
            if lease.entry.epoch() != before:
                raise StoreError(
                    f"{self.path}: an append began while the store was checked, so what was "
                    "read may be pages it reused; when it is done, check the store again with "
                    f"`fastdata verify {shlex.quote(os.path.abspath(self.path))}`"
                )
            damage.extend(tree.found)
            damage.extend(dict.fromkeys(found))  # (once each: a page may be walked twice)

    def _paired(self, tree: Tree, start: int, stop: int) -> Iterator[ScanItem | ScanBlock]:
        """Records ``start .. stop-1`` from the tree: the headers and the bytes sort apart, so
        two walks go through them side by side. Where the next keys of both are the records'
        own, one after the other, they come as a block; elsewhere one record at a time."""
        heads = Walk(tree, tree.leaves(header_key(start), header_key(stop)))
        datas = Walk(tree, tree.leaves(record_key(start), record_key(stop)))
        i = start
        while i < stop:
            n = in_place(heads, datas, i, stop)
            read = None
            if n:
                data_values = datas.values(n)
                head_values = heads.values(len(data_values))
                # (up to a value on damaged pages: that record is read alone, below)
                n = min(none_at(head_values), none_at(data_values))
                if n:
                    yield ScanBlock(self.path, i, head_values[:n], data_values[:n])  # type: ignore[arg-type]
                    heads.skip(n)
                    datas.skip(n)
                    i += n
                    continue
                read = head_values[0], data_values[0]  # (one of them None: not read again)
            yield self._one(tree, heads, datas, i, read)
            i += 1

    def _one(
        self,
        tree: Tree,
        heads: Walk,
        datas: Walk,
        i: int,
        read: tuple[bytes | memoryview | None, bytes | memoryview | None] | None = None,
    ) -> ScanItem:
        """Record ``i``, where the walks are at its keys or past them (``read``: its header and
        bytes, read already where the walks are at its keys)."""
        key = b"%010d" % i  # record_key, inline
        while heads.key is not None and heads.key[1:] < key:  # (a key of no record)
            heads.value()
            heads.skip(1)
        while datas.key is not None and datas.key < key:
            datas.value()
            datas.skip(1)
        head_key, data_key = heads.key, datas.key
        if data_key != key or head_key is None or head_key[1:] != key:
            where = f"{self.path}: record {key.decode()}"
            missing = key if data_key != key else b"#" + key
            under = tree.covering(missing)
            return (
                i,
                None,
                b"",
                (
                    f"lies under damaged page {under.page}; not read"
                    if under is not None
                    else f"{where}{'' if missing == key else ': its header'} is missing; the "
                    "store is damaged, convert it again"
                ),
            )
        head, data = read if read is not None else (heads.value(), datas.value())
        heads.skip(1)
        datas.skip(1)
        if data is None or head is None:
            under = tree.covering(key if data is None else b"#" + key)
            page = f"page {under.page}" if under is not None else "a page"
            return i, None, b"", f"its bytes lie on damaged {page}; not read"
        return scan_item(self.path, i, head, data)


def _named(name: bytes, page: int) -> Foreign:
    return Foreign(
        f"a named database {name.decode('utf-8', 'replace')!r} (another tool's, its record on "
        f"page {page}): fastdata stores have none; it is read around and kept",
        page,
    )
