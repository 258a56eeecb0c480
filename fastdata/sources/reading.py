"""Read a source's files safely (:func:`read_file`: no FIFO waited on, no size trusted), and say
in a few words why a file or folder cannot be used (:func:`os_reason`, :func:`file_kind`)."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["file_kind", "os_reason", "read_file"]


def os_reason(exc: OSError, what: str = "unreadable") -> str:
    """A short reason for a file or folder that could not be used."""
    if exc.errno == errno.ENAMETOOLONG:
        return "path too long for the operating system"
    if exc.errno == errno.ELOOP:
        return "a link loop"
    if exc.errno == errno.ENOENT:
        return "vanished, or a broken link"
    return f"{what}: {exc.strerror or exc}"


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_file(path: str, limit: int, raise_with: str = "--max-file-size") -> bytes | str:
    """The bytes of the regular file at ``path``, or why it cannot be used.

    The file is opened without blocking (a FIFO would wait forever for a writer) and checked with
    ``fstat`` before anything is read: FIFOs, sockets and devices, directly or through a link, are
    refused, and so is a file over ``limit`` bytes (the reason ends with ``raise_with``, what
    raises the limit); no more than ``limit`` bytes are ever read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return os_reason(exc)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({file_kind(st.st_mode)})"
        if st.st_size > limit:
            return _too_large(st.st_size, limit, raise_with)
        # One read of what fstat said plus one byte: a regular file that gives exactly its size
        # has ended (os.read allocates what it asks for, so never more than the limit + 1).
        data = os.read(fd, st.st_size + 1)
        if len(data) != st.st_size:  # it grew or shrank since, or the file system reads short
            data = _read_rest(fd, data, limit)
    except OSError as exc:
        return os_reason(exc)
    finally:
        os.close(fd)
    if len(data) > limit:
        return _too_large(len(data), limit, raise_with)
    return data


def _read_rest(fd: int, first: bytes, limit: int) -> bytes:
    """``first`` and what follows it in ``fd`` up to its end or ``limit + 1`` bytes in all."""
    parts, total = [first], len(first)
    while first and total <= limit:
        first = os.read(fd, min(limit + 1 - total, 1 << 24))
        parts.append(first)
        total += len(first)
    return b"".join(parts)


def _too_large(size: int, limit: int, raise_with: str) -> str:
    return f"too large ({size} bytes; the limit is {limit}: {raise_with})"
