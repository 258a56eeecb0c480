"""Each reason a page check can give, from a page built by mdb.c's names and damaged in one
field: the checks name the page's first failing node and what is wrong with it, alone or among
sound pages checked side by side."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from fastdata.stores.lmdb.pages import FormatError, NotRegular, Truncated, check_file
from fastdata.stores.lmdb.pages.check import NAMED, check_overflow, check_pages
from fastdata.stores.lmdb.pages.format import (
    F_DUPDATA,
    F_SUBDATA,
    P_BRANCH,
    P_OVERFLOW,
    PAGEHDRSZ,
    MDB_db,
    MDB_meta,
    MDB_overflow,
)

from .build import PSIZE, big_leaf, branch, header, leaf, node, offset, tree_page

LAST = 50


def reason(
    page: np.ndarray,
    number: int = 7,
    low: bytes | None = None,
    high: bytes | None = None,
    whole: bool = True,
) -> str:
    return check_pages(
        page.tobytes(), np.array([number]), [low], [high], LAST, PSIZE, np.array([whole])
    ).reasons[0]


def sound_leaf() -> np.ndarray:
    return leaf(7, [(b"k1", b"one"), (b"k2", b"two"), (b"k3", b"three")])


def sound_branch() -> np.ndarray:
    return branch(7, [(b"", 10), (b"k2", 11), (b"k3", 12)])


def test_a_sound_leaf_and_branch_pass_and_give_their_nodes() -> None:
    checked = check_pages(sound_leaf().tobytes(), np.array([7]), [None], [None], LAST, PSIZE)
    assert checked.reasons == [""] and checked.key_list(0, 3) == [b"k1", b"k2", b"k3"]
    assert checked.values.tolist() == [-1, -1, -1] and checked.sizes.tolist() == [3, 3, 5]
    checked = check_pages(sound_branch().tobytes(), np.array([7]), [None], [None], LAST, PSIZE)
    assert checked.reasons == [""] and checked.values.tolist() == [10, 11, 12]


def _damage(kind: str, change: Callable[[np.ndarray], object]) -> np.ndarray:
    page = sound_leaf() if kind == "leaf" else sound_branch()
    change(page)
    return page


def _set(field: str, value: int, j: int | None = None) -> Callable[[np.ndarray], None]:
    def change(page: np.ndarray) -> None:
        (header(page) if j is None else node(page, j))[field] = value

    return change


# (page kind, damage, bounds, the reason)
REASONS = {
    "header says another page": (
        "leaf",
        _set("mp_pgno", 9),
        {},
        "damaged (its header says page 9)",
    ),
    "not a tree page": (
        "leaf",
        _set("mp_flags", P_OVERFLOW),
        {},
        "damaged (flags 0x4, not a tree page)",
    ),
    "bounds": ("leaf", _set("mp_lower", PSIZE - 2), {}, f"damaged (bounds {PSIZE - 2}-"),
    "odd lower bound": ("leaf", _set("mp_lower", 21), {}, "damaged (bounds 21-"),
    "a branch of one node": (
        "branch",
        _set("mp_lower", PAGEHDRSZ + 2),
        {},
        "damaged (a branch of 1 node, not two or more)",
    ),
    "leaf node outside the page": (
        "leaf",
        lambda p: offset(p, 1).__setitem__(0, 4090),
        {},
        "damaged (node 1: at offset 4090, outside the page)",
    ),
    "leaf key out of order": (
        "leaf",
        lambda p: p.__setitem__(
            slice(int(offset(p, 2)[0]) + 8, int(offset(p, 2)[0]) + 10),
            np.frombuffer(b"k0", np.uint8),
        ),
        {},
        "damaged (node 2: its key is out of order)",
    ),
    "leaf key below its low bound": (
        "leaf",
        lambda p: None,
        {"low": b"k2"},
        "damaged (node 0: its key is out of order)",
    ),
    "leaf key at its high bound": (
        "leaf",
        lambda p: None,
        {"high": b"k3"},
        "damaged (node 2: its key is out of order)",
    ),
    "value past the page": (
        "leaf",
        _set("mn_lo", 5000, 0),
        {},
        "damaged (node 0: a key of 2 bytes and a value of 5000 run past the page)",
    ),
    "sub-database flags": (
        "leaf",
        _set("mn_flags", F_DUPDATA, 1),
        {},
        "damaged (node 1: flags 0x4 of a sub-database)",
    ),
    "branch node outside the page": (
        "branch",
        lambda p: offset(p, 2).__setitem__(0, 20),
        {},
        "damaged (node 2: at offset 20, outside the page)",
    ),
    "branch key past the page": (
        "branch",
        _set("mn_ksize", 4000, 1),
        {},
        "damaged (node 1: key of 4000 bytes runs past the page)",
    ),
    "child outside the file": (
        "branch",
        _set("mn_lo", LAST + 1, 2),
        {},
        f"damaged (node 2: child page {LAST + 1} outside the file)",
    ),
    "branch key out of order": (
        "branch",
        lambda p: None,
        {"low": b"k2"},
        "damaged (node 1: its key is out of order)",
    ),
}


@pytest.mark.parametrize("name", list(REASONS))
def test_each_reason_is_named_alone_and_among_sound_pages(name: str) -> None:
    kind, change, bounds, want = REASONS[name]
    page = _damage(kind, change)
    assert reason(page, **bounds).startswith(want)
    # the same page between two sound ones, checked side by side: named alike, and only it
    before, after = leaf(5, [(b"a", b"x")]), leaf(6, [(b"z", b"y")])
    buf = np.concatenate([before, page, after]).tobytes()
    checked = check_pages(
        buf,
        np.array([5, 7, 6]),
        [None, bounds.get("low"), None],
        [None, bounds.get("high"), None],
        LAST,
        PSIZE,
    )
    assert checked.reasons[0] == checked.reasons[2] == ""
    assert checked.reasons[1].startswith(want)


def test_a_page_not_read_whole_is_past_the_end_of_the_file() -> None:
    assert reason(sound_leaf(), whole=False) == "past the end of the file"


def test_an_overflow_pointer_past_the_page_is_named() -> None:
    page = big_leaf(7, b"k", 9000, 20)
    node(page, 0)["mn_ksize"] = 3  # (the key runs on: its 8-byte page number past the page)
    assert reason(page) == "damaged (node 0: overflow pointer runs past the page)"


def test_a_value_on_pages_outside_the_file_is_named() -> None:
    assert reason(big_leaf(7, b"k", 9000, LAST - 1)) == (
        "damaged (node 0: a value of 9000 bytes on pages outside the file)"
    )
    assert reason(big_leaf(7, b"k", 9000, 1)).endswith("on pages outside the file)")
    assert reason(big_leaf(7, b"k", 9000, LAST - 2)) == ""


def test_a_named_database_is_no_damage_but_is_told_apart() -> None:
    page = tree_page(7, 2, [(b"db", MDB_db.itemsize, F_SUBDATA, bytes(MDB_db.itemsize))])
    checked = check_pages(page.tobytes(), np.array([7]), [None], [None], LAST, PSIZE)
    assert checked.reasons == [""] and checked.values.tolist() == [NAMED]


def test_the_first_node_with_an_offset_is_named_where_offsets_repeat() -> None:
    page = sound_leaf()
    offset(page, 1)[0] = offset(page, 2)[0]  # (node 1 and node 2 at one place: node 2 is
    # out of order after node 1's copy, and is named by the first node at its offset)
    assert reason(page) == "damaged (node 1: its key is out of order)"


def overflow_run(
    first: int,
    size: int,
    *,
    pgno: int | None = None,
    flags: int = P_OVERFLOW,
    pages: int | None = None,
) -> bytes:
    count = -(-(size + PAGEHDRSZ) // PSIZE)
    head = np.zeros(1, MDB_overflow)
    head["mp_pgno"] = first if pgno is None else pgno
    head["mp_flags"], head["mp_pages"] = flags, count if pages is None else pages
    return head.tobytes() + bytes(count * PSIZE - PAGEHDRSZ)


@pytest.mark.parametrize(
    ("run", "want"),
    [
        (overflow_run(20, 9000)[: PSIZE - 1], "past the end of the file"),
        (overflow_run(20, 9000)[: 2 * PSIZE], "past the end of the file"),
        (overflow_run(20, 9000, pgno=21), "damaged (its header says page 21)"),
        (
            overflow_run(20, 9000, flags=P_BRANCH),
            "damaged (flags 0x1, 3 pages: not the overflow run of a value of 9000 bytes)",
        ),
        (
            overflow_run(20, 9000, pages=2),
            "damaged (flags 0x4, 2 pages: not the overflow run of a value of 9000 bytes)",
        ),
    ],
    ids=["first page missing", "cut short", "another page", "not overflow", "count"],
)
def test_each_overflow_reason(run: bytes, want: str) -> None:
    sound = overflow_run(17, 5000)
    data = sound + run
    at, firsts = np.array([0, len(sound)]), np.array([17, 20])
    assert check_overflow(data, at, firsts, np.array([5000, 9000]), PSIZE) == (1, want)
    assert check_overflow(sound, at[:1], firsts[:1], np.array([5000]), PSIZE) == (1, "")


def _store(path: Path) -> Path:
    env = lmdb.open(str(path), map_size=1 << 24, subdir=True)
    with env.begin(write=True) as txn:
        for i in range(2000):
            txn.put(b"%010d" % i, b"v" * 100)
    env.close()
    return path / "data.mdb"


def _meta_field(data_file: Path, field: str, value: int, pages: tuple[int, ...] = (0, 1)) -> None:
    """Set a field of the meta pages by its name (``md_pad`` the free database's: the page
    size; other ``md_`` fields the main database's)."""
    raw = bytearray(data_file.read_bytes())
    for p in pages:
        meta = np.frombuffer(raw, MDB_meta, 1, p * PSIZE + PAGEHDRSZ).copy()
        if field.startswith("md_"):
            db = 0 if field == "md_pad" else 1
            meta["mm_dbs"][0, db : db + 1][field] = value
        else:
            meta[field] = value
        raw[p * PSIZE + PAGEHDRSZ : p * PSIZE + PAGEHDRSZ + MDB_meta.itemsize] = meta.tobytes()
    data_file.write_bytes(bytes(raw))


def test_the_file_checks_each_name_what_is_wrong(tmp_path: Path) -> None:
    data_file = _store(tmp_path / "s")
    head = check_file(str(data_file), for_lmdb=True)
    assert head.depth >= 2 and 2 <= head.root <= head.last_page
    raw = data_file.read_bytes()

    def refused(change: Callable[[], object]) -> FormatError:
        data_file.write_bytes(raw)
        change()
        with pytest.raises(FormatError) as caught:
            check_file(str(data_file), for_lmdb=True)
        return caught.value

    assert isinstance(refused(lambda: os.truncate(data_file, head.used_bytes - 1)), Truncated)
    assert refused(lambda: _meta_field(data_file, "mm_magic", 1)).reason.startswith(
        "no LMDB header"
    )
    assert refused(lambda: _meta_field(data_file, "md_pad", 1000, (0,))).reason == (
        "page size 1000 in its header"
    )

    def second_current_and_other() -> None:
        _meta_field(data_file, "mm_txnid", 1 << 40, (1,))
        _meta_field(data_file, "md_pad", 8192, (1,))

    assert refused(second_current_and_other).reason == "inconsistent meta pages"
    out = head.last_page + 5
    assert refused(lambda: _meta_field(data_file, "md_root", out)).reason == (
        f"root page {out} outside the file"
    )

    def one_node() -> None:
        with open(data_file, "r+b") as f:
            f.seek(head.root * PSIZE + 12)
            f.write(np.uint16(PAGEHDRSZ + 2).tobytes())

    assert refused(one_node).reason == f"root page {head.root} is a branch of 1 node(s)"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegular):
        check_file(str(fifo))
