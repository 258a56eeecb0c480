"""Pages of LMDB's file built by ``mdb.c``'s names, for the checks' tests."""

from __future__ import annotations

import numpy as np

from fastdata.stores.lmdb.pages.format import (
    F_BIGDATA,
    NODESIZE,
    P_BRANCH,
    P_LEAF,
    PAGEHDRSZ,
    MDB_node,
    MDB_page,
)

PSIZE = 4096


def tree_page(pgno: int, kind: int, nodes: list[tuple[bytes, int, int, bytes]]) -> np.ndarray:
    """A branch or leaf page: each node ``(key, lo_hi, flags, data)`` (a leaf's value size or a
    branch's child in ``mn_lo``/``mn_hi``, its flags, and what follows the key)."""
    page = np.zeros(PSIZE, np.uint8)
    upper, offsets = PSIZE, []
    for key, number, flags, data in nodes:
        size = NODESIZE + len(key) + len(data)
        upper -= size + (size & 1)
        node = page[upper : upper + NODESIZE].view(MDB_node)
        node["mn_lo"], node["mn_hi"] = number & 0xFFFF, (number >> 16) & 0xFFFF
        node["mn_flags"], node["mn_ksize"] = flags, len(key)
        page[upper + NODESIZE : upper + size] = np.frombuffer(key + data, np.uint8)
        offsets.append(upper)
    head = header(page)
    head["mp_pgno"], head["mp_flags"] = pgno, kind
    head["mp_lower"], head["mp_upper"] = PAGEHDRSZ + 2 * len(nodes), upper
    page[PAGEHDRSZ : PAGEHDRSZ + 2 * len(nodes)] = np.array(offsets, "<u2").view(np.uint8)
    return page


def leaf(pgno: int, entries: list[tuple[bytes, bytes]]) -> np.ndarray:
    """A leaf page of values on the page."""
    return tree_page(pgno, P_LEAF, [(k, len(v), 0, v) for k, v in entries])


def big_leaf(pgno: int, key: bytes, size: int, first: int) -> np.ndarray:
    """A leaf page of one value of ``size`` bytes on overflow pages from ``first``."""
    return tree_page(pgno, P_LEAF, [(key, size, F_BIGDATA, np.uint64(first).tobytes())])


def branch(pgno: int, children: list[tuple[bytes, int]]) -> np.ndarray:
    """A branch page: ``(key, child)`` for each node (node 0's key is empty)."""
    return tree_page(pgno, P_BRANCH, [(k, c & 0xFFFFFFFF, c >> 32, b"") for k, c in children])


def header(page: np.ndarray) -> np.void:
    return page[:PAGEHDRSZ].view(MDB_page)[0]


def node(page: np.ndarray, j: int) -> np.void:
    """Node ``j``'s header, writable in place."""
    at = int(page[PAGEHDRSZ + 2 * j : PAGEHDRSZ + 2 * j + 2].view("<u2")[0])
    return page[at : at + NODESIZE].view(MDB_node)[0]


def offset(page: np.ndarray, j: int) -> np.ndarray:
    """Node ``j``'s offset, writable in place (an array of one)."""
    return page[PAGEHDRSZ + 2 * j : PAGEHDRSZ + 2 * j + 2].view("<u2")
