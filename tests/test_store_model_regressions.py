"""Defects that the model of a store's life (tests/test_store_model.py) found, each as the plain
sequence of steps that shows it, shrunk. Those still open are listed by tag in
tests/store_model.KNOWN_BROKEN, where the model leaves them alone until they are fixed."""

from __future__ import annotations

import re
import shlex
import signal
import warnings
from pathlib import Path

import pytest

from fastdata import MongoImageDataset, convert, copy_store, open_store
from fastdata.errors import (
    FastdataError,
    IncompleteStoreError,
    ReservedNameError,
    StoreNotFoundError,
    StoreReplacedError,
)

from .conftest import jpeg_bytes, snapshot, write
from .mongo_server import database
from .procs import KILLED_CONVERT, cli, run_killable, run_script


def folder(root: Path, classes: dict[str, int], *, bad: int = 0, seed: int = 0) -> Path:
    """``classes`` of that many small JPEGs each, and ``bad`` files that are no image."""
    for cls, n in classes.items():
        for i in range(n):
            write(root / cls / f"{i}.jpg", jpeg_bytes(16, 16, seed=seed + 10 * len(cls) + i))
    for i in range(bad):
        write(root / next(iter(classes)) / f"bad{i}.jpg", b"not an image\n")
    return root


def held(store: object, collection: str | None = None) -> tuple[list[str], list[tuple]]:
    """The classes and records (name, label, bytes) of a store, and its skipped files' names."""
    reader = open_store(store, collection=collection)  # type: ignore[arg-type]
    try:
        records = [(r.header.name, r.header.label, r.data) for r in reader.iter_records()]
        skipped = sorted(s.name for s in reader.skipped_files())
        return list(reader.meta.classes), [*records, ("skipped", skipped)]
    finally:
        reader.close()


# ------------------------------------------------------------------------ fixed


@pytest.mark.mongo
def test_a_mongo_reader_of_a_store_replaced_by_a_smaller_one_says_replaced(
    tmp_path: Path, mongo_uri: str
) -> None:
    """Model steps: convert A+M into collection C; a reader opens it (9 records); convert
    Aplus over it (--overwrite, 8 records); the reader reads every record. It said 'record 8
    is missing; the store is damaged', not that its store was replaced: the reader looked for
    missing records before it looked at whose the records it found are."""
    convert(folder(tmp_path / "big", {"a": 6}), mongo_uri, collection="c")
    ds = MongoImageDataset(mongo_uri, "c", output="bytes")
    assert len(ds) == 6
    convert(
        folder(tmp_path / "small", {"b": 3}, seed=50), mongo_uri, collection="c", overwrite=True
    )
    with pytest.raises(StoreReplacedError, match="create the dataset"):
        ds.__getitems__(list(range(6)))
    with pytest.raises(StoreReplacedError):
        ds[5]  # a record only the old store had, alone


def test_a_copy_killed_before_its_first_batch_resumes(tmp_path: Path) -> None:
    """Model steps: convert M (2 files skipped) into S; copy S into D, killed before its first
    commit; open D, then copy S into D with --resume. The progress counted the source's skipped
    files, which were saved only with the first batch: D read as damaged metadata, and a copy
    killed so over an interrupted conversion was discarded as damaged, so that --resume went
    back to the conversion and was refused."""
    src = tmp_path / "s.lmdb"
    convert(folder(tmp_path / "M", {"m": 5}, bad=2), src)
    dst = tmp_path / "d.lmdb"
    assert run_killable(["copy", str(src), str(dst)], "write:0", tmp_path / "run1").killed
    with pytest.raises(IncompleteStoreError, match="--resume"):
        open_store(dst)
    copy_store(src, dst, resume=True)
    assert held(dst) == held(src)
    # the same kill over an interrupted conversion (the copy built aside)
    other = tmp_path / "o.lmdb"
    a = folder(tmp_path / "A", {"a": 8}, seed=20)
    assert run_script(KILLED_CONVERT, a, other, 2).returncode == -signal.SIGKILL
    words = ["copy", str(src), str(other), "--overwrite"]
    assert run_killable(words, "write:0", tmp_path / "run2").killed
    copy_store(src, other, resume=True)
    assert held(other) == held(src)


