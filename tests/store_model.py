"""The plain model that ``tests/test_store_model.py`` checks fastdata's stores against: the
source folders it converts, the places it writes (names drawn from a hostile alphabet), what
each operation should leave in a place, and the processes it runs beside the test (a write killed
at a point it reaches, a reader that holds a store open).

What a store holds is modelled as plainly as docs/stores.md states it: its classes, its records in
index order (class, relative name, stored bytes, the source file's bytes), the names of the files
it skipped, and a serial that changes exactly when the store's id does. Nothing here imports
fastdata: the model is what the code is compared with, not a second copy of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .conftest import jpeg_bytes, png_bytes, write
from .procs import REPO

# --------------------------------------------------------------------------- known defects

KNOWN_BROKEN: dict[str, str] = {}
# Empty: every defect the model found is fixed, each kept as a plain test in
# tests/test_store_model_regressions.py (reserved names, a store in another's .replacement or
# named like its files, a source with no usable image, a store named like a GridFS bucket, the
# resume command printed under an interrupted replacement, names the server refuses). A defect
# found next is listed here by tag, and the places that meet it are drawn only when enabled.
"""Defects the model finds on today's code, by tag. A place or source that meets one is drawn
only when its tag is enabled: ``FASTDATA_MODEL_ENABLE=tag,tag`` (or ``all``) once it is fixed."""


def broken() -> set[str]:
    """The tags of KNOWN_BROKEN that the model leaves alone in this run."""
    enabled = os.environ.get("FASTDATA_MODEL_ENABLE", "")
    if enabled.strip() == "all":
        return set()
    return set(KNOWN_BROKEN) - {t.strip() for t in enabled.split(",")}


# --------------------------------------------------------------------------- places


@dataclass(frozen=True)
class Place:
    """Where a store may be: an LMDB folder (``name`` relative to the run's store folder) or a
    Mongo collection of the run's database.

    Attributes:
        defect: the KNOWN_BROKEN tag this name runs into ("" if none).
        refused: the backend cannot hold a store of this name; every write must be refused.
    """

    backend: str
    name: str
    defect: str = ""
    refused: bool = False

    def __str__(self) -> str:
        return f"{self.backend}:{self.name!r}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # (Hypothesis prints steps so)
        printer.text(repr(self))

    def __repr__(self) -> str:  # (as failing steps print it, runnable)
        extra = "".join(
            f", {k}={v!r}" for k, v in (("defect", self.defect), ("refused", self.refused)) if v
        )
        return f"Place({self.backend!r}, {self.name!r}{extra})"


_LMDB = [
    Place("lmdb", "s"),
    Place("lmdb", "c"),
    Place("lmdb", "s/inner"),  # a store inside another store's folder
    # names of a store's own files, as stores inside it: reserved (I14), every write refused
    Place("lmdb", "s/data.mdb", refused=True),
    Place("lmdb", "s/writer.lock", refused=True),
    Place("lmdb", "s/lock.mdb", refused=True),
    Place("lmdb", "s/readers.epoch", refused=True),
    Place("lmdb", "a b"),
    Place("lmdb", "$x"),
    Place("lmdb", "x:progress"),
    Place("lmdb", "__fastdata__"),
    Place("lmdb", "-x"),
    Place("lmdb", ".replacement", refused=True),
    Place("lmdb", "s/.replacement", refused=True),
]
_MONGO = [
    Place("mongo", "s"),
    Place("mongo", "c"),
    Place("mongo", "x"),
    Place("mongo", "s.inner"),
    Place("mongo", "a b"),
    Place("mongo", "d.e"),
    Place("mongo", "a:b"),
    Place("mongo", "-x"),
    Place("mongo", "$x", refused=True),
    Place("mongo", "__fastdata__", refused=True),
    Place("mongo", "x:progress", refused=True),
    Place("mongo", "c.__replacement__", refused=True),
    Place("mongo", "c:writer", refused=True),
    Place("mongo", "c.gridfs.files", refused=True),
    Place("mongo", "system.x", refused=True),
]


def places() -> list[Place]:
    """Every place a run may write, less those that meet a defect left alone."""
    skip = broken()
    return [p for p in _LMDB + _MONGO if p.defect not in skip]


def nested(a: Place, b: Place) -> bool:
    """Whether one LMDB place lies inside the other's folder."""
    if a.backend != "lmdb" or b.backend != "lmdb" or a == b:
        return False
    return b.name.startswith(a.name + "/") or a.name.startswith(b.name + "/")


# --------------------------------------------------------------------------- sources

EOI = b"\xff\xd9"


@dataclass(frozen=True)
class SourceFile:
    """One image file of a source: ``stored`` is what a store keeps of it (its bytes, with a
    missing end-of-image marker appended), None for a file that cannot be used."""

    cls: str
    fname: str
    data: bytes
    stored: bytes | None

    @property
    def name(self) -> str:
        return f"{self.cls}/{self.fname}"


def _good(cls: str, fname: str, data: bytes) -> SourceFile:
    return SourceFile(cls, fname, data, data)


def _sources() -> dict[str, list[SourceFile]]:
    a = [_good("a0", f"{i}.jpg", jpeg_bytes(16, 16, seed=i)) for i in range(3)]
    a += [_good("a1", f"{i}.jpg", jpeg_bytes(16, 16, seed=10 + i)) for i in range(2)]
    # A and more: an append of it to a store of A adds a0/3.jpg and a class Z, which sorts
    # first in a fresh conversion and goes last in an append
    more = [_good("a0", "3.jpg", jpeg_bytes(16, 16, seed=3))]
    more += [_good("Z", f"{i}.jpg", jpeg_bytes(16, 16, seed=20 + i)) for i in range(2)]
    cut = jpeg_bytes(16, 16, seed=31)[:-2]
    mixed = [
        _good("m", "good.jpg", jpeg_bytes(16, 16, seed=30)),
        SourceFile("m", "eoi.jpg", cut, cut + EOI),  # repaired: the marker appended
        _good("m", "pic.png", png_bytes(8, 8, seed=32)),
        _good("m", "chat é.jpg", jpeg_bytes(16, 16, seed=33)),
        SourceFile("m", "text.jpg", b"not an image at all\n", None),
        SourceFile("m", "empty.jpg", b"", None),
        # the name of one of A's files, other bytes: an append never stores it twice
        _good("a0", "0.jpg", jpeg_bytes(20, 12, seed=34)),
    ]
    return {
        "A": a,
        "Aplus": a + more,
        "M": mixed,
        "BAD": [SourceFile("x", "t.jpg", b"no image here\n", None)],
    }


SOURCES = _sources()
SOURCE_DEFECTS = {"BAD": "no-usable-image"}
"""Sources whose conversion meets a defect (an append of them does not)."""
_IGNORED = {"M": {"m/notes.txt": b"not an image, ignored", "m/.hidden.jpg": jpeg_bytes(8, 8)}}
"""Files a conversion passes over (no image extension, hidden)."""


def build_sources(root: Path) -> dict[str, Path]:
    """Write every source folder under ``root``; return their paths by key."""
    out = {}
    for key, files in SOURCES.items():
        for f in files:
            write(root / key / f.cls / f.fname, f.data)
        for name, data in _IGNORED.get(key, {}).items():
            write(root / key / name, data)
        out[key] = root / key
    return out


# --------------------------------------------------------------------------- what a store holds


@dataclass(frozen=True)
class Rec:
    cls: str
    name: str
    stored: bytes
    original: bytes


@dataclass(frozen=True)
class Version:
    """A complete store's content. ``serial`` changes exactly when the store's id does;
    ``grew_from`` lists the serials of the stores it grew from by appends (a reader that opened
    one of them reads on)."""

    classes: tuple[str, ...]
    records: tuple[Rec, ...]
    skipped: frozenset[str]
    serial: int
    grew_from: frozenset[int] = frozenset()

    def files(self) -> dict[str, bytes]:
        """What an export writes: every record's source bytes under its name."""
        return {r.name: r.original for r in self.records}

    def digest(self) -> dict[str, object]:
        """What a reader process reports (see READER)."""
        import hashlib

        index = {c: i for i, c in enumerate(self.classes)}
        return {
            "classes": list(self.classes),
            "records": [
                [r.name, index[r.cls], hashlib.sha1(r.stored).hexdigest()] for r in self.records
            ],
        }


@dataclass(frozen=True)
class Pending:
    """An interrupted write (killed): what its resume completes.

    Attributes:
        kind: ``convert``, ``append`` or ``copy``.
        source: a source key, or for a copy the source place.
        result: the store it completes into.
        aside: built aside (it replaces a store there): a complete store stays readable.
        moved: the replacement aside is complete, killed before it was moved into place: the
            next writer of the place moves it first.
        source_serial: for a copy, the serial of the store it copies.
    """

    kind: str
    source: str | Place
    result: Version
    aside: bool = False
    moved: bool = False
    source_serial: int = 0


@dataclass(frozen=True)
class Store:
    complete: Version | None = None
    pending: Pending | None = None

    @property
    def empty(self) -> bool:
        return self.complete is None and self.pending is None


EMPTY = Store()


def settled(store: Store) -> Store:
    """The store as its next writer finds it: a replacement complete aside moved into place."""
    if store.pending is not None and store.pending.moved:
        return Store(store.pending.result)
    return store


def scanned(key: str, serial: int) -> Version:
    """The store a conversion of the source ``key`` makes."""
    files = SOURCES[key]
    classes = tuple(sorted({f.cls for f in files}))
    order = {c: i for i, c in enumerate(classes)}
    ordered = sorted(files, key=lambda f: (order[f.cls], f.fname))
    return Version(
        classes,
        tuple(Rec(f.cls, f.name, f.stored, f.data) for f in ordered if f.stored is not None),
        frozenset(f.name for f in files if f.stored is None),
        serial,
    )


def appended(base: Version, key: str, serial: int) -> Version | None:
    """The store an append of the source ``key`` to ``base`` makes, or None when the source has
    nothing new (the store is left as it is). A file is new when no record has its relative
    name (one that changed since it was stored is reported, never stored twice) and it is not
    listed as skipped unchanged (every source file here is immutable, and no two sources share
    the name of a file that cannot be used)."""
    fresh = scanned(key, serial)
    held = {r.name for r in base.records}
    todo = [f for f in SOURCES[key] if f.name not in held and f.name not in base.skipped]
    if not todo:
        return None
    names = {f.name for f in todo}
    return Version(
        base.classes + tuple(c for c in fresh.classes if c not in base.classes),
        base.records + tuple(r for r in fresh.records if r.name in names),
        base.skipped | {f.name for f in todo if f.stored is None},
        serial,
        base.grew_from | {base.serial},
    )


# --------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """What a write operation on a place should do.

    Attributes:
        base: the place as the operation finds it (see ``settled``); what a refusal leaves.
        success: the place after the operation; None: it must be refused.
        refusable: it may be refused instead (a name the backend may refuse, a store inside
            another's folder, a resume of a store already complete).
        grows: the complete store grows by an append (readers that opened it read on).
    """

    base: Store
    success: Store | None
    refusable: bool = False
    grows: bool = False
    notes: list[str] = field(default_factory=list)


def write_outcome(
    store: Store,
    *,
    kind: str,
    mode: str,
    result: Version | None,
    source: str | Place,
    source_serial: int = 0,
) -> Outcome:
    """The outcome of ``convert`` / ``copy`` (``kind``) in ``mode`` (``plain``, ``overwrite``,
    ``resume``) of what makes ``result`` (None: the source cannot be converted or read)."""
    base = settled(store)
    if result is None:
        return Outcome(base, None)
    if mode == "plain":
        return Outcome(base, Store(result) if base.empty else None)
    if mode == "overwrite":
        return Outcome(base, Store(result))
    pending = base.pending
    if pending is not None:
        same = pending.kind == kind and pending.source == source
        if same and pending.source_serial == source_serial:
            return Outcome(base, Store(pending.result))
        return Outcome(base, None)
    if base.complete is not None:  # the same run, complete already, or another: as it was
        return Outcome(base, base, refusable=True)
    return Outcome(base, None)


def append_outcome(store: Store, key: str, *, resume: bool, serial: int) -> Outcome:
    """The outcome of ``convert --append`` of the source ``key``."""
    base = settled(store)
    if base.complete is None or (base.pending is not None and base.pending.aside):
        return Outcome(base, None)
    pending = base.pending
    if pending is not None and pending.kind == "append" and pending.source == key:
        return Outcome(base, Store(pending.result), grows=True)  # it goes on
    if pending is not None and resume:
        return Outcome(base, None)  # another append is interrupted: not resumed by this one
    grown = appended(base.complete, key, serial)
    return Outcome(base, Store(grown or base.complete), grows=True)


def killed_store(
    base: Store, kind: str, source: str | Place, out: Store, point: str, *, source_serial: int = 0
) -> Store:
    """The place after a write whose success is ``out`` was killed at ``point`` (reached)."""
    assert out.complete is not None
    if base.pending is not None and base.pending.result == out.complete:  # a resume
        return replace(base, pending=replace(base.pending, moved=point == "promote"))
    if kind == "append":
        return Store(base.complete, Pending("append", source, out.complete))
    aside = not base.empty
    pending = Pending(kind, source, out.complete, aside, point == "promote", source_serial)
    return Store(base.complete, pending)


# --------------------------------------------------------------------------- other processes


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


# A process that opened a dataset of a store (before the test's next steps) and, for each line
# on its stdin, reads every record through it and through a copy of it made by pickling (as a
# DataLoader worker gets it), printing both views as one JSON line.
READER = """
import hashlib, json, pickle, sys
from fastdata import LMDBImageDataset, MongoImageDataset
from fastdata.errors import FastdataError, StoreReplacedError

args = sys.argv[1:]
if len(args) == 1:
    ds = LMDBImageDataset(args[0], output="bytes")
else:
    ds = MongoImageDataset(args[0], args[1], output="bytes")

def view(d):
    try:
        samples = d.__getitems__(list(range(len(d))))
        names = [name for name, _ in d.samples]
        records = [[n, int(label), hashlib.sha1(data).hexdigest()]
                   for n, (data, label) in zip(names, samples)]
        return {"classes": list(d.classes), "records": records}
    except StoreReplacedError as exc:
        return {"replaced": str(exc)}
    except FastdataError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}

for line in sys.stdin:
    copy = pickle.loads(pickle.dumps(ds))
    print(json.dumps([view(ds), view(copy)]), flush=True)
"""


class ReaderProcess:
    """A READER process over one place, opened on a complete store."""

    def __init__(self, args: list[str], place: Place, version: Version) -> None:
        self.place, self.version = place, version
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )

    def read(self) -> list[dict[str, object]]:
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("read\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            assert self.proc.stderr is not None
            raise AssertionError(f"the reader of {self.place} died: {self.proc.stderr.read()}")
        return list(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
