"""Where a value read from the map lies in this process's memory, in a few hundred nanoseconds.

A reader checks that every value LMDB hands back lies inside the data file before it copies the
value (a damaged page can give a value a size or place past the end of the file, and copying it
would kill the process with SIGBUS). The check needs the address of the value's bytes, which
Python does not offer for a read-only buffer: numpy finds it in about 1.5 us, which was the
largest cost of a raw read. A memoryview's address is a field of the memoryview object itself
(``view.buf`` of CPython's ``PyMemoryViewObject``), so it is read from there with one
``struct.unpack_from`` over this process's own memory.

The field's place is not taken on trust: when this module loads, it is found by comparing
candidate offsets with numpy's answer for memoryviews over several kinds of buffer, and
:func:`address` uses numpy for every value when no offset agrees on all of them (another Python
implementation or a changed object layout).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import sys
from collections.abc import Callable

import numpy as np

__all__ = ["address", "fast"]

_POINTER = struct.Struct("P")


def _by_numpy(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _probe_views() -> list[memoryview]:
    """Memoryviews over buffers of every kind a reader meets, each with a distinct address."""
    data = bytes(range(256)) * 16
    mapped = mmap.mmap(-1, mmap.PAGESIZE)
    mapped.write(data[: mmap.PAGESIZE])
    views = [memoryview(data), memoryview(data)[37:], memoryview(bytearray(data))[5:900]]
    views.append(memoryview(mapped)[100:200])
    return views


def _reader(memory: memoryview, offset: int) -> Callable[[memoryview], int]:
    unpack = _POINTER.unpack_from

    def by_field(view: memoryview) -> int:
        found: int = unpack(memory, id(view) + offset)[0]
        return found

    return by_field


def _find() -> Callable[[memoryview], int]:
    if sys.maxsize < 2**32 or sys.implementation.name != "cpython":
        return _by_numpy
    try:
        memory = memoryview((ctypes.c_char * sys.maxsize).from_address(0))
    except (ValueError, OverflowError, TypeError, MemoryError):
        return _by_numpy
    views = _probe_views()
    expected = [_by_numpy(v) for v in views]
    size = min(sys.getsizeof(v) for v in views)
    for offset in range(0, size - _POINTER.size + 1, _POINTER.size):
        if all(
            _POINTER.unpack_from(memory, id(v) + offset)[0] == want
            for v, want in zip(views, expected, strict=True)
        ):
            return _reader(memory, offset)
    return _by_numpy


address: Callable[[memoryview], int] = _find()
"""The address of the first byte of ``view`` (a memoryview over bytes that are alive)."""

fast = address is not _by_numpy
"""Whether the field was found (otherwise every address comes from numpy)."""
