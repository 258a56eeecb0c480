"""Every check of LMDB's pages, written once, over an array of pages (one page is an array of
one): the file's header against its size, branch and leaf pages (:func:`check_pages`), the
overflow pages that hold a value (:func:`check_overflow`). Each gives, for every page, the first
check it fails, naming the node and the reason, as LMDB would meet them one after the other."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import format as mdb

VALUE_ALONE = 3
"""The first of the leaf checks (``_LEAF_WHY``) that concern one node's value alone."""
NAMED = -2
"""The first overflow page :func:`check_pages` gives the node of a named database (another
tool's sub-database: its record, not an entry)."""


class NotRegular(mdb.FormatError):
    """Not a regular file."""


class Unreadable(mdb.FormatError):
    """The file cannot be read (``reason``: the system's words)."""


class Truncated(mdb.FormatError):
    """The file ends before its last page does."""

    def __init__(self, size: int, end: int) -> None:
        super().__init__(f"{size} bytes, but its last page ends at byte {end}")
        self.size, self.end = size, end


def check_file(path: str, *, for_lmdb: bool = False) -> mdb.Header:
    """The current meta page of the LMDB data file at ``path``, checked against the file's size
    before anything maps it; ``for_lmdb`` (LMDB is about to map it), its root page's header too:
    LMDB asserts that a branch has two or more nodes, and an assertion ends the whole process.

    Raises:
        mdb.FormatError: (or one of its kinds) what is wrong, in ``reason``.
    """
    try:
        # (without blocking: opening a FIFO for reading waits for a writer, forever)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise NotRegular("not a regular file")
            head = mdb.current_meta(fd)
            root = b""
            if for_lmdb and 2 <= head.root <= head.last_page:
                root = os.pread(fd, head.psize, head.root * head.psize)
        finally:
            os.close(fd)
    except OSError as exc:
        raise Unreadable(str(exc.strerror or exc)) from None
    if info.st_size < head.used_bytes:
        raise Truncated(info.st_size, head.used_bytes)
    if head.flags & (mdb.MDB_REVERSEKEY | mdb.MDB_INTEGERKEY):
        order = "reversed" if head.flags & mdb.MDB_REVERSEKEY else "as integers"
        raise mdb.FormatError(
            f"its keys are compared {order} (flags {head.flags:#x} of the main database), not as "
            "bytes, as every key of the tree is checked"
        )
    if head.root != mdb.P_INVALID and not 2 <= head.root <= head.last_page:
        raise mdb.FormatError(f"root page {head.root} outside the file")
    if len(root) == head.psize:
        page = np.frombuffer(root, mdb.page_dtype(head.psize), 1)
        if page["mp_flags"][0] & mdb.P_BRANCH and page["mp_lower"][0] < mdb.PAGEHDRSZ + 4:
            count = max(0, (int(page["mp_lower"][0]) - mdb.PAGEHDRSZ) // 2)
            raise mdb.FormatError(f"root page {head.root} is a branch of {count} node(s)")
    return head


Bound = bytes | None


@dataclass
class Checked:
    """What :func:`check_pages` found: for each page, what is wrong with it ("": nothing) and its
    kind; for each node of the pages that passed their header's checks, in page and key order,
    its page (``row``), key and value.

    Attributes:
        reasons: per page.
        kinds: per page, ``mdb.P_BRANCH`` or ``mdb.P_LEAF`` (sound pages).
        ends: per page, the index past its last node (a page's nodes are ``ends[p-1] .. ends[p]``).
        row, keys, klen: per node: its page, its key (one zero-padded row each) and the key's size.
        starts, sizes, values: per node: where its value starts in the pages' bytes and its
            size; a leaf's first overflow page (-1: on the page, :data:`NAMED`: a named
            database), a branch's child page.
    """

    reasons: list[str]
    kinds: np.ndarray
    ends: np.ndarray
    row: np.ndarray
    keys: np.ndarray
    klen: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    values: np.ndarray

    values_alone: dict[int, str] = field(default_factory=dict)
    """Nodes of leaves whose value alone is damaged (its size past the page or the file, its
    overflow pointer, flags of a sub-database), by node index: what is wrong. A leaf whose
    nodes are all in order but these is sound for every other key."""

    def span(self, p: int) -> tuple[int, int]:
        """Page ``p``'s nodes, as a range of node indices."""
        return (int(self.ends[p - 1]) if p else 0), int(self.ends[p])

    def key_list(self, a: int, b: int) -> list[bytes]:
        """Nodes ``a .. b-1``'s keys, as bytes."""
        rows = self.uniform(a, b)
        if rows is not None:
            flat, width = rows.tobytes(), rows.shape[1]
            return [flat[j : j + width] for j in range(0, len(flat), width)]
        width = self.keys.shape[1]
        flat = self.keys[a:b].tobytes()
        lens = self.klen[a:b].tolist()
        return [flat[i * width : i * width + n] for i, n in enumerate(lens)]

    def uniform(self, a: int, b: int) -> np.ndarray | None:
        """Nodes ``a .. b-1``'s keys as rows, where they are all of one size (None else)."""
        lens = self.klen[a:b]
        if b <= a or not lens[0] or (lens != lens[0]).any():
            return None
        return self.keys[a:b, : int(lens[0])]


_NODE_BYTES = np.arange(mdb.NODESIZE)
_DB_RECORD = mdb.MDB_db.itemsize
_LEAF_WHY = (
    "",
    "at offset {off}, outside the page",
    "its key is out of order",
    "a key of {ksize} bytes and a value of {size} run past the page",
    "flags {nflags:#x} of a sub-database",
    "overflow pointer runs past the page",
    "a value of {size} bytes on pages outside the file",
)
_BRANCH_WHY = (
    "",
    "at offset {off}, outside the page",
    "key of {ksize} bytes runs past the page",
    "child page {child} outside the file",
    "its key is out of order",
)


def _words(rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Keys (zero-padded rows and their sizes) as big-endian 64-bit words, the size last, which
    compare in the keys' order (LMDB's: bytes, then the shorter first)."""
    n, width = rows.shape
    pad = -width % 8
    if pad:
        rows = np.concatenate([rows, np.zeros((n, pad), np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view(">u8").astype(np.uint64)
    return np.concatenate([words, lens.astype(np.uint64)[:, None]], axis=1)


def _before(a: np.ndarray, b: np.ndarray, *, strict: np.ndarray | bool) -> np.ndarray:
    """Row by row, whether key ``a`` sorts before key ``b`` (or is equal, where not
    ``strict``); both as :func:`_words`."""
    less = np.zeros(len(a), bool)
    same = np.ones(len(a), bool)
    for w in range(a.shape[1]):
        less |= same & (a[:, w] < b[:, w])
        same &= a[:, w] == b[:, w]
    return less | (same & ~np.asarray(strict))


def _bounds(bounds: Sequence[Bound], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page bounds as zero-padded rows, their sizes, and whether each is given."""
    given = np.array([b is not None for b in bounds], bool)
    items = [b or b"" for b in bounds]
    lens = np.fromiter(map(len, items), np.int64, len(items))
    if not width:
        return np.zeros((len(items), 0), np.uint8), lens, given
    rows = np.array(items, f"S{width}")  # (each zero-padded to the width, in one pass)
    return rows.view(np.uint8).reshape(len(items), width), lens, given


def read_pages(
    fd: int, numbers: Sequence[int] | np.ndarray, psize: int
) -> tuple[bytearray, np.ndarray]:
    """The pages ``numbers`` of the file ``fd``, in that order, one after the other (zeros
    past the end of the file), for :func:`check_pages`, and whether each was read whole: one
    read for each run of pages that follow one another in the file (a file's leaves mostly do,
    in key order), not one a page."""
    n = len(numbers)
    buf = bytearray(n * psize)
    view, whole = memoryview(buf), np.zeros(n, bool)
    edges = [0, *(np.flatnonzero(np.diff(numbers) != 1) + 1).tolist(), n] if n else []
    for c, d in itertools.pairwise(edges):
        read = os.preadv(fd, [view[c * psize : d * psize]], int(numbers[c]) * psize)
        whole[c : c + read // psize] = True  # (the file ends inside the run: the rest zeros)
    return buf, whole


def check_pages(
    buf: bytes | bytearray | memoryview,
    numbers: np.ndarray,
    lows: Sequence[Bound],
    highs: Sequence[Bound],
    last: int,
    psize: int,
    whole: np.ndarray | None = None,
) -> Checked:
    """Check branch and leaf pages read side by side into ``buf``: page ``p`` should be page
    ``numbers[p]`` of the file, its keys in ``[lows[p], highs[p])`` (None: unbounded), every page
    and overflow run it names within ``2 .. last``; ``whole[p]``: its bytes were all read.

    Each page's header (its number, kind and bounds), then each node in turn (its offset, its
    key's size and order, its child or value) are checked, and the first that fails is each
    page's reason: ``damaged (node 3: its key is out of order)``.
    """
    k = len(numbers)
    pages = np.frombuffer(buf, mdb.page_dtype(psize), count=k)
    pgno, flags = pages["mp_pgno"], pages["mp_flags"].astype(np.int64)
    lower, upper = pages["mp_lower"].astype(np.int64), pages["mp_upper"].astype(np.int64)
    kinds = flags & mdb.P_KINDS
    count = (lower - mdb.PAGEHDRSZ) >> 1
    branch = kinds == mdb.P_BRANCH
    fail = [
        np.zeros(k, bool) if whole is None else ~whole,
        pgno != numbers,
        (kinds != mdb.P_BRANCH) & (kinds != mdb.P_LEAF),
        (count < 0) | (lower > upper) | (upper > psize) | ((lower - mdb.PAGEHDRSZ) & 1 == 1),
        branch & (count < 2),  # (LMDB stops the process on one: an assertion)
    ]
    why = np.select(fail, np.arange(1, len(fail) + 1), 0)
    reasons = [""] * k
    for p in np.flatnonzero(why).tolist():
        n = int(count[p])
        reasons[p] = [
            "past the end of the file",
            f"damaged (its header says page {int(pgno[p])})",
            f"damaged (flags {int(flags[p]):#x}, not a tree page)",
            f"damaged (bounds {int(lower[p])}-{int(upper[p])})",
            f"damaged (a branch of {n} node{'' if n == 1 else 's'}, not two or more)",
        ][int(why[p]) - 1]
    count[why != 0] = 0
    ends = np.cumsum(count)
    most = int(count.max()) if k else 0
    table = np.frombuffer(buf, "<u2", k * psize // 2).reshape(k, psize // 2)
    row = np.repeat(np.arange(k), count)
    off = table[:, 8 : 8 + most][np.arange(most) < count[:, None]].astype(np.int64)
    j = np.arange(len(off)) - (ends - count)[row]  # (each node's place on its page)
    outside = (off < upper[row]) | (off > psize - mdb.NODESIZE)
    off = np.where(outside, upper[row].clip(0, psize - mdb.NODESIZE), off)
    flat = np.frombuffer(buf, np.uint8, k * psize)
    at = row * psize + off
    node = flat[at[:, None] + _NODE_BYTES].view(mdb.MDB_node).ravel()
    lo, hi = node["mn_lo"].astype(np.int64), node["mn_hi"].astype(np.int64)
    nflags, ksize = node["mn_flags"].astype(np.int64), node["mn_ksize"].astype(np.int64)
    size = lo | (hi << 16)
    start = off + mdb.NODESIZE + ksize
    klen = np.minimum(ksize, psize - off - mdb.NODESIZE)  # (a leaf's key past the page: cut)
    width = max([int(klen.max()) if len(klen) else 0, *(len(b or b"") for b in (*lows, *highs))])
    take = np.arange(width)
    keys = flat[np.minimum(at[:, None] + mdb.NODESIZE + take, len(flat) - 1)]
    if (klen != width).any():
        keys[take >= klen[:, None]] = 0
    words = _words(keys, klen)
    # each key after the one before it on its page, the first at or after the page's low bound
    # (a branch's node 0 has no key: its child begins at the page's low key), all before its high
    nb = branch[row]
    first = j == nb.astype(np.int64)
    low_rows, low_lens, has_low = _bounds(lows, width)
    high_rows, high_lens, has_high = _bounds(highs, width)
    prior = np.roll(words, 1, axis=0)
    prior[first] = _words(low_rows, low_lens)[row[first]]
    order = (~first | has_low[row]) & ~_before(prior, words, strict=~first | nb)
    order |= has_high[row] & ~_before(words, _words(high_rows, high_lens)[row], strict=True)
    order &= ~(nb & (j == 0))
    # leaves: a value on the page, a named database's record, or the first of its own pages
    named = (nflags == mdb.F_SUBDATA) & (size == _DB_RECORD) & (start + size <= psize)
    sub = (nflags != 0) & ~named & (nflags & (mdb.F_SUBDATA | mdb.F_DUPDATA) != 0)
    big = (nflags != 0) & ~named & ~sub
    pointer = big & (start + 8 > psize)
    got = flat[np.minimum(row * psize + start, len(flat) - 8)[:, None] + _NODE_BYTES]
    firsts = got.view("<u8").ravel()
    runs = (size + mdb.PAGEHDRSZ - 1) // psize
    firsts = np.minimum(firsts, last + 1).astype(np.int64)
    far = big & ~pointer & ((firsts < 2) | (firsts + runs > last))
    leaf_why = np.select(
        [outside, order, (nflags == 0) & (start + size > psize), sub, pointer, far], range(1, 7), 0
    )
    child = lo | (hi << 16) | (nflags << 32)
    branch_why = np.select(
        [outside, start > psize, (child < 2) | (child > last), order], range(1, 5), 0
    )
    node_why = np.where(nb, branch_why, leaf_why)
    bad = np.flatnonzero(node_why)
    if len(bad):
        pages_bad, at_first = np.unique(row[bad], return_index=True)
        for p, n in zip(pages_bad.tolist(), bad[at_first].tolist(), strict=True):
            text = (_BRANCH_WHY if branch[p] else _LEAF_WHY)[int(node_why[n])].format(
                off=int(table[p, 8 + j[n]]),
                ksize=int(ksize[n]),
                size=int(size[n]),
                nflags=int(nflags[n]),
                child=int(child[n]),
            )
            offsets = table[p, 8 : 8 + int(count[p])].tolist()
            reasons[p] = f"damaged (node {offsets.index(offsets[j[n]])}: {text})"
    values = np.where(nb, child, np.where(big, firsts, np.where(named, NAMED, -1)))
    out = Checked(reasons, kinds, ends, row, keys, klen, row * psize + start, size, values)
    # a leaf's node whose value alone is wrong (its size, its pages, its flags): LMDB meets it
    # only where that key is read, not on its way to any other
    alone = ~nb & (leaf_why >= VALUE_ALONE) & ~np.isin(row, row[~nb & np.isin(leaf_why, (1, 2))])
    for n in np.flatnonzero(alone).tolist():
        p, code = int(row[n]), int(leaf_why[n])
        text = _LEAF_WHY[code].format(
            off=0, ksize=int(ksize[n]), size=int(size[n]), nflags=int(nflags[n]), child=0
        )
        out.values_alone[n] = f"damaged (node {int(j[n])} of the page: {text})"
    return out


def check_overflow(
    data: bytes | memoryview,
    at: np.ndarray,
    firsts: np.ndarray,
    sizes: np.ndarray,
    psize: int,
    *,
    whole: bool = True,
) -> tuple[int, str]:
    """Check values on pages of their own read into ``data``: value ``i`` of ``sizes[i]`` bytes
    on the pages from ``firsts[i]``, read to ``at[i]`` (not ``whole``: only the first page of
    each was read, and is checked). How many in a row pass, and what is wrong with the first
    that does not ("": all pass)."""
    pages = (sizes + mdb.PAGEHDRSZ + psize - 1) // psize
    head = at + psize <= len(data)
    index = at[:, None] + np.arange(mdb.PAGEHDRSZ)
    flat = np.frombuffer(data, np.uint8)
    if head.all():  # (the header of each read: most often)
        fields = flat[index].view(mdb.MDB_overflow).ravel()
    else:
        fields = np.zeros(len(at), mdb.MDB_overflow)
        fields[head] = flat[index[head]].view(mdb.MDB_overflow).ravel()
    pgno, flags, count = fields["mp_pgno"], fields["mp_flags"], fields["mp_pages"]
    checks = [  # (in the order LMDB meets them; the first that fails is the reason)
        ~head,
        pgno != firsts,
        (flags & mdb.P_OVERFLOW == 0) | (count != pages),
        (at + mdb.PAGEHDRSZ + sizes > len(data)) & whole,
    ]
    failed = checks[0] | checks[1] | checks[2] | checks[3]
    if not failed.any():
        return len(at), ""
    why = np.select(checks, [1, 2, 3, 1], 0)
    i = int(np.argmax(why != 0))
    return i, [
        "past the end of the file",
        f"damaged (its header says page {int(pgno[i])})",
        f"damaged (flags {int(flags[i]):#x}, {int(count[i])} pages: not the overflow run of a "
        f"value of {int(sizes[i])} bytes)",
    ][int(why[i]) - 1]
