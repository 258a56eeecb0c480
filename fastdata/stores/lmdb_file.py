"""LMDB's on-disk layout, read without LMDB: the only place that knows it.

LMDB maps ``data.mdb`` into memory and follows the page numbers it finds there. A file cut short
(an interrupted copy, a full disk) or a damaged page makes it touch memory past the end of the
file, which kills the process with SIGBUS or SIGSEGV instead of raising an error. So nothing is
handed to LMDB before the file's header has been checked here against the file's size, and
``fastdata verify`` walks every page of the B-tree here, in Python, where damage is an error.

Layout (LMDB 0.9, 64-bit, little-endian): pages of ``psize`` bytes; pages 0 and 1 are meta pages,
the one with the larger transaction id is current. Each page starts with a 16-byte header
(page number, flags, lower/upper bounds or overflow page count).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ..errors import StoreError

__all__ = ["SLACK", "Header", "check_file", "pad", "walk"]

MAGIC = 0xBEEFC0DE
PAGE_HEADER = 16
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
NODE_HEADER = 8
SLACK = 128 << 10
"""Zero bytes kept after the last page of a finished store: LMDB reading a damaged page near the
end of the file then reads zeros (and reports the page as corrupt) instead of faulting."""


@dataclass(frozen=True)
class Header:
    """The current meta page's facts."""

    psize: int
    last_page: int
    txnid: int
    root: int
    depth: int
    entries: int

    @property
    def used_bytes(self) -> int:
        return (self.last_page + 1) * self.psize


def _damaged(path: str, what: str) -> StoreError:
    return StoreError(
        f"{path}: damaged LMDB file: {what}; run `fastdata verify` on the store, then convert it "
        "again (or copy it again, if it was copied)"
    )


def _meta(page: bytes) -> Header | None:
    if len(page) < 152 or struct.unpack_from("<I", page, 16)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", page, 40)[0]
    depth = struct.unpack_from("<H", page, 94)[0]
    entries, root = struct.unpack_from("<QQ", page, 120)
    last_page, txnid = struct.unpack_from("<QQ", page, 136)
    return Header(psize, last_page, txnid, root, depth, entries)


def check_file(path: str) -> Header:
    """Check an LMDB data file's header against its size before anything maps it.

    Raises:
        StoreError: unreadable, not an LMDB file, or shorter than its header says (truncated).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(160)
            head = _meta(first)
            if head is None:
                raise _damaged(path, "no LMDB header (not an LMDB data file, or overwritten)")
            if head.psize & (head.psize - 1) or not 512 <= head.psize <= 65536:
                raise _damaged(path, f"page size {head.psize} in its header")
            f.seek(head.psize)
            second = _meta(f.read(160))
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    current = max((m for m in (head, second) if m is not None), key=lambda m: m.txnid)
    if current.psize != head.psize or current.last_page < 1:
        raise _damaged(path, "inconsistent meta pages")
    if size < current.used_bytes:
        raise StoreError(
            f"{path}: the file is truncated: {size} bytes, but its last page ends at byte "
            f"{current.used_bytes} (an interrupted copy or a full disk); copy or convert the "
            "store again"
        )
    if current.root != P_INVALID and not 2 <= current.root <= current.last_page:
        raise _damaged(path, f"root page {current.root} outside the file")
    return current


def pad(path: str) -> None:
    """Make sure :data:`SLACK` zero bytes follow the last page (a sparse extension)."""
    head = check_file(path)
    want = head.used_bytes + SLACK
    if os.path.getsize(path) < want:
        os.truncate(path, want)


def walk(path: str, *, limit: int = 20) -> list[str]:
    """Check every page of the main B-tree, reading the file directly; return what is wrong.

    Every branch and leaf page reached from the root is checked: its page number and type, its
    bounds, every node's offset and key length, every child page and overflow run within the
    file. At most ``limit`` problems are listed.
    """
    head = check_file(path)
    problems: list[str] = []
    if head.root == P_INVALID:
        return problems
    psize, last = head.psize, head.last_page
    seen: set[int] = set()
    with open(path, "rb") as f:

        def page(number: int) -> bytes:
            f.seek(number * psize)
            return f.read(psize)

        stack = [(head.root, 0)]
        while stack and len(problems) < limit:
            number, level = stack.pop()
            if number in seen:
                problems.append(f"page {number} is reached twice (a loop in the tree)")
                continue
            seen.add(number)
            if level > 64:
                problems.append(f"page {number}: the tree is deeper than LMDB allows")
                continue
            data = page(number)
            pgno, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, 0)
            if pgno != number:
                problems.append(f"page {number}: damaged (its header says page {pgno})")
                continue
            kind = flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
            if kind not in (P_BRANCH, P_LEAF):
                problems.append(f"page {number}: damaged (flags {flags:#x}, not a tree page)")
                continue
            if not PAGE_HEADER <= lower <= upper <= psize or (lower - PAGE_HEADER) % 2:
                problems.append(f"page {number}: damaged (bounds {lower}-{upper})")
                continue
            count = (lower - PAGE_HEADER) // 2
            offsets = struct.unpack_from(f"<{count}H", data, PAGE_HEADER)
            for i, offset in enumerate(offsets):
                problem = _check_node(data, number, i, offset, upper, kind, last, stack, level)
                if problem:
                    problems.append(problem)
                    break
    return problems


def _check_node(
    data: bytes,
    number: int,
    i: int,
    offset: int,
    upper: int,
    kind: int,
    last: int,
    stack: list[tuple[int, int]],
    level: int,
) -> str | None:
    psize = len(data)
    where = f"page {number} node {i}"
    if not upper <= offset <= psize - NODE_HEADER:
        return f"{where}: damaged (offset {offset} outside the page)"
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, offset)
    if offset + NODE_HEADER + ksize > psize:
        return f"{where}: damaged (key of {ksize} bytes runs past the page)"
    if kind == P_BRANCH:
        child = lo | (hi << 16) | (flags << 32)
        if not 2 <= child <= last:
            return f"{where}: damaged (child page {child} outside the file)"
        stack.append((child, level + 1))
        return None
    dsize = lo | (hi << 16)
    if flags & (F_SUBDATA | F_DUPDATA):
        return None  # fastdata stores have no sub-databases; other layouts are not walked
    start = offset + NODE_HEADER + ksize
    if flags & F_BIGDATA:
        if start + 8 > psize:
            return f"{where}: damaged (overflow pointer runs past the page)"
        first = struct.unpack_from("<Q", data, start)[0]
        pages = -(-(dsize + PAGE_HEADER) // psize)
        if first < 2 or first + pages - 1 > last:
            return f"{where}: damaged (value of {dsize} bytes on pages outside the file)"
        return None
    if start + dsize > psize:
        return f"{where}: damaged (value of {dsize} bytes runs past the page)"
    return None
