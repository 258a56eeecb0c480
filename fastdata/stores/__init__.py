"""Storage backends. :func:`open_store` and :func:`open_writer` pick one from a path or URI."""

from __future__ import annotations

import os
from typing import Any

from .base import StoreReader, StoreWriter

__all__ = ["StoreReader", "StoreWriter", "open_store", "open_writer"]


def _mongo_options(options: dict[str, Any]) -> Any:
    from .mongo_store import MongoOptions

    return MongoOptions(**options)


def open_store(
    target: str | os.PathLike[str],
    *,
    collection: str | None = None,
    database: str | None = None,
    index_file: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    **mongo_options: Any,
) -> StoreReader:
    """Open a store for reading.

    Args:
        target: an LMDB path, or a ``mongodb://`` URI (then ``collection`` is required).
        collection: the Mongo collection.
        database: the Mongo database, when the URI names none.
        index_file: for a Mongo collection in the common ``img_name``/``bson_img`` layout, its
            JSON index (``{"path_list": [...], "label_list": [...]}``).
        allow_pickle: read an LMDB store written by the pickle-based recipes.
        **mongo_options: fields of :class:`~fastdata.stores.mongo_store.MongoOptions`
            (``read_preference``, ``timeout_s``, ``socket_timeout_s``, ``retry_budget_s``).
    """
    from .mongo_store import is_mongo_uri

    if is_mongo_uri(target):
        from ..errors import StoreError
        from .mongo_store import LegacyMongoStore, MongoStore, mask_uri

        uri = str(target)
        if not collection:
            raise StoreError(f"{mask_uri(uri)}: name the collection (--collection NAME)")
        options = _mongo_options(mongo_options)
        if index_file is not None:
            return LegacyMongoStore(uri, collection, index_file, database=database, options=options)
        return MongoStore(uri, collection, database=database, options=options)
    from .lmdb_store import open_lmdb

    return open_lmdb(target, allow_pickle=allow_pickle)


def open_writer(
    target: str | os.PathLike[str] | StoreWriter,
    *,
    collection: str | None = None,
    default_collection: str | None = None,
    database: str | None = None,
    **mongo_options: Any,
) -> StoreWriter:
    """A writer for ``target``: an LMDB folder path, a ``mongodb://`` URI with ``collection``
    (else ``default_collection``), or a writer given as it is."""
    if isinstance(target, StoreWriter):
        return target
    from .mongo_store import is_mongo_uri

    if is_mongo_uri(target):
        from ..errors import StoreError
        from .mongo_store import MongoWriter, mask_uri

        name = collection or default_collection
        if not name:
            raise StoreError(f"{mask_uri(str(target))}: name the collection (--collection NAME)")
        return MongoWriter(
            str(target), name, database=database, options=_mongo_options(mongo_options)
        )
    if collection:
        from ..errors import StoreError

        raise StoreError(
            f"{target}: --collection names a MongoDB collection, but the destination is an LMDB "
            "folder; give a mongodb:// URI, or leave --collection out"
        )
    from .lmdb_store import LMDBWriter

    return LMDBWriter(target)
