"""A run's progress (a conversion, an append or a copy, saved with every batch it commits) and
the source files it left out (the skipped list): what a resume continues, and the command that
finishes it."""

from __future__ import annotations

import json
import json.scanner
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import StoreDamagedError, StoreError, option
from .meta import damaged_metadata


@dataclass(frozen=True)
class SkippedFile:
    """A source file left out of the store, and why.

    ``size`` and ``mtime_ns`` are the file's as it was when it was left out (-1 when unknown):
    an append reads it again only once either changed.
    """

    name: str
    reason: str
    size: int = -1
    mtime_ns: int = -1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "reason": self.reason}
        if self.size >= 0:
            d["size"], d["mtime_ns"] = self.size, self.mtime_ns
        return d


@dataclass
class Progress:
    """Where a conversion stands; saved with every committed batch so it can resume.

    Attributes:
        source: the folder or manifest being converted, resolved (for a copy: the source store
            as command-line words, quoted for the shell).
        fingerprint: digest of the folder's sample list (see ``FolderScan.fingerprint``).
        total: samples in the folder.
        next_sample: samples handled so far (stored or skipped), in scan order.
        count: records stored so far (their indices are ``0 .. count-1``).
        repairs: records whose JPEG end-of-image marker was appended.
        total_bytes: image bytes stored so far.
        skipped: files left out so far. Saved apart from the progress, each once (the
            progress saves only their count), so a commit costs the same however many there are.
        boot_id: the boot of the machine that saved this progress (a writer may refuse to resume
            after a restart).
        store_id: the identity the store will carry (see ``StoreMeta.id``), fixed when the
            conversion starts.
        verify_decode: whether images were fully decoded: a resume must do the same.
        first_index: the index of the first record this run writes (0, or for an append the
            count of the store it grows).
        base_id: for an append, the id of the complete store it grows ("" for a conversion).
        max_file_bytes: the file size limit the run skips above (0: the default, or not
            recorded); a resume keeps it.
    """

    source: str
    fingerprint: str
    total: int
    next_sample: int = 0
    count: int = 0
    repairs: int = 0
    total_bytes: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    boot_id: str = ""
    store_id: str = ""
    verify_decode: bool = False
    first_index: int = 0
    base_id: str = ""
    max_file_bytes: int = 0
    fields: str = ""
    """The run's fields as ``--fields`` declares them (its resume gives them again)."""
    sidecars: str = ""
    """The run's ``--sidecars``, comma-separated."""
    unreadable: str = field(default="", compare=False)
    """Why the run cannot be resumed though its progress reads ("": it can): its skipped list
    is damaged. Never saved: found when the progress is read."""

    @classmethod
    def of_a_damaged_append(cls, count: int, base_id: str) -> Progress:
        """What stands for the progress of an append to a complete store (of ``count``
        records, id ``base_id``) that did not finish and whose saved progress is damaged: one
        that cannot resume, and that a plain append discards (it has no source)."""
        damaged = "its saved progress is damaged"
        return cls("", "", 0, first_index=count, base_id=base_id, unreadable=damaged)

    @property
    def next_index(self) -> int:
        """The index of the next record to write."""
        return self.first_index + self.count

    def to_json(self) -> bytes:
        """The progress without its skipped list, which the backends save apart (see above)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SAVED}
        d["skipped_count"] = len(self.skipped)
        return json.dumps(d).encode("ascii")

    @classmethod
    def from_json(
        cls,
        raw: bytes | str | memoryview,
        where: str,
        load_skipped: Callable[[int], list[SkippedFile]] | None = None,
    ) -> Progress:
        """Parse a saved progress; ``load_skipped(count)`` reads its skipped list back (without
        it the list is left empty: fine for messages, not for resuming)."""
        try:
            d = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
            count = d.pop("skipped_count", None)
            d.pop("unreadable", None)
            unreadable = ""
            listed = len(d["skipped"]) if isinstance(d.get("skipped"), list) else count
            try:
                if "skipped" in d:  # saved inside the progress by earlier versions
                    d["skipped"] = [skipped_file(s, where) for s in d["skipped"]]
                elif count is not None:
                    if type(count) is not int or count < 0:
                        raise ValueError(f"'skipped_count' is {count!r}")
                    d["skipped"] = load_skipped(count) if load_skipped is not None else []
            except StoreDamagedError:  # (the rest reads: what the run did is known, but a
                # resume would finish a store whose list of left-out files is wrong)
                d["skipped"] = []
                unreadable = "its saved list of the files it left out is damaged"
            progress = cls(**d, unreadable=unreadable)
        except RecursionError:  # (JSON nested deeper than the parser goes: no progress of ours)
            raise StoreError(
                f"{where}: unreadable conversion progress (nested too deep); convert again with ",
                option("overwrite"),
            ) from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise StoreError(
                f"{where}: unreadable conversion progress ({exc}); convert again with ",
                option("overwrite"),
            ) from exc
        ints = (
            progress.total,
            progress.next_sample,
            progress.count,
            progress.repairs,
            progress.total_bytes,
            progress.first_index,
        )
        if not all(type(v) is int and v >= 0 for v in ints) or not (
            progress.count <= progress.next_sample <= progress.total
        ):
            raise StoreError(
                f"{where}: damaged conversion progress (counts out of range); convert again with ",
                option("overwrite"),
            )
        if progress.first_index and not progress.base_id:  # (a store of the first format
            # has no id for an append to name: such an append starts over)
            progress.unreadable = f"its first record is {progress.first_index}, not 0"
        if len({s.name for s in progress.skipped}) != len(progress.skipped):
            progress.unreadable = "its saved list of the files it left out names a file twice"
        # each file handled was stored or left out (the list also holds those left out before
        # the run began): fewer says the counts or the list lost some
        if (
            not progress.unreadable
            and type(listed) is int
            and progress.count + listed < progress.next_sample
        ):
            progress.unreadable = (
                f"its saved counts do not add up ({progress.count} stored and {listed} "
                f"left out of {progress.next_sample} handled)"
            )
        why = progress._not_a_command()
        if why:
            raise StoreError(
                f"{where}: damaged conversion progress ({why}); convert again with ",
                option("overwrite"),
            )
        return progress

    def _not_a_command(self) -> str:
        """What in this progress would not give the command that resumes it ("": nothing):
        the resume command is printed from it, and a damaged one could print another command
        (an option in place of the source, a limit that is not a number)."""
        texts = (self.source, self.fingerprint, self.fields, self.sidecars, self.base_id)
        if not all(isinstance(v, str) for v in (*texts, self.boot_id, self.store_id)):
            return "a text of the wrong type"
        if type(self.max_file_bytes) is not int or self.max_file_bytes < 0:
            return f"'max_file_bytes' is {self.max_file_bytes!r}"
        decode = self.verify_decode  # (None: a run that left it to the store's default)
        if not (decode is None or type(decode) is bool) or type(self.repairs) is not int:
            return "a flag or count of the wrong type"
        if not self.is_copy:
            return "" if os.path.isabs(self.source) else f"the source {self.source!r} is no path"
        try:  # a copy's: the source store as words, then the options that select from it
            words = shlex.split(self.source)
        except ValueError:
            words = []
        if not words or len(words) % 2 == 0 or not _a_store(words[0]):
            return f"the source {self.source!r} is no store"
        if any(flag not in _COPY_OPTIONS for flag in words[1::2]):
            return f"the source {self.source!r} is no store"
        return ""

    @property
    def is_copy(self) -> bool:
        return self.fingerprint.startswith("store:")

    @property
    def done(self) -> str:
        """How far the run got, as messages say it: ``120 of 240 images`` (a copy's: records)."""
        return f"{self.next_sample} of {self.total} {'records' if self.is_copy else 'images'}"

    def options(self) -> list[str]:
        """The run's options, as the command-line flags that give them."""
        return [
            *(["--append"] if self.base_id else []),
            *(["--verify-decode"] if self.verify_decode else []),
            *([f"--max-file-size {self.max_file_bytes}"] if self.max_file_bytes else []),
            *([f"--sidecars {shlex.quote(self.sidecars)}"] if self.sidecars else []),
            *([f"--fields {shlex.quote(self.fields)}"] if self.fields else []),
        ]

    def resume_command(self, destination: str) -> str:
        """The command that finishes this run into ``destination`` (``DST [--collection C]``),
        with the options it was started with."""
        verb = "copy" if self.is_copy else "convert"
        flags = "".join(f" {flag}" for flag in self.options())
        source = self.source if self.is_copy else shlex.quote(self.source)  # a copy's: words
        return f"fastdata {verb} {source} {destination}{flags} --resume"

    def finish_command(self, destination: str) -> str:
        """The command that completes what this run began in ``destination``: its resume, or,
        where it cannot resume (see ``unreadable``), the run from its start (a conversion or
        copy with ``--overwrite``; an append without ``--resume``, which discards the
        interrupted one)."""
        command = self.resume_command(destination)
        if not self.unreadable:
            return command
        command = command.removesuffix(" --resume")
        return command if self.base_id else f"{command} --overwrite"

    def finish_advice(self, destination: str) -> str:
        """What a message about this stopped run says to do: finish it with its resume, or why
        it cannot resume and the command that starts it over."""
        if self.unreadable and not self.source:  # (an append whose progress says nothing)
            return (
                f"{self.unreadable}, so it cannot resume: run the append again, without "
                "--resume, which first discards what it wrote"
            )
        if self.unreadable:
            return (
                f"{self.unreadable}, so it cannot resume: start it over with "
                f"`{self.finish_command(destination)}`"
            )
        return f"finish it with `{self.finish_command(destination)}`"

    def resumable_as_recorded(self, other: Progress) -> bool:
        """Whether the run this progress records may still be finished by its own resume
        command, although ``other`` differs from it: ``other`` names another source (the
        recorded one may be as it was), or differs only in an option, or it is a copy (of a
        store named by its id). Not when the same source changed since, nor when its own
        progress cannot be resumed (see ``unreadable``)."""
        if self.unreadable:
            return False
        if self.is_copy:  # a copy: of a store named elsewhere; not when that store changed
            return self.source != other.source
        return self.fingerprint == other.fingerprint or (
            os.path.realpath(self.source) != os.path.realpath(other.source)
        )

    def same_conversion(self, other: Progress) -> str | None:
        """What differs between the conversion this progress records and ``other``, or None.

        A resume continues only the same conversion: same source folder (resolved), same file
        list, same options (an option ``other`` leaves as None takes the recorded value), and
        only one whose progress reads whole (see ``unreadable``).
        """
        if self.unreadable:
            return self.unreadable
        if self.is_copy or other.is_copy:  # a copy: the source store's id, wherever it is now
            if self.fingerprint != other.fingerprint:
                if self.source == other.source:
                    return (
                        f"the store it copies ({self.source}) changed since (an append, or a "
                        "replacement)"
                    )
                return f"it copies another store ({self.source}), not {other.source}"
            return None
        if os.path.realpath(self.source) != os.path.realpath(other.source):
            return f"it was started from {self.source}, not {other.source}"
        if self.fingerprint != other.fingerprint:
            mine = (self.fields, self.sidecars)
            if any(mine) and mine != (other.fields, other.sidecars):
                flags = [f for f in self.options() if f.startswith(("--fields", "--sidecars"))]
                return f"it was started with {' '.join(flags)}"
            return f"the source {other.source} changed since it started"
        given = other.max_file_bytes
        if given and given != (self.max_file_bytes or given):
            return f"it was started with --max-file-size {self.max_file_bytes}"
        if other.verify_decode is not None and self.verify_decode != other.verify_decode:
            flag = "with" if self.verify_decode else "without"
            return f"it was started {flag} --verify-decode"
        return None


_NOT_SAVED = frozenset({"skipped", "unreadable"})
_COPY_OPTIONS = frozenset({"--source-collection", "--where"})
"""The options a copy's source words may hold after the store (see ``ops/copy.py``)."""


def _a_store(word: str) -> bool:
    """Whether ``word`` names a store as a copy saves its source: a resolved path (a relative
    one would name another store in each folder the command is run from) or a MongoDB URI."""
    return os.path.isabs(word) or word.startswith(("mongodb://", "mongodb+srv://"))


def skipped_file(item: Any, where: str) -> SkippedFile:
    """One entry of a saved skipped list (``{"name": ..., "reason": ...}``), checked."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise damaged_metadata(where, "skipped")
    size, mtime = item.get("size", -1), item.get("mtime_ns", -1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, mtime)):
        size = mtime = -1  # (BSON gives its 64-bit integers as a subclass of int)
    return SkippedFile(item["name"], str(item.get("reason", "")), int(size), int(mtime))
