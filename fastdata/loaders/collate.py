"""Batch collation that keeps images as uint8: normalisation happens later, on the device."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..sample_fields import FieldBatch
from .slots import batch_buffer, finish

__all__ = ["EncodedBatch", "collate_encoded", "collate_for", "fast_collate"]


def _hwc(image: Any) -> torch.Tensor:
    if isinstance(image, torch.Tensor):
        if image.dim() != 3:
            raise ValueError(f"expected a 3-D image tensor (C x H x W), got shape {image.shape}")
        return image.permute(1, 2, 0)
    arr = np.asarray(image)  # numpy HWC, or a PIL image
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ValueError(f"expected an H x W x C image, got shape {arr.shape}")
    return torch.from_numpy(arr)


def fast_collate(batch: Sequence[Any], *, schema: Any = None, pad: bool = False) -> Any:
    """``[(image, label), ...]`` -> ``(uint8 N x C x H x W tensor, int64 labels)``.

    Images may be ``H x W x C`` uint8 arrays (what the pipelines produce), PIL images or
    ``C x H x W`` uint8 tensors, all of one size. Each is copied once, as it lies in memory, into
    an ``N x H x W x C`` buffer; the batch is that buffer seen as ``N x C x H x W`` (the
    ``channels_last`` layout). Nothing is converted to float on the CPU. In a ``DataLoader``
    worker the buffer is shared memory reused batch after batch (:mod:`fastdata.loaders.slots`).

    Samples with fields (a dataset read with ``fields=``) batch them too (:func:`collate_fields`):
    ``[(image, label, {name: value}), ...]`` -> ``(images, labels, {name: batched})``, and dict
    samples ``[{"image", "target", name...}, ...]`` -> one dict of the same keys. ``schema``
    (the dataset's :class:`fastdata.fields.Schema`; by default the one a fastdata dataset's
    samples carry) decides which fields are tensors, so a batch has the same types in
    ``create_loader``, in a ``DataLoader`` of any worker count and here; ``pad`` pads
    variable-length ones (see :func:`collate_fields`).
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    if isinstance(batch, FieldBatch):  # (read from columns: batched as arrays)
        chw, labels, owner = _images(
            list(zip(batch.images, batch.targets, strict=True)), not batch.as_dict
        )
        fields = {name: _tensor(v) for name, v in batch.arrays(pad).items()}
        if batch.as_dict:
            return {"image": chw, "target": labels, **fields}
        return finish(chw, labels, owner, fields)
    first_sample = batch[0]
    as_dict = isinstance(first_sample, dict)
    if as_dict:
        pairs = [(s["image"], s["target"]) for s in batch]
    elif len(first_sample) == 3:
        pairs = [(s[0], s[1]) for s in batch]
    else:
        pairs = batch  # type: ignore[assignment]
    chw, labels, owner = _images(pairs, not as_dict)
    if as_dict:
        if schema is None:
            schema = getattr(first_sample, "schema", None)
        values = [{k: v for k, v in s.items() if k not in ("image", "target")} for s in batch]
        return {"image": chw, "target": labels, **collate_fields(values, schema, pad)}
    if len(first_sample) == 3:
        if schema is None:
            schema = getattr(first_sample[2], "schema", None)
        fields = collate_fields([s[2] for s in batch], schema, pad)
        return finish(chw, labels, owner, fields)
    return finish(chw, labels, owner)


