"""Turn uint8 image batches into normalised floating-point tensors, on whatever device they are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .device import is_image_batch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Normalizer"]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Normalizer:
    """Converts uint8 ``N x C x H x W`` image batches; every other tensor is left as it is.

    Args:
        mean: per-channel mean in 0-1 units, or None for no mean/std normalisation.
        std: per-channel standard deviation in 0-1 units.
        dtype: the floating-point type of the result (float32, float16, bfloat16, ...), or None to
            leave images as uint8 (when not normalising).
        channels_last: give images the ``channels_last`` memory format.
    """

    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    dtype: torch.dtype | None = None
    channels_last: bool = False

    @property
    def converts(self) -> bool:
        return self.mean is not None or self.dtype is not None

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``mean * 255`` and ``1 / (std * 255)``: ``1 x C x 1 x 1`` float32 tensors on ``device``.

        Computed once per device by the caller, so the 255 scaling is not paid per batch.
        """
        if self.mean is None:
            return None
        std = self.std if self.std is not None else IMAGENET_STD
        mean = torch.tensor(self.mean, dtype=torch.float32).mul_(255).view(1, -1, 1, 1)
        inv_std = torch.tensor(std, dtype=torch.float32).mul_(255).reciprocal_().view(1, -1, 1, 1)
        return mean.to(device), inv_std.to(device)

    def apply(
        self, t: torch.Tensor, constants: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """Normalise one tensor if it is an image batch; return it unchanged otherwise."""
        if not is_image_batch(t):
            return t
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.converts:
            dtype = self.dtype or torch.float32
            # Arithmetic in float32 (exact for 0..255), then one cast: float16 and bfloat16
            # results match the float32 reference to their own precision. The first copy also
            # gives the result its memory format (batches may arrive channels_last).
            x = t.to(dtype=torch.float32, memory_format=layout)
            if constants is not None:
                mean, inv_std = constants
                if t.shape[1] != mean.shape[1]:
                    raise ValueError(
                        f"mean/std have {mean.shape[1]} channels but the image batch has "
                        f"{t.shape[1]} (shape {tuple(t.shape)}, expected N x C x H x W)"
                    )
                x = x.sub_(mean).mul_(inv_std)
            else:
                x = x.mul_(1.0 / 255.0)
            return x if dtype == torch.float32 else x.to(dtype)
        return t.contiguous(memory_format=layout) if self.channels_last else t
