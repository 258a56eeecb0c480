"""apex's ``data_prefetcher`` loop, on fastdata's stream-correct :class:`PrefetchLoader`.

NVIDIA's ImageNet example drives its loader with::

    prefetcher = data_prefetcher(loader)
    input, target = prefetcher.next()
    while input is not None:
        ...
        input, target = prefetcher.next()

This class keeps that loop working, on CUDA and (unlike apex's) on the CPU, normalising uint8
batches with the ImageNet constants as apex does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..loaders.normalize import IMAGENET_MEAN, IMAGENET_STD
from ..loaders.prefetch import PrefetchLoader

__all__ = ["data_prefetcher"]


class data_prefetcher:
    """Prefetch ``(input, target)`` batches of ``loader`` to the device; ``next()`` returns
    ``(None, None)`` at the end, as apex's does.

    Args:
        loader: an iterable of ``(images, targets)``: uint8 ``N x C x H x W`` images (what
            ``fast_collate`` gives) are normalised on the device; float ones only moved.
        device: where batches go; None picks the current accelerator, else the CPU.
        mean, std: per-channel normalisation in 0-1 units (the ImageNet constants by default).
        fp16: half-precision images, like apex's ``--fp16`` / ``opt_level``.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: Any = None,
        *,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        fp16: bool = False,
    ) -> None:
        import torch

        self._prefetch = PrefetchLoader(
            loader, device, mean=mean, std=std, dtype=torch.float16 if fp16 else None
        )
        self._batches: Iterator[Any] = iter(self._prefetch)

    def next(self) -> tuple[Any, Any]:
        """The next ``(input, target)`` on the device, or ``(None, None)`` after the last."""
        try:
            images, targets = next(self._batches)
        except StopIteration:
            return None, None
        return images, targets

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while True:
            images, targets = self.next()
            if images is None:
                return
            yield images, targets
