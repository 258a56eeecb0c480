"""Allocator tuning for loops that allocate and free image-sized buffers.

glibc serves allocations under 128 KiB (a typical JPEG) from the heap and returns freed memory at
the top of the heap to the kernel as soon as more than 128 KiB is free; larger blocks (decoded
images) get a fresh ``mmap`` each time. A loop that reads a batch of images, uses it and frees it
therefore page-faults on every byte of every batch; measured here, that tripled the cost of reading
a file into memory and of copying it into an LMDB transaction. :func:`tune_malloc` makes glibc keep
freed memory for reuse instead, so steady-state memory stays at the loop's working set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["tune_malloc"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
_done = False


def tune_malloc() -> bool:
    """Keep freed image-sized buffers for reuse (glibc only; once per process).

    Blocks up to 32 MiB come from the heap, and up to 256 MiB of free heap is kept rather than
    returned to the kernel. Does nothing where the user set ``MALLOC_TRIM_THRESHOLD_`` or
    ``MALLOC_MMAP_THRESHOLD_`` themselves, or where the C library is not glibc.

    Returns:
        Whether the settings are in effect.
    """
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    log.debug("glibc malloc tuned for image-sized buffers: %s", ok)
    _done = ok
    return ok
