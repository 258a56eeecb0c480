"""Defects found by driving a store's life against a model (tests/test_store_model.py), each
as the plain sequence of steps that shows it, shrunk."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

from fastdata import open_store
from fastdata.errors import StoreNotFoundError

from .conftest import jpeg_bytes, write
from .procs import cli


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
