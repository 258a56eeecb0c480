"""Readers of stores that other tools wrote: the pickle-recipe LMDB (values ``pickle((image,
label))``, read only with ``allow_pickle=True``) and the ``img_name``/``bson_img`` Mongo layout."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import (
    RecordError,
    StoreError,
)
from ..packed import PackedStrings
from ..records import Record, RecordHeader, StoreMeta, class_count
from .lmdb.env import Lease, _reading, open_reader
from .lmdb.layout import KEYS_KEY
from .lmdb.reader import _Leased


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


class PickleLMDBStore(_Leased):
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
        with _reading(self.path), self._lease.env.begin(buffers=True) as txn:
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

    def read_samples(self, indices: Sequence[int]) -> list[tuple[bytes, int]]:
        idx = self.check_indices(indices)
        with _reading(self.path), self._env().env.begin(buffers=True) as txn:
            return [self._get(txn, i) for i in idx]

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
            with _reading(self.path), self._env().env.begin(buffers=True) as txn:
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
