"""Readers of stores that other tools wrote: the pickle-recipe LMDB (values ``pickle((image,
label))``, read only with ``allow_pickle=True``) and the ``img_name``/``bson_img`` Mongo layout."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    RecordError,
    StoreDamagedError,
    StoreError,
)
from ..packed import PackedStrings
from ..records import Record, RecordHeader, StoreMeta, class_count
from ..sources.reading import read_file
from .lmdb.env import open_reader, reading
from .lmdb.layout import KEYS_KEY
from .lmdb.lease import Lease
from .lmdb.leased import LeasedReader
from .mongo.connection import MongoOptions, MongoTarget
from .reader import StoreReader

INDEX_FILE_MOST = 1 << 32
"""The largest JSON index of a Mongo collection in the common layout that is read (4 GiB)."""


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


class PickleLMDBStore(LeasedReader):
    """Reads LMDB stores written by the common pickle-based recipes.

    Values are ``pickle((image_bytes, label))`` under the keys listed in a pickled ``__keys__``
    (``b'0'``, ``b'1'``, ... or zero-padded). Unpickling can run arbitrary code, so this reader is
    only used when the caller passes ``allow_pickle=True``. Classes and labels are not stored by
    those recipes: they are gathered by reading every record, once, when first asked for.
    """

    has_checksums = False

    def __init__(self, path: str | os.PathLike[str], lease: Lease | None = None) -> None:
        self.path = os.fspath(path)
        self.location = self.path
        self._lease = lease or open_reader(self.path)
        with reading(self.path), self._lease.env.begin(buffers=True) as txn:
            raw_keys = self._lease.value(txn.get(KEYS_KEY), f"{self.path}: __keys__")
        if raw_keys is None:
            raise StoreError(f"{self.path}: no __keys__ entry; not a pickle-based LMDB store")
        try:
            keys = pickle.loads(raw_keys)
        except Exception as exc:
            raise StoreError(f"{self.path}: cannot unpickle __keys__ ({exc})") from exc
        if not isinstance(keys, (list, tuple)) or not all(
            isinstance(k, (bytes, str)) for k in keys
        ):
            raise StoreError(f"{self.path}: __keys__ is not a list of keys")
        # One packed buffer instead of a list of Python objects in every worker.
        self._keys = PackedStrings([k.encode() if isinstance(k, str) else bytes(k) for k in keys])
        self._lazy_labels: np.ndarray | None = None
        self._lazy_meta: StoreMeta | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def _get(self, txn: Any, i: int) -> tuple[bytes, int]:
        key = self._keys[i]
        raw = self._env().value(txn.get(key), f"{self.path}: key {key!r}")
        if raw is None:
            raise RecordError(f"{self.path}: key {key!r} listed in __keys__ is missing")
        return _unpickled_sample(raw, f"{self.path}: key {key!r}")

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)  # (no checksums: nothing to check)
        with reading(self.path), self._env().env.begin(buffers=True) as txn:
            try:
                return [self._get(txn, i) for i in idx]
            except StoreDamagedError as exc:
                exc.in_store(self.command_target)
                raise

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..images.codec import sniff
        from ..records import checksum

        out = []
        for i, (data, label) in zip(
            self.check_indices(indices), self.read_samples(indices), strict=True
        ):
            fmt = sniff(data) or "unknown"
            key = self._keys[i].decode("ascii", "replace")
            header = RecordHeader(f"{label}/{key}.{fmt}", label, len(data), checksum(data), fmt)
            out.append(Record(i, header, data))
        return out

    @property
    def labels(self) -> np.ndarray:
        if self._lazy_labels is None:
            n = len(self)
            labels = np.empty(n, dtype=np.int64)
            with reading(self.path), self._env().env.begin(buffers=True) as txn:
                for i in range(n):
                    labels[i] = self._get(txn, i)[1]
            labels.setflags(write=False)
            self._lazy_labels = labels
        return self._lazy_labels

    @property
    def meta(self) -> StoreMeta:
        if self._lazy_meta is None:
            labels = self.labels
            n_classes = class_count(labels, self.path)
            self._lazy_meta = StoreMeta(
                count=len(self),
                classes=[str(c) for c in range(n_classes)],
                source=self.path,
                format="pickle-lmdb",
                version=0,
            )
        return self._lazy_meta


class LegacyMongoStore(MongoTarget, StoreReader):
    """Reads collections in the common layout written by other tools, without converting them.

    Documents hold ``img_name`` (the image's path) and ``bson_img`` (its bytes); a JSON index file
    ``{"path_list": [...], "label_list": [...]}`` gives the order and the labels. JPEGs whose
    end-of-image marker is missing are repaired as they are read. Class names are the first
    path component of each image when that is consistent with the labels, else the label numbers.

    Args:
        uri, collection, database, options: as for :class:`MongoStore`.
        index_file: the JSON index.
    """

    has_checksums = False

    def __init__(
        self,
        uri: str,
        collection: str,
        index_file: str | os.PathLike[str],
        *,
        database: str | None = None,
        options: MongoOptions | None = None,
    ) -> None:
        super().__init__(uri, collection, database=database, options=options)
        path = Path(index_file)
        try:
            raw = read_file(str(path), INDEX_FILE_MOST, "a smaller index")  # (never a FIFO)
            if isinstance(raw, str):
                raise OSError(raw)
            index = json.loads(raw.decode("utf-8"))
            paths, labels = index["path_list"], index["label_list"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{path}: not a usable index file ({exc}); expected JSON with "
                '"path_list" and "label_list"'
            ) from exc
        if len(paths) != len(labels):
            raise StoreError(
                f"{path}: {len(paths)} paths but {len(labels)} labels; the index is damaged"
            )
        # One packed buffer and one int array, not two lists of Python objects.
        try:
            self._names = PackedStrings([p.encode("utf-8", "surrogateescape") for p in paths])
            self._labels = np.asarray(labels, dtype=np.int64)
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise StoreError(
                f'{path}: not a usable index file ({exc}); "path_list" must hold strings and '
                '"label_list" integers'
            ) from None
        self._labels.setflags(write=False)
        self._meta = StoreMeta(
            count=len(paths),
            classes=_legacy_classes(paths, self._labels, str(path)),
            source=str(path),
            format="img_name/bson_img",
            version=0,
        )

    def _fetch(self, idx: list[int]) -> list[tuple[str, bytes, bool]]:
        from ..images.codec import repair_if_cut

        names = [self._names[i].decode("utf-8", "surrogateescape") for i in idx]

        def query() -> dict[str, bytes]:
            coll = self._conn.db()[self.collection]
            docs = coll.find(
                {"img_name": {"$in": sorted(set(names))}}, {"img_name": 1, "bson_img": 1}
            )
            out = {}
            for d in docs:
                if not isinstance(d.get("bson_img"), bytes):
                    raise RecordError(
                        f"{self.location}: the document of {d.get('img_name')!r} holds no "
                        "binary 'bson_img'; the collection is damaged"
                    )
                out[d["img_name"]] = d["bson_img"]
            return out

        span = f"{min(idx)}-{max(idx)}" if idx else "none"
        found = self._run(f"reading images {span}", query)
        out = []
        for name in names:
            if name not in found:
                raise RecordError(
                    f"{self.location}: no document with img_name {name!r}",
                    store=self.command_target,
                )
            data, repaired = repair_if_cut(found[name])
            out.append((name, data, repaired))
        return out

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)  # (no checksums: nothing to check)
        return [
            (data, int(self._labels[i]))
            for (_, data, _), i in zip(self._fetch(idx), idx, strict=True)
        ]

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx = self.check_indices(indices)
        return [
            (name, data, int(self._labels[i]))
            for (name, data, _), i in zip(self._fetch(idx), idx, strict=True)
        ]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        from ..images.codec import sniff
        from ..records import checksum

        idx = self.check_indices(indices)
        out = []
        for (name, data, repaired), i in zip(self._fetch(idx), idx, strict=True):
            header = RecordHeader(
                name,
                int(self._labels[i]),
                len(data),
                checksum(data),
                sniff(data) or "unknown",
                repaired,
            )
            out.append(Record(i, header, data))
        return out


def _legacy_classes(paths: Sequence[str], labels: np.ndarray, where: str) -> list[str]:
    n = class_count(labels, where)
    names: dict[int, str] = {}
    for p, label in zip(paths, labels.tolist(), strict=True):
        first = p.split("/", 1)[0] if "/" in p else None
        if first is None or names.setdefault(label, first) != first:
            return [str(i) for i in range(n)]
    if len(set(names.values())) != len(names):
        return [str(i) for i in range(n)]
    return [names.get(i, str(i)) for i in range(n)]
