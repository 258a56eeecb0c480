"""What a writer finds at its destination, looked at under its lock (:class:`Existing`), and what
is said of it: a store there that the command would not replace (:func:`exists_message`), and
an incomplete store a reader refuses (:func:`incomplete_error`), each with the command that goes
on from there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import IncompleteStoreError, Phrase, option
from ..records import Progress, StoreMeta

__all__ = ["APPEND", "OVERWRITE", "RESUME", "Existing", "exists_message", "incomplete_error"]

OVERWRITE, RESUME, APPEND = option("overwrite"), option("resume"), option("append")


def incomplete_error(
    location: str,
    progress: Progress,
    target: str,
    aside: Progress | None = None,
    writing: str = "",
) -> IncompleteStoreError:
    """What a reader says of a store whose run stopped before it was complete: how far it got,
    and the command that finishes it (``target``: the store as command-line words). ``aside``:
    the progress of a replacement (``--overwrite``) begun since and interrupted too, which is
    what a resume continues (the run in place can no longer be finished: the replacement takes
    its place), so its command is the one named. ``writing``: the writer that holds the
    store's lock now (its description), whose run is not stopped but going on."""
    what = "copy" if progress.is_copy else "conversion"
    if progress.base_id:
        what = "append"
    if writing:
        run = aside if aside is not None else progress
        return IncompleteStoreError(
            f"{location}: being written now ({writing}): its {what} has written "
            f"{run.done} so far; open it when that {what} has "
            "finished"
        )
    stopped = f"its {what} stopped after {progress.done}"
    if aside is not None:
        return IncompleteStoreError(
            f"{location}: incomplete store: {stopped}, and a replacement (--overwrite) begun "
            f"since stopped after {aside.done}; of the replacement: "
            f"{aside.finish_advice(target)}"
        )
    return IncompleteStoreError(
        f"{location}: incomplete store: {stopped}; {progress.finish_advice(target)}"
    )


@dataclass(frozen=True)
class Existing:
    """What a writer found at its destination, looked at under its lock.

    Attributes:
        meta: the metadata of the complete store there, if any.
        progress: the progress of an interrupted conversion in place, if any.
        aside: the progress of an interrupted replacement (``--overwrite``) built aside, if any.
        aside_complete: the replacement aside is complete but was not yet moved into place.
        other: something that is not a fastdata store (a foreign LMDB, documents, damage), as
            message parts (a damage's own advice is said in the caller's words).
        appending: the progress of an interrupted append to the complete store ``meta``.
    """

    meta: StoreMeta | None = None
    progress: Progress | None = None
    aside: Progress | None = None
    aside_complete: bool = False
    other: tuple[str | Phrase, ...] = ()
    appending: Progress | None = None

    @property
    def empty(self) -> bool:
        return self.meta is None and self.progress is None and self.aside is None and not self.other


def exists_message(location: str, found: Existing, copy: bool) -> tuple[str | Phrase, ...]:
    """Why a command that would not replace the store at ``location`` (a plain conversion or
    copy) is refused by what it ``found`` there, and the options that go on from there."""
    if found.meta is not None and found.aside is not None:
        return (
            f"{location}: a store exists, and a replacement of it was interrupted; pass ",
            RESUME,
            " to finish the replacement or ",
            OVERWRITE,
            " to start it over",
        )
    if found.meta is not None and not copy:
        return (
            f"{location}: a store exists already; pass ",
            APPEND,
            " to add the images it lacks, or ",
            OVERWRITE,
            " to replace it",
        )
    if found.meta is not None:
        return (f"{location}: a store exists already; pass ", OVERWRITE, " to replace it")
    if found.progress is not None and found.progress.unreadable:
        return (
            f"{location}: holds an interrupted conversion that cannot resume "
            f"({found.progress.unreadable}); pass ",
            OVERWRITE,
            " to start over",
        )
    if found.progress is not None:
        return (
            f"{location}: holds an interrupted conversion; pass ",
            RESUME,
            " to continue it or ",
            OVERWRITE,
            " to start over",
        )
    return (f"{location}: ", *found.other, "; pass ", OVERWRITE, " to replace it")


def refuse_unfinished(writer: Any, found: Existing, doing: str) -> None:
    """Refuse to work on a store in place (``doing`` what) unless ``found`` is a complete
    store with nothing unfinished in the way, naming the command that finishes it.

    Raises:
        StoreNotFoundError: no complete store there.
        StoreError: an interrupted conversion, replacement or append, or another tool's data.
    """
    from ..errors import StoreError, StoreNotFoundError

    target = writer.command_target
    if found.meta is None:
        if found.progress is not None:
            raise StoreError(
                f"{writer.location}: holds an interrupted conversion, not a complete store; "
                f"finish it first with `{found.progress.finish_command(target)}`"
            )
        if found.other:
            raise StoreError(f"{writer.location}: ", *found.other, "; not a fastdata store")
        raise StoreNotFoundError(f"{writer.location}: no store here")
    unfinished = found.appending or found.aside
    if unfinished is not None:
        what = "an append" if found.appending is not None else "a replacement"
        raise StoreError(
            f"{writer.location}: {what} of this store was interrupted; first, "
            f"{unfinished.finish_advice(target)}; then go on {doing}"
        )
