"""The guard past the end of the data file, for readers' maps.

NOTE [ Past the end of the file ]

py-lmdb touches every page of a value before it returns it (its "preload", with the GIL
released), so a damaged node whose size runs past the end of the file would fault (SIGBUS)
inside LMDB's own get, before any check of ours could look at the value. The rules:

1. Readers map far more than the file (``READER_MAP_SIZE`` in ``env.py``), so that an append
   that grows the file stays inside their map.
2. When a reader's environment opens, the map past the file's last page is covered with an
   anonymous, read-only mapping (:func:`cover`): touching it reads zeros, never faults.
3. LMDB never takes a page of zeros for one of its own (its flags name no kind of page), so a
   read that meets one fails, and is tried again once the file is found to have grown
   (``Lease.read``).
4. A value is copied only where it lies inside the file's span; outside it, the file's growth
   is looked for first, and a value that still lies outside is damage (``Lease.value``).
5. When an append grows the file, the pages it now holds are mapped from the file again in
   their place (:func:`uncover`, from ``Entry.grown``) before anything past the old end is read.

Every site that takes part points here.
"""

from __future__ import annotations

import mmap

from .pages.advice import c_library

__all__ = ["cover", "page_up", "uncover"]

PROT_READ, MAP_SHARED, MAP_PRIVATE = 0x1, 0x01, 0x02
MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x10, 0x20, 0x4000  # Linux's values


def page_up(n: int) -> int:
    """``n`` rounded up to a whole memory page."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _map_fixed(address: int, length: int, flags: int, fd: int, offset: int) -> bool:
    """Map ``length`` bytes, read-only, at exactly ``address`` (replacing what was there)."""
    libc = c_library()
    if not libc:
        return False
    got = libc.mmap(address, length, PROT_READ, flags | MAP_FIXED, fd, offset)
    return bool(got == address)


def cover(base: int, size: int, map_length: int) -> tuple[int, int] | None:
    """Rule 2: cover the map at ``base`` (``map_length`` bytes) past a file of ``size`` bytes
    with zeros; where the cover begins and ends (None: nothing covered)."""
    start, end = base + page_up(size), base + map_length
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    if start < end and _map_fixed(start, end - start, flags, -1, 0):
        return start, end
    return None


def uncover(base: int, covered: int, end: int, size: int, fd: int) -> int | None:
    """Rule 5: map the file's pages (it now has ``size`` bytes, open at ``fd``) back where zeros
    covered them from ``covered``; where the cover now begins (None: they could not be)."""
    upto = min(base + page_up(size), end)
    if upto <= covered:
        return covered
    if not _map_fixed(covered, upto - covered, MAP_SHARED, fd, covered - base):
        return None
    return upto
