"""The LMDB backend: writer, reader, and ``LMDBImageDataset``.

Layout of a store folder (``data.mdb`` + ``lock.mdb``), documented in ``docs/format.md``:

- ``0000000000`` ... ``NNNNNNNNNN``: the image bytes of each record, as they are (plus a JPEG
  end-of-image repair), keys zero-padded so a cursor walks them in index order;
- ``#0000000000`` ...: each record's header (JSON: name, label, size, crc32, format, repaired);
- ``__labels__``: the labels, one little-endian int32 per record;
- ``__len__``: the record count as ASCII decimal; ``__keys__``: the record keys, newline-separated;
- ``#progress``: conversion progress (JSON), saved with every committed batch;
- ``__fastdata__``: the metadata (JSON), written last: a store without it is incomplete.

py-lmdb refuses to open an environment twice in one process, and a child forked from a process that
opened it inherits that refusal. Environments are therefore kept in a per-process registry: datasets
over the same store share one handle, and a forked child closes the inherited handle (never using
it) before opening its own.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np

from ..errors import (
    IncompleteStoreError,
    PickleNotAllowedError,
    RecordError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
)
from ..records import Progress, Record, RecordHeader, StoreMeta, record_key
from .base import StoreReader, StoreWriter

__all__ = ["LMDBStore", "LMDBWriter", "PickleLMDBStore", "open_lmdb"]

log = logging.getLogger(__name__)

META_KEY = b"__fastdata__"
LABELS_KEY = b"__labels__"
PROGRESS_KEY = b"#progress"
LEN_KEY = b"__len__"
KEYS_KEY = b"__keys__"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
INITIAL_MAP_SIZE = 1 << 30
LABEL_DTYPE = np.dtype("<i4")


def boot_id() -> str:
    """An id of the running kernel's boot (Linux), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def header_key(index: int) -> bytes:
    """The key of record ``index``'s header: ``#`` + its record key.

    Headers and progress sort before the records (``#`` < ``0``) and the metadata after them
    (``_`` > ``9``), so every record can be appended at the end of the B-tree (``MDB_APPEND``),
    which writes at the speed of a plain file append.
    """
    return b"#" + record_key(index)


# --------------------------------------------------------------------------- environment registry


@dataclass
class _Entry:
    pid: int
    env: Any
    refs: int


_registry: dict[str, _Entry] = {}
_registry_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _is_subdir_store(path: str) -> bool:
    return os.path.isdir(path)


def _open_readonly(path: str) -> Any:
    if not os.path.exists(path) or (
        os.path.isdir(path) and not os.path.exists(os.path.join(path, DATA_FILE))
    ):
        raise StoreNotFoundError(
            f"{path}: no LMDB store here; create one with `fastdata convert SRC {path}`"
        )
    try:
        # lock=False: readers of a finished store need no lock file (and may lack write access);
        # readahead stays on: with it off, every 4 KiB page of an image is a separate disk read.
        return lmdb.open(
            path,
            subdir=_is_subdir_store(path),
            readonly=True,
            lock=False,
            readahead=True,
            meminit=False,
            max_readers=1024,
        )
    except lmdb.Error as exc:
        raise StoreError(f"{path}: cannot open the LMDB store: {exc}") from exc


def _acquire(path: str) -> Any:
    """This process's shared read-only environment for ``path`` (opened on first use)."""
    key = os.path.realpath(path)
    pid = os.getpid()
    with _registry_lock:
        entry = _registry.get(key)
        if entry is not None and entry.pid != pid:
            # Inherited across fork: never used here, only closed so this process may open its own.
            del _registry[key]
            with suppress(lmdb.Error):
                entry.env.close()
            entry = None
        if entry is None:
            entry = _Entry(pid, _open_readonly(path), 0)
            _registry[key] = entry
        entry.refs += 1
        return entry.env


def _release(path: str) -> None:
    key = os.path.realpath(path)
    with _registry_lock:
        entry = _registry.get(key)
        if entry is None or entry.pid != os.getpid():
            return
        entry.refs -= 1
        if entry.refs <= 0:
            del _registry[key]
            entry.env.close()


@contextmanager
def _borrowed(path: str) -> Iterator[Any]:
    env = _acquire(path)
    try:
        yield env
    finally:
        _release(path)