def test_opening_a_folder_that_is_no_store_closes_it_and_prints_a_command_that_runs(
    tmp_path: Path,
) -> None:
    """Model steps: convert into the LMDB store 's/inner'; open 's' (a folder of folders). The
    folder's listing was left open (a ResourceWarning, an error under pytest's settings); and
    the command the message prints did not quote the path."""
    images = folder(tmp_path / "my images", {"a": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StoreNotFoundError) as info:
            open_store(images)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    command = re.search(r"`fastdata (convert [^`]*)`", str(info.value))
    assert command is not None, info.value
    result = cli(*shlex.split(command.group(1)))
    assert result.returncode == 0, result.stderr
    assert len(open_store(f"{images}.lmdb")) == 2


@pytest.mark.mongo
def test_a_missing_mongo_store_names_a_command_with_its_collection_quoted(
    mongo_uri: str,
) -> None:
    """Model steps: open the collection 'a b' before anything was written to it."""
    with pytest.raises(StoreNotFoundError) as info:
        open_store(mongo_uri, collection="a b")
    command = re.search(r"`fastdata ([^`]*)`", str(info.value))
    assert command is not None, info.value
    words = shlex.split(command.group(1))
    assert words[words.index("--collection") + 1] == "a b"


# ------------------------------------------------------------------------ found by the model


def test_the_command_an_interrupted_store_prints_finishes_it_under_an_interrupted_replacement(
    tmp_path: Path,
) -> None:
    """Was KNOWN_BROKEN 'printed-resume-under-a-replacement'. Model steps: convert M into S, killed
    after a batch; convert A into S with --overwrite, killed after a batch; open S, and run the
    command its error names. It named M's conversion, and that command is refused: a resume
    continues the replacement built aside (A's)."""
    dst = tmp_path / "s.lmdb"
    m = folder(tmp_path / "M", {"m": 6})
    a = folder(tmp_path / "A", {"a": 6}, seed=30)
    assert run_script(KILLED_CONVERT, m, dst, 1).returncode == -signal.SIGKILL
    assert run_script(KILLED_CONVERT, a, dst, 1, "--overwrite").returncode == -signal.SIGKILL
    with pytest.raises(IncompleteStoreError) as info:
        open_store(dst)
    command = re.search(r"`fastdata ([^`]*)`", str(info.value))
    assert command is not None, info.value
    result = cli(*shlex.split(command.group(1)))
    assert result.returncode == 0, result.stderr
    assert len(open_store(dst)) == 6


def test_the_commands_info_prints_for_an_append_under_an_interrupted_replacement_run(
    tmp_path: Path,
) -> None:
    """Was KNOWN_BROKEN 'printed-resume-under-a-replacement', its append: convert A into S; append
    Aplus, killed after a batch; convert M into S with --overwrite, killed after a batch;
    `fastdata info S`, and run the first command it names. It names the append's command
    first, and that is refused (the replacement is in the way)."""
    dst = tmp_path / "s.lmdb"
    convert(folder(tmp_path / "A", {"a": 3}), dst)
    plus = folder(tmp_path / "Aplus", {"a": 3, "b": 6})
    assert run_script(KILLED_CONVERT, plus, dst, 1, "--append").returncode == -signal.SIGKILL
    m = folder(tmp_path / "M", {"m": 6}, seed=40)
    assert run_script(KILLED_CONVERT, m, dst, 1, "--overwrite").returncode == -signal.SIGKILL
    info = cli("info", str(dst))
    command = re.search(r"`fastdata ([^`]*)`", info.stdout)
    assert command is not None, info.stdout
    result = cli(*shlex.split(command.group(1)))
    assert result.returncode == 0, result.stderr


def test_a_store_folder_that_holds_a_folder_named_data_mdb_is_refused_without_a_trace(
    tmp_path: Path,
) -> None:
    """Was KNOWN_BROKEN 'lmdb-store-file-names'. Model steps: convert A into the LMDB store
    S/data.mdb; convert A into S with --overwrite. The new store was built aside, could not be
    moved over the folder S/data.mdb ('Is a directory'), and stayed: every later writer of S
    failed. A store may no longer be named data.mdb (reserved): refused before anything is
    written, and S converts."""
    a = folder(tmp_path / "A", {"a": 3})
    store = tmp_path / "s"
    with pytest.raises(ReservedNameError, match="data.mdb"):
        convert(a, store / "data.mdb")
    assert not store.exists()
    convert(a, store)
    assert len(open_store(store)) == 3 and not (store / ".replacement").exists()


def test_an_append_to_a_store_whose_folder_holds_a_folder_named_readers_epoch_is_refused(
    tmp_path: Path,
) -> None:
    """Was KNOWN_BROKEN 'lmdb-store-file-names'. Model steps: convert A into the LMDB store
    S/readers.epoch; convert A into S; append Aplus to S: a bare IsADirectoryError. A store may
    no longer be named readers.epoch (reserved): refused before anything is written; S is
    converted and appended to."""
    a = folder(tmp_path / "A", {"a": 3})
    store = tmp_path / "s"
    with pytest.raises(ReservedNameError, match="readers.epoch"):
        convert(a, store / "readers.epoch")
    assert not store.exists()
    convert(a, store)
    convert(folder(tmp_path / "Aplus", {"a": 3, "b": 2}), store, append=True)
    assert len(open_store(store)) == 5


@pytest.mark.mongo
def test_a_store_named_like_a_gridfs_bucket_of_another_survives_its_writer(
    tmp_path: Path, mongo_uri: str
) -> None:
    """Was KNOWN_BROKEN 'mongo-bucket-names'. Model steps: convert A into collection
    c.gridfs.files; convert A into collection c, which dropped c.gridfs.files as an orphan
    bucket of c. That name is now reserved: refused before anything is written."""
    a = folder(tmp_path / "A", {"a": 3})
    with pytest.raises(ReservedNameError, match="GridFS bucket"):
        convert(a, mongo_uri, collection="c.gridfs.files")
    assert database(mongo_uri).list_collection_names() == []
    convert(a, mongo_uri, collection="c")
    assert len(open_store(mongo_uri, collection="c")) == 3


@pytest.mark.mongo
def test_a_store_named_like_another_stores_writer_claim_survives_its_writer(
    tmp_path: Path, mongo_uri: str
) -> None:
    """Was KNOWN_BROKEN 'mongo-reserved-names' (c:writer, beside x:progress, c.__replacement__
    and __fastdata__). Model steps: convert A into collection c:writer; convert A into c, whose
    writer claim (c:writer in __fastdata__) replaced the first store's metadata. The name is
    now reserved: refused before anything is written."""
    a = folder(tmp_path / "A", {"a": 3})
    with pytest.raises(ReservedNameError, match="writer claim"):
        convert(a, mongo_uri, collection="c:writer")
    assert database(mongo_uri).list_collection_names() == []
    convert(a, mongo_uri, collection="c")
    assert len(open_store(mongo_uri, collection="c")) == 3


@pytest.mark.mongo
@pytest.mark.parametrize("name", ["system.x", "$x"])
def test_a_collection_name_the_server_refuses_leaves_a_new_database_alone(
    tmp_path: Path, mongo_uri: str, name: str
) -> None:
    """Was KNOWN_BROKEN 'mongo-invalid-names'. Model steps: convert A into the collection system.x
    (or $x) of a new database. The name was found out only once the writer had begun: system.x
    left an interrupted store behind (its progress saved, the first insert refused), $x the
    __fastdata__ collection (the writer claim taken, then the look refused)."""
    with pytest.raises(FastdataError):
        convert(folder(tmp_path / "A", {"a": 3}), mongo_uri, collection=name)
    assert database(mongo_uri).list_collection_names() == []
    with pytest.raises(FastdataError) as info:
        open_store(mongo_uri, collection=name)
    assert not isinstance(info.value, IncompleteStoreError), info.value


@pytest.mark.mongo
@pytest.mark.parametrize("backend", ["lmdb", "mongo"])
def test_a_replacement_opened_where_it_is_built_names_its_stores_resume(
    tmp_path: Path, mongo_uri: str, backend: str
) -> None:
    """Model steps: convert A into S; convert M into S with --overwrite, killed after a batch;
    open S's replacement where it is built (S/.replacement, or the collection
    S.__replacement__). It printed a resume into that reserved name, which is refused; it
    names S's resume now, and that finishes the replacement."""
    a = folder(tmp_path / "A", {"a": 3})
    m = folder(tmp_path / "M", {"m": 6}, seed=40)
    if backend == "lmdb":
        dst, kw, aside = str(tmp_path / "s.lmdb"), {}, {"target": tmp_path / "s.lmdb/.replacement"}
        extra: tuple[str, ...] = ()
    else:
        dst, kw, aside = mongo_uri, {"collection": "s"}, {"target": mongo_uri}
        aside["collection"] = "s.__replacement__"
        extra = ("-c", "s")
    convert(a, dst, **kw)
    killed = run_script(KILLED_CONVERT, m, dst, 1, "--overwrite", *extra)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with pytest.raises(IncompleteStoreError, match="replacement of") as info:
        open_store(**aside)  # type: ignore[arg-type]
    command = re.search(r"`fastdata ([^`]*)`", str(info.value))
    assert command is not None, info.value
    assert ".replacement" not in command.group(1) and "__replacement__" not in command.group(1)
    result = cli(*shlex.split(command.group(1)))
    assert result.returncode == 0, result.stderr
    reader = open_store(dst, **kw)  # type: ignore[arg-type]
    try:
        assert list(reader.meta.classes) == ["m"] and len(reader) == 6
    finally:
        reader.close()


@pytest.mark.mongo
@pytest.mark.parametrize("backend", ["lmdb", "mongo"])
def test_an_overwrite_from_a_source_of_no_usable_image_keeps_an_interrupted_replacement(
    tmp_path: Path, mongo_uri: str, backend: str
) -> None:
    """Model steps (long profile): convert M into S; convert A into S with --overwrite, killed
    at its first batch; convert BAD (no usable image) into S with --overwrite: refused, as it
    must be, but its writer had begun a replacement of its own and dropped the interrupted one
    (its progress gone: a refused command changed the store). Now the source is found unusable
    before the writer starts; the interrupted replacement is there, and its resume finishes it."""
    from fastdata.errors import SourceError

    m = folder(tmp_path / "M", {"m": 4})
    a = folder(tmp_path / "A", {"a": 5}, seed=30)
    bad = folder(tmp_path / "BAD", {"x": 0}, bad=2)
    if backend == "lmdb":
        dst, kw, extra = str(tmp_path / "s.lmdb"), {}, ()
    else:
        dst, kw, extra = mongo_uri, {"collection": "s"}, ("-c", "s")
    convert(m, dst, **kw)
    killed = run_script(KILLED_CONVERT, a, dst, 0, "--overwrite", *extra)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    def state() -> object:
        if backend == "lmdb":
            files = snapshot(tmp_path / "s.lmdb")
            return {k: v for k, v in files.items() if not k.endswith(("lock.mdb", "writer.lock"))}
        db = database(mongo_uri)
        return {
            name: sorted(repr(sorted(d.items())) for d in db[name].find({}) if "token" not in d)
            for name in db.list_collection_names()
        }

    before = state()
    with pytest.raises(SourceError, match="none of its 2 images could be used"):
        convert(bad, dst, overwrite=True, **kw)
    assert state() == before
    convert(a, dst, resume=True, **kw)
    assert held(dst, kw.get("collection"))[0] == ["a"]
