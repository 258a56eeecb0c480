"""LMDB's meta page read by mdb.c's names agrees with LMDB's own account of the file, and a file
of another format version is refused, by the page reader and by a store opened over it, with
the version it has."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import numpy as np
import pytest

from fastdata.errors import StoreError
from fastdata.stores.lmdb.pages import FormatError, check_file
from fastdata.stores.lmdb.pages.format import (
    MAIN_DBI,
    MDB_DATA_VERSION,
    PAGEHDRSZ,
    MDB_meta,
    MDB_node,
    MDB_page,
    current_meta,
    read_meta,
)

from ....conftest import tiny_store


def test_the_structs_have_mdb_cs_sizes_and_places() -> None:
    assert (MDB_page.itemsize, MDB_node.itemsize, MDB_meta.itemsize) == (16, 8, 136)
    main = MDB_meta.fields["mm_dbs"][1] + MAIN_DBI * 48  # type: ignore[index]
    assert PAGEHDRSZ + main + MDB_meta["mm_dbs"].base.fields["md_depth"][1] == 94
    assert PAGEHDRSZ + MDB_meta.fields["mm_last_pg"][1] == 136  # type: ignore[index]


def test_the_meta_page_read_by_name_is_what_lmdb_reports(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 24, subdir=True)
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"%010d" % i, b"v" * 200)
    stat, info = env.stat(), env.info()
    env.close()
    fd = os.open(tmp_path / "s" / "data.mdb", os.O_RDONLY)
    try:
        head = current_meta(fd)
    finally:
        os.close(fd)
    assert (head.psize, head.depth, head.entries) == (stat["psize"], stat["depth"], 3000)
    assert (head.last_page, head.txnid) == (info["last_pgno"], info["last_txnid"])
    assert head.version == MDB_DATA_VERSION and read_meta(b"\0" * 200) is None


def _version(data_file: Path, version: int) -> None:
    raw = bytearray(data_file.read_bytes())
    psize = check_file(str(data_file)).psize
    for page in (0, 1):
        at = page * psize + PAGEHDRSZ
        meta = np.frombuffer(raw, MDB_meta, 1, at).copy()
        meta["mm_version"] = version
        raw[at : at + MDB_meta.itemsize] = meta.tobytes()
    data_file.write_bytes(bytes(raw))


def test_a_file_of_another_format_version_is_refused_with_its_version(tmp_path: Path) -> None:
    from fastdata import LMDBImageDataset

    store = tiny_store(tmp_path, 5)
    _version(store / "data.mdb", 2)
    with pytest.raises(FormatError, match="LMDB data format version 2, not 1"):
        check_file(str(store / "data.mdb"))
    with pytest.raises(
        StoreError, match=r"data\.mdb: damaged LMDB file: LMDB data format version 2"
    ):
        LMDBImageDataset(store)
