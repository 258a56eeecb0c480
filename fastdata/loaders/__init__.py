"""Feeding the GPU: create_loader, PrefetchLoader, BackgroundGenerator and friends.

The names load their modules (and torch) on first use, so that what needs only the worker-count
chooser (``tuning``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# torch-free, and its function shares the submodule's name: bound here, before anything can
# import the submodule and shadow the function with it
from .background import BackgroundGenerator, background

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

_LOCATIONS = {
    "IMAGENET_MEAN": "normalize",
    "IMAGENET_STD": "normalize",
    "EpochSampler": "sampler",
    "Loader": "factory",
    "PrefetchLoader": "prefetch",
    "create_loader": "factory",
    "fast_collate": "collate",
}

if TYPE_CHECKING:
    from .collate import fast_collate
    from .factory import Loader, create_loader
    from .normalize import IMAGENET_MEAN, IMAGENET_STD
    from .prefetch import PrefetchLoader
    from .sampler import EpochSampler


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata.loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
