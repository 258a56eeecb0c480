"""Image pipelines without torchvision: encoded bytes to ``H x W x 3`` uint8 arrays.

``TrainPipeline`` is random-resized-crop (the usual scale and aspect-ratio ranges) plus horizontal
flip; ``EvalPipeline`` resizes the short side and takes the center crop. Both decode JPEGs with
libjpeg-turbo (``simplejpeg``) when it is installed, and at a reduced size when the region they
keep is at least twice the output (the decoder scales by 1/2, 1/4 or 1/8 in the DCT domain, which
is cheaper than decoding everything; other factors cost more than they save), and only down to
the bottom of the region they keep (a sequential JPEG's scan can end there: the rows below are
never decoded). Resizing uses torch's antialiased uint8 kernel.

Randomness comes from a per-sample seed, so a sample gets the same crop and flip whichever worker
process decodes it: ``create_loader`` derives the seed from its own seed, the epoch and the index.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import window
from .codec import is_jpeg
from .decode import decode_array, decode_top, image_size

__all__ = [
    "CropPlan",
    "EvalPipeline",
    "Pipeline",
    "Planned",
    "TrainPipeline",
    "output_shape",
    "render",
    "sample_crop",
    "shrink_for",
    "takes_scan_end",
]


def shrink_for(kept_h: float, kept_w: float, out_h: int, out_w: int) -> int:
    """The largest power-of-two reduction (at most 8) that keeps the region >= the output."""
    shrink = 1
    while shrink < 8 and kept_h / (shrink * 2) >= out_h and kept_w / (shrink * 2) >= out_w:
        shrink *= 2
    return shrink


def _resize(region: np.ndarray, out_h: int, out_w: int, flip: bool) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    # channels_last in, channels_last out: the kernel's fast path, and the result is already HWC.
    # (The batch dimension added first: added after the permute, its stride is C, and a whole
    # contiguous region then passes for channels_last without being it for the kernel, which
    # took 2-3x as long: measured, 0.55 against 0.23 ms for a 372 x 432 window to 224.)
    x = torch.from_numpy(region).unsqueeze(0).permute(0, 3, 1, 2)
    x = x.contiguous(memory_format=torch.channels_last)
    if x.shape[2] != out_h or x.shape[3] != out_w:
        x = F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True)
    hwc = x[0].permute(1, 2, 0)
    if flip:
        hwc = hwc.flip(1)
    return np.ascontiguousarray(hwc.numpy())


def output_shape(size: int | Sequence[int]) -> tuple[int, int]:
    """``(height, width)`` of a pipeline's output: ``size`` square, or an ``(h, w)`` pair (the
    forms timm's ``img_size`` takes).

    Raises:
        ValueError: not a positive int or a pair of them.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        pair: tuple[Any, ...] = (size, size)
    elif isinstance(size, Sequence) and not isinstance(size, str | bytes) and len(size) == 2:
        pair = tuple(size)
    else:
        raise ValueError(f"image size {size!r}: give an int or an (height, width) pair")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ValueError(f"image size {size!r}: sides must be positive whole numbers")
    return int(pair[0]), int(pair[1])


@dataclass(frozen=True)
class CropPlan:
    """What a pipeline does to one image, drawn before any pixel is decoded: the CPU path
    (:func:`render`) and the device path (:mod:`fastdata.images.device_decode`) both follow it,
    so a sample gets the same crop, flip and jitter on either.

    Attributes:
        full: ``(height, width)`` of the image, from its header.
        box: ``(top, left, height, width)`` of the region kept, in full-size pixels (floats:
            the evaluation crop need not fall on whole pixels).
        out: ``(height, width)`` of the output.
        flip: flip the output horizontally.
        jitter: the colour jitter, ``(op, factor)`` in the order applied (see
            :func:`draw_jitter`); empty for none.
    """

    full: tuple[int, int]
    box: tuple[float, float, float, float]
    out: tuple[int, int]
    flip: bool = False
    jitter: tuple[tuple[int, float], ...] = ()

    def pixels(self, rows: int, cols: int) -> tuple[int, int, int, int]:
        """The box as whole pixels ``(y0, x0, y1, x1)`` of the image decoded at ``rows x cols``
        (the full size, or a reduction of it): at least one pixel, never past the edge."""
        height, width = self.full
        top, left, h, w = self.box
        fy, fx = rows / height, cols / width
        y0 = max(0, min(rows - 1, int(top * fy)))  # a crop_pct over 1 asks for more than
        x0 = max(0, min(cols - 1, int(left * fx)))  # the image: it keeps the whole image
        y1 = max(y0 + 1, min(rows, round((top + h) * fy)))
        x1 = max(x0 + 1, min(cols, round((left + w) * fx)))
        return y0, x0, y1, x1


