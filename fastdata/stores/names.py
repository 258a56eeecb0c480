"""Every name fastdata derives from a user's store name, and the names no user store may take.

A user names a store: an LMDB folder, or a MongoDB collection. Beside it fastdata keeps things of
its own, each named here and nowhere else:

LMDB, in the store folder ``P`` (``docs/format.md``):

- ``P/data.mdb`` (the store), ``P/lock.mdb`` (LMDB's lock table, a writer's), ``P/writer.lock``
  (the writer lock), ``P/readers.epoch`` (the append epoch; ``P/readers.epoch.<pid>.tmp`` while it
  is made);
- ``P/.replacement/``: a replacement being built (``--overwrite``), with the same files inside.

MongoDB, in the store's database, for the collection ``C``:

- the collection ``__fastdata__`` (one per database), holding the documents ``"C"`` (the store's
  metadata), ``"C:progress"`` (an unfinished conversion or append), ``"C:writer"`` (the writer
  claim) and ``"skipped:<id>:<n>"`` (the skipped list of the store ``<id>``);
- the collection ``C.__replacement__``: a replacement being built, its documents
  ``"C.__replacement__"`` and ``"C.__replacement__:progress"`` in ``__fastdata__``;
- the GridFS bucket of each store ``<id>``, ``C.gridfs.<id>`` (``C.gridfs`` for stores of the
  first format): the collections ``C.gridfs.<id>.files`` and ``.chunks``, holding the files
  ``"<id>:<index>"`` and ``"<id>:labels"``.

NOTE [ Reserved names ]

Two stores never share a derived name, and no store is ever named like another's derived name,
because user names are kept out of the forms above (:func:`check_lmdb_store`,
:func:`check_collection`, called by every writer before it writes anything):

- LMDB: a store's folder is never named ``data.mdb``, ``lock.mdb``, ``writer.lock``,
  ``.replacement`` or ``readers.epoch[.*]`` (in any case), nor lies inside a ``.replacement``
  folder, once its path is resolved (links followed). So ``Q/<own name>`` is never a store, and
  everything under ``Q/.replacement`` is fastdata's, which it may remove as a whole.
- MongoDB: a collection is never ``__fastdata__``, never ends in ``.__replacement__``, ``:progress``
  or ``:writer``, never begins with ``skipped:``, never has the form of a GridFS bucket
  (``<name>.gridfs[.<32 hex>].files|chunks``), and is one MongoDB allows (no ``$``, no NUL, not
  empty, not ``system.*``, UTF-8) with room for the longest name derived from it (a namespace,
  ``<db>.<collection>``, holds at most 255 bytes).

Each derived form then lies in a set no user name meets, and each maps its user name back
(strip the fixed suffix), so the map from user names to derived names is injective; the buckets'
ids are 32 hex digits, which never end in ``gridfs``. ``tests/test_names.py`` enumerates the
derived names of hostile user names and checks both.

Stores written before this rule under a name it now refuses are still read (a copy moves one to
a name of its own); only writing into such a name is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, NoReturn

from ..errors import ReservedNameError

__all__ = [
    "ASIDE_DIR",
    "ASIDE_SUFFIX",
    "DATA_FILE",
    "EPOCH_FILE",
    "EXPORT_TEMP",
    "LOCK_FILE",
    "META_COLLECTION",
    "NAMESPACE_MAX_BYTES",
    "OWN_FILES",
    "WRITER_LOCK",
    "aside_collection",
    "aside_folder",
    "bucket",
    "check_collection",
    "check_lmdb_store",
    "claim_id",
    "data_file",
    "epoch_file",
    "epoch_temp",
    "export_temp",
    "gridfs_labels_id",
    "gridfs_record_id",
    "gridfs_records_of",
    "is_bucket_of",
    "is_gridfs_file_id",
    "lmdb_derived",
    "mongo_collections",
    "mongo_documents",
    "progress_id",
    "skipped_id",
    "skipped_range",
    "writer_lock",
]

# --------------------------------------------------------------------------- export

EXPORT_TEMP = re.compile(r"\.fastdata-(\d+)\.tmp")
"""A file an export is writing, before it is renamed into place, beside the file's final name
(the exporting process's id in it: short, as a record's own name may take 255 bytes). Only an
export's own folders hold it; an export removes those whose process no longer runs."""


def export_temp(target: str | os.PathLike[str], pid: int) -> str:
    """Where the file that becomes ``target`` is written by the process ``pid``."""
    return os.path.join(os.path.dirname(os.fspath(target)), f".fastdata-{pid}.tmp")


