"""The walk of LMDB's tree gives every entry LMDB gives, in key order, over any range, its values
read one at a time or in stretches alike; a page two branches point to is a loop, named once; a
named database is told apart; and the descent to a few keys finds where their values lie."""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb
import numpy as np

from fastdata.stores.lmdb.pages import Tree, check_file, value_places, walk
from fastdata.stores.lmdb.pages.format import MAIN_DBI, PAGEHDRSZ, MDB_meta

from .build import PSIZE, branch, leaf


def _store(path: Path, sizes: list[int]) -> tuple[Path, dict[bytes, bytes]]:
    rng = random.Random(3)
    want = {b"%010d" % i: rng.randbytes(size) for i, size in enumerate(sizes)}
    want[b"__len__"] = b"%d" % len(sizes)
    env = lmdb.open(str(path), map_size=1 << 26, subdir=True)
    with env.begin(write=True) as txn:
        for key, value in want.items():
            txn.put(key, value)
    env.close()
    return path / "data.mdb", want


def test_the_walk_gives_what_lmdb_gives_over_any_range(tmp_path: Path) -> None:
    rng = random.Random(5)
    data_file, want = _store(
        tmp_path / "s", [rng.choice([10, 700, 1500, 5000, 9000]) for _ in range(4000)]
    )
    assert check_file(str(data_file)).depth >= 3
    keys = sorted(want)
    with Tree(str(data_file)) as tree:
        assert [(k, bytes(v)) for k, v in tree.entries()] == [(k, want[k]) for k in keys]  # type: ignore[arg-type]
        low, high = b"0000000500", b"0000002001"
        got = [k for k, _ in tree.entries(low, high, values=False)]
        assert got == [k for k in keys if low <= k < high]
        stretched: list[bytes] = []
        for run in tree.leaves():
            a = 0
            while a < len(run):
                values = tree.values(run, a, len(run))
                stretched += [bytes(v) for v in values]  # type: ignore[arg-type]
                a += len(values)
        assert stretched == [want[k] for k in keys] and not tree.found
    assert walk(str(data_file)) == []


def _built(path: Path, pages: list[np.ndarray], depth: int) -> Path:
    """An LMDB file whose tree is ``pages`` (pages 2, 3, ...; the first the root), each built
    by mdb.c's names, under the meta pages LMDB wrote."""
    data_file, _ = _store(path, [10])
    raw = bytearray(data_file.read_bytes()[: 2 * PSIZE])
    raw += b"".join(p.tobytes() for p in pages)
    for meta_page in (0, 1):
        at = meta_page * PSIZE + PAGEHDRSZ
        meta = np.frombuffer(raw, MDB_meta, 1, at).copy()
        meta["mm_last_pg"] = 1 + len(pages)
        meta["mm_dbs"][0, MAIN_DBI : MAIN_DBI + 1]["md_root"] = 2
        meta["mm_dbs"][0, MAIN_DBI : MAIN_DBI + 1]["md_depth"] = depth
        raw[at : at + MDB_meta.itemsize] = meta.tobytes()
    data_file.write_bytes(bytes(raw))
    return data_file


def test_a_page_two_branches_point_to_is_a_loop_named_once(tmp_path: Path) -> None:
    """A branch whose two children are one leaf (an empty one: its keys fit both places)."""
    data_file = _built(tmp_path / "s", [branch(2, [(b"", 3), (b"m", 3)]), leaf(3, [])], 2)
    found = walk(str(data_file))
    assert [(d.page, d.what) for d in found] == [(3, "reached twice (a loop in the tree)")]


def test_a_named_database_is_told_apart_and_not_an_entry(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 24, subdir=True, max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"1")
    other = env.open_db(b"theirs")
    with env.begin(write=True, db=other) as txn:
        txn.put(b"x", b"2")
    env.close()
    with Tree(str(tmp_path / "s" / "data.mdb")) as tree:
        assert [k for k, _ in tree.entries()] == [b"a"]
        assert [name for name, _ in tree.databases] == [b"theirs"] and not tree.found


def test_the_descent_to_a_few_keys_finds_their_values_and_nothing_else(tmp_path: Path) -> None:
    sizes = [9000 if i % 3 == 0 else 50 for i in range(600)]
    data_file, want = _store(tmp_path / "s", sizes)
    raw = data_file.read_bytes()
    keys = [b"%010d" % i for i in (0, 1, 3, 299, 599)] + [b"missing"]
    fd = os.open(data_file, os.O_RDONLY)
    try:
        places, asked = value_places(fd, keys, lambda offset: True)
    finally:
        os.close(fd)
    assert asked is not None and asked[0] >= 2 * len(places) and asked[1] == 0  # (all held)
    assert sorted(raw[at : at + n] for at, n in places) == sorted(
        want[k] for k in keys if k in want and len(want[k]) == 9000
    )
    assert all(at % PSIZE == PAGEHDRSZ for at, _ in places)


def test_a_branch_built_by_name_is_walked_to_its_leaves(tmp_path: Path) -> None:
    """A tree of one branch over two leaves, each page built by mdb.c's names."""
    pages = [
        branch(2, [(b"", 3), (b"m", 4)]),
        leaf(3, [(b"a", b"1"), (b"b", b"2")]),
        leaf(4, [(b"m", b"3")]),
    ]
    data_file = _built(tmp_path / "s", pages, 2)
    with Tree(str(data_file)) as tree:
        got = [(k, bytes(v)) for k, v in tree.entries()]  # type: ignore[arg-type]
        assert got == [(b"a", b"1"), (b"b", b"2"), (b"m", b"3")] and not tree.found
