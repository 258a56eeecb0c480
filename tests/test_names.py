"""No name a user may give a store reaches another store's files, collections or documents
(``stores/names.py``, NOTE [ Reserved names ]): a name that would is refused, in one line naming
the rule, before anything is written; every other name keeps its own store, whatever the stores
around it do."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

import fastdata
from fastdata import convert, copy_store, export_store, open_store
from fastdata.errors import UsageError
from fastdata.stores import names

from .conftest import jpeg_bytes, snapshot, write
from .mongo_server import database
from .procs import cli

STORE_ID = "0123456789abcdef0123456789abcdef"


def folder(root: Path, seed: int, n: int = 3) -> Path:
    """A tiny image folder whose bytes differ from every other seed's."""
    for i in range(n):
        write(root / "c" / f"{i}.jpg", jpeg_bytes(16, 16, seed=seed * 100 + i))
    return root


_exports = itertools.count()


def exported(store: str, tmp_path: Path, collection: str | None = None) -> dict[str, bytes]:
    """Every file of the store, exported, by relative path."""
    out = tmp_path / "exports" / str(next(_exports))
    export_store(open_store(store, collection=collection), out)
    return snapshot(out)


def refused(check: object, *args: object) -> str | None:
    """The one-line message of a refusal, or None when the name is allowed."""
    try:
        check(*args)  # type: ignore[operator]
    except fastdata.ReservedNameError as exc:
        assert "\n" not in str(exc)
        return str(exc)
    return None


# --------------------------------------------------------------------------- derived names


MONGO_TOKENS = [
    "c",
    "x",
    ".",
    ":",
    " ",
    "$",
    "progress",
    "__fastdata__",
    ".__replacement__",
    ":progress",
    ":writer",
    "skipped:",
    ".gridfs",
    ".files",
    ".chunks",
    "." + STORE_ID,
    "system.",
    ":000000001",
]


def test_no_legal_collection_name_reaches_a_name_fastdata_derives() -> None:
    """Every name of up to three hostile tokens (reserved names, dots, ``$``, colons, spaces):
    either refused, or none of the collections and documents derived from it is another legal
    name, or derived from another legal name."""
    hostile = {"".join(p) for k in (1, 2, 3) for p in itertools.product(MONGO_TOKENS, repeat=k)}
    hostile |= {
        f"c.gridfs.{STORE_ID}.files",
        f"skipped:{STORE_ID}:000000000",
        "c.__replacement__:progress",
        "c.__replacement__.x",
        "",
        "x" * 250,
    }
    legal = {n for n in hostile if refused(names.check_collection, n, "here", "db") is None}
    for name in ("__fastdata__", "c.__replacement__", "x:progress", "c:writer", "a$b", ""):
        assert name not in legal
    assert {"c", "c.gridfs", "c:progressx", "c.__replacement__.x", "c x", "c:c"} <= legal

    collections: dict[str, str] = {}
    documents: dict[str, str] = {names.skipped_id(STORE_ID, n): "" for n in range(3)}
    for name in sorted(legal):
        for derived in names.mongo_collections(name, (STORE_ID,)):
            if derived != names.META_COLLECTION:
                assert collections.setdefault(derived, name) == name, derived
        for derived in names.mongo_documents(name):
            assert documents.setdefault(derived, name) == name, derived
    for name in legal:
        assert name not in collections, f"{name!r} is {collections[name]!r}'s"
        assert name != names.META_COLLECTION
        # a writer drops the GridFS buckets of its collection that no store uses: never a store
        if name.endswith((".files", ".chunks")):
            assert not any(names.is_bucket_of(name, name[:i]) for i in range(len(name)))


LMDB_PARTS = [
    "s.lmdb",
    ".replacement",
    ".REPLACEMENT",
    "data.mdb",
    "lock.mdb",
    "writer.lock",
    "readers.epoch",
    "readers.epoch.7.tmp",
    "..",
    "a b",
    "a:b",
    "$x",
]


