"""LMDB 0.9's data file, by ``mdb.c``'s names: the meta page, the page header and the node.

Layout (64-bit, little-endian): pages of ``psize`` bytes; pages 0 and 1 are meta pages, the one
with the larger transaction id is current. Every page begins with a header (:data:`MDB_page`);
a branch or leaf page's node offsets follow it, its nodes (:data:`MDB_node`) lie at the end of
the page; a value too large for its leaf lies on overflow pages of its own, the first of which
carries their count. The format's version (``mm_version``) is checked once, here.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
"""The data format of LMDB 0.9 (``MDB_DATA_VERSION``): the only one read here."""
PAGEHDRSZ = 16
NODESIZE = 8
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
P_KINDS = P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_REVERSEKEY, MDB_INTEGERKEY = 0x02, 0x08
"""A database's flags that change the order of its keys (``md_flags``)."""
MIN_PSIZE, MAX_PSIZE = 512, 65536

MDB_page = np.dtype(
    [
        ("mp_pgno", "<u8"),
        ("mp_pad", "<u2"),
        ("mp_flags", "<u2"),
        ("mp_lower", "<u2"),
        ("mp_upper", "<u2"),
    ]
)
"""A branch or leaf page's header (``MDB_page``, its ``pb_lower``/``pb_upper`` arm)."""
PAGE_HEADER = struct.Struct("<QHHHH")
""":data:`MDB_page` as a struct, for one page's header read where numpy costs too much: (mp_pgno,
mp_pad, mp_flags, mp_lower, mp_upper)."""
MDB_overflow = np.dtype(
    [("mp_pgno", "<u8"), ("mp_pad", "<u2"), ("mp_flags", "<u2"), ("mp_pages", "<u4")]
)
"""The first overflow page's header (``MDB_page``, its ``pb_pages`` arm)."""
MDB_node = np.dtype([("mn_lo", "<u2"), ("mn_hi", "<u2"), ("mn_flags", "<u2"), ("mn_ksize", "<u2")])
"""A node's header (``MDB_node``), its key after it. A leaf's value size is ``mn_lo | mn_hi <<
16``; a branch's child page ``mn_lo | mn_hi << 16 | mn_flags << 32``."""
NODE_HEADER = struct.Struct("<HHHH")
""":data:`MDB_node` as a struct: (mn_lo, mn_hi, mn_flags, mn_ksize)."""
MDB_db = np.dtype(
    [
        ("md_pad", "<u4"),
        ("md_flags", "<u2"),
        ("md_depth", "<u2"),
        ("md_branch_pages", "<u8"),
        ("md_leaf_pages", "<u8"),
        ("md_overflow_pages", "<u8"),
        ("md_entries", "<u8"),
        ("md_root", "<u8"),
    ]
)
"""A database's record (``MDB_db``): the value of a named database's node, too."""
MDB_meta = np.dtype(
    [
        ("mm_magic", "<u4"),
        ("mm_version", "<u4"),
        ("mm_address", "<u8"),
        ("mm_mapsize", "<u8"),
        ("mm_dbs", MDB_db, (2,)),  # FREE_DBI (whose md_pad holds the page size), MAIN_DBI
        ("mm_last_pg", "<u8"),
        ("mm_txnid", "<u8"),
    ]
)
"""A meta page's body (``MDB_meta``), just past its page header."""
FREE_DBI, MAIN_DBI = 0, 1
META_END = PAGEHDRSZ + MDB_meta.itemsize

_PAGE_DTYPES: dict[int, np.dtype] = {}


def page_dtype(psize: int) -> np.dtype:
    """:data:`MDB_page` spaced ``psize`` apart: an array of pages read side by side."""
    dtype = _PAGE_DTYPES.get(psize)
    if dtype is None:
        names = list(MDB_page.names or ())
        offsets = [MDB_page.fields[n][1] for n in names]  # type: ignore[index]
        formats = [MDB_page.fields[n][0] for n in names]  # type: ignore[index]
        dtype = _PAGE_DTYPES[psize] = np.dtype(
            {"names": names, "formats": formats, "offsets": offsets, "itemsize": psize}
        )
    return dtype


class FormatError(Exception):
    """The file is not one this package reads: ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Header:
    """One meta page's facts: the page size, the last page, the transaction and the main
    database's tree (``mm_last_pg``, ``mm_txnid``, ``md_root``, ``md_depth``, ``md_entries``)."""

    psize: int
    last_page: int
    txnid: int
    root: int
    depth: int
    entries: int
    version: int = MDB_DATA_VERSION
    flags: int = 0
    """The main database's ``md_flags``."""

    @property
    def used_bytes(self) -> int:
        return (self.last_page + 1) * self.psize


META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
""":data:`MDB_meta` as a struct (read on every cold read's way down the tree, where numpy's
fields cost tens of microseconds): mm_magic, mm_version, mm_address, mm_mapsize, both MDB_db
(md_pad, md_flags, md_depth, md_branch_pages, md_leaf_pages, md_overflow_pages, md_entries,
md_root), mm_last_pg, mm_txnid."""
assert META.size == MDB_meta.itemsize


def read_meta(page: bytes) -> Header | None:
    """A meta page's facts (None: too short, or no LMDB magic)."""
    if len(page) < META_END:
        return None
    mm_magic, mm_version, _, _, *dbs, mm_last_pg, mm_txnid = META.unpack_from(page, PAGEHDRSZ)
    if mm_magic != MDB_MAGIC:
        return None
    free, main = dbs[:8], dbs[8:]
    return Header(
        psize=free[0],  # (md_pad of the free database)
        last_page=mm_last_pg,
        txnid=mm_txnid,
        root=main[7],  # md_root
        depth=main[2],  # md_depth
        entries=main[6],  # md_entries
        version=mm_version,
        flags=main[1],  # md_flags
    )


def current_meta(fd: int) -> Header:
    """The current meta page's facts, of the two the one with the larger transaction id, both
    checked against each other and the format's version.

    Raises:
        FormatError: no LMDB header, a page size LMDB never writes, another format version, or
            meta pages that disagree.
    """
    head = read_meta(os.pread(fd, META_END, 0))
    if head is None:
        raise FormatError("no LMDB header (not an LMDB data file, or overwritten)")
    if head.version != MDB_DATA_VERSION:
        raise FormatError(
            f"LMDB data format version {head.version}, not {MDB_DATA_VERSION} (LMDB 0.9's): "
            "written by another version of LMDB"
        )
    psize = head.psize
    if psize & (psize - 1) or not MIN_PSIZE <= psize <= MAX_PSIZE:
        raise FormatError(f"page size {psize} in its header")
    second = read_meta(os.pread(fd, META_END, psize))
    current = max((m for m in (head, second) if m is not None), key=lambda m: m.txnid)
    if current.psize != psize or current.last_page < 1 or current.version != head.version:
        raise FormatError("inconsistent meta pages")
    return current
