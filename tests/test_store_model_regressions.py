"""Defects found by driving a store's life against a model (tests/test_store_model.py), each
as the plain sequence of steps that shows it, shrunk."""

from __future__ import annotations

import re
import shlex
import signal
import warnings
from pathlib import Path

import pytest

from fastdata import MongoImageDataset, convert, copy_store, open_store
from fastdata.errors import IncompleteStoreError, StoreNotFoundError, StoreReplacedError

from .conftest import jpeg_bytes, write
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
