"""Image pipelines without torchvision: encoded bytes to ``H x W x 3`` uint8 arrays.

``TrainPipeline`` is random-resized-crop (the usual scale and aspect-ratio ranges) plus horizontal
flip; ``EvalPipeline`` resizes the short side and takes the center crop. Both decode JPEGs with
libjpeg-turbo (``simplejpeg``) when it is installed, and at a reduced size when the region they
keep is at least twice the output (the decoder scales by 1/2, 1/4 or 1/8 in the DCT domain, which
is cheaper than decoding everything; other factors cost more than they save). Resizing uses
torch's antialiased uint8 kernel.

Randomness comes from a per-sample seed, so a sample gets the same crop and flip whichever worker
process decodes it: ``create_loader`` derives the seed from its own seed, the epoch and the index.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from .decode import decode_array, image_size

__all__ = ["EvalPipeline", "Pipeline", "TrainPipeline", "sample_crop"]


def _shrink_for(kept_h: float, kept_w: float, out_h: int, out_w: int) -> int:
    """The largest power-of-two reduction (at most 8) that keeps the region >= the output."""
    shrink = 1
    while shrink < 8 and kept_h / (shrink * 2) >= out_h and kept_w / (shrink * 2) >= out_w:
        shrink *= 2
    return shrink


def _resize(region: np.ndarray, out_h: int, out_w: int, flip: bool) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    # channels_last in, channels_last out: the kernel's fast path, and the result is already HWC
    x = torch.from_numpy(region).permute(2, 0, 1).unsqueeze(0)
    x = x.contiguous(memory_format=torch.channels_last)
    if x.shape[2] != out_h or x.shape[3] != out_w:
        x = F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True)
    hwc = x[0].permute(1, 2, 0)
    if flip:
        hwc = hwc.flip(1)
    return np.ascontiguousarray(hwc.numpy())


def _region(
    data: bytes,
    full: tuple[int, int],
    box: tuple[float, float, float, float],
    size: int,
    fast: bool,
    flip: bool = False,
) -> np.ndarray:
    """Decode (reduced where the box allows), cut ``box`` = (top, left, h, w) of the full-size
    image, resize it to ``size`` square, flip it if asked."""
    height, width = full
    top, left, h, w = box
    img = decode_array(data, shrink=_shrink_for(h, w, size, size), fast=fast, size=full)
    fy, fx = img.shape[0] / height, img.shape[1] / width
    y0, x0 = int(top * fy), int(left * fx)
    y1 = max(y0 + 1, min(img.shape[0], round((top + h) * fy)))
    x1 = max(x0 + 1, min(img.shape[1], round((left + w) * fx)))
    return _resize(img[y0:y1, x0:x1], size, size, flip)


def sample_crop(
    rng: random.Random,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> tuple[int, int, int, int]:
    """A random crop ``(top, left, h, w)`` covering a ``scale`` fraction of the area with an
    aspect ratio in ``ratio`` (log-uniform), as RandomResizedCrop draws it; after ten misses, the
    largest centered crop within ``ratio``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class Pipeline:
    """Encoded image bytes -> ``size x size x 3`` uint8 RGB array (subclasses: ``__call__``)."""

    size: int

    def __call__(self, data: bytes, seed: int | None = None) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class TrainPipeline(Pipeline):
    """Random-resized-crop to ``size`` and a horizontal flip with probability ``hflip``.

    Args:
        size: output side.
        scale: range of the crop's share of the image area.
        ratio: range of the crop's aspect ratio.
        hflip: probability of a horizontal flip.
        fast_decode: libjpeg-turbo's fast integer IDCT and chroma upsampling (slightly less exact
            pixels, invisible under augmentation).
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    fast_decode: bool = True

    def __call__(self, data: bytes, seed: int | None = None) -> np.ndarray:
        rng = random.Random(seed)  # cheap to create per sample, unlike numpy's generators
        height, width = image_size(data)
        top, left, h, w = sample_crop(rng, height, width, self.scale, self.ratio)
        flip = bool(rng.random() < self.hflip)
        return _region(data, (height, width), (top, left, h, w), self.size, self.fast_decode, flip)


@dataclass(frozen=True)
class EvalPipeline(Pipeline):
    """Resize the short side to ``size / crop_pct``, then take the central ``size`` square.

    Args:
        size: output side.
        crop_pct: the share of the resized short side kept (0.875: resize to 256, crop 224).
        fast_decode: see :class:`TrainPipeline` (off by default for evaluation).
    """

    size: int = 224
    crop_pct: float = 0.875
    fast_decode: bool = False

    def __call__(self, data: bytes, seed: int | None = None) -> np.ndarray:
        height, width = image_size(data)
        short = min(height, width)
        resized = self.size / self.crop_pct
        # the central square of the source that ends up in the output
        side = short * self.size / resized
        top, left = (height - side) / 2, (width - side) / 2
        return _region(data, (height, width), (top, left, side, side), self.size, self.fast_decode)