def _images(
    pairs: Sequence[tuple[Any, Any]], slots: bool
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The images of ``(image, label)`` pairs as one uint8 N x C x H x W batch (channels last
    in memory), the labels as int64, and the owner of the batch's buffer."""
    images = [_hwc(image) for image, _ in pairs]
    first = images[0]
    out, owner = batch_buffer((len(images), *first.shape), slots=slots)
    for i, image in enumerate(images):
        if image.shape != first.shape:
            raise ValueError(
                f"images of one batch must have one size: {tuple(first.shape)} and "
                f"{tuple(image.shape)} (H x W x C); resize or crop them first"
            )
        out[i].copy_(image)
    labels = torch.as_tensor([int(label) for _, label in pairs], dtype=torch.int64)
    return out.permute(0, 3, 1, 2), labels, owner


def _tensor(value: Any) -> Any:
    """A field's batched value as ``collate_fields`` gives it: arrays as tensors (one, or a
    list of them), strings and JSON as they are."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if value and isinstance(value[0], np.ndarray):
        return [torch.from_numpy(v) for v in value]
    return value


def collate_fields(
    samples: Sequence[dict[str, Any]], schema: Any = None, pad: bool = False
) -> dict[str, Any]:
    """A batch's field values, by name: numbers of one shape (a fixed-shape field of the
    schema) as one tensor; numbers whose first dimension varies as a list of tensors, or, with
    ``pad``, one tensor padded with zeros to the longest and ``<name>_mask`` (bool, N x L: True
    where a value is); strings and JSON as lists. Without a schema, numbers whose shapes agree in
    this batch are one tensor.

    Scalar floats are float64, the values as stored (a float32 would turn 1e300 into infinity
    and 1700000000.25 into 1700000000.0); lists of floats, which a store keeps inside float32's
    range, are float32 as the dataset reads them; ints are int64."""
    if not samples:
        return {}
    out: dict[str, Any] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        field = schema.get(name) if schema is not None else None
        kind = field.type if field is not None else _kind_of(values)
        if kind not in ("int", "float", "bool"):
            out[name] = values
            continue
        if kind == "float" and all(isinstance(v, (int, float)) for v in values):
            out[name] = torch.tensor(values, dtype=torch.float64)  # (exact; see above)
            continue
        tensors = [torch.as_tensor(v) for v in values]
        fixed = field.fixed if field is not None else len({t.shape for t in tensors}) == 1
        if fixed:
            out[name] = torch.stack(tensors)
        elif pad:
            if f"{name}_mask" in samples[0]:
                raise ValueError(
                    f"fields: padding {name!r} makes its mask {name}_mask, which is a field of "
                    "the store too: read the fields without padding (pad_fields=False), or "
                    "leave one of them out of fields="
                )
            out[name], out[f"{name}_mask"] = _padded(tensors)
        else:
            out[name] = tensors
    return out


def _kind_of(values: list[Any]) -> str:
    first = values[0]
    if isinstance(first, np.ndarray) and first.dtype.kind in "biuf":
        return {"b": "bool", "i": "int", "u": "int", "f": "float"}[first.dtype.kind]
    if isinstance(first, (bool, int, float)) and all(
        isinstance(v, (bool, int, float)) for v in values
    ):
        return "float" if any(isinstance(v, float) for v in values) else "int"
    return "json"


def _padded(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(t.shape[0] for t in tensors)
    rest = tensors[0].shape[1:]
    out = torch.zeros((len(tensors), longest, *rest), dtype=tensors[0].dtype)
    mask = torch.zeros((len(tensors), longest), dtype=torch.bool)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
        mask[i, : t.shape[0]] = True
    return out, mask


class EncodedBatch(NamedTuple):
    """A batch still encoded, for a :class:`~fastdata.images.device_decode.DeviceDecoder`: each
    sample's stored bytes and :class:`~fastdata.images.pipelines.CropPlan`, the labels, and
    the samples' indices in the dataset (for errors that name the record)."""

    data: list[bytes]
    plans: list[Any]
    labels: torch.Tensor
    indices: list[int]


def collate_encoded(batch: Sequence[tuple[tuple[bytes, Any, int], Any]]) -> EncodedBatch:
    """``[((bytes, plan, index), label), ...]`` (what a dataset with a
    :class:`~fastdata.images.pipelines.Planned` pipeline gives) -> :class:`EncodedBatch`."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    labels = torch.as_tensor([int(label) for _, label in batch], dtype=torch.int64)
    samples = [sample for sample, _ in batch]
    return EncodedBatch(
        [s[0] for s in samples], [s[1] for s in samples], labels, [s[2] for s in samples]
    )


def collate_for(dataset: Any, pad: bool) -> Callable[[list[Any]], Any]:
    """``fast_collate``, told the dataset's field schema when it reads fields (so a field is a
    tensor in every batch or in none), padding variable-length ones with ``pad``."""
    schema = getattr(dataset, "field_schema", None)
    if not getattr(dataset, "fields", None) or schema is None:
        return fast_collate
    if pad:  # (refused here, not at the first batch)
        names = set(schema.names)
        for f in schema.fields:
            if not f.fixed and f.type in ("int", "float", "bool") and f"{f.name}_mask" in names:
                raise ValueError(
                    f"pad_fields=True: padding {f.name!r} makes its mask {f.name}_mask, which "
                    "is a field of the store too: leave one of them out of fields=, or pass "
                    "pad_fields=False"
                )
    return functools.partial(fast_collate, schema=schema, pad=pad)
