"""The reader base shared by the LMDB and Mongo datasets: decode, transforms, targets, batches.

A dataset holds a :class:`~fastdata.stores.policy.StoreReader` and nothing per sample: keys come
from the index, labels live in one array. The reader's handle opens lazily in each process, so
a dataset can be handed to ``DataLoader`` workers under fork or spawn. How a sample's field
values are given to the caller is :mod:`fastdata.sample_fields`'s.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import Any, Literal, overload

import numpy as np
from torch.utils.data import Dataset

from .errors import CorruptImageError, RecordError, UsageError
from .images.decode import decode_numpy, decode_pil
from .images.pipelines import Pipeline, takes_scan_end
from .records import bytes_problem
from .sample_fields import FieldBatch, FieldValues, field_reader
from .stores.reader import StoreReader
from .stores.view import StoreView

__all__ = [
    "OUTPUTS",
    "ImageStoreDataset",
    "LMDBImageDataset",
    "MongoImageDataset",
    "Output",
    "Samples",
]

Output = Literal["pil", "numpy", "bytes"]
OUTPUTS: tuple[str, ...] = ("pil", "numpy", "bytes")


class Samples(Sequence[tuple[str, int]]):
    """A read-only sequence of ``(name, label)`` over a store: each item is read when asked,
    a slice or a loop reads in batches. Unlike ``ImageFolder.samples`` it cannot be appended to:
    the store is what it holds."""

    def __init__(self, reader: StoreReader) -> None:
        self._reader = reader

    def __len__(self) -> int:
        return len(self._reader)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._read(range(len(self))[index])
        return self._read([index])[0]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for start in range(0, len(self), 256):
            yield from self._read(range(start, min(len(self), start + 256)))

    def _read(self, indices: Sequence[int]) -> list[tuple[str, int]]:
        return [(r.header.name, r.header.label) for r in self._reader.read_records(indices)]


def _part(
    reader: StoreReader,
    classes: Sequence[str] | None,
    indices: Sequence[int] | np.ndarray | None,
    where: Any = None,
) -> StoreReader:
    """``reader``, or the view of it that ``classes`` / ``indices`` / ``where`` choose."""
    if classes is None and indices is None and where is None:
        return reader
    return StoreView(reader, classes=classes, indices=indices, where=where)


class ImageStoreDataset(Dataset):
    """A map-style dataset over a store, usable wherever ``torchvision``'s ``ImageFolder`` is.

    ``ds[i]`` is ``(image, label)`` with ``transform`` applied to the image and
    ``target_transform`` to the label. ``DataLoader`` calls ``__getitems__`` with a whole batch of
    indices, which the store answers in one transaction or query.

    Args:
        reader: the store to read.
        transform: applied to each image (a ``PIL.Image`` by default).
        target_transform: applied to each label.
        output: what an image is before ``transform``: ``"pil"`` (RGB ``PIL.Image``),
            ``"numpy"`` (``HxWx3`` uint8 RGB array) or ``"bytes"`` (the stored encoded bytes).
        pipeline: a :class:`~fastdata.images.pipelines.Pipeline` that turns the stored bytes
            straight into a uint8 array (decode, crop, resize, flip); used when ``transform``
            is None.
        classes: read only the records of these classes; the dataset's ``classes`` are these,
            in this order, and its labels index them (see :class:`~fastdata.stores.view.StoreView`).
        indices: read only these records, in this order.
        fields: names of fields of the store (see ``info``) to read with each sample, which is
            then ``(image, target, {name: value})``; ``"*"``: all of them (none, in a store
            without fields: ``(image, target, {})``). Numbers with a shape come as numpy
            arrays (int64, float32, bool), a float as ``float``, strings as ``str``, JSON as
            Python objects. Without it, samples are ``(image, target)`` and no field is read.
        as_dict: samples as ``{"image": ..., "target": ..., name: value, ...}``.
        where: read only the records that match: a query document, the same on every backend
            (:mod:`fastdata.query`: MongoDB's language, ``{"fields.caption": {"$regex":
            "dog"}, "fields.boxes.3": {"$exists": True}}``; a MongoDB server runs it, an LMDB
            store runs it over its headers), or a predicate over a record's field values
            (``lambda f: len(f["boxes"]) > 3``) for what a query cannot say; see
            :class:`~fastdata.stores.view.StoreView`.
        check: with ``output="bytes"`` and no pipeline, check each record's bytes against
            the size and CRC-32 its header keeps before giving them (the default); False gives
            them unchecked, for a store you have verified (docs/stores.md, "Reads are checked",
            gives the cost). Records that are decoded are always checked (well under 1% of a
            decode). A record that fails raises a :class:`~fastdata.errors.RecordError` naming
            the store, the record and the ``fastdata verify`` command.

    In a store without classes (a manifest without labels), every target is -1.
    """

    def __init__(
        self,
        reader: StoreReader,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        output: Output = "pil",
        pipeline: Pipeline | None = None,
        classes: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        fields: Sequence[str] | str | None = None,
        as_dict: bool = False,
        where: Any = None,
        check: bool = True,
    ) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}; got {output!r}")
        self.reader = _part(reader, classes, indices, where)
        self.transform = transform
        self.target_transform = target_transform
        self.output = output
        self.pipeline = pipeline
        self.fields: list[str] = self._chosen_fields(fields)
        self.as_dict = as_dict
        self._with_fields = fields is not None
        """Samples carry their field values (``fields=`` given, even where the store has none:
        ``(image, target, {})``, as every other store's samples are)."""
        self.check = check

    def _chosen_fields(self, fields: Sequence[str] | str | None) -> list[str]:
        if fields is None:
            return []
        schema = self.reader.meta.schema
        if fields == "*":
            return schema.names
        names = [fields] if isinstance(fields, str) else [str(f) for f in fields]
        unknown = [n for n in names if schema.get(n) is None]
        if unknown:
            has = schema.describe() or "none"
            raise ValueError(
                f"{self.reader.location}: no field {unknown[0]!r} in the store; its fields: {has}"
            )
        return names

    @property
    def field_schema(self) -> Any:
        """The :class:`fastdata.fields.Schema` of the fields read with each sample."""
        from .fields import Schema

        cached = self.__dict__.get("_field_schema")
        if cached is None:
            schema = self.reader.meta.schema
            cached = Schema([f for f in schema.fields if f.name in self.fields])
            self.__dict__["_field_schema"] = cached
        return cached

    @property
    def samples_carry_fields(self) -> bool:
        """Whether a sample is more than ``(image, target)``: ``(image, target, fields)``
        (``fields=`` given, even an empty list) or a dict (``as_dict=True``)."""
        return self._with_fields or self.as_dict

    # -- ImageFolder-compatible attributes

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def classes(self) -> list[str]:
        """Class names, sorted as the source folder's subfolders were."""
        return self.reader.meta.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name to label."""
        return self.reader.meta.class_to_idx

    @property
    def targets(self) -> np.ndarray:
        """Every record's label, as one read-only int64 array (not a list of Python ints)."""
        return self.reader.labels

    @property
    def samples(self) -> Samples:
        """``(name, label)`` of every record, like ``ImageFolder.samples``, read from the store
        when asked (nothing per sample is held). Names are paths relative to the converted
        folder, not files on this machine."""
        return Samples(self.reader)

    imgs = samples
    """The same, under ImageFolder's older name."""

    # -- reading

    def _decode(self, data: bytes, index: int, seed: int | None, scan_end: int = -1) -> Any:
        try:
            if self.pipeline is not None and self.transform is None:
                if getattr(self.pipeline, "wants_index", False):
                    return self.pipeline(data, seed, index)  # type: ignore[call-arg]
                if scan_end >= 0:
                    return self.pipeline(data, seed, scan_end=scan_end)  # type: ignore[call-arg]
                return self.pipeline(data, seed)
            if self.output == "bytes":
                return data
            if self.output == "numpy":
                return decode_numpy(data)
            return decode_pil(data)
        except CorruptImageError as exc:
            raise CorruptImageError(self.where(index), exc.reason) from exc

    def where(self, index: int) -> str:
        """The store and the record ``index`` (with its name), as messages name a record."""
        return f"{self.reader.location}: record {index} ({self._name(index)})"

    def _name(self, index: int) -> str:
        """The record's name, for a message (read only when one is given)."""
        try:
            return self.reader.read_named([index])[0][0]
        except Exception as exc:  # the message about the image comes first
            return f"name unreadable: {exc}"

    def __getitems__(self, keys: Sequence[Any]) -> list[tuple[Any, Any]]:
        """Read and decode a batch of samples with one store round trip.

        Args:
            keys: indices, or ``(index, seed)`` pairs giving each sample's augmentation seed
                (what ``create_loader``'s sampler yields), so that a sample's crop and flip do
                not depend on which worker decodes it.
        """
        indices: Sequence[Any] = keys
        seeds: list[int | None] = [None] * len(keys)
        if any(map(isinstance, keys, repeat(tuple))):  # (in C: this is every batch's path)
            indices = [k[0] if isinstance(k, tuple) else k for k in keys]
            seeds = [int(k[1]) if isinstance(k, tuple) else None for k in keys]
        if self._with_fields or self.as_dict:
            return self._samples_with_fields(indices, seeds)
        samples, ends = self._samples(indices)
        if self.output == "bytes" and self._plain:
            return samples  # nothing to apply
        transform, target_transform = self.transform, self.target_transform
        out = []
        for i, seed, (data, label), end in zip(indices, seeds, samples, ends, strict=True):
            image = self._decode(data, int(i), seed, end)
            if transform is not None:
                image = transform(image)
            out.append((image, label if target_transform is None else target_transform(label)))
        return out

    def _samples_with_fields(self, indices: Sequence[Any], seeds: list[int | None]) -> Any:
        """Samples with their fields: from the store's columns where it keeps them (a
        :class:`~fastdata.sample_fields.FieldBatch`, which a collate function batches without
        making a value per sample), otherwise the records read whole (headers and bytes) in
        one round trip."""
        columns = self.reader.field_batch(indices, self.fields) if self.fields else None
        if columns is not None:
            samples, ends = self._samples(indices)
            if self.output == "bytes" and self._plain:  # (nothing to apply)
                images, targets = [d for d, _ in samples], [t for _, t in samples]
            else:
                images, targets = [], []
                transform, target_transform = self.transform, self.target_transform
                for i, seed, (data, label), end in zip(indices, seeds, samples, ends, strict=True):
                    image = self._decode(data, int(i), seed, end)
                    images.append(image if transform is None else transform(image))
                    targets.append(label if target_transform is None else target_transform(label))
            return FieldBatch(images, targets, columns, self.field_schema, self.as_dict)
        schema = self.reader.meta.schema
        readers = [(n, field_reader(schema.get(n))) for n in self.fields]
        read_by = self.field_schema
        transform, target_transform = self.transform, self.target_transform
        checked = self._checked and self.reader.has_checksums
        out: list[Any] = []
        for i, seed, record in zip(indices, seeds, self.reader.read_records(indices), strict=True):
            if checked:
                h = record.header
                why = bytes_problem(h.size, h.crc32, record.data)
                if why is not None:
                    raise self.reader.mismatch(int(i), h.name, why)
            image = self._decode(record.data, int(i), seed, record.header.scan_end)
            if transform is not None:
                image = transform(image)
            label = record.header.label
            target = label if target_transform is None else target_transform(label)
            stored = record.header.fields or {}
            values = FieldValues() if not self.as_dict else FieldValues(image=image, target=target)
            values.schema = read_by
            try:
                for name, read in readers:
                    values[name] = read(stored[name])
            except KeyError as exc:
                raise RecordError(
                    f"{self.where(int(i))}: field {exc.args[0]!r} of the store's schema is missing",
                    store=self.reader.command_target,
                ) from None
            out.append(values if self.as_dict else (image, target, values))
        return out

    @property
    def _checked(self) -> bool:
        """Whether reads are checked: always where records are decoded, and where raw bytes are
        given unless ``check=False``."""
        return self.check or self.pipeline is not None or self.output != "bytes"

    def _samples(self, indices: Sequence[Any]) -> tuple[list[tuple[bytes, int]], list[int]]:
        """The records' bytes and labels (checked where :attr:`_checked` says), and each one's
        scan end where the pipeline takes it (NOTE [ Scan ends ] in
        :mod:`fastdata.images.codec`: read from the headers a checked read reads anyway); -1
        each otherwise (searched where needed)."""
        pipeline = self.pipeline
        if pipeline is not None and self.transform is None and takes_scan_end(pipeline):
            return self.reader.read_samples_ends(indices)
        samples = self.reader.read_samples(indices, check=self._checked)
        return samples, [-1] * len(samples)

    @property
    def _plain(self) -> bool:
        """No pipeline and no transforms: samples are what the store gives."""
        return self.pipeline is None and self.transform is None and self.target_transform is None

    def __getitem__(self, index: Any) -> tuple[Any, Any]:
        if (
            type(index) is int
            and self.output == "bytes"
            and self.pipeline is None
            and self.transform is None
            and self.target_transform is None
            and not self._with_fields
            and not self.as_dict
        ):
            # the raw read: its shortest path
            return self.reader.read_sample(index, check=self.check)
        return self.__getitems__([index])[0]

    def subset(
        self,
        *,
        classes: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        where: Any = None,
    ) -> ImageStoreDataset:
        """A copy of this dataset that reads only some classes and/or records (indices of this
        dataset, or those whose fields match ``where``), sharing the store's reader; no record
        is copied."""
        clone = copy.copy(self)
        clone.reader = StoreView(self.reader, classes=classes, indices=indices, where=where)
        return clone

    def with_pipeline(self, pipeline: Pipeline | None) -> ImageStoreDataset:
        """A copy of this dataset that turns records into arrays with ``pipeline`` (when it has
        no ``transform`` of its own); the copy shares the store's reader."""
        clone = copy.copy(self)
        clone.pipeline = pipeline
        return clone

    def close(self) -> None:
        """Release this process's store handle (it reopens on the next read)."""
        self.reader.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.reader.location!r}, {len(self)} records, "
            f"output={self.output!r})"
        )


