"""What a writer of an LMDB store may write: a data file of the store's own, and the keys of
the records it adds.

NOTE [ A data file of its own ]

The writer lock (``writer.lock``) and LMDB's lock table (``lock.mdb``) lie beside ``data.mdb`` in
the store's folder, and a writer holds those of the folder it was given. So one data file reached
from two folders (a symbolic link, or a hard link, from one store's ``data.mdb`` to another's)
would have two writers at once, each under a lock of its own, writing the same pages. A writer
therefore writes only a ``data.mdb`` (its replacement's too) that is a regular file with one name,
and refuses any other before it writes anything (:func:`refuse_shared`); a store reached through
a link is read, and copied, as any other. Where records appear that the writer did not write all
the same (a link made while it ran, another program), it says so, and never advises starting over
where another store's records may be in the file (:func:`taken`).

Another tool's key where an append puts its records (shaped like a record past the last) would
take the place of a record the append numbers so: the append is refused before it writes, naming
the key (:func:`check_room`), as ``verify`` names it (``layout.foreign_keys``).
"""

from __future__ import annotations

import os
import shlex

from ...errors import SAME_COMMAND, StoreError, option
from ..files import not_its_own, unused_name
from ..names import DATA_FILE, aside_folder, data_file
from .env import open_reader, reading
from .layout import past_the_last

__all__ = ["check_room", "refuse_shared", "shared_error", "taken"]


def refuse_shared(folder: str) -> None:
    """Refuse the store in ``folder`` where its data file, or its replacement's, is not a
    regular file of its own, or its replacement's folder is a link.

    Raises:
        StoreError: one line naming the file, what it is, and what to do.
    """
    aside = aside_folder(folder)
    if os.path.islink(aside):
        raise StoreError(
            f"{aside}: a symbolic link, where fastdata builds a replacement of the store (and "
            f"removes it whole); remove the link (`rm {shlex.quote(os.path.abspath(aside))}`) "
            "and run the same command again"
        )
    for path in (data_file(folder), data_file(aside)):
        what = not_its_own(path)
        if what is not None:
            raise shared_error(path, what)


def shared_error(path: str, what: str) -> StoreError:
    """The refusal of the data file ``path``, which is ``what`` (``files.not_its_own``)."""
    here = shlex.quote(os.path.abspath(path))
    if what.startswith("a symbolic link to "):
        real = os.path.realpath(path)
        if not _a_store_data_file(path, real):  # (a loop, nothing, or a file of another kind)
            return StoreError(
                f"{path}: {what}, which is no store's data file; nothing was written: remove "
                f"the link (`rm {here}`), then run the same command again"
            )
        fix = (
            f"write to {os.path.dirname(real)} instead, or give this store a copy of its own "
            f"while nothing writes to either (`cp --remove-destination {shlex.quote(real)} "
            f"{here}`)"
        )
    elif what.endswith("(hard links)"):
        copy = shlex.quote(unused_name(os.path.abspath(path) + ".copy"))
        fix = (
            "give this store a copy of its own while nothing writes to any of them "
            f"(`cp -p {here} {copy} && mv {copy} {here}`)"
        )
    else:
        return StoreError(
            f"{path}: {what}, where the store's data file belongs; nothing was written: move it "
            "out of the store folder"
        )
    return StoreError(
        f"{path}: {what}, not a data file of this store's own: a writer of another store may "
        "write the same file at the same time, under another lock, and damage both; nothing "
        f"was written: {fix}"
    )


def _a_store_data_file(link: str, real: str) -> bool:
    """Whether the link ``link`` leads to ``real``, a regular file named as a store's data file
    in another folder (another store's): then writing to that store, or copying the file, is
    advice that works."""
    import stat

    try:
        regular = stat.S_ISREG(os.stat(real).st_mode)
    except OSError:
        return False
    return (
        regular
        and os.path.basename(real) == DATA_FILE
        and os.path.dirname(real) != os.path.dirname(os.path.abspath(link))
    )


def check_room(folder: str, first: int) -> None:
    """Refuse an append to the store in ``folder``, before it writes, where another tool's key
    lies where it puts its records (record ``first`` on): it would end refused.

    Raises:
        StoreError: the key, and what to do.
    """
    lease = open_reader(folder)
    try:
        with reading(folder), lease.env.begin() as txn:
            key = past_the_last(txn, first)
    finally:
        lease.release()
    if key is None:
        return
    root, ext = os.path.splitext(os.path.abspath(folder))
    copy = " ".join(map(shlex.quote, (os.path.abspath(folder), f"{root}-copy{ext}")))
    raise StoreError(
        f"{folder}: holds the key {key.decode('ascii', 'backslashreplace')!r}, which fastdata "
        "did not write, where an append puts its records (past the last record): remove it "
        "with the tool that wrote it, or copy the store, which leaves it out "
        f"(`fastdata copy {copy}`), and append to the copy"
    )


def taken(folder: str, target: str, first: int, appending: bool) -> StoreError:
    """What to say when records from ``first`` on, which this run did not write, are in the
    store in ``folder`` (written in ``target``, the folder or its replacement's): something else
    writes it. A data file shared with another store (linked since the run began) is named;
    otherwise another program wrote into it, and starting over is advised only for a store that
    is not complete yet (an append's store holds what earlier runs added)."""
    path = data_file(target)
    what = not_its_own(path)
    if what is not None:
        return shared_error(path, what)
    where = f"{folder}: records from {first} on are in the store, which this "
    if appending:
        return StoreError(
            where + "append did not write: another program writes into the store; nothing of "
            "this batch was written, and the store reads as before the append: stop that "
            "program, then run ",
            SAME_COMMAND,
            " with ",
            option("resume"),
        )
    return StoreError(
        where + "conversion did not write: another program writes into the store, which is not "
        "complete yet; stop that program, then convert again with ",
        option("overwrite"),
    )
