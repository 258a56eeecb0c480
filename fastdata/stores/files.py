"""Files that fastdata keeps beside a store (the writer lock, ``readers.epoch``) or reads back
(an export's files), opened as files it trusts only after checking them.

Anyone can put something else under such a name: a link (written through, it would change the
file it names), a FIFO (opening one for reading waits for a writer, forever), a folder. So each
is opened without following a link at its last component and without blocking, and ``fstat``
must find a regular file before anything is read or written.

Also what a writer asks of the file system itself: whether it is full, and a flush to disk.
"""

from __future__ import annotations

import errno
import os
import stat

from ..sources.reading import file_kind

__all__ = ["fsync_file", "no_space_left", "not_its_own", "open_regular", "unused_name"]


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int | str:
    """A descriptor of the regular file at ``path``, opened with ``flags`` (``O_CREAT`` among
    them creates it), not through a link and without blocking; or, where something else is
    there, what it is ("a link", "a FIFO", "a folder", ...), for a message.

    Raises:
        OSError: it cannot be opened for another reason (missing, no permission).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a link"
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # (ENXIO: a socket, or a FIFO to write)
            return file_kind(os.lstat(path).st_mode)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return file_kind(st.st_mode)
    return fd


def not_its_own(path: str | os.PathLike[str]) -> str | None:
    """What makes the file at ``path`` not a regular file of its own, for a message: a link
    ("a symbolic link to ..."), a file with several names (hard links), or something else
    ("a folder", ...); None when it is one, or when nothing is there. A writer that wrote into
    such a file would write another store's too, under a lock of its own."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.path.realpath(path)}"
    if not stat.S_ISREG(st.st_mode):
        return file_kind(st.st_mode)
    if st.st_nlink > 1:
        return f"a file with {st.st_nlink} names (hard links)"
    return None


def unused_name(path: str) -> str:
    """``path``, or the first of ``<stem>-2<ext>``, ``-3`` ... that nothing has taken: where a
    command that fastdata prints writes, it never meets a file or a store already there."""
    stem, ext = os.path.splitext(path)
    n, found = 1, path
    while os.path.lexists(found):
        n += 1
        found = f"{stem}-{n}{ext}"
    return found


def no_space_left(path: str) -> bool:
    """Whether the file system holding ``path`` (or its nearest folder that exists) is full:
    less free than one page (4 KiB)."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        found = os.statvfs(folder)
    except OSError:
        return False
    return found.f_bavail * found.f_frsize < 4096


def fsync_file(path: str) -> None:
    """Flush the file at ``path`` to its disk."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