class LMDBImageDataset(ImageStoreDataset):
    """An image dataset read from an LMDB store written by ``fastdata convert``.

    Example::

        ds = LMDBImageDataset("train.lmdb", transform=my_transform)
        loader = DataLoader(ds, batch_size=64, num_workers=4)

    Args:
        path: the store folder (or a single-file LMDB written by another tool).
        transform: applied to each image.
        target_transform: applied to each label.
        output: ``"pil"`` (default), ``"numpy"`` or ``"bytes"``; see :class:`ImageStoreDataset`.
        pipeline: decode-crop-resize straight to uint8 arrays; see :class:`ImageStoreDataset`.
        allow_pickle: read a store written by the pickle-based recipes (its values are unpickled,
            which can run arbitrary code: only for stores you trust).
        classes: read only the records of these classes (labels follow this list).
        indices: read only these records, in this order.
        fields, as_dict, where: the store's per-image fields; see :class:`ImageStoreDataset`.
        check: raw bytes checked against their records' CRC-32 (the default); see
            :class:`ImageStoreDataset`.

    Raises:
        StoreNotFoundError, IncompleteStoreError, PickleNotAllowedError, StoreError: see
            :func:`fastdata.stores.lmdb.layout.open_lmdb`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        output: Output = "pil",
        pipeline: Pipeline | None = None,
        allow_pickle: bool = False,
        classes: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        fields: Sequence[str] | str | None = None,
        as_dict: bool = False,
        where: Any = None,
        check: bool = True,
    ) -> None:
        from .stores.lmdb.open import open_lmdb
        from .stores.uri import is_mongo_uri, mask_uri

        if is_mongo_uri(path):
            raise UsageError(
                f"{mask_uri(str(path))}: a MongoDB URI, not an LMDB store: read it with "
                "MongoImageDataset(uri, collection)"
            )
        super().__init__(
            open_lmdb(os.path.expanduser(path), allow_pickle=allow_pickle),
            transform,
            target_transform,
            output=output,
            pipeline=pipeline,
            classes=classes,
            indices=indices,
            fields=fields,
            as_dict=as_dict,
            where=where,
            check=check,
        )


class MongoImageDataset(ImageStoreDataset):
    """An image dataset read from a MongoDB collection written by ``fastdata convert``, or from
    a collection in the common ``img_name``/``bson_img`` layout (give its ``index_file``).

    Example::

        ds = MongoImageDataset("mongodb://db1:27017/images", "train",
                               read_preference="secondaryPreferred", transform=my_transform)

    Args:
        uri: ``mongodb://[user:password@]host:port/DB``; credentials may also come from the
            ``FASTDATA_MONGO_USER`` and ``FASTDATA_MONGO_PASSWORD`` environment variables.
        collection: the collection.
        transform: applied to each image.
        target_transform: applied to each label.
        output: ``"pil"`` (default), ``"numpy"`` or ``"bytes"``.
        pipeline: decode-crop-resize straight to uint8 arrays; see :class:`ImageStoreDataset`.
        database: the database, when the URI names none.
        index_file: the JSON index of a collection in the common layout.
        classes: read only the records of these classes (labels follow this list).
        indices: read only these records, in this order.
        fields, as_dict, where: the store's per-image fields; ``where``'s query is run by the
            server; see :class:`ImageStoreDataset`.
        check: raw bytes checked against their records' CRC-32 (the default); see
            :class:`ImageStoreDataset`.
        **options: any field of :class:`~fastdata.stores.mongo.connection.MongoOptions`
            (``read_preference``, ``timeout_s``, ``socket_timeout_s``, ``retry_budget_s``);
            the ones not given keep its defaults.
    """

    def __init__(
        self,
        uri: str,
        collection: str,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        output: Output = "pil",
        pipeline: Pipeline | None = None,
        database: str | None = None,
        index_file: str | os.PathLike[str] | None = None,
        classes: Sequence[str] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        fields: Sequence[str] | str | None = None,
        as_dict: bool = False,
        where: Any = None,
        check: bool = True,
        **options: Any,
    ) -> None:
        from .stores import open_store
        from .stores.uri import is_mongo_uri

        if not is_mongo_uri(uri) and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", str(uri)):
            raise UsageError(
                f"{uri}: an LMDB path, not a mongodb:// URI: read it with LMDBImageDataset(path)"
            )
        super().__init__(
            open_store(
                uri, collection=collection, database=database, index_file=index_file, **options
            ),
            transform,
            target_transform,
            output=output,
            pipeline=pipeline,
            classes=classes,
            indices=indices,
            fields=fields,
            as_dict=as_dict,
            where=where,
            check=check,
        )