# --------------------------------------------------------------------------- LMDB

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
WRITER_LOCK = "writer.lock"
EPOCH_FILE = "readers.epoch"
"""Beside ``data.mdb``: the append epoch that readers of earlier versions check around every
read; appends still advance it (this version's readers watch the copy in ``data.mdb``'s first
page: see "the append epoch" in ``lmdb/env.py``)."""
ASIDE_DIR = ".replacement"
OWN_FILES = frozenset({DATA_FILE, LOCK_FILE, WRITER_LOCK, ASIDE_DIR, EPOCH_FILE})
"""What fastdata keeps in a store folder (and nothing else: a folder holding anything more, and
no store, is not fastdata's to write into)."""


def data_file(folder: str) -> str:
    return os.path.join(folder, DATA_FILE)


def writer_lock(folder: str) -> str:
    return os.path.join(folder, WRITER_LOCK)


def epoch_file(folder: str) -> str:
    return os.path.join(folder, EPOCH_FILE)


def epoch_temp(folder: str, pid: int) -> str:
    """Where the epoch file is made before it is renamed into place."""
    return f"{epoch_file(folder)}.{pid}.tmp"


def aside_folder(folder: str) -> str:
    """Where a replacement of the store in ``folder`` is built."""
    return os.path.join(folder, ASIDE_DIR)


def aside_owner(path: str) -> str | None:
    """The store folder whose replacement is built at ``path``, if ``path`` is such a place."""
    parent, leaf = os.path.split(os.path.normpath(path))
    return parent if leaf == ASIDE_DIR and parent else None


def _own_name(part: str) -> bool:
    folded = part.casefold()
    return folded in OWN_FILES or folded.startswith(EPOCH_FILE + ".")


def check_lmdb_store(path: str | os.PathLike[str]) -> None:
    """Refuse an LMDB store path that would be one of another store's own names.

    Raises:
        ReservedNameError: the folder (its path resolved) is named like a file or folder that
            fastdata keeps inside a store, or lies inside a ``.replacement`` folder.
    """
    given = os.fspath(path)
    real = os.path.realpath(os.path.expanduser(given))
    parts = real.split(os.sep)
    if any(part.casefold() == ASIDE_DIR for part in parts[:-1]):
        raise ReservedNameError(
            given,
            f"lies inside a {ASIDE_DIR} folder, which is reserved: fastdata builds the "
            "replacement of the store around it there, and removes it whole",
        )
    if _own_name(parts[-1]):
        raise ReservedNameError(
            given,
            f"{parts[-1]!r} is reserved: fastdata keeps "
            + ", ".join(sorted(OWN_FILES))
            + f" and {EPOCH_FILE}.* inside every store folder (in any case)",
        )


def lmdb_derived(path: str | os.PathLike[str]) -> list[str]:
    """Every path fastdata may make for the store at ``path`` (resolved), but the folder itself:
    for tests, and for the rule's proof in the NOTE above."""
    folder = os.path.realpath(os.fspath(path))
    out: list[str] = []
    for where in (folder, aside_folder(folder)):
        out += [os.path.join(where, n) for n in (DATA_FILE, LOCK_FILE, WRITER_LOCK, EPOCH_FILE)]
        out.append(epoch_temp(where, 0))
    out.append(aside_folder(folder))
    return out


# --------------------------------------------------------------------------- MongoDB

META_COLLECTION = "__fastdata__"
ASIDE_SUFFIX = ".__replacement__"
_PROGRESS = ":progress"
_WRITER = ":writer"
_SKIPPED = "skipped:"
_BUCKET = r"\.gridfs(\.[0-9a-f]{32})?\.(files|chunks)"
NAMESPACE_MAX_BYTES = 255
"""MongoDB's limit on ``<database>.<collection>`` (unsharded collections, since 4.4)."""
_LONGEST_SUFFIX = len(".gridfs.") + 32 + len(".chunks")


def aside_collection(collection: str) -> str:
    """Where a replacement of ``collection`` is built."""
    return collection + ASIDE_SUFFIX


def aside_owner_collection(collection: str) -> str | None:
    """The collection whose replacement is built in ``collection``, if it is such a place."""
    owner = collection.removesuffix(ASIDE_SUFFIX)
    return owner if owner != collection and owner else None


def progress_id(name: str) -> str:
    """The document of ``name``'s unfinished conversion or append (``name``: a collection or
    its aside), in ``__fastdata__``."""
    return name + _PROGRESS


def claim_id(collection: str) -> str:
    """The writer claim of ``collection``, in ``__fastdata__``."""
    return collection + _WRITER


def skipped_id(store_id: str, n: int) -> str:
    """The ``n``-th document of the skipped list of the store ``store_id``."""
    return f"{_SKIPPED}{store_id}:{n:09d}"


def skipped_range(store_id: str) -> dict[str, Any]:
    """The filter of every document of the skipped list of the store ``store_id``."""
    return {"_id": {"$gte": f"{_SKIPPED}{store_id}:", "$lt": f"{_SKIPPED}{store_id};"}}


