"""Open any LMDB store for reading: a fastdata store, or a pickle recipe's when allowed."""

from __future__ import annotations

import os
import shlex
from typing import Any

from ...errors import (
    FastdataError,
    IncompleteStoreError,
    PickleNotAllowedError,
    StoreError,
    option,
)
from ...records import Progress
from ..foreign import PickleLMDBStore
from ..locks import describe_holder, flock_holder
from ..names import WRITER_LOCK, aside_owner
from ..policy import incomplete_error
from ..reader import StoreReader
from .env import open_reader, reading
from .layout import KEYS_KEY, META_KEY, PROGRESS_KEY
from .look import peek, read_skipped
from .reader import LMDBStore


def open_lmdb(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> StoreReader:
    """Open an LMDB store for reading: a fastdata store, or (with ``allow_pickle``) a pickle one.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        IncompleteStoreError: a conversion into it did not finish; the message says how to resume.
        PickleNotAllowedError: it holds pickled values and ``allow_pickle`` is false.
        StoreError: it is not a store fastdata can read.
    """
    path = os.fspath(path)
    lease = open_reader(path)
    try:
        if lease.env.stat()["depth"] == 0:  # (no tree: not LMDB's count of keys, which
            # another tool may have changed)
            writing = _writer(path)
            if writing:
                raise IncompleteStoreError(
                    f"{path}: being written now ({writing}): nothing committed yet; open it "
                    "when that conversion has finished"
                )
            raise IncompleteStoreError(
                f"{path}: an empty store: a conversion into it stopped before it began; run "
                f"fastdata convert again, from its image folder into {shlex.quote(path)}"
            )

        def first_look(txn: Any) -> tuple[bool, Progress | None, bool]:
            has_meta = txn.get(META_KEY) is not None
            raw = lease.value(txn.get(PROGRESS_KEY), f"{path}: the progress")
            progress = None
            if raw is not None and not has_meta:  # (with its skipped list: can it resume?)
                progress = Progress.from_json(
                    raw, path, lambda count: read_skipped(lease, txn, count, path)
                )
            return has_meta, progress, txn.get(KEYS_KEY) is not None

        with reading(path):  # (its pages checked, and read again where the store grew since
            has_meta, progress, has_keys = lease.read(first_look, path)  # it was mapped)
        if has_meta:
            return LMDBStore(path, lease)
        if has_keys and allow_pickle:
            return PickleLMDBStore(path, lease)
    except BaseException:
        lease.release()
        raise
    lease.release()
    if progress is not None:
        owner = aside_owner(path)
        if owner is not None:  # (a replacement being built: its store's resume finishes it)
            where = f"{path} (the replacement of {owner} being built)"
            target = shlex.quote(os.path.abspath(owner))
            raise incomplete_error(where, progress, target, writing=_writer(owner))
        target = shlex.quote(os.path.abspath(path))
        raise incomplete_error(path, progress, target, _replacement(path), _writer(path))
    if has_keys:
        raise PickleNotAllowedError(
            f"{path}: this LMDB store was written by another tool and its values are Python "
            "pickles, which can run arbitrary code when loaded; pass ",
            option("allow_pickle"),
            " only if you trust where it came from",
        )
    raise StoreError(
        f"{path}: an LMDB store without fastdata metadata (written by another tool); "
        "fastdata reads its own stores and the pickle-based recipes' (",
        option("allow_pickle"),
        ")",
    )


def _replacement(path: str) -> Progress | None:
    """The progress of an interrupted replacement (``--overwrite``) of the store at ``path``,
    built aside, if there is one that reads."""
    from ..names import aside_folder, data_file

    aside = aside_folder(path)
    if not os.path.exists(data_file(aside)):
        return None
    try:
        _, building, _ = peek(aside)
    except FastdataError:  # (damaged, or half made: the writer says so when it meets it)
        return None
    return building


def _writer(store: str) -> str:
    """Who holds the store's writer lock now ("": nobody, or it cannot be told)."""
    folder = store if os.path.isdir(store) else os.path.dirname(store)
    info = flock_holder(os.path.join(folder, WRITER_LOCK))
    return "" if info is None else describe_holder(info)
