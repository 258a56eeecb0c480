"""How an export writes its files: each record's path checked to stay inside the export folder
and out of every LMDB store (:class:`Destination`), each file written under a temporary name
and renamed into place (:func:`write_file`, :func:`replace_file`), so that no file is ever
partial under its own name, and what a killed export left behind removed by the next."""

from __future__ import annotations

import os
import re
import stat
from contextlib import suppress
from pathlib import Path

from ..errors import SAME_COMMAND, StoreError, StoreExistsError, UnsafePathError, option
from ..stores import names
from ..stores.files import open_regular
from .reports import ExportReport

__all__ = [
    "any_unsafe",
    "Destination",
    "replace_file",
    "safe_destination",
    "safe_name",
    "write_failed",
    "write_file",
]


def safe_destination(outdir: Path, name: str) -> Path:
    """The path under ``outdir`` for a record named ``name``.

    Raises:
        UnsafePathError: the name is absolute, empty, has ``.`` or ``..`` parts or a NUL byte,
            or would resolve (through a link) outside ``outdir``.
    """
    return Destination(outdir).path_for(name, create=False)


def safe_name(name: str) -> bool:
    """Whether ``name`` is a relative path that stays inside the folder it is written to: not
    empty nor absolute, no ``.`` or ``..`` parts, no NUL byte (nor a drive, on Windows)."""
    raw = name.encode("utf-8", "surrogatepass")  # (any string: only its slashes and dots count)
    return b"\0" not in raw and not any_unsafe(raw) and not (os.name == "nt" and ":" in name)


_UNSAFE = re.compile(rb"\A\Z|\A\0|\0\Z|\0\0|\A/|\0/|//|/\0|/\Z|(?:\A|[\0/])\.\.?(?=\Z|[\0/])")
"""Among names joined by NULs: an empty one, one that begins or ends with ``/``, or one with an
empty, ``.`` or ``..`` part."""


def any_unsafe(joined: bytes) -> bool:
    """Whether any of the names ``joined`` by NULs (as ``verify`` reads a block's) fails
    :func:`safe_name` (a drive's colon aside: on Windows only, each name is asked alone)."""
    return _UNSAFE.search(joined) is not None


class Destination:
    """Where an export writes: each record's path checked to stay inside the folder, each
    folder under it created and resolved once (its links followed) however many files go in."""

    def __init__(self, outdir: Path, *, resume: bool = False) -> None:
        self.outdir = outdir
        self.resume = resume
        """Remove what a killed export left in each folder (``--resume`` only: a folder of the
        user's may hold a file of that name of its own)."""
        self.root = os.path.realpath(outdir)
        self._folders: set[tuple[str, ...]] = set()
        """Folders (as name parts) made and found to resolve inside the root."""
        self._plain: set[str] = set()
        """Resolved folders found to be no store's folder."""

    def path_for(self, name: str, *, create: bool = True) -> Path:
        """The checked path of the record ``name``; with ``create``, its folder exists."""
        if not safe_name(name):
            raise UnsafePathError(
                f"record name {name!r} is not a safe relative path; refusing to write it"
            )
        parts = name.split("/")
        target = self.outdir.joinpath(*parts)
        folder = tuple(parts[:-1])
        if folder not in self._folders:
            if create:
                # the deepest folder that exists must resolve inside first: making the rest
                # through a link that leads out would create folders outside
                existing = target.parent
                while not existing.exists() and existing != self.outdir:
                    existing = existing.parent
                self.inside(existing, name)
                target.parent.mkdir(parents=True, exist_ok=True)
            self.inside(target.parent, name)
            self.not_in_a_store(target.parent, name)
            if create:
                if self.resume and existing == target.parent:  # (a new folder holds none)
                    _remove_stale_temporaries(target.parent)
                self._folders.add(folder)
        # the folder resolves inside the root; only the file's own name may still be a link,
        # which the caller looks at (it stats the target anyway)
        if not create and os.path.islink(target):
            self.inside(target, name)
        return target

    def not_in_a_store(self, folder: Path, name: str) -> None:
        """Refuse a folder that is an LMDB store's (it holds ``data.mdb``) or lies inside one,
        however the export is asked to write (``overwrite`` too): a file written there could
        take the place of the store's own."""
        path = os.path.realpath(folder)
        while True:
            if path not in self._plain:
                if os.path.lexists(os.path.join(path, names.DATA_FILE)):
                    raise UnsafePathError(
                        f"record name {name!r} would be written into {path}, the folder of an "
                        "LMDB store; export into a folder outside every store"
                    )
                self._plain.add(path)
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent

    def inside(self, path: Path, name: str) -> None:
        """Refuse ``path`` (for the record ``name``) unless it resolves inside the folder."""
        if os.path.commonpath([self.root, os.path.realpath(path)]) != self.root:
            raise UnsafePathError(
                f"record name {name!r} resolves outside {self.outdir}; refusing to write it"
            )