def render(data: bytes, plan: CropPlan, fast: bool, scan_end: int = -1) -> np.ndarray:
    """Follow ``plan`` on the CPU: decode (reduced where the box allows), cut the box, resize
    it to the output, flip and jitter it; an ``H x W x 3`` uint8 array. ``scan_end``: where a
    JPEG's first scan ends as its record's header gives it (NOTE [ Scan ends ] in
    :mod:`~fastdata.images.codec`; -1: searched where needed)."""
    out_h, out_w = plan.out
    top, _, kept_h, kept_w = plan.box
    shrink = shrink_for(kept_h, kept_w, out_h, out_w)
    region = None
    if window.available() and is_jpeg(data):  # the window alone, where it can be
        height, width = plan.full
        box = plan.pixels(-(-height // shrink), -(-width // shrink))
        region = window.decode_window(data, shrink, box, fast, scan_end)
    if region is None:
        # only the rows down to the box's bottom edge (and a scaled pixel more, for the rounding)
        img, rows = decode_top(
            data,
            math.ceil(top + kept_h) + shrink,
            shrink=shrink,
            fast=fast,
            size=plan.full,
            scan_end=scan_end,
        )
        y0, x0, y1, x1 = plan.pixels(rows, img.shape[1])
        if y1 > img.shape[0]:  # (never, by the margins above; but never a cut-off crop either)
            img = decode_array(data, shrink=shrink, fast=fast, size=plan.full)
            y0, x0, y1, x1 = plan.pixels(img.shape[0], img.shape[1])
        region = img[y0:y1, x0:x1]
    image = _resize(region, out_h, out_w, plan.flip)
    return color_jitter(image, plan.jitter) if plan.jitter else image


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
    """Encoded image bytes -> ``height x width x 3`` uint8 RGB array (subclasses:
    ``__call__``), ``size`` being an int (square) or an ``(h, w)`` pair."""

    size: int | tuple[int, int]

    def __call__(self, data: bytes, seed: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def plan(self, data: bytes, seed: int | None = None) -> CropPlan:
        """What the pipeline will do to ``data`` (its crop, flip, jitter), from the header
        alone: the device decoder follows it (:mod:`fastdata.images.device_decode`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class TrainPipeline(Pipeline):
    """Random-resized-crop to ``size`` and a horizontal flip with probability ``hflip``.

    Args:
        size: output side, or ``(height, width)`` (the crop is then resized to that shape,
            as ``RandomResizedCrop`` does).
        scale: range of the crop's share of the image area.
        ratio: range of the crop's aspect ratio.
        hflip: probability of a horizontal flip.
        fast_decode: libjpeg-turbo's fast integer IDCT and chroma upsampling (slightly less exact
            pixels, invisible under augmentation).
        color_jitter: brightness, contrast and saturation jitter as timm's ``color_jitter``
            (and torchvision's ``ColorJitter``) apply it: a float ``j`` for all three, or a
            triple; each factor is drawn from ``[max(0, 1 - j), 1 + j]`` and the three are
            applied in a random order. None (the default) or 0: none.
        color_jitter_prob: the probability that the jitter is applied to a sample (timm's
            ``color_jitter_prob``); None: always.

    The crop, the flip and the jitter are drawn from the sample's seed, so a sample gets the
    same ones whichever worker decodes it.
    """

    size: int | tuple[int, int] = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    fast_decode: bool = True
    color_jitter: float | tuple[float, float, float] | None = None
    color_jitter_prob: float | None = None

    def __post_init__(self) -> None:
        output_shape(self.size)  # a bad size is refused here, not in a worker
        jitter_strengths(self.color_jitter)

    def plan(self, data: bytes, seed: int | None = None) -> CropPlan:
        rng = random.Random(seed)  # cheap to create per sample, unlike numpy's generators
        height, width = image_size(data)
        box = sample_crop(rng, height, width, self.scale, self.ratio)
        flip = bool(rng.random() < self.hflip)
        strengths = jitter_strengths(self.color_jitter)
        jitter: tuple[tuple[int, float], ...] = ()
        if any(strengths) and (
            self.color_jitter_prob is None or rng.random() < self.color_jitter_prob
        ):
            jitter = tuple(draw_jitter(rng, strengths))
        return CropPlan((height, width), box, output_shape(self.size), flip, jitter)

    def __call__(self, data: bytes, seed: int | None = None, scan_end: int = -1) -> np.ndarray:
        return render(data, self.plan(data, seed), self.fast_decode, scan_end)


def jitter_strengths(value: float | Sequence[float] | None) -> tuple[float, float, float]:
    """``(brightness, contrast, saturation)`` strengths from timm's ``color_jitter`` forms: a
    float for all three, a triple, or a 4-tuple whose hue (fourth) must be 0 (hue is not
    supported).

    Raises:
        ValueError: a negative strength, a hue, or another form.
    """
    if value is None:
        return (0.0, 0.0, 0.0)
    if isinstance(value, int | float) and not isinstance(value, bool):
        out = (float(value),) * 3
    elif isinstance(value, Sequence) and len(value) in (3, 4):
        if len(value) == 4 and float(value[3]) != 0:
            raise ValueError(f"color_jitter {tuple(value)}: hue jitter is not supported; give 0")
        out = (float(value[0]), float(value[1]), float(value[2]))
    else:
        raise ValueError(
            f"color_jitter {value!r}: give a float or (brightness, contrast, saturation)"
        )
    if any(not v >= 0 for v in out):
        raise ValueError(f"color_jitter {value!r}: strengths must be >= 0")
    return out[0], out[1], out[2]


def draw_jitter(
    rng: random.Random, strengths: tuple[float, float, float]
) -> list[tuple[int, float]]:
    """The jitter of one sample: ``(op, factor)`` in the order applied, as torchvision's
    ``ColorJitter`` draws it (an order, then a factor per op; op 0 brightness, 1 contrast,
    2 saturation; ops of strength 0 left out)."""
    order = [0, 1, 2]
    rng.shuffle(order)
    return [
        (op, rng.uniform(max(0.0, 1 - strengths[op]), 1 + strengths[op]))
        for op in order
        if strengths[op] > 0
    ]


def color_jitter(image: np.ndarray, ops: Sequence[tuple[int, float]]) -> np.ndarray:
    """Apply ``ops`` (see :func:`draw_jitter`) to an ``H x W x 3`` uint8 RGB image, as
    torchvision's functional ``adjust_brightness`` / ``adjust_contrast`` /
    ``adjust_saturation`` do on uint8 tensors (blend, clamp, truncate to uint8 after each)."""
    x = image.astype(np.float32)
    for op, factor in ops:
        if op == 0:
            other: np.ndarray | float = 0.0
        else:
            gray = x[..., 0] * 0.2989 + x[..., 1] * 0.587 + x[..., 2] * 0.114
            gray = np.floor(gray)  # torchvision's grayscale of uint8 is uint8
            other = float(gray.mean()) if op == 1 else gray[..., None]
        x = np.clip(factor * x + (1 - factor) * other, 0, 255)
        x = np.floor(x)  # back to uint8 between ops, as torchvision's functions return
    return x.astype(np.uint8)


@dataclass(frozen=True)
class EvalPipeline(Pipeline):
    """Resize the short side to ``size / crop_pct``, then take the central ``size`` square.

    Args:
        size: output side, or ``(height, width)``: then, as timm does for a pair, the image
            is resized to ``(height, width) / crop_pct`` and its centre cut out.
        crop_pct: the share of the resized short side kept (0.875: resize to 256, crop 224).
        fast_decode: see :class:`TrainPipeline` (off by default for evaluation).
    """

    size: int | tuple[int, int] = 224
    crop_pct: float = 0.875
    fast_decode: bool = False

    def __post_init__(self) -> None:
        output_shape(self.size)  # a bad size is refused here, not in a worker

    def plan(self, data: bytes, seed: int | None = None) -> CropPlan:
        height, width = image_size(data)
        out = output_shape(self.size)
        if out[0] == out[1]:
            # the short side resized to size / crop_pct: the central square of the source
            # that ends up in the output
            kept_h = kept_w = min(height, width) * self.crop_pct
        else:  # the whole image resized to (h, w) / crop_pct: its central crop_pct
            kept_h, kept_w = height * self.crop_pct, width * self.crop_pct
        top, left = (height - kept_h) / 2, (width - kept_w) / 2
        return CropPlan((height, width), (top, left, kept_h, kept_w), out)

    def __call__(self, data: bytes, seed: int | None = None, scan_end: int = -1) -> np.ndarray:
        return render(data, self.plan(data, seed), self.fast_decode, scan_end)


class Planned(Pipeline):
    """A pipeline's plans without its pixels: ``(encoded bytes, plan, index)`` per sample, what
    a loader's workers hand to a :class:`~fastdata.images.device_decode.DeviceDecoder`
    (``create_loader(decode="device")``).

    Args:
        pipeline: a pipeline whose ``plan`` says all that its ``__call__`` does (the built-in
            ones, and subclasses that leave ``__call__`` alone).

    Raises:
        ValueError: a pipeline the device cannot follow.
    """

    wants_index = True  # the dataset passes each sample's index (errors name the record)

    def __init__(self, pipeline: Pipeline) -> None:
        if type(pipeline).__call__ not in _FOLLOWED:
            raise ValueError(
                f"decode='device' follows a pipeline's plan(), and {type(pipeline).__name__} "
                "has none or does more in its own __call__: use TrainPipeline or EvalPipeline "
                "(or a subclass that changes only their options), or decode='cpu'"
            )
        self.pipeline = pipeline
        self.size = pipeline.size

    def plan(self, data: bytes, seed: int | None = None) -> CropPlan:
        return self.pipeline.plan(data, seed)

    def __call__(self, data: bytes, seed: int | None = None, index: int = -1) -> Any:
        return bytes(data), self.pipeline.plan(data, seed), index

    def __repr__(self) -> str:
        return f"Planned({self.pipeline!r})"


_FOLLOWED = (TrainPipeline.__call__, EvalPipeline.__call__)
"""The ``__call__`` s whose work is all in their ``plan`` (and :func:`render`)."""


def takes_scan_end(pipeline: Pipeline) -> bool:
    """Whether ``pipeline`` takes ``scan_end=`` (the built-in ones and subclasses that leave
    their ``__call__`` alone): a dataset then passes each record's, as its header gives it."""
    return type(pipeline).__call__ in _FOLLOWED
