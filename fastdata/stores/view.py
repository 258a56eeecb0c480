"""A subset of a store read in place: some of its classes, some of its records, or both.

A view maps its own indices ``0 .. n-1`` to records of the store and its own labels to its own
class list, so a dataset over a view behaves like a dataset over a smaller store (``classes``,
``targets`` and labels agree), without copying a record. A view chosen by classes is computed from
the store's labels in each process (a pickle holds the class names); one chosen by indices holds
them as one int64 array.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..records import Record, SkippedFile, StoreMeta
from .reader import StoreReader

if TYPE_CHECKING:
    from ..columns import BatchColumn

__all__ = ["StoreView"]


def _as_indices(indices: Any, n: int, where: str) -> np.ndarray:
    """Record indices as an int64 array: integers as they are, or a boolean mask of the
    store's length, which selects like numpy's and torch's (the records where it is true).

    Raises:
        TypeError: anything else that is not integral (floats, a mask of another length).
    """
    if hasattr(indices, "numpy") and hasattr(indices, "dtype"):  # a torch tensor
        indices = indices.detach().cpu().numpy()
    given = np.asarray(indices)
    if given.ndim != 1:
        raise TypeError(
            f"{where}: indices must be one sequence of integers or a boolean mask, not an "
            f"array of shape {given.shape}"
        )
    if given.dtype == bool:
        if given.ndim != 1 or len(given) != n:
            raise TypeError(
                f"{where}: a boolean mask selects records only at the store's length ({n}); "
                f"this one has shape {given.shape}"
            )
        return np.flatnonzero(given).astype(np.int64)
    if given.size == 0:
        return np.zeros(0, dtype=np.int64)
    if given.dtype.kind not in "iu":
        raise TypeError(
            f"{where}: indices must be integers or a boolean mask, not {given.dtype} "
            f"(e.g. {given.reshape(-1)[0]!r}); nothing is rounded"
        )
    if given.dtype.kind == "u" and given.max() > np.iinfo(np.int64).max:
        raise IndexError(f"{where}: index {int(given.max())} out of range for {n} records")
    return given.astype(np.int64)


class StoreView(StoreReader):
    """The records of ``reader`` whose class is in ``classes`` and whose index is in ``indices``.

    Args:
        reader: the whole store.
        classes: class names to keep, in the order the view's labels follow (label ``k`` is
            ``classes[k]``); None keeps every class with its label.
        indices: record indices to keep, in the order the view gives them (negative ones count
            from the end); None keeps every record of the kept classes, in store order.
        where: keep only the records that match, found once when the view is made (a pickled
            view holds the records found, not ``where``): a query document, the same on every
            backend (``{"fields.caption": {"$regex": "dog"}}``; :mod:`fastdata.query`), or a
            predicate called with each record's field values (a dict); see
            :meth:`StoreReader.matching`.

    Raises:
        ValueError: a class the store does not have, a class named twice.
        IndexError: an index out of range.
    """

    def __init__(
        self,
        reader: StoreReader,
        *,
        classes: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        where: Any = None,
    ) -> None:
        self.base = reader
        self.location = reader.location
        self.has_checksums = reader.has_checksums
        known = reader.meta.class_to_idx
        if classes is not None:
            classes = [str(c) for c in classes]
            unknown = [c for c in classes if c not in known]
            if unknown:
                raise ValueError(
                    f"{reader.location}: no class {unknown[0]!r} in the store; its classes are "
                    f"{', '.join(reader.meta.classes[:10])}{', ...' if len(known) > 10 else ''}"
                )
            if len(set(classes)) != len(classes):
                raise ValueError(f"{reader.location}: a class is named twice in {classes!r}")
        self._classes = classes
        self._given: np.ndarray | None = None
        if indices is not None:
            given = _as_indices(indices, len(reader), reader.location)
            n = len(reader)
            bad = (given < -n) | (given >= n)
            if bad.any():
                raise IndexError(
                    f"{reader.location}: index {int(given[bad][0])} out of range for {n} records"
                )
            self._given = np.where(given < 0, given + n, given)
        if where is not None:
            found = reader.matching(where)
            if self._given is None:
                self._given = found
            else:
                self._given = self._given[np.isin(self._given, found)]
        self._index: np.ndarray | None = None
        self._view_labels: np.ndarray | None = None
        self._meta_view: StoreMeta | None = None
        self._build()

    def _build(self) -> None:
        """The view's record indices and labels, from the store's labels (every process)."""
        labels = self.base.labels
        index = self._given if self._given is not None else np.arange(len(labels), dtype=np.int64)
        view_labels = labels[index]
        classes = self.base.meta.classes
        if self._classes is not None:
            # old label -> new label, -1 for the classes left out
            remap = np.full(len(classes), -1, dtype=np.int64)
            for new, name in enumerate(self._classes):
                remap[self.base.meta.class_to_idx[name]] = new
            view_labels = remap[view_labels]
            keep = view_labels >= 0
            index, view_labels = index[keep], view_labels[keep]
            classes = list(self._classes)
        index.setflags(write=False)
        view_labels.setflags(write=False)
        self._index, self._view_labels = index, view_labels
        self._meta_view = replace(self.base.meta, count=len(index), classes=classes)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # recomputed from the store's labels where it is unpickled: a view by classes pickles
        # their names, a view by indices the indices it was given
        state["_index"] = state["_view_labels"] = state["_meta_view"] = None
        return state

    def _loaded(self) -> None:
        if self._index is None:
            self._build()

    @property
    def meta(self) -> StoreMeta:
        self._loaded()
        assert self._meta_view is not None
        return self._meta_view

    @property
    def labels(self) -> np.ndarray:
        self._loaded()
        assert self._view_labels is not None
        return self._view_labels

    @property
    def records(self) -> np.ndarray:
        """The store index of each of the view's records (read-only)."""
        self._loaded()
        assert self._index is not None
        return self._index

    def __len__(self) -> int:
        return len(self.records)

    def identity(self) -> dict[str, Any]:
        """The store's identity (as its reader's), and the view's: a digest of its records (as
        the store numbers them, through any view it is a view of) and their labels (the same
        query, classes or indices on the same store give the same)."""
        import hashlib

        records, store = self.records, self.base
        while isinstance(store, StoreView):  # (a view of a view: its records are the inner's)
            records, store = store.records[records], store.base
        digest = hashlib.sha256(np.ascontiguousarray(records, "<i8").tobytes())
        digest.update(np.ascontiguousarray(self.labels, "<i8").tobytes())
        return {**store.identity(), "view": digest.hexdigest()[:16], "selected": len(self)}

    def matching(self, where: Any) -> np.ndarray:
        """The view's records that match ``where`` (a query, or a predicate, as in every
        reader): a query is run by the store's backend over the store, its answer then
        narrowed to this view."""
        if callable(where):
            return super().matching(where)
        found = self.base.matching(where)
        return np.flatnonzero(np.isin(self.records, found)).astype(np.int64)

    def _map(self, indices: Sequence[int]) -> tuple[list[int], list[int]]:
        idx = self.check_indices(indices)
        return idx, self.records[idx].tolist()

    def read_samples(
        self, indices: Sequence[int], *, check: bool = True
    ) -> list[tuple[bytes, int]]:
        idx, base = self._map(indices)
        labels = self.labels[idx].tolist()
        return list(zip(self.base.read_data(base, check=check), labels, strict=True))

    def read_data(self, indices: Sequence[int], *, check: bool = True) -> list[bytes]:
        return self.base.read_data(self._map(indices)[1], check=check)

    def read_data_ends(self, indices: Sequence[int]) -> tuple[list[bytes], list[int]]:
        return self.base.read_data_ends(self._map(indices)[1])

    def field_batch(
        self, indices: Sequence[int], names: Sequence[str]
    ) -> dict[str, BatchColumn] | None:
        return self.base.field_batch(self._map(indices)[1], names)

    @property
    def command_target(self) -> str:
        return self.base.command_target

    def read_named(self, indices: Sequence[int]) -> list[tuple[str, bytes, int]]:
        idx, base = self._map(indices)
        labels = self.labels[idx].tolist()
        return [
            (name, data, label)
            for (name, data, _), label in zip(self.base.read_named(base), labels, strict=True)
        ]

    def read_records(self, indices: Sequence[int]) -> list[Record]:
        idx, base = self._map(indices)
        labels = self.labels[idx].tolist()
        return [
            Record(i, replace(r.header, label=label), r.data)
            for i, r, label in zip(idx, self.base.read_records(base), labels, strict=True)
        ]

    @contextmanager
    def sequential(self) -> Iterator[None]:
        with self.base.sequential():
            yield

    def skipped_files(self) -> list[SkippedFile]:
        return self.base.skipped_files()

    def close(self) -> None:
        self.base.close()
