"""The exception tree.

Every error fastdata raises derives from :class:`FastdataError`. Messages name the file, key or URI
involved and say what to do about it; the CLI prints them as one line and exits with
:attr:`FastdataError.exit_code`.

Advice that names an option is said in the caller's words: a message is made of parts, text and
:class:`Phrase` objects (:func:`option` makes one for an option), and the error renders it for
whoever reads it. ``str(error)`` speaks to a Python caller (``pass overwrite=True``); the command
line renders it with ``render(cli=True)`` (``pass --overwrite``). (``__all__`` lists the
exception tree; ``Phrase`` and ``option`` are for the modules that raise.)
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CorruptImageError",
    "FastdataError",
    "IncompleteStoreError",
    "MissingDependencyError",
    "PickleNotAllowedError",
    "QueryError",
    "RecordError",
    "ReservedNameError",
    "ResumeError",
    "SourceError",
    "StoreError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreDamagedError",
    "StoreReplacedError",
    "UnsafePathError",
    "UsageError",
    "WriteFailedError",
]


@dataclass(frozen=True)
class Phrase:
    """Words of a message said one way on the command line and another to a Python caller."""

    cli: str
    python: str


def option(name: str, value: object = True, *, flag: str = "") -> Phrase:
    """An option that advice names: ``--name`` (``flag`` where the command line spells it
    otherwise, followed by ``value`` unless it is True or None) on the command line, and
    ``name=value`` (the name alone where ``value`` is None) to a Python caller."""
    words = flag or "--" + name.replace("_", "-")
    if value is not True and value is not None:
        words += f" {shlex.quote(str(value))}"
    return Phrase(words, name if value is None else f"{name}={value!r}")


SAME_COMMAND = Phrase("the same command", "the same call")
"""What to run again, in the caller's words."""


class FastdataError(Exception):
    """Base of every fastdata error.

    Args:
        parts: the message: text, and :class:`Phrase` objects for the words (options, mostly)
            that depend on who reads it.

    An error class may carry a hint (:meth:`advice`): what to do, said once for every error of
    the class, here, and appended to the message where it is rendered (as py-lmdb keeps a hint
    per error class). :meth:`without_hint` is the message without it.
    """

    exit_code = 1

    def __init__(self, *parts: str | Phrase) -> None:
        super().__init__(*parts)
        self.parts = parts

    def advice(self) -> tuple[str | Phrase, ...]:
        """The hint of the error's class (none by default)."""
        return ()

    def without_hint(self, *, cli: bool = False) -> str:
        """The message without the class's hint (what ``fastdata verify`` lists). (Not named
        ``message``: torch's DataLoader re-raises a worker's error as ``type(message=...)``
        where the class has that attribute.)"""
        return _said(self.parts, cli)

    def render(self, *, cli: bool = False) -> str:
        """The message as the command line says it (``cli``) or as a Python caller reads it,
        with the class's hint after it (once: a message re-raised from a worker holds it)."""
        return _said(self.said(cli=cli), cli)

    def __str__(self) -> str:
        return self.render()

    def said(self, *, cli: bool = True) -> tuple[str | Phrase, ...]:
        """The message with its hint, as parts (the hint left out where the message holds it
        already, in the words ``cli`` says): what :meth:`render` says, and what another message
        that quotes this one takes, so that its options and commands are said in that message's
        words (a ``str()`` says them to a Python caller, on the command line too)."""
        advice = self.advice()
        hint = _said(advice, cli)
        if not hint or self._holds_hint(_said(self.parts, cli), hint):
            return self.parts
        return (*self.parts, "; ", *advice)

    def _holds_hint(self, message: str, hint: str) -> bool:
        """Whether ``message`` says the class's hint already (one re-raised from a worker
        holds the hint it was rendered with)."""
        return hint in message


def _said(parts: tuple[str | Phrase, ...], cli: bool) -> str:
    return "".join(p if isinstance(p, str) else (p.cli if cli else p.python) for p in parts)


class UsageError(FastdataError):
    """A call or command asks for something that cannot apply (an unknown URI scheme, an option
    that does not fit the store, ``--resume`` with nothing to resume); the message says what to
    give instead. Like the command line's own usage errors, it exits with code 2."""

    exit_code = 2


class QueryError(UsageError, ValueError):
    """A query (``where=``, ``--where``) the query language does not take: an operator outside
    :data:`fastdata.query.OPERATORS`, a key no record has, a field the store does not have, or
    a malformed condition. Raised before any record is read; exits with code 2."""


class ResumeError(UsageError, ValueError):
    """A loader's saved state (``Loader.load_state_dict``) that cannot continue here: from
    another store, selection, seed or order, from a later fastdata, or edited or cut short. The
    message names what differs and the way out (the matching store, or the saved epoch from
    its beginning: ``restart_epoch=True``, ``--restart-epoch``); exits with code 2."""


