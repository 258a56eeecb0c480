"""What a store folder holds, looked at without opening it as a store: its metadata, the progress
of an unfinished run and another tool's key list (for the writer that decides what to do with
it, the reader that names an unfinished append, and the open that names an interrupted
replacement)."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ...errors import StoreDamagedError, StoreError
from ...records import Progress, SkippedFile, StoreMeta, skipped_file
from .env import open_reader, reading
from .layout import KEYS_KEY, META_KEY, PROGRESS_KEY, header_key, record_key, skipped_key
from .lease import Lease

__all__ = ["appends_to", "interrupted_notes", "peek", "read_skipped"]


def peek(path: str) -> tuple[StoreMeta | None, Progress | None, bool | None]:
    """The metadata, the progress of an unfinished run (a conversion, or an append to the store
    the metadata describes) and whether there is a pickle-recipe key list, of ``path``; None for
    the last when the environment holds nothing at all (a writer stopped right after creating
    it)."""
    lease = open_reader(path)
    try:
        if lease.env.stat()["depth"] == 0:  # (no tree; see open_lmdb)
            return None, None, None
        with reading(path), lease.env.begin(buffers=True) as txn:
            raw_meta = lease.value(txn.get(META_KEY), f"{path}: the metadata")
            raw_progress = lease.value(txn.get(PROGRESS_KEY), f"{path}: the progress")
            has_keys = txn.get(KEYS_KEY) is not None
            meta = StoreMeta.from_json(raw_meta, path) if raw_meta is not None else None
            progress = None
            if raw_progress is not None:
                # a complete store keeps the progress of its last run: it matters only when it
                # is an append to this very store that did not finish
                try:
                    progress = Progress.from_json(raw_progress, path)
                except StoreError:
                    if meta is None:
                        raise
                    progress = _damaged_append(txn, meta)
                    return meta, progress, has_keys
                if (
                    meta is not None
                    and appends_to(progress, meta)
                    and not _records_agree(txn, progress)
                ):
                    return meta, _damaged_append(txn, meta), has_keys
                if meta is None or appends_to(progress, meta):
                    progress = Progress.from_json(
                        raw_progress, path, lambda n: read_skipped(lease, txn, n, path)
                    )
                else:
                    progress = None
    except StoreDamagedError as exc:  # (the metadata, the progress or its skipped list)
        exc.in_store(shlex.quote(os.path.abspath(path)))
        raise
    finally:
        lease.release()
    return meta, progress, has_keys


def _damaged_append(txn: Any, meta: StoreMeta) -> Progress | None:
    """A damaged progress beside the complete store ``meta``: the last run's, which no longer
    matters (None), or, where a record past the store's last is there, an append's that did
    not finish."""
    if txn.get(record_key(meta.count)) is None and txn.get(header_key(meta.count)) is None:
        return None
    return Progress.of_a_damaged_append(meta.count, meta.id)


def _records_agree(txn: Any, progress: Progress) -> bool:
    """Whether the last record an unfinished append's progress counts is there (counts raised
    since say another run than the one that wrote them, whose resume would leave a gap). A
    record past it may be another program's, written into the store meanwhile: the resume
    names it, and nothing discards it."""
    return not progress.count or txn.get(record_key(progress.next_index - 1)) is not None


def appends_to(progress: Progress, meta: StoreMeta) -> bool:
    """Whether a progress found beside a complete store is an unfinished append to it (and not
    what its own conversion, or an earlier append, left)."""
    return progress.base_id == meta.id and 0 < progress.first_index == meta.count


def read_skipped(lease: Lease, txn: Any, count: int, where: str) -> list[SkippedFile]:
    """The first ``count`` skipped-file entries (read in the caller's transaction)."""
    out = []
    for n in range(count):
        named = f"{where}: skipped-file entry {n}"
        lease.refuse_damaged([skipped_key(n)], lambda _: named)  # noqa: B023 (called at once)
        raw = lease.value(txn.get(skipped_key(n)), named)
        try:
            item = json.loads(raw) if raw is not None else None
        except ValueError:
            item = None
        out.append(skipped_file(item, where))
    return out


def interrupted_notes(path: str) -> list[str]:
    """What is unfinished in the store at ``path``: an append, or a replacement left in
    ``.replacement/`` (each with the command that finishes it, or what happens to it)."""
    from ..names import aside_folder, data_file
    from ..reader import append_note

    target = shlex.quote(os.path.abspath(path))
    notes = []
    _, pending, _ = peek(path)
    aside = aside_folder(path)
    if os.path.exists(data_file(aside)):
        try:
            done, building, _ = peek(aside)
        except StoreError:
            done = building = None
        if building is not None:
            notes.append(
                f"a replacement (--overwrite) was interrupted after {building.done}; "
                f"{building.finish_advice(target)}"
            )
        elif done is not None:
            notes.append(
                "a finished replacement waits to be moved into place; the next writer moves it"
            )
    if pending is not None:
        notes.append(append_note(pending, target, replacing=bool(notes)))
    return notes
