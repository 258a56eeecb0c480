"""The writer's life, once for both backends: lock, look, build aside, promote, resume, the
finish invariants. Backends say where bytes live and how to lock, build aside and replace (the
abstract steps of :class:`StoreWriter`). What a writer finds at its destination and the errors
that name it are :mod:`.existing`'s; the commit loop of every writing verb, :mod:`.batch`'s."""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import (
    SAME_COMMAND,
    Interrupted,
    Phrase,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    UsageError,
    WriteFailedError,
)
from ..records import Progress, Record, SkippedFile, StoreMeta, new_store_id
from .existing import APPEND, OVERWRITE, RESUME, Existing, exists_message, incomplete_error
from .invariants import invariant_failures

if TYPE_CHECKING:
    import numpy as np

    from ..packed import PackedStrings
    from .reader import StoreReader

# (Existing and incomplete_error live in .existing; the LMDB backend imports them from here)
__all__ = ["Completion", "Existing", "StoreWriter", "incomplete_error"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """What completes a store (see ``StoreWriter.finish``): its metadata, one label per record,
    the skipped files (those not saved yet are saved now) and the record names, if known."""

    meta: StoreMeta
    labels: np.ndarray
    skipped: Sequence[SkippedFile] = ()
    names: bytes | None = None
    """Every record's name (:func:`~fastdata.records.name_bytes`), in order, joined by NULs."""

    def failures(self) -> list[str]:
        """The invariants of a finished store (docs/stores.md, "What a finished store guarantees")
        that this completion breaks, each named; none when it may be written."""
        return invariant_failures(self.meta, self.labels, self.names, self.skipped)


class StoreWriter(abc.ABC):
    """Writes records in committed batches, then the metadata that marks the store complete.

    The policy both backends share lives here: one writer at a time (the backend's lock, held from
    ``start`` to ``close``); progress saved before the first record, so an interrupted store is
    always reported as resumable; ``--resume`` continues only the same conversion; an existing
    store is replaced only by one built aside and moved into place when complete, so until then
    the old store stays whole and readable. Backends say where bytes live and how to lock,
    build aside and replace.

    Use as a context manager; leaving it early (an error, Ctrl-C) keeps every committed batch and
    the progress saved with it, so the conversion can resume, and releases the lock.
    """

    location: str
    """The store's path or URI (password masked), for messages."""

    @property
    def command_target(self) -> str:
        """The destination as command-line words (``DST`` or ``URI --collection C``)."""
        import shlex

        return shlex.quote(os.path.abspath(self.location))  # never read as an option

    _aside = False
    _skipped_stale = 0
    """Entries of the skipped list saved before it was shortened (see ``finish``)."""
    _skipped_saved = 0
    """How many of the conversion's skipped files are saved already (see ``_take_skipped``)."""
    completed: StoreMeta | None = None
    """After ``start`` returned None: the metadata of the complete store it found."""
    discarded = ""
    """What an append discarded before it began (an interrupted append of another source)."""

    def start(self, progress: Progress, *, overwrite: bool, resume: bool) -> Progress | None:
        """Take the writer lock and prepare the store for writing.

        Args:
            progress: the state of a fresh conversion (source, fingerprint, options).
            overwrite: replace an existing store (built aside, moved into place when complete).
            resume: continue the interrupted conversion of the same source, if any.

        Returns:
            The progress to continue from (``progress`` itself, with a new store id, for a fresh
            start), or None when ``resume`` finds the same conversion already complete.

        Raises:
            StoreLockedError: another writer holds the store.
            StoreExistsError: something is there and neither ``overwrite`` nor ``resume`` fits.
            StoreError: ``resume`` of a conversion that differs from this one.
        """
        if resume and self._nothing_here():  # refused before anything is created or claimed
            raise UsageError(
                f"{self.location}: nothing to resume (no interrupted conversion or copy "
                "here); run ",
                SAME_COMMAND,
                " without ",
                RESUME,
            )
        found = self._lock_and_look()
        if resume:
            saved = found.aside or found.progress
            if saved is not None:
                why = saved.same_conversion(progress)
                if why is not None:
                    finish = (
                        f"finish it with `{saved.resume_command(self.command_target)}`, or "
                        if saved.resumable_as_recorded(progress)
                        else ""
                    )
                    raise StoreExistsError(
                        f"{self.location}: cannot resume the conversion it holds: {why}; "
                        f"{finish}pass ",
                        OVERWRITE,
                        " instead of ",
                        RESUME,
                        " to start over",
                    )
                self._aside = found.aside is not None
                return self._resume(saved, "")
            if found.appending is not None:
                pending = found.appending
                raise StoreExistsError(
                    f"{self.location}: an append to this store was interrupted; "
                    f"{pending.finish_advice(self.command_target)}"
                )
            if found.meta is not None:
                if self._same_store(found.meta, progress):
                    self.completed = found.meta
                    return None
                same_folder = not progress.is_copy and os.path.realpath(
                    found.meta.source or ""
                ) == os.path.realpath(progress.source)
                if same_folder:  # (its files changed since, or the store grew by an append)
                    raise StoreExistsError(
                        f"{self.location}: holds a complete store converted from "
                        f"{found.meta.source}, whose files are not those it was converted from "
                        "now; ",
                        RESUME,
                        " continues only an interrupted conversion: pass ",
                        APPEND,
                        " to add the images it lacks, or ",
                        OVERWRITE,
                        " to convert the folder again",
                    )
                raise StoreExistsError(
                    f"{self.location}: holds a complete store converted from "
                    f"{found.meta.source or 'another folder'}; ",
                    RESUME,
                    " continues only an interrupted conversion of the same folder; pass ",
                    OVERWRITE,
                    " to replace it",
                )
            if found.other:
                raise StoreExistsError(
                    f"{self.location}: ",
                    *found.other,
                    "; nothing to resume: pass ",
                    OVERWRITE,
                    " to replace it",
                )
            raise UsageError(
                f"{self.location}: nothing to resume (no interrupted conversion or copy "
                "here); run ",
                SAME_COMMAND,
                " without ",
                RESUME,
            )
        elif not found.empty and not overwrite:
            raise StoreExistsError(*exists_message(self.location, found, progress.is_copy))
        self._aside = not found.empty
        if found.aside is not None:
            self._discard_aside()
        progress.store_id = new_store_id()
        self._skipped_saved = 0
        try:
            self._open(progress, new=True)
        except WriteFailedError:  # (its progress not saved: nothing a resume could continue)
            self.abandon()
            raise
        return progress

    _appending = False

    @property
    def appending(self) -> bool:
        """Whether this writer adds to the complete store in place (an append): what a backend
        asks to choose durable commits and where new records go. Set by the policy only."""
        return self._appending

    @property
    def building_aside(self) -> bool:
        """Whether this writer builds a replacement aside (``--overwrite``) rather than writing
        in place. Set by the policy only."""
        return self._aside

    base: StoreMeta | None = None
    """During an append: the metadata of the complete store it grows."""

    def start_append(
        self, plan: Callable[[StoreMeta], Progress], *, resume: bool
    ) -> Progress | None:
        """Take the writer lock and prepare to add records to the complete store in place.

        Records already there are never touched: new ones get the next indices, and the store
        stays complete and readable (as it was) until ``finish`` writes the new labels and
        metadata, with a new id that lists the old one in ``appended_from``.

        Args:
            plan: called with the store's metadata, before anything is written, to give the
                progress of a fresh append (what to add, its fingerprint); it may read the store.
            resume: continue an interrupted append of the same source, if there is one (else
                the append starts as if it was not given).

        Returns:
            The progress to continue from, or None when there is nothing to add.

        Raises:
            StoreNotFoundError: no store to append to.
            StoreError: an interrupted conversion or replacement is in the way, or the store is
                not a fastdata store.
            StoreLockedError: another writer holds the store.
        """
        if self._nothing_here():  # refused before anything is created or claimed
            raise StoreNotFoundError(
                f"{self.location}: no store to append to; convert the folder without ", APPEND
            )
        found = self._lock_and_look()
        if found.meta is None:
            if found.progress is not None:
                raise StoreExistsError(
                    f"{self.location}: holds an interrupted conversion, not a complete store; "
                    f"finish it first with `{found.progress.finish_command(self.command_target)}`"
                )
            if found.other:
                raise StoreError(
                    f"{self.location}: ", *found.other, "; ", APPEND, " adds to a fastdata store"
                )
            raise StoreNotFoundError(
                f"{self.location}: no store to append to; convert the folder without ", APPEND
            )
        if found.aside is not None:
            raise StoreExistsError(
                f"{self.location}: a replacement of this store was interrupted; finish it (",
                Phrase("the same convert command", "the same convert call"),
                " with ",
                RESUME,
                ", without ",
                APPEND,
                ") or start it over with ",
                OVERWRITE,
                " before appending",
            )
        self.base = found.meta
        self._appending = True
        fresh = plan(found.meta)
        pending = found.appending
        if pending is not None:
            why = pending.same_conversion(fresh)
            if why is None:  # the same append, with or without --resume: it goes on
                return self._resume(pending, " the append")
            if resume:
                finish = (
                    f"finish it with `{pending.resume_command(self.command_target)}`, or "
                    if pending.resumable_as_recorded(fresh)
                    else ""
                )
                raise StoreExistsError(
                    f"{self.location}: cannot resume the interrupted append it holds: {why}; "
                    f"{finish}run without ",
                    RESUME,
                    " to discard it (its records were never part of the store)",
                )
            self.discarded = (
                f"an interrupted append ({pending.done + '; ' if pending.source else ''}"
                f"{why}): its records were never part of the store"
            )
            log.warning("%s: discarding %s", self.location, self.discarded)
            self._discard_append(found.meta, pending)
        if fresh.total == 0:
            return None
        fresh.store_id = new_store_id()
        self._skipped_saved = self._kept_skipped(found.meta)
        self._open(fresh, new=True)
        return fresh

    def _resume(self, saved: Progress, what: str) -> Progress:
        """Continue the interrupted run ``saved`` records (``what`` it was, for the log)."""
        self._check_resumable(saved)
        self._skipped_saved = len(saved.skipped)
        self._open(saved, new=False)
        log.info(
            "%s: resuming%s after %d of %d samples",
            self.location,
            what,
            saved.next_sample,
            saved.total,
        )
        return saved

    def _lock_and_look(self) -> Existing:
        """Take the writer lock and look at the destination, first finishing a replacement
        that was complete but not yet moved into place."""
        self._lock()
        found = self._inspect()
        if found.aside_complete:
            log.warning("%s: finishing a replacement that was interrupted", self.location)
            self._promote()
            self._aside = False
            found = self._inspect()
        return found

    @staticmethod
    def _same_store(meta: StoreMeta, progress: Progress) -> bool:
        """Whether the complete store was converted from the same folder and file list (or
        copied from the same store)."""
        if meta.copied_from and progress.fingerprint.startswith("store:"):
            return progress.fingerprint == f"store:{meta.copied_from}"
        return bool(meta.fingerprint) and (
            meta.fingerprint == progress.fingerprint
            and os.path.realpath(meta.source) == os.path.realpath(progress.source)
        )

    def finish(
        self,
        meta: StoreMeta,
        labels: np.ndarray,
        skipped: Sequence[SkippedFile] = (),
        names: bytes | None = None,
        *,
        skipped_from: int | None = None,
    ) -> None:
        """Write the skipped files not saved yet, the labels, the record names (joined by NULs,
        see ``Completion``; backends that keep an index of them do) and the metadata, last; a
        replacement then moves into place. ``skipped_from``: the first entry of ``skipped``
        that differs from the list saved so far (when entries were taken off it).

        The store's invariants are checked first (:meth:`Completion.failures`, and the records
        the backend holds: :meth:`_count_records`); a store that fails them is not marked
        complete.

        Raises:
            StoreError: an invariant fails; the message names it.
        """
        done = Completion(meta, labels, skipped, names)
        broken = done.failures()
        held = self._count_records(meta.count)
        if held is not None:
            broken.append(f"every index once: {held}")
        if broken:
            raise StoreError(*self._broken_message(broken))
        if skipped_from is not None and skipped_from < self._skipped_saved:
            # the list changed from this entry on (an append took fixed files off it): saved
            # again from there, and the saved entries past its new end removed
            self._skipped_stale = self._skipped_saved
            self._skipped_saved = skipped_from
        self._write_meta(done)
        if self._aside:
            self._promote()
            self._aside = False

    def abandon(self) -> None:
        """Remove what this run wrote, when it stored no record at all (a source with no usable
        image): a new store in place is removed, a replacement built aside is discarded (the
        store it would have replaced stays as it was). Nothing is left that a later run would
        have to resume or overwrite. Not for an append, whose store stays as it is."""
        if self._appending:
            raise StoreError(f"{self.location}: an append is not abandoned; its store stays")
        self._discard_new()
        self._aside = False

    def _take_skipped(self, skipped: Sequence[SkippedFile]) -> int:
        """Mark all of ``skipped`` as saved; return how many were saved before (the ones to save
        now start there). The list is saved apart from the progress, each entry once, so a
        commit costs the same however many files were skipped."""
        saved, self._skipped_saved = self._skipped_saved, len(skipped)
        return saved

    def _broken_message(self, broken: list[str]) -> tuple[str | Phrase, ...]:
        what = "; ".join(broken)
        if self._appending:
            return (
                f"{self.location}: the append was not completed, because the store it would "
                f"leave breaks its invariants ({what}); the store reads as it did before the "
                "append. This is a fault in fastdata: please report it with this message",
            )
        return (
            f"{self.location}: the store was not marked complete, because it breaks its "
            f"invariants ({what}); no reader will open it. This is a fault in fastdata: please "
            "report it with this message; convert again with ",
            OVERWRITE,
        )

    # -- what each backend provides

    def _nothing_here(self) -> bool:
        """Whether, at a look without the lock, the destination holds nothing at all (no store,
        no interrupted run): then a resume or an append is refused before anything is created
        or claimed. False when the backend cannot tell cheaply."""
        return False

    def _count_records(self, count: int) -> str | None:
        """What is wrong with the records the store holds, when they are not exactly the
        indices ``0 .. count-1`` once each (None when they are, or the backend cannot tell)."""
        return None

    def _kept_skipped(self, base: StoreMeta) -> int:
        """How many entries of a fresh append's skipped list (the store's list, then the new
        ones) are saved already: the store's, where entries are kept by position."""
        return base.skipped_count

    def _discard_append(self, base: StoreMeta, pending: Progress) -> None:
        """Remove what an interrupted append to the store ``base`` left (records and skipped
        entries past the store's own)."""
        raise NotImplementedError

    def open_reader(self) -> StoreReader:
        """A reader of the complete store at this writer's location (before it is written)."""
        raise NotImplementedError

    def written_names(self, count: int) -> PackedStrings:
        """The names the headers of this run's first ``count`` records hold (a resumed run's,
        read back from the store it is writing; ``name_bytes``-encoded).

        Raises:
            StoreError: one is missing or cannot be read.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def _lock(self) -> None:
        """Take the writer lock (held until ``close``), or raise StoreLockedError."""

    @abc.abstractmethod
    def _inspect(self) -> Existing:
        """What is at the destination now."""

    def _check_resumable(self, saved: Progress) -> None:
        """Raise StoreError when the backend cannot trust what an interrupted run left."""
        return None

    @abc.abstractmethod
    def _open(self, progress: Progress, *, new: bool) -> None:
        """Open the store in place, or aside when ``self._aside``; a ``new`` one is emptied
        first and gets ``progress`` saved before any record."""

    @abc.abstractmethod
    def _discard_aside(self) -> None:
        """Remove what an interrupted replacement left aside."""

    @abc.abstractmethod
    def _discard_new(self) -> None:
        """Remove the store this writer opened (in place, or aside when ``building_aside``),
        which holds no record (see ``abandon``)."""

    @abc.abstractmethod
    def _promote(self) -> None:
        """Move the complete store built aside into place, replacing the old one atomically."""

    @abc.abstractmethod
    def write(self, records: Sequence[Record], progress: Progress) -> None:
        """Store ``records`` and ``progress`` together, atomically where the backend allows."""

    @abc.abstractmethod
    def _write_meta(self, done: Completion) -> None:
        """Write the unsaved skipped files, the labels, the names and the metadata (the store
        is complete once they are there)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's handles and the writer lock."""

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except WriteFailedError as failed:
            failed.name_store(*self.store_target)
            raise
        if isinstance(exc, WriteFailedError):
            exc.name_store(*self.store_target)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(*self.store_target) from exc

    @property
    def store_target(self) -> tuple[str, str | None]:
        """The store as ``open_store`` takes it: a folder, or a URI and its collection."""
        return os.path.abspath(self.location), None