class ReservedNameError(UsageError):
    """A store name that fastdata keeps for names of its own (``stores/names.py``, and
    ``docs/guarantees.md``, I14): a store there would take another store's files,
    collections or documents. Refused before anything is written.

    Attributes:
        where: the store as given (a path, or a URI and collection).
        rule: the rule the name breaks.
    """

    def __init__(self, where: str, rule: str) -> None:
        super().__init__(f"{where}: {rule}")
        self.where = where
        self.rule = rule

    def advice(self) -> tuple[str | Phrase, ...]:
        return ("give the store another name",)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.where, self.rule)


class SourceError(FastdataError):
    """The image folder to convert is missing, empty or unusable."""

    exit_code = 2


class CorruptImageError(FastdataError):
    """An image's bytes are not a usable image.

    Attributes:
        name: the file or record the bytes came from.
        reason: a short description of what is wrong.

    Any ``advice`` follows the reason in the message (not in ``reason``).
    """

    def __init__(self, name: str, reason: str, *advice: str | Phrase) -> None:
        super().__init__(f"{name}: {reason}", *advice)
        self.name = name
        self.reason = reason

    def __reduce__(self) -> tuple[type[CorruptImageError], tuple[str | Phrase, ...]]:
        return type(self), (self.name, self.reason, *self.parts[1:])


class StoreError(FastdataError):
    """A store cannot be opened, read or written."""


class StoreNotFoundError(StoreError):
    """No store exists at the given path or URI."""

    exit_code = 2


class StoreExistsError(StoreError):
    """The destination already holds a store and neither overwrite nor resume was asked for."""

    exit_code = 2


class StoreLockedError(StoreError):
    """Another writer holds the store; the message names it (host, PID, since when)."""


class StoreReplacedError(StoreError):
    """The store was replaced (``--overwrite``) after this reader opened it; its records would
    no longer match the labels the reader holds."""


class IncompleteStoreError(StoreError):
    """The store's metadata is missing: a conversion stopped before it finished."""


class WriteFailedError(StoreError):
    """Writing a store failed part-way (a full disk, a file-size limit, an I/O error); what
    was committed is kept. The writer names its store (``target``, ``collection``: as
    ``open_store`` takes it) as the error leaves it, so that the command line says what the
    store holds now and the command that finishes it, not advice that may not apply (a resume
    with nothing to resume, or beside ``--overwrite``)."""

    target: str | None = None
    collection: str | None = None

    def advice(self) -> tuple[str | Phrase, ...]:
        return (
            "free space (or fix the disk) and run ",
            SAME_COMMAND,
            " with ",
            option("resume"),
            ": what was committed is kept",
        )

    def name_store(self, target: str, collection: str | None) -> None:
        """Name the store being written, where no writer named it yet."""
        if self.target is None:
            self.target, self.collection = target, collection


class PickleNotAllowedError(StoreError):
    """The store holds pickled values and the caller did not pass ``allow_pickle=True``."""


class StoreDamagedError(StoreError):
    """The store is damaged: a record, a page of its file, its metadata or labels are not what
    fastdata wrote. The hint names ``fastdata verify``, which lists every damaged record and
    the repairs that work for them.

    Args:
        parts: the message (what is damaged, where).
        store: the store as command-line words (``PATH`` or ``URI --collection C``, quoted),
            for the command the hint prints; without it, the hint says "on it".
    """

    def __init__(self, *parts: str | Phrase, store: str = "") -> None:
        super().__init__(*parts)
        self.store = store

    def in_store(self, store: str) -> None:
        """Name ``store`` (command-line words, as ``store=``) where the code that found the
        damage did not know which store it was reading (a header or metadata parsed from
        bytes): a reader that catches its damage does so before it raises it again, which
        keeps the hint's command runnable as printed."""
        if not self.store:
            self.store = store

    def advice(self) -> tuple[str | Phrase, ...]:
        command = f"{_DAMAGED_LEAD} {self.store}`" if self.store else f"{_DAMAGED_LEAD}` on it"
        return (f"{command}, which names every damaged record and the repair that works",)

    def _holds_hint(self, message: str, hint: str) -> bool:
        # (torch's DataLoader raises a worker's error again from its text alone: the store the
        # hint named is in the text, not in this error, whose own hint would name none)
        return _DAMAGED_LEAD in message

    def __reduce__(self) -> tuple[Any, ...]:  # (``store`` is a keyword: kept across processes)
        return _rebuilt, (type(self), self.parts, self.store)


_DAMAGED_LEAD = "the store is damaged: run `fastdata verify"


def _rebuilt(
    kind: type[StoreDamagedError], parts: tuple[str | Phrase, ...], store: str
) -> StoreDamagedError:
    return kind(*parts, store=store)


class RecordError(StoreDamagedError):
    """One record is missing, malformed or fails its checksum."""


class UnsafePathError(StoreError):
    """A record's name would place a file outside the export folder."""


class MissingDependencyError(FastdataError):
    """An optional dependency is not installed; the message names the ``pip install`` to run."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a store was being written, with the store it was writing (``target``: a
    folder or a URI, and ``collection``), so that what is said next comes from what that store
    holds now (nothing, an interrupted run and the command that finishes it, or the store as it
    was), not from the words the command was given."""

    def __init__(self, target: str, collection: str | None = None) -> None:
        super().__init__(target, collection)
        self.target = target
        self.collection = collection