def bucket(collection: str, store_id: str) -> str:
    """The GridFS bucket of one store: named by its id, so a replacement never needs to move it
    (stores written before ids existed used ``<collection>.gridfs``)."""
    return f"{collection}.gridfs.{store_id}" if store_id else f"{collection}.gridfs"


def is_bucket_of(name: str, collection: str) -> bool:
    """Whether the collection ``name`` is part of a GridFS bucket of ``collection``'s stores."""
    return re.fullmatch(re.escape(collection) + _BUCKET, name) is not None


def gridfs_record_id(store_id: str, index: int) -> str:
    """The GridFS file of record ``index`` of the store ``store_id`` (an image too large for a
    document)."""
    return f"{store_id}:{index}"


def gridfs_labels_id(store_id: str) -> str:
    """The GridFS file of the labels of the store ``store_id`` (too many for its metadata)."""
    return f"{store_id}:labels"


def gridfs_records_of(store_id: str) -> dict[str, Any]:
    """The filter of every GridFS file of the store ``store_id``."""
    return {"_id": {"$regex": f"^{re.escape(store_id)}:"}}


def is_gridfs_file_id(file_id: object, collection: str) -> bool:
    """Whether ``file_id`` is the id of a GridFS file that fastdata makes for a store in
    ``collection``: ``"<id>:<index>"`` or ``"<id>:labels"`` (``<id>``: a store id, or the
    collection's name for stores of the first format)."""
    if not isinstance(file_id, str):
        return False
    owner = rf"(?:[0-9a-f]{{32}}|{re.escape(collection)})"
    return re.fullmatch(owner + r":(?:[0-9]+|labels)", file_id) is not None


def check_collection(collection: str, where: str, database: str = "") -> None:
    """Refuse a collection name that MongoDB does not allow, or that is one of fastdata's own
    names (or of its form) in the database ``database``.

    Raises:
        ReservedNameError: one line naming the rule the name breaks.
    """

    def refuse(rule: str) -> NoReturn:
        raise ReservedNameError(where, f"the collection name {collection!r} {rule}")

    def reserved(what: str) -> NoReturn:
        refuse(f"is reserved: {what}")

    if not collection:
        refuse("is empty")
    try:
        size = len(collection.encode("utf-8"))
    except UnicodeEncodeError:
        refuse("is not UTF-8, which MongoDB requires")
    if "$" in collection or "\0" in collection:
        refuse("holds '$' or a NUL, which MongoDB does not allow in a collection name")
    if collection.startswith(".") or collection.endswith(".") or ".." in collection:
        refuse("begins or ends with '.' or holds '..', which MongoDB does not allow")
    if collection.startswith("system."):
        refuse("begins with 'system.', which MongoDB keeps for itself")
    if collection == META_COLLECTION:
        reserved(f"{META_COLLECTION} is fastdata's own collection, holding every store's metadata")
    if collection.endswith(ASIDE_SUFFIX):
        reserved(f"'<collection>{ASIDE_SUFFIX}' is where fastdata builds a replacement")
    if collection.endswith(_PROGRESS):
        reserved(f"'<collection>{_PROGRESS}' in {META_COLLECTION} is a store's progress")
    if collection.endswith(_WRITER):
        reserved(f"'<collection>{_WRITER}' in {META_COLLECTION} is a store's writer claim")
    if collection.startswith(_SKIPPED):
        reserved(f"'{_SKIPPED}...' in {META_COLLECTION} are the stores' skipped lists")
    if re.search(_BUCKET + r"\Z", collection):
        reserved("'<collection>.gridfs[.<id>].files' and '.chunks' are a store's GridFS bucket")
    longest = len(database.encode("utf-8", "replace")) + 1 + size + _LONGEST_SUFFIX
    if database and longest > NAMESPACE_MAX_BYTES:
        refuse(
            f"is too long: the names fastdata derives from it (up to {_LONGEST_SUFFIX} bytes "
            f"longer, with the database's) would pass MongoDB's {NAMESPACE_MAX_BYTES}-byte limit"
        )


def mongo_collections(collection: str, store_ids: tuple[str, ...] = ()) -> list[str]:
    """Every collection fastdata may make for the store in ``collection`` (but itself), given the
    ids of its stores (a first-format store has none: ``""``)."""
    out = [META_COLLECTION, aside_collection(collection)]
    for store_id in ("", *store_ids):
        out += [f"{bucket(collection, store_id)}.{part}" for part in ("files", "chunks")]
    return out


def mongo_documents(collection: str) -> list[str]:
    """Every document id in ``__fastdata__`` that fastdata derives from ``collection``'s name."""
    aside = aside_collection(collection)
    return [collection, progress_id(collection), claim_id(collection), aside, progress_id(aside)]