def _close_registered(path: str) -> None:
    """Close this process's shared handle on ``path`` (before the writer replaces the store)."""
    key = os.path.realpath(path)
    with _registry_lock:
        entry = _registry.pop(key, None)
    if entry is not None:
        entry.env.close()


# --------------------------------------------------------------------------- writer


class LMDBWriter(StoreWriter):
    """Writes a fastdata store into an LMDB folder.

    Each batch and its progress are committed in one transaction. The map grows (doubling) when
    LMDB reports it full, so no size needs guessing.

    Args:
        path: the store folder (created if missing; must be empty or hold an LMDB store).
        map_size: the initial map size in bytes.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = INITIAL_MAP_SIZE) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._map_size = map_size
        self._env: Any = None

    # -- lifecycle

    def start(self, progress: Progress, *, overwrite: bool, resume: bool) -> Progress:
        folder = Path(self.path)
        if folder.exists() and not folder.is_dir():
            raise StoreExistsError(
                f"{folder}: a file is in the way; give a new or empty folder for the store"
            )
        data_file = folder / DATA_FILE
        if folder.is_dir() and not data_file.exists() and any(folder.iterdir()):
            raise StoreExistsError(
                f"{folder}: the folder is not empty and holds no LMDB store; "
                "give a new or empty folder for the store"
            )
        if data_file.exists():
            if overwrite:
                _close_registered(self.path)
                for name in (DATA_FILE, LOCK_FILE):
                    (folder / name).unlink(missing_ok=True)
            elif not resume:
                raise StoreExistsError(self._exists_message())
        folder.mkdir(parents=True, exist_ok=True)
        _close_registered(self.path)
        try:
            # Batches are committed without fsync and the store is flushed once, before its
            # metadata is written: an fsync per batch costs a journal commit each and, measured,
            # as much again as the whole conversion. A killed process loses nothing committed
            # (the page cache holds it); a machine that restarts mid-conversion may, which is
            # why a resume after a restart is refused (see _check_same_boot).
            self._env = lmdb.open(
                self.path,
                map_size=self._map_size,
                subdir=True,
                meminit=False,
                sync=False,
                metasync=False,
                max_dbs=0,
            )
        except lmdb.Error as exc:
            raise StoreError(f"{self.path}: cannot open the LMDB store for writing: {exc}") from exc
        if resume:
            with self._env.begin() as txn:
                raw = txn.get(PROGRESS_KEY)
            if raw is not None:
                saved = Progress.from_json(raw, self.path)
                self._check_same_boot(saved)
                if saved.fingerprint != progress.fingerprint:
                    raise StoreError(
                        f"{self.path}: the source folder {progress.source} changed since this "
                        "conversion started; convert again with --overwrite"
                    )
                log.info(
                    "%s: resuming after %d of %d samples", self.path, saved.next_sample, saved.total
                )
                return saved
        return progress

    def _check_same_boot(self, saved: Progress) -> None:
        if saved.boot_id and saved.boot_id != boot_id():
            raise StoreError(
                f"{self.path}: the machine restarted while this conversion was running, and "
                "its last batches may not have reached the disk intact; convert again with "
                "--overwrite"
            )

    def _exists_message(self) -> str:
        env = lmdb.open(self.path, readonly=True, lock=False, subdir=True)
        try:
            with env.begin() as txn:
                complete = txn.get(META_KEY) is not None
                interrupted = txn.get(PROGRESS_KEY) is not None
        finally:
            env.close()
        if complete:
            return f"{self.path}: a store exists already; pass --overwrite to replace it"
        if interrupted:
            return (
                f"{self.path}: holds an interrupted conversion; pass --resume to continue it "
                "or --overwrite to start over"
            )
        return f"{self.path}: an LMDB store exists already; pass --overwrite to replace it"

    def _commit(self, fill: Callable[[Any], None]) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    fill(txn)
                return
            except lmdb.MapFullError:
                size = self._env.info()["map_size"] * 2
                log.info("%s: map full, growing it to %d MiB", self.path, size >> 20)
                self._env.set_mapsize(size)

    def write(self, records: Sequence[Record], progress: Progress) -> None:
        data = [(record_key(r.index), r.data) for r in records]
        headers = [(header_key(r.index), r.header.to_json()) for r in records]
        progress.boot_id = boot_id()
        state = progress.to_json()

        def fill(txn: Any) -> None:
            # One call per batch: a put per record would hand the GIL back and forth with the
            # reader threads for every image, and wait out the switch interval each time.
            cursor = txn.cursor()
            _, added = cursor.putmulti(data, append=True)
            if added != len(data):
                raise StoreError(
                    f"{self.path}: records from {records[0].index} on exist already; the store "
                    "is not the one this conversion started, convert again with --overwrite"
                )
            cursor.putmulti(headers)
            txn.put(PROGRESS_KEY, state)

        self._commit(fill)

    def finish(self, meta: StoreMeta, labels: np.ndarray) -> None:
        self._env.sync(True)  # every record on disk before the metadata says the store is whole
        count = meta.count
        keys = b"\n".join(record_key(i) for i in range(count))
        label_bytes = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()

        def fill(txn: Any) -> None:
            txn.put(LABELS_KEY, label_bytes)
            txn.put(LEN_KEY, str(count).encode("ascii"))
            txn.put(KEYS_KEY, keys)
            txn.put(META_KEY, meta.to_json())

        self._commit(fill)

    def close(self) -> None:
        if self._env is None:
            return
        env, self._env = self._env, None
        env.sync(True)
        env.close()


# --------------------------------------------------------------------------- readers


class _LazyEnv:
    """Holds a per-process shared environment, acquired on first use, dropped when pickled."""

    path: str

    def __init__(self) -> None:
        self._env: Any = None
        self._pid = -1

    def _handle(self) -> Any:
        if self._env is None or self._pid != os.getpid():
            self._env = _acquire(self.path)
            self._pid = os.getpid()
        return self._env

    def close(self) -> None:
        """Release this process's handle; the next read opens it again."""
        if self._env is not None and self._pid == os.getpid():
            _release(self.path)
        self._env = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None
        state["_pid"] = -1
        return state


