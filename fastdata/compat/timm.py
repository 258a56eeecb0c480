"""timm's ``create_loader`` call, on fastdata's :func:`~fastdata.loaders.create_loader`.

Code written for timm calls::

    loader = create_loader(dataset, input_size=(3, 224, 224), batch_size=32, is_training=True,
                           use_prefetcher=True, mean=..., std=..., num_workers=8,
                           distributed=False, pin_memory=True, fp16=False)

This function takes that call. Crops, flips and colour jitter come from fastdata's pipelines
(random-resized-crop with timm's ``scale``, ``ratio`` and ``hflip``, and timm's ``color_jitter``
(default 0.4) and ``color_jitter_prob`` for training; resize and centre crop with ``crop_pct``
for evaluation), and ``input_size`` may be a pair as in timm. timm's other augmentations (random
erasing, AutoAugment, ...) have no counterpart here: asking for one logs which were not
applied.
``use_prefetcher`` needs no CUDA: without a GPU the batches are normalised on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..loaders.factory import Loader
from ..loaders.factory import create_loader as _create_loader
from ..loaders.normalize import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["create_loader"]

log = logging.getLogger(__name__)

_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "no_aug": False,
    "re_prob": 0.0,
    "re_mode": "const",
    "re_count": 1,
    "re_split": False,
    "vflip": 0.0,
    "grayscale_prob": 0.0,
    "gaussian_blur_prob": 0.0,
    "auto_augment": None,
    "num_aug_repeats": 0,
    "num_aug_splits": 0,
    "interpolation": "bilinear",
    "crop_mode": None,
    "crop_border_pixels": None,
    "tf_preprocessing": False,
    "use_multi_epochs_loader": False,
    "train_crop_mode": None,
    "worker_seeding": "all",
}
"""timm's options with no fastdata counterpart, and the values at which they do nothing (timm's
defaults, each of which does nothing): any other value is logged as not applied."""


def _shape(input_size: int | Sequence[int]) -> int | tuple[int, int]:
    """timm's ``input_size`` (an int, ``(h, w)`` or ``(channels, h, w)``) as an image size."""
    if isinstance(input_size, int):
        return input_size
    *_, height, width = tuple(input_size)
    return int(height) if height == width else (int(height), int(width))


def create_loader(
    dataset: Any,
    input_size: int | Sequence[int],
    batch_size: int,
    is_training: bool = False,
    *,
    use_prefetcher: bool = True,
    scale: tuple[float, float] | None = None,
    ratio: tuple[float, float] | None = None,
    hflip: float = 0.5,
    color_jitter: float | Sequence[float] | None = 0.4,
    color_jitter_prob: float | None = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    num_workers: int = 1,
    distributed: bool = False,
    crop_pct: float | None = None,
    collate_fn: Any = None,
    pin_memory: bool = False,
    fp16: bool = False,
    img_dtype: Any = None,
    device: Any = None,
    persistent_workers: bool = True,
    **timm_only: Any,
) -> Loader:
    """A fastdata :class:`~fastdata.loaders.Loader` from timm's ``create_loader`` arguments.

    Returns:
        A loader that yields ``(images, targets)``: normalised on ``device`` (the current
        accelerator, else the CPU) with ``use_prefetcher``, else normalised float images on the
        CPU, as timm's loader without its prefetcher gives them.

    Raises:
        TypeError: an argument timm's ``create_loader`` does not take either.
    """
    import torch

    from ..images.pipelines import EvalPipeline, TrainPipeline, jitter_strengths

    unknown = sorted(set(timm_only) - set(_UNSUPPORTED_DEFAULTS))
    if unknown:
        raise TypeError(f"create_loader() got unexpected keyword argument(s): {', '.join(unknown)}")
    ignored = sorted(k for k, v in timm_only.items() if v != _UNSUPPORTED_DEFAULTS[k])
    if ignored:
        log.warning("timm options without a fastdata counterpart, not applied: %s", ignored)
    side = _shape(input_size)
    if is_training:
        # timm leaves the colour jitter out when AutoAugment replaces it (not applied here)
        jitter = None if timm_only.get("auto_augment") else color_jitter
        pipeline: Any = TrainPipeline(
            side,
            scale=(float(scale[0]), float(scale[1])) if scale else (0.08, 1.0),
            ratio=(float(ratio[0]), float(ratio[1])) if ratio else (3 / 4, 4 / 3),
            hflip=hflip,
            color_jitter=jitter_strengths(jitter) if jitter is not None else None,
            color_jitter_prob=color_jitter_prob,
        )
    else:
        pipeline = EvalPipeline(side, crop_pct=crop_pct or 0.875)
    dtype = torch.float16 if fp16 else img_dtype
    return _create_loader(
        dataset,
        batch_size,
        train=is_training,
        image_size=side,
        num_workers=num_workers,
        device=device if use_prefetcher else "cpu",
        mean=mean,
        std=std,
        dtype=dtype,
        distributed=distributed,
        pipeline=pipeline,
        collate_fn=collate_fn,
        pin_memory=pin_memory if use_prefetcher else False,
        persistent_workers=persistent_workers,
    )
