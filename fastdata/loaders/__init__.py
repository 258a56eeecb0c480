"""Feeding the GPU: PrefetchLoader, BackgroundGenerator and friends."""

from .background import BackgroundGenerator, background
from .normalize import IMAGENET_MEAN, IMAGENET_STD
from .prefetch import PrefetchLoader

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "BackgroundGenerator", "PrefetchLoader", "background"]
