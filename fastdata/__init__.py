"""fastdata: image folders packed into LMDB or MongoDB and fed to PyTorch at full speed.

Importing the package is cheap: the public names below load their modules (and torch) on first
use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (  # the exception tree is cheap to import; errors.__all__ lists it
    CorruptImageError as CorruptImageError,
)
from .errors import (
    FastdataError as FastdataError,
)
from .errors import (
    IncompleteStoreError as IncompleteStoreError,
)
from .errors import (
    MissingDependencyError as MissingDependencyError,
)
from .errors import (
    PickleNotAllowedError as PickleNotAllowedError,
)
from .errors import (
    RecordError as RecordError,
)
from .errors import (
    SourceError as SourceError,
)
from .errors import (
    StoreError as StoreError,
)
from .errors import (
    StoreExistsError as StoreExistsError,
)
from .errors import (
    StoreLockedError as StoreLockedError,
)
from .errors import (
    StoreNotFoundError as StoreNotFoundError,
)
from .errors import (
    StoreReplacedError as StoreReplacedError,
)
from .errors import (
    UnsafePathError as UnsafePathError,
)
from .errors import (
    UsageError as UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "BackgroundGenerator",
    "ConvertReport",
    "CopyReport",
    "EvalPipeline",
    "ImageStoreDataset",
    "LMDBImageDataset",
    "Loader",
    "MongoImageDataset",
    "PrefetchLoader",
    "TrainPipeline",
    "__version__",
    "background",
    "convert",
    "copy_store",
    "create_loader",
    "export_store",
    "fast_collate",
    "open_store",
    "scan_folder",
    "store_info",
    "verify_store",
]
__all__ += errors.__all__
__all__.sort()

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
    "CopyReport": "copy",
    "copy_store": "copy",
    "ImageStoreDataset": "datasets",
    "LMDBImageDataset": "datasets",
    "MongoImageDataset": "datasets",
    "export_store": "export",
    "open_store": "stores",
    "scan_folder": "folder",
    "store_info": "info",
    "verify_store": "verify",
}

if TYPE_CHECKING:
    from .convert import ConvertReport, convert
    from .copy import CopyReport, copy_store
    from .datasets import ImageStoreDataset, LMDBImageDataset, MongoImageDataset
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