def test_no_legal_store_path_reaches_a_name_fastdata_derives(tmp_path: Path) -> None:
    """Every path of up to three hostile parts (fastdata's own names in any case, ``..``,
    spaces, colons, ``$``, paths inside other stores, a link into a replacement folder):
    either refused, or none of the files and folders fastdata makes for it is another legal
    store, lies under one, or is made for another legal store."""
    (tmp_path / "s.lmdb" / ".replacement").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "s.lmdb" / ".replacement")
    paths = {
        os.path.join(tmp_path, *p)
        for k in (1, 2, 3)
        for p in itertools.product(LMDB_PARTS, repeat=k)
    }
    paths |= {str(tmp_path / "link"), str(tmp_path / "link" / "x")}
    legal = {os.path.realpath(p) for p in paths if refused(names.check_lmdb_store, p) is None}
    for path in ("s.lmdb/.replacement", "s.lmdb/.replacement/s.lmdb", "s.lmdb/Data.MDB", "link"):
        assert os.path.realpath(tmp_path / path) not in legal
    assert {str(tmp_path / "s.lmdb"), str(tmp_path / "s.lmdb" / "s.lmdb")} <= legal

    made: dict[str, str] = {}
    for path in sorted(legal):
        for derived in names.lmdb_derived(path):
            assert made.setdefault(derived, path) == path, derived
    aside_folders = {names.aside_folder(p) for p in legal}
    for path in legal:
        assert path not in made, f"{path} is {made.get(path)}'s"
        parents = {str(p) for p in Path(path).parents}
        assert not parents & aside_folders, f"{path} lies in a replacement folder"


# --------------------------------------------------------------------------- LMDB stores


