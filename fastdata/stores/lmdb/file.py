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

from ...errors import StoreError

__all__ = ["SLACK", "Damage", "Header", "check_file", "pad", "walk"]

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


@dataclass(frozen=True)
class Damage:
    """A damaged page of the B-tree, and the range of keys that live under it.

    Attributes:
        page: the page number.
        what: what is wrong with it.
        low: the smallest key that may live under it (None: from the first key).
        high: the first key past it (None: to the last key).
    """

    page: int
    what: str
    low: bytes | None
    high: bytes | None

    def covers(self, key: bytes) -> bool:
        return (self.low is None or key >= self.low) and (self.high is None or key < self.high)

    def __str__(self) -> str:
        low = self.low.decode("ascii", "replace") if self.low is not None else "the first key"
        high = self.high.decode("ascii", "replace") if self.high is not None else "the last key"
        return f"page {self.page} (keys {low} to {high}): {self.what}"


_Bounds = tuple[int, int, "bytes | None", "bytes | None"]
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")


def walk(path: str, *, limit: int = 100) -> list[Damage]:
    """Check every page of the main B-tree, reading the file directly; return what is wrong.

    Every branch and leaf page reached from the root is checked: its page number and type, its
    bounds, every node's offset and key length, every child page and overflow run within the
    file. A damaged page's subtree is not followed; the damage names the keys it holds. At most
    ``limit`` damaged pages are listed.

    Raises:
        StoreError: the file's header is damaged or the file is truncated (nothing to walk).
    """
    head = check_file(path)
    found: list[Damage] = []
    if head.root == P_INVALID:
        return found
    psize, last = head.psize, head.last_page
    seen: set[int] = set()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stack: list[_Bounds] = [(head.root, 0, None, None)]
        while stack and len(found) < limit:
            number, level, low, high = stack.pop()
            if number in seen or level > 64:
                found.append(Damage(number, "reached twice (a loop in the tree)", low, high))
                continue
            seen.add(number)
            pushed = len(stack)
            data = os.pread(fd, psize, number * psize)
            what = _check_page(data, number, last, level, low, high, stack)
            if what:
                found.append(Damage(number, what, low, high))
            elif len(stack) > pushed:
                _prefetch(fd, [c[0] for c in stack[pushed:]], psize)
    finally:
        os.close(fd)
    return found


PREFETCH_GAP = 16
"""Child pages this close together are asked for as one run (the pages between come along)."""


def _prefetch(fd: int, pages: list[int], psize: int) -> None:
    """Ask the kernel to read a branch page's children now, in runs, while the walk goes on:
    one page at a time, a cold file's walk waits for the disk once per page."""
    if not hasattr(os, "posix_fadvise"):
        return
    pages = sorted(pages)
    start = end = pages[0]
    for page in pages[1:]:
        if page - end > PREFETCH_GAP:
            os.posix_fadvise(fd, start * psize, (end - start + 1) * psize, os.POSIX_FADV_WILLNEED)
            start = page
        end = page
    os.posix_fadvise(fd, start * psize, (end - start + 1) * psize, os.POSIX_FADV_WILLNEED)


def _check_page(
    data: bytes,
    number: int,
    last: int,
    level: int,
    low: bytes | None,
    high: bytes | None,
    stack: list[_Bounds],
) -> str:
    """What is wrong with one tree page ("" if nothing); a branch page's children are pushed."""
    psize = len(data)
    if psize < PAGE_HEADER:
        return "past the end of the file"
    pgno, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, 0)
    if pgno != number:
        return f"damaged (its header says page {pgno})"
    kind = flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)
    if kind not in (P_BRANCH, P_LEAF):
        return f"damaged (flags {flags:#x}, not a tree page)"
    if not PAGE_HEADER <= lower <= upper <= psize or (lower - PAGE_HEADER) % 2:
        return f"damaged (bounds {lower}-{upper})"
    count = (lower - PAGE_HEADER) // 2
    children: list[_Bounds] = []
    keys: list[bytes | None] = []
    where = "node {}"  # (formatted only for a message)
    for i, offset in enumerate(struct.unpack_from(f"<{count}H", data, PAGE_HEADER)):
        if not upper <= offset <= psize - NODE_HEADER:
            return f"damaged ({where.format(i)} at offset {offset}, outside the page)"
        lo, hi, nflags, ksize = _NODE.unpack_from(data, offset)
        start = offset + NODE_HEADER + ksize
        if start > psize:
            return f"damaged ({where.format(i)}: key of {ksize} bytes runs past the page)"
        keys.append(data[offset + NODE_HEADER : start] if i or kind == P_LEAF else low)
        if kind == P_BRANCH:
            child = lo | (hi << 16) | (nflags << 32)
            if not 2 <= child <= last:
                return f"damaged ({where.format(i)}: child page {child} outside the file)"
            children.append((child, level + 1, None, None))
            continue
        dsize = lo | (hi << 16)
        if nflags & (F_SUBDATA | F_DUPDATA):
            continue  # fastdata stores have no sub-databases; other layouts are not walked
        if nflags & F_BIGDATA:
            if start + 8 > psize:
                return f"damaged ({where.format(i)}: overflow pointer runs past the page)"
            first = _PGNO.unpack_from(data, start)[0]
            pages = -(-(dsize + PAGE_HEADER) // psize)
            if first < 2 or first + pages - 1 > last:
                return (
                    f"damaged ({where.format(i)}: a value of {dsize} bytes on pages outside "
                    "the file)"
                )
        elif start + dsize > psize:
            return f"damaged ({where.format(i)}: a value of {dsize} bytes runs past the page)"
    # pushed last first, so that they are walked in order (the order they were prefetched in)
    for i in range(len(children) - 1, -1, -1):
        child, lvl = children[i][0], children[i][1]
        stack.append((child, lvl, keys[i], keys[i + 1] if i + 1 < len(keys) else high))
    return ""
