"""Batch collation that keeps images as uint8: normalisation happens later, on the device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .slots import batch_buffer, finish

__all__ = ["EncodedBatch", "collate_encoded", "fast_collate"]


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


def fast_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(image, label), ...]`` -> ``(uint8 N x C x H x W tensor, int64 labels)``.

    Images may be ``H x W x C`` uint8 arrays (what the pipelines produce), PIL images or
    ``C x H x W`` uint8 tensors, all of one size. Each is copied once, as it lies in memory, into
    an ``N x H x W x C`` buffer; the batch is that buffer seen as ``N x C x H x W`` (the
    ``channels_last`` layout). Nothing is converted to float on the CPU. In a ``DataLoader``
    worker the buffer is shared memory reused batch after batch (:mod:`fastdata.loaders.slots`).
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    images = [_hwc(image) for image, _ in batch]
    first = images[0]
    out, owner = batch_buffer((len(images), *first.shape))
    for i, image in enumerate(images):
        if image.shape != first.shape:
            raise ValueError(
                f"images of one batch must have one size: {tuple(first.shape)} and "
                f"{tuple(image.shape)} (H x W x C); resize or crop them first"
            )
        out[i].copy_(image)
    labels = torch.as_tensor([int(label) for _, label in batch], dtype=torch.int64)
    return finish(out.permute(0, 3, 1, 2), labels, owner)


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
    :class:`~fastdata.images.device_decode.Planned` pipeline gives) -> :class:`EncodedBatch`."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    labels = torch.as_tensor([int(label) for _, label in batch], dtype=torch.int64)
    samples = [sample for sample, _ in batch]
    return EncodedBatch(
        [s[0] for s in samples], [s[1] for s in samples], labels, [s[2] for s in samples]
    )
