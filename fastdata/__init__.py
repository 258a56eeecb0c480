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
    QueryError as QueryError,
)
from .errors import (
    RecordError as RecordError,
)
from .errors import (
    ReservedNameError as ReservedNameError,
)
from .errors import (
    ResumeError as ResumeError,
)
from .errors import (
    SourceError as SourceError,
)
from .errors import (
    StoreDamagedError as StoreDamagedError,
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
from .errors import (
    WriteFailedError as WriteFailedError,
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
    "EvalPipeline": "images.pipelines",
    "Loader": "loaders",
    "PrefetchLoader": "loaders",
    "TrainPipeline": "images.pipelines",
    "background": "loaders",
    "create_loader": "loaders",
    "fast_collate": "loaders",
    "ConvertReport": "ops.convert",
    "convert": "ops.convert",
    "CopyReport": "ops.copy",
    "copy_store": "ops.copy",
    "ImageStoreDataset": "datasets",
    "LMDBImageDataset": "datasets",
    "MongoImageDataset": "datasets",
    "export_store": "ops.export",
    "open_store": "stores",
    "scan_folder": "sources.folder",
    "store_info": "ops.info",
    "verify_store": "ops.verify",
}

if TYPE_CHECKING:
    from .datasets import ImageStoreDataset, LMDBImageDataset, MongoImageDataset
    from .images.pipelines import EvalPipeline, TrainPipeline
    from .loaders import (
        BackgroundGenerator,
        Loader,
        PrefetchLoader,
        background,
        create_loader,
        fast_collate,
    )
    from .ops.convert import ConvertReport, convert
    from .ops.copy import CopyReport, copy_store
    from .ops.export import export_store
    from .ops.info import store_info
    from .ops.verify import verify_store
    from .sources.folder import scan_folder
    from .stores import open_store


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
