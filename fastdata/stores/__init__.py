"""Storage backends. :func:`open_store` and :func:`open_writer` pick one from a path or URI."""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import Phrase
from .policy import StoreWriter
from .reader import StoreReader

__all__ = ["StoreReader", "StoreWriter", "open_store", "open_writer", "reader_class"]

COLLECTION = Phrase("--collection NAME", "collection=NAME")


def _check_target(target: object, **mongo_only: object) -> bool:
    """Whether ``target`` is a MongoDB URI; a URI of another scheme, or options meant for
    MongoDB given with an LMDB path, are usage errors."""
    from ..errors import UsageError, option
    from .uri import is_mongo_uri

    if is_mongo_uri(target):
        return True
    text = os.fspath(target) if isinstance(target, (str, os.PathLike)) else ""
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):/", str(text))
    if scheme:
        raise UsageError(
            f"{text}: unknown scheme {scheme.group(1)}:; a MongoDB store is "
            "mongodb://host:port/DB (or mongodb+srv://...), an LMDB store a folder path"
        )
    for name, value in mongo_only.items():
        if value not in (None, False):
            given = option(name, None, flag={"timeout_s": "--timeout"}.get(name, ""))
            raise UsageError(
                f"{text}: ",
                given,
                " applies to mongodb:// stores, and this is an LMDB path; leave ",
                given,
                " out",
            )
    return False


def _mongo_options(options: dict[str, Any]) -> Any:
    """The :class:`MongoOptions` of the fields given (a name it lacks is a usage error)."""
    from dataclasses import fields

    from ..errors import UsageError
    from .mongo.connection import MongoOptions

    known = {f.name for f in fields(MongoOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(
            f"unknown MongoDB option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(known))}"
        )
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
        **mongo_options: fields of :class:`~fastdata.stores.mongo.connection.MongoOptions`
            (``read_preference``, ``timeout_s``, ``socket_timeout_s``, ``retry_budget_s``).
    """
    if _check_target(target, collection=collection, index_file=index_file, **mongo_options):
        from ..errors import UsageError, option
        from .foreign import LegacyMongoStore
        from .mongo.reader import MongoStore
        from .uri import mask_uri

        uri = str(target)
        if allow_pickle:
            raise UsageError(
                f"{mask_uri(uri)}: ",
                option("allow_pickle"),
                " applies to LMDB stores; leave it out",
            )
        if not collection:
            raise UsageError(f"{mask_uri(uri)}: name the collection (", COLLECTION, ")")
        options = _mongo_options(mongo_options)
        if index_file is not None:
            return LegacyMongoStore(uri, collection, index_file, database=database, options=options)
        return MongoStore(uri, collection, database=database, options=options)
    from .lmdb.open import open_lmdb

    return open_lmdb(os.path.expanduser(target), allow_pickle=allow_pickle)


def reader_class(target: str | os.PathLike[str]) -> type[StoreReader]:
    """The class of reader a store at ``target`` (an LMDB path or a ``mongodb://`` URI) is read
    with, for what it can say of a store it cannot open (:meth:`StoreReader.damaged_pages`)."""
    from .uri import is_mongo_uri

    if is_mongo_uri(target):
        from .mongo.reader import MongoStore

        return MongoStore
    from .lmdb.reader import LMDBStore

    return LMDBStore


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
    if _check_target(target, collection=collection, **mongo_options):
        from ..errors import UsageError
        from .mongo.writer import MongoWriter
        from .uri import mask_uri

        name = collection or default_collection
        if not name:
            raise UsageError(f"{mask_uri(str(target))}: name the collection (", COLLECTION, ")")
        return MongoWriter(
            str(target), name, database=database, options=_mongo_options(mongo_options)
        )
    from .lmdb.writer import LMDBWriter

    return LMDBWriter(os.path.expanduser(target))