def write_file(
    out: Destination,
    name: str,
    data: bytes,
    *,
    overwrite: bool,
    resume: bool,
    report: ExportReport,
) -> None:
    """Write one file: under a temporary name beside it, then renamed into place (assumption 1
    of docs/guarantees.md), so that a file under its own name is always whole, however the
    export ends (Ctrl-C, a full disk, killed); a file it replaces (``overwrite``) stays whole
    until then."""
    target = out.outdir / name  # (for a message, until it is checked)
    try:
        target = out.path_for(name)
        try:
            st: os.stat_result | None = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                out.inside(target, name)  # a link there may not lead out of the folder
            held = _held(target, st, data) if resume else "other"
            if held == "whole":
                report.kept += 1
                return
            if held != "part" and not overwrite:  # (a prefix: left by an earlier fastdata)
                hint = (
                    ("it differs from the record: pass ", option("overwrite"), " to replace it")
                    if resume
                    else (
                        "export into an empty folder, or pass ",
                        option("resume"),
                        " (keep files that match) or ",
                        option("overwrite"),
                    )
                )
                raise StoreExistsError(f"{target}: exists already; ", *hint)
        replace_file(target, data)
    except OSError as exc:
        raise write_failed(target, exc) from None
    report.files += 1
    report.total_bytes += len(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_new(path: Path, data: bytes) -> None:
    """``data`` into a new file at ``path`` (which must not exist, not even as a link); a write
    that fails, or is interrupted, removes the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _temporary(target: Path) -> Path:
    return Path(names.export_temp(target, os.getpid()))


def replace_file(target: Path, data: bytes) -> None:
    """``data`` written aside and renamed to ``target``: no file under that name is ever partial
    (what was there stays whole until then)."""
    tmp = _temporary(target)
    try:
        try:
            _write_new(tmp, data)
        except FileExistsError:  # left by a killed process that had this process's id
            os.unlink(tmp)
            _write_new(tmp, data)
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporary files that exports killed outright (SIGKILL, a power cut) left in
    ``folder``: those of processes that no longer run (an export running beside this one keeps
    its own)."""
    with suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            found = names.EXPORT_TEMP.fullmatch(entry.name)
            if found and not _running(int(found.group(1))) and entry.is_file(follow_symlinks=False):
                with suppress(OSError):
                    os.unlink(entry.path)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # (its temporary files exist only while it writes one, never here)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: running)
        return True
    return True


def _held(target: Path, st: os.stat_result, data: bytes) -> str:
    """What the regular file ``target`` (``st``: its lstat) holds against ``data``: ``"whole"``
    (exactly it), ``"part"`` (a shorter prefix of it: an export by an earlier fastdata, which
    wrote files in place, stopped while writing it) or ``"other"``."""
    if not stat.S_ISREG(st.st_mode) or st.st_size > len(data):
        return "other"
    fd = open_regular(target, os.O_RDONLY)  # (what lstat saw may have changed since)
    if isinstance(fd, str):
        return "other"
    with open(fd, "rb") as f:
        held = f.read(len(data) + 1)
    if held == data:
        return "whole"
    return "part" if len(held) < len(data) and data.startswith(held) else "other"


def write_failed(where: Path, exc: OSError) -> StoreError:
    return StoreError(
        f"{where}: writing failed: {exc.strerror or exc}; free space (or fix the cause) and run ",
        SAME_COMMAND,
        " with ",
        option("resume"),
        ": the files written so far are whole and are kept",
    )
