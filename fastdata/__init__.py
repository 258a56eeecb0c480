"""fastdata: image folders packed into LMDB or MongoDB and fed to PyTorch at full speed.

Importing the package is cheap: the public names below load their modules (and torch) on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "BackgroundGenerator",
    "ConvertReport",
    "CorruptImageError",
    "EvalPipeline",
    "FastdataError",
    "ImageStoreDataset",
    "IncompleteStoreError",
    "LMDBImageDataset",
    "Loader",
    "MissingDependencyError",
    "MongoImageDataset",
    "PickleNotAllowedError",
    "PrefetchLoader",
    "RecordError",
    "SourceError",
    "StoreError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreReplacedError",
    "TrainPipeline",
    "UnsafePathError",
    "UsageError",
    "__version__",
    "background",
    "convert",
    "create_loader",
    "export_store",
    "fast_collate",
    "open_store",
    "scan_folder",
    "store_info",
    "verify_store",
]

_LOCATIONS = {
    "BackgroundGenerator": "loaders",
    "EvalPipeline": "pipelines",
    "Loader": "loaders",
    "PrefetchLoader": "loaders",
    "TrainPipeline": "pipelines",
    "background": "loaders",
    "create_loader": "loaders",
    "fast_collate": "loaders",
    "ConvertReport": "convert",
    "convert": "convert",
    "ImageStoreDataset": "datasets",
    "LMDBImageDataset": "datasets",
    "MongoImageDataset": "datasets",
    "export_store": "export",
    "open_store": "stores",
    "scan_folder": "folder",
    "store_info": "info",
    "verify_store": "verify",
    **{
        name: "errors"
        for name in (
            "CorruptImageError",
            "FastdataError",
            "IncompleteStoreError",
            "MissingDependencyError",
            "PickleNotAllowedError",
            "RecordError",
            "SourceError",
            "StoreError",
            "StoreExistsError",
            "StoreLockedError",
            "StoreNotFoundError",
            "StoreReplacedError",
            "UnsafePathError",
            "UsageError",
        )
    },
}

if TYPE_CHECKING:
    from .convert import ConvertReport, convert
    from .datasets import ImageStoreDataset, LMDBImageDataset, MongoImageDataset
    from .errors import (
        CorruptImageError,
        FastdataError,
        IncompleteStoreError,
        MissingDependencyError,
        PickleNotAllowedError,
        RecordError,
        SourceError,
        StoreError,
        StoreExistsError,
        StoreLockedError,
        StoreNotFoundError,
        StoreReplacedError,
        UnsafePathError,
        UsageError,
    )
    from .export import export_store
    from .folder import scan_folder
    from .info import store_info
    from .loaders import (
        BackgroundGenerator,
        Loader,
        PrefetchLoader,
        background,
        create_loader,
        fast_collate,
    )
    from .pipelines import EvalPipeline, TrainPipeline
    from .stores import open_store
    from .verify import verify_store


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
