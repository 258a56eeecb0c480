"""Feeding the GPU: create_loader, PrefetchLoader, BackgroundGenerator and friends."""

from .background import BackgroundGenerator, background
from .collate import fast_collate
from .factory import Loader, create_loader
from .normalize import IMAGENET_MEAN, IMAGENET_STD
from .prefetch import PrefetchLoader
from .sampler import EpochSampler

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BackgroundGenerator",
    "EpochSampler",
    "Loader",
    "PrefetchLoader",
    "background",
    "create_loader",
    "fast_collate",
]