class LMDBStore(_LazyEnv, StoreReader):
    """Reads a complete fastdata LMDB store. Use :func:`open_lmdb` to open any LMDB store."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.location = self.path
        with _borrowed(self.path) as env, env.begin() as txn:
            raw_meta = txn.get(META_KEY)
            raw_labels = txn.get(LABELS_KEY)
        if raw_meta is None:
            raise IncompleteStoreError(f"{self.path}: store metadata missing")
        self._meta = StoreMeta.from_json(raw_meta, self.path)
        labels = np.frombuffer(raw_labels or b"", dtype=LABEL_DTYPE).astype(np.int64)
        if len(labels) != self._meta.count:
            raise StoreError(
                f"{self.path}: {len(labels)} labels for {self._meta.count} records; "
                "the store is damaged, convert it again with --overwrite"
            )
        labels.setflags(write=False)
        self._labels = labels

    def _missing(self, key: bytes) -> RecordError:
        return RecordError(
            f"{self.path}: record {key.decode()} is missing; the store is damaged, "
            "convert it again with --overwrite"
        )

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        labels = self._labels[idx].tolist()
        # Read in key order (file order), so pages that come from disk come in ascending runs.
        data: dict[int, bytes] = {}
        with self._handle().begin() as txn:
            get = txn.get
            for i in sorted(set(idx)):
                key = record_key(i)
                value = get(key)
                if value is None:
                    raise self._missing(key)
                data[i] = value
        return list(zip([data[i] for i in idx], labels))

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx = self.check_indices(indices)
        out = []
        with self._handle().begin() as txn:
            for i in idx:
                key = record_key(i)
                data, head = txn.get(key), txn.get(header_key(i))
                if data is None or head is None:
                    raise self._missing(key)
                header = RecordHeader.from_json(head, f"{self.path}: record {key.decode()}")
                out.append(Record(i, header, data))
        return out


def _unpickled_sample(raw: bytes, where: str) -> tuple[bytes, int]:
    try:
        obj = pickle.loads(raw)
    except Exception as exc:
        raise RecordError(f"{where}: cannot unpickle the value ({exc})") from exc
    if not isinstance(obj, (tuple, list)) or len(obj) < 2:
        raise RecordError(f"{where}: expected a pickled (image, label) pair, got {type(obj)}")
    img, label = obj[0], obj[1]
    if isinstance(img, np.ndarray):
        img = img.tobytes()
    elif isinstance(img, (bytearray, memoryview)):
        img = bytes(img)
    if not isinstance(img, bytes):
        raise RecordError(f"{where}: image is a {type(img).__name__}, not encoded bytes")
    return img, int(label)


class PickleLMDBStore(_LazyEnv, StoreReader):
    """Reads LMDB stores written by the common pickle-based recipes.

    Values are ``pickle((image_bytes, label))`` under the keys listed in a pickled ``__keys__``
    (``b'0'``, ``b'1'``, ... or zero-padded). Unpickling can run arbitrary code, so this reader is
    only used when the caller passes ``allow_pickle=True``. Classes and labels are not stored by
    those recipes: they are gathered by reading every record, once, when first asked for.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.location = self.path
        with _borrowed(self.path) as env, env.begin() as txn:
            raw_keys = txn.get(KEYS_KEY)
        if raw_keys is None:
            raise StoreError(f"{self.path}: no __keys__ entry; not a pickle-based LMDB store")
        try:
            keys = pickle.loads(raw_keys)
        except Exception as exc:
            raise StoreError(f"{self.path}: cannot unpickle __keys__ ({exc})") from exc
        # One fixed-width byte array instead of a list of Python objects in every worker.
        self._keys = np.array([bytes(k) for k in keys], dtype=np.bytes_)
        self._lazy_labels: np.ndarray | None = None
        self._lazy_meta: StoreMeta | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def _get(self, txn: Any, i: int) -> tuple[bytes, int]:
        key = bytes(self._keys[i])
        raw = txn.get(key)
        if raw is None:
            raise RecordError(f"{self.path}: key {key!r} listed in __keys__ is missing")
        return _unpickled_sample(raw, f"{self.path}: key {key!r}")

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        with self._handle().begin() as txn:
            return [self._get(txn, i) for i in idx]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..jpeg import checksum, sniff

        out = []
        for i, (data, label) in zip(self.check_indices(indices), self.read_samples(indices)):
            fmt = sniff(data) or "unknown"
            key = bytes(self._keys[i]).decode("ascii", "replace")
            header = RecordHeader(f"{label}/{key}.{fmt}", label, len(data), checksum(data), fmt)
            out.append(Record(i, header, data))
        return out

    @property
    def labels(self) -> np.ndarray:
        if self._lazy_labels is None:
            n = len(self)
            labels = np.empty(n, dtype=np.int64)
            with self._handle().begin() as txn:
                for i in range(n):
                    labels[i] = self._get(txn, i)[1]
            labels.setflags(write=False)
            self._lazy_labels = labels
        return self._lazy_labels

    @property
    def meta(self) -> StoreMeta:
        if self._lazy_meta is None:
            labels = self.labels
            n_classes = int(labels.max()) + 1 if len(labels) else 0
            self._lazy_meta = StoreMeta(
                count=len(self),
                classes=[str(c) for c in range(n_classes)],
                source=self.path,
                format="pickle-lmdb",
                version=0,
            )
        return self._lazy_meta