def test_hostile_store_paths_are_refused_or_keep_their_own_store(tmp_path: Path) -> None:
    """A store inside another store's ``.replacement`` folder was accepted, and the next append
    to the outer store with nothing to add moved it over the outer store's records."""
    a = folder(tmp_path / "A", 1)
    outer = tmp_path / "s.lmdb"
    convert(a, outer)
    before = snapshot(outer)

    result = cli("convert", str(folder(tmp_path / "B", 2)), str(outer / ".replacement"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "'.replacement' is reserved" in result.stderr
    assert snapshot(outer) == before  # refused before anything was written

    (tmp_path / "link").symlink_to(outer / ".replacement")
    hostile = {
        outer / ".replacement": None,
        outer / ".replacement" / "deep": None,
        tmp_path / "link": None,
        outer / "writer.lock": None,
        outer / "readers.epoch": None,
        tmp_path / "t.lmdb" / "DATA.MDB": None,
        outer / "inner": 3,  # legal: a store of its own inside the folder
        tmp_path / "a b:c$.lmdb": 4,
        tmp_path / ".replacement.lmdb": 5,
    }
    for path, seed in hostile.items():
        source = folder(tmp_path / f"src{seed}", seed or 9)
        if seed is None:
            with pytest.raises(fastdata.ReservedNameError, match="is reserved"):
                convert(source, path)
            with pytest.raises(UsageError, match="is reserved"):
                copy_store(outer, path)
        else:
            convert(source, path)
    assert not (tmp_path / "t.lmdb").exists() and not (outer / ".replacement").exists()

    # the outer store's own life: an append with nothing to add, then a replacement
    convert(a, outer, append=True)
    assert exported(str(outer), tmp_path) == snapshot(a)
    c = folder(tmp_path / "C", 6)
    convert(c, outer, overwrite=True)
    assert exported(str(outer), tmp_path) == snapshot(c)
    for path, seed in hostile.items():
        if seed is not None:
            assert exported(str(path), tmp_path) == snapshot(tmp_path / f"src{seed}")


# --------------------------------------------------------------------------- MongoDB stores


@pytest.mark.mongo
def test_a_store_named___fastdata___is_refused_and_every_other_store_keeps_its_metadata(
    mongo_uri: str, tmp_path: Path
) -> None:
    """It was refused with "pass --overwrite", and with --overwrite it dropped the metadata of
    every store in the database."""
    a = folder(tmp_path / "A", 1)
    convert(a, mongo_uri, collection="c")
    meta = database(mongo_uri)[names.META_COLLECTION]
    before = list(meta.find({}))
    b = folder(tmp_path / "B", 2)
    for extra in ((), ("--overwrite",)):
        result = cli("convert", str(b), mongo_uri, "-c", "__fastdata__", *extra)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
        assert "'__fastdata__' is reserved" in result.stderr
        assert "--overwrite" not in result.stderr
    assert list(meta.find({})) == before
    assert exported(mongo_uri, tmp_path, "c") == snapshot(a)


@pytest.mark.mongo
def test_a_store_named_like_a_replacement_is_refused_before_anything_is_written(
    mongo_uri: str, tmp_path: Path
) -> None:
    """A store in ``c.__replacement__`` was accepted, and silently dropped by the next
    ``convert ... -c c --overwrite``."""
    b = folder(tmp_path / "B", 2)
    result = cli("convert", str(b), mongo_uri, "-c", "c.__replacement__")
    assert result.returncode == 2, result.stderr
    assert "'c.__replacement__' is reserved" in result.stderr
    assert database(mongo_uri).list_collection_names() == []
    a = folder(tmp_path / "A", 1)
    convert(a, mongo_uri, collection="c")
    convert(b, mongo_uri, collection="c", overwrite=True)
    assert exported(mongo_uri, tmp_path, "c") == snapshot(b)


@pytest.mark.mongo
def test_a_store_named_x_progress_is_refused_and_x_converts(mongo_uri: str, tmp_path: Path) -> None:
    """A store named ``x:progress`` made ``x`` impossible to convert ("unreadable conversion
    progress", and the --overwrite it advised failed the same way)."""
    b = folder(tmp_path / "B", 2)
    result = cli("convert", str(b), mongo_uri, "-c", "x:progress")
    assert result.returncode == 2, result.stderr
    assert "'x:progress' is reserved" in result.stderr
    a = folder(tmp_path / "A", 1)
    result = cli("convert", str(a), mongo_uri, "-c", "x")
    assert result.returncode == 0, result.stderr
    assert exported(mongo_uri, tmp_path, "x") == snapshot(a)


@pytest.mark.mongo
def test_hostile_collection_names_are_refused_or_keep_their_own_store(
    mongo_uri: str, tmp_path: Path
) -> None:
    """Through every Python path that writes (convert, its default collection, copy, a writer
    made directly): a reserved name is refused before anything is written; every other name
    keeps its own store while the stores around it are converted, appended to and replaced."""
    from fastdata.stores.mongo.writer import MongoWriter

    db = database(mongo_uri)
    lmdb = tmp_path / "s.lmdb"
    convert(folder(tmp_path / "L", 9), lmdb)
    reserved = [
        "__fastdata__",
        "c.__replacement__",
        "c:progress",
        "c:writer",
        f"skipped:{STORE_ID}:000000000",
        "c.gridfs.files",
        f"c.gridfs.{STORE_ID}.chunks",
    ]
    for name in reserved:
        source = folder(tmp_path / "R" / name, 8)
        with pytest.raises(fastdata.ReservedNameError, match="is reserved"):
            convert(source, mongo_uri, collection=name)
        with pytest.raises(fastdata.ReservedNameError, match="is reserved"):
            copy_store(lmdb, mongo_uri, collection=name)
        with pytest.raises(fastdata.ReservedNameError, match="is reserved"):
            MongoWriter(mongo_uri, name)
    with pytest.raises(fastdata.ReservedNameError, match="is reserved"):
        convert(tmp_path / "R" / "__fastdata__", mongo_uri)  # the folder's name, by default
    assert db.list_collection_names() == []

    legal = ["c", "c.gridfs", "c:progressx", "c.__replacement__.x", "__fastdata__.c", "c c", "c:1"]
    sources = {name: folder(tmp_path / "S" / str(k), k) for k, name in enumerate(legal)}
    for name in legal:
        convert(sources[name], mongo_uri, collection=name)
    c = folder(tmp_path / "C", 20)
    convert(c, mongo_uri, collection="c", overwrite=True)
    convert(sources["c.gridfs"], mongo_uri, collection="c.gridfs", append=True)
    sources["c"] = c
    for name in legal:
        assert exported(mongo_uri, tmp_path, name) == snapshot(sources[name]), name


@pytest.mark.parametrize("name", [".a", "a.", "a..b", "."])
def test_a_collection_name_mongodb_refuses_for_its_dots_is_refused_as_a_usage_error(
    name: str,
) -> None:
    # (pymongo refused these deep in a write: "checking the collection failed", exit 1)
    from fastdata.stores.names import check_collection

    with pytest.raises(fastdata.ReservedNameError, match=r"'\.'"):
        check_collection(name, "mongodb://h/db")


@pytest.mark.mongo
def test_a_uri_whose_database_name_holds_a_dot_is_refused_not_cut_at_the_dot(
    mongo_uri: str, tmp_path: Path
) -> None:
    """``mongodb://host/a.b`` is read by MongoDB as the database ``a`` and the collection ``b``:
    the stores of "a.b" and "a.other" were one database, and ``--overwrite`` into one replaced
    the other's store. Refused now, naming --collection, before anything is written; as are
    MongoDB's own databases."""
    a = folder(tmp_path / "A", 3)
    convert(a, mongo_uri, collection="t")
    before = snapshot(a)
    for uri in (f"{mongo_uri}.other", f"{mongo_uri}.b?appName=x"):
        for extra in ((), ("--overwrite",)):
            result = cli("convert", str(folder(tmp_path / "B", 2)), uri, "-c", "t", *extra)
            assert result.returncode == 2, result.stderr
            assert "--collection" in result.stderr and "Traceback" not in result.stderr
    assert exported(mongo_uri, tmp_path, "t") == before
    base = mongo_uri.rsplit("/", 1)[0]
    for system in ("admin", "local", "config"):
        result = cli("convert", str(a), f"{base}/{system}", "-c", "t")
        assert result.returncode == 2 and "MongoDB's own databases" in result.stderr, result.stderr
        assert "t" not in database(f"{base}/{system}").list_collection_names()