def open_lmdb(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> StoreReader:
    """Open an LMDB store for reading: a fastdata store, or (with ``allow_pickle``) a pickle one.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        IncompleteStoreError: a conversion into it did not finish; the message says how to resume.
        PickleNotAllowedError: it holds pickled values and ``allow_pickle`` is false.
        StoreError: it is not a store fastdata can read.
    """
    path = os.fspath(path)
    with _borrowed(path) as env, env.begin() as txn:
        has_meta = txn.get(META_KEY) is not None
        raw_progress = txn.get(PROGRESS_KEY)
        has_keys = txn.get(KEYS_KEY) is not None
    if has_meta:
        return LMDBStore(path)
    if raw_progress is not None:
        progress = Progress.from_json(raw_progress, path)
        raise IncompleteStoreError(
            f"{path}: incomplete store: its conversion stopped after {progress.next_sample} of "
            f"{progress.total} images; finish it with "
            f"`fastdata convert {progress.source} {path} --resume`"
        )
    if has_keys:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{path}: this LMDB store was written by another tool and its values are Python "
                "pickles, which can run arbitrary code when loaded; pass allow_pickle=True "
                "(CLI: --allow-pickle) only if you trust where it came from"
            )
        return PickleLMDBStore(path)
    raise StoreError(
        f"{path}: an LMDB store without fastdata metadata; if a conversion into it stopped "
        "before its first commit, convert again with --overwrite"
    )
