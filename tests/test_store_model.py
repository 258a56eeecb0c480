"""A store's life, driven by random sequences of operations and checked against a plain model
after every step (Hypothesis' stateful testing; the model is ``tests/store_model.py``).

The operations, on LMDB folders and MongoDB collections (of the SecantusDB server the tests
start) whose names come from a hostile alphabet (``__fastdata__``, ``x:progress``, ``-x``, ``$x``,
spaces, dots, colons, stores inside other stores' folders): ``convert`` (plain, ``overwrite``,
``resume``), ``convert --append`` (with or without ``resume``), ``copy`` between any two places,
``export`` (into a new folder, or over an earlier export with ``resume`` or ``overwrite``), a
write run by the CLI in another process and killed (SIGKILL) at a point it reaches (before a
commit, before the metadata, before a replacement is moved into place), its resume (by the
command the store's error message prints, where it prints one), and readers in other processes
that opened a dataset before the writes that follow.

After every step: every place opens as the model says (a complete store with exactly its
classes, records, bytes and skipped files, and the same id as long as nothing was written to it;
an interrupted one refused as incomplete; nothing at all otherwise), ``verify`` passes on every
complete store, every reader read its own version (or, once its store was replaced, failed with
StoreReplacedError; never a mix), the source folders are as they were, and a refused operation
(an error with a message, never a traceback) left every store and file as it was.

Profiles (``FASTDATA_MODEL_PROFILE``):

- ``ci`` (default): a fixed set of 8 runs of 16 steps (derandomized), under a minute on two cores.
- ``long``: 200 random runs of 40 steps (half an hour and more)::

      FASTDATA_MODEL_PROFILE=long python -m pytest tests/test_store_model.py -p no:cacheprovider

Defects that are known and not fixed yet are listed in ``tests/store_model.KNOWN_BROKEN``; the
places and sources that meet them are drawn only with ``FASTDATA_MODEL_ENABLE=tag,...`` (or
``all``). Hypothesis keeps no example database (nothing is written into the repository); a
failure prints the steps that make it, shrunk.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import fastdata
from fastdata.errors import FastdataError, IncompleteStoreError, StoreError, StoreExistsError

from .conftest import snapshot
from .mongo_server import database
from .procs import run_killable
from .store_model import (
    EMPTY,
    SOURCE_DEFECTS,
    SOURCES,
    Outcome,
    Place,
    ReaderProcess,
    Store,
    Version,
    append_outcome,
    broken,
    build_sources,
    killed_store,
    nested,
    places,
    scanned,
    write_outcome,
)

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci",
    max_examples=8,
    stateful_step_count=16,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "long",
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=_QUIET,
)
PROFILE = os.environ.get("FASTDATA_MODEL_PROFILE", "ci")

POINTS = ["write:0", "write:1", "write:2", "write:3", "write_meta", "promote"]
"""Where a killed write stops (see store_model.KILLABLE_CLI)."""
MAX_READERS = 2

PLACES = places()
CONVERTIBLE = [k for k in SOURCES if SOURCE_DEFECTS.get(k) not in broken()]


def kin(place: Place) -> str:
    """The root of a place's name: places of one root are a store and names derived from it."""
    return re.split(r"[/.:]", place.name.lstrip("_.$-"), maxsplit=1)[0]


def gist(message: str) -> str:
    """A message without its paths and URIs, shortened: what kind of refusal it is."""
    message = re.sub(r"(mongodb://|/)\S*", "…", message.strip().splitlines()[0] if message else "")
    return message[:90]


def changes(before: Any, after: Any) -> list[str]:
    """What differs between two ``StoreLife.disk()`` looks, by file or collection."""
    out = []
    for old, new in zip(before, after, strict=True):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return out


class StoreLife(RuleBasedStateMachine):
    """One run: its own store folder and database, the model of every place in them."""

    workdir: Path
    sources: dict[str, Path]
    source_files: dict[str, bytes]
    mongo: str

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(dir=self.workdir))
        self.stores = self.root / "stores"
        self.stores.mkdir()
        self.db = f"model_{uuid.uuid4().hex[:12]}"
        self.uri = f"{self.mongo}/{self.db}"
        self.model: dict[Place, Store] = {}
        self.ids: dict[int, str] = {}
        self.serials = itertools.count(1)
        self.runs = itertools.count(1)
        self.readers: list[ReaderProcess] = []
        self.exports: dict[Path, dict[str, bytes]] = {}

    def teardown(self) -> None:
        for reader in self.readers:
            reader.close()
        database(self.uri).client.drop_database(self.db)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- places as the API and the CLI name them

    def target(self, place: Place) -> tuple[str, dict[str, Any]]:
        if place.backend == "lmdb":
            return str(self.stores / place.name), {}
        return self.uri, {"collection": place.name}

    def words(self, place: Place, flag: str = "--collection") -> tuple[str, list[str]]:
        if place.backend == "lmdb":
            return str(self.stores / place.name), []
        return self.uri, [f"{flag}={place.name}"]

    def seen(self, place: Place) -> Store:
        """The store a reader of ``place`` finds: its own; for ``S/data.mdb`` where nothing
        was written, the store S (an LMDB store opens by its data file's path too); for
        ``S/.replacement`` (Mongo: ``S.__replacement__``), where every write is refused, S's replacement built aside, if an
        interrupted write left one (incomplete, or complete when it was killed before it was
        moved into place)."""
        store = self.model.get(place, EMPTY)
        if not store.empty:
            return store
        sep = "/" if place.backend == "lmdb" else "."
        folder, _, leaf = place.name.rpartition(sep)
        if not folder:
            return store
        if place.backend == "lmdb" and leaf == "data.mdb":
            return self.model.get(Place("lmdb", folder), EMPTY)
        if leaf == (".replacement" if place.backend == "lmdb" else "__replacement__"):
            pending = self.model.get(Place(place.backend, folder), EMPTY).pending
            if pending is not None and pending.aside:
                return Store(pending.result if pending.moved else None, pending)
        return store

    def complete(self) -> list[Place]:
        """The places a reader finds a complete store at (not a replacement aside, which its
        store's next writer moves)."""
        return [
            p
            for p in PLACES
            if self.seen(p).complete is not None and not p.name.endswith("replacement")
        ]

    def open(self, place: Place) -> Any:
        where, kw = self.target(place)
        return fastdata.open_store(where, **kw)

    def draw_place(
        self, data: st.DataObject, label: str, prefer: list[Place] | None = None, only: bool = False
    ) -> Place:
        """A place: mostly one of ``prefer`` (by default those used already in this run), else
        often a kin of one used (a name derived from its name, or its folder's), and with
        ``only``, one of ``prefer``."""
        used = [p for p in PLACES if p in self.model]
        if prefer is None:
            prefer = used
        among = PLACES
        pick = 3 if only else data.draw(st.integers(0, 3), label=f"{label} from")
        if pick >= 2 and prefer:
            among = prefer
        elif pick == 1 and used:
            roots = {kin(p) for p in used}
            among = [p for p in PLACES if kin(p) in roots]
        return data.draw(st.sampled_from(among), label=label)

    def waiting(self) -> list[Place]:
        """The places that hold an interrupted write."""
        return [p for p in PLACES if self.model.get(p, EMPTY).pending is not None]

    # -- operations: what they should do, and how to run them

    def plan(
        self, op: str, place: Place, mode: str, source: str | Place, workers: int | None = None
    ) -> tuple[Outcome, Callable[[], object], list[str], str, int]:
        """The outcome of ``op`` (convert, append, copy) on ``place`` in ``mode``, the call
        that runs it, the CLI words that run it, and its kind and source serial for the model."""
        store = self.model.get(place, EMPTY)
        serial = next(self.serials)
        dst, kw = self.target(place)
        dst_word, dst_flags = self.words(place)
        flags = {"overwrite": ["--overwrite"], "resume": ["--resume"]}.get(mode, [])
        source_serial = 0
        if op in ("convert", "append"):
            assert isinstance(source, str)
            folder = self.sources[source]
            if op == "append":
                out = append_outcome(store, source, resume=mode == "resume", serial=serial)
            else:
                # a source that meets a defect is drawn once it is fixed: then it is refused
                result = None if source in SOURCE_DEFECTS else scanned(source, serial)
                out = write_outcome(store, kind="convert", mode=mode, result=result, source=source)

            def call() -> object:
                return fastdata.convert(
                    folder,
                    dst,
                    append=op == "append",
                    overwrite=mode == "overwrite",
                    resume=mode == "resume",
                    workers=workers,
                    **kw,
                )

            words = ["convert", str(folder), dst_word, *dst_flags, *flags]
            words += ["--append"] if op == "append" else []
        else:
            assert isinstance(source, Place)
            src = self.seen(source).complete
            result = None
            if src is not None and source != place:
                result = replace(src, serial=serial, grew_from=frozenset())
                source_serial = src.serial
            out = write_outcome(
                store,
                kind="copy",
                mode=mode,
                result=result,
                source=source,
                source_serial=source_serial,
            )
            src_where, src_kw = self.target(source)

            def call() -> object:
                return fastdata.copy_store(
                    src_where,
                    dst,
                    source_collection=src_kw.get("collection"),
                    collection=kw.get("collection"),
                    overwrite=mode == "overwrite",
                    resume=mode == "resume",
                )

            src_word, src_flags = self.words(
                source, "--source-collection" if place.backend == "mongo" else "--collection"
            )
            words = ["copy", src_word, dst_word, *src_flags, *dst_flags, *flags]
        self.adjust(place, out)
        return out, call, words, "append" if op == "append" else op, source_serial

    def adjust(self, place: Place, out: Outcome) -> None:
        """What the place's name allows: a name the backend refuses is refused; a name that
        meets a known defect, or an LMDB folder inside (or holding) another store's, may be."""
        if place.refused:
            out.success, out.refusable = None, False
        elif place.defect or any(
            nested(place, other) for other, s in self.model.items() if not s.empty
        ):
            out.refusable = True

    def written(self, what: str, place: Place, out: Outcome, run: Callable[[], object]) -> None:
        """Run a write on ``place`` and take its outcome into the model."""
        before = self.disk()
        try:
            run()
        except FastdataError as exc:
            event(f"{what}: refused: {type(exc).__name__}: {gist(str(exc))}")
            assert out.success is None or out.refusable, f"{place}: refused: {exc}"
            self.refused(place, out, before)
            return
        event(f"{what}: done")
        assert out.success is not None, f"{place}: done, but it should have been refused"
        self.model[place] = out.success

    def refused(self, place: Place, out: Outcome, before: object) -> None:
        """A refusal leaves everything as it was, except that a writer that got as far as its
        lock first moves a replacement left complete aside into place (then so does the
        model)."""
        store = self.model.get(place, EMPTY)
        if out.base == store:
            after = self.disk()
            assert after == before, f"a refused write to {place} changed {changes(before, after)}"
            return
        moved = True
        try:
            reader = self.open(place)
        except IncompleteStoreError:
            moved = False
        else:
            assert store.complete is not None or out.base.complete is not None
            moved = store.complete is None or reader.meta.id != self.ids.get(store.complete.serial)
            reader.close()
        self.model[place] = out.base if moved else store

    def disk(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        """Every file and folder under the store folder (not the lock files, which any writer
        takes), with its bytes' hash, and every collection of the database with its documents
        (not writer claims)."""
        import hashlib

        files = {}
        for path in sorted(self.stores.rglob("*")):
            if path.name in ("lock.mdb", "writer.lock") and path.is_file():
                continue
            rel = path.relative_to(self.stores).as_posix()
            files[rel] = hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file() else "/"
        db = database(self.uri)
        docs = {}
        for name in sorted(db.list_collection_names()):
            found = db[name].find({}, {"data": 0})
            docs[name] = sorted(repr(sorted(d.items())) for d in found if "token" not in d)
        if docs.get("__fastdata__") == []:
            # a writer that claimed a collection in a new database and then found nothing to
            # write leaves fastdata's own collection there, empty (I10): dropping it could drop
            # the claim another writer inserts meanwhile
            del docs["__fastdata__"]
        return files, docs

    # -- rules

    @rule(
        data=st.data(),
        source=st.sampled_from(CONVERTIBLE),
        mode=st.sampled_from(["plain", "overwrite", "resume"]),
        workers=st.sampled_from([1, 2, None]),
    )
    def convert(self, data: st.DataObject, source: str, mode: str, workers: int | None) -> None:
        place = self.draw_place(data, "place")
        out, call, _, _, _ = self.plan("convert", place, mode, source, workers)
        self.written(f"convert {mode}", place, out, call)

    @precondition(lambda self: bool(self.complete()))
    @rule(data=st.data(), source=st.sampled_from(list(SOURCES)), resume=st.booleans())
    def append(self, data: st.DataObject, source: str, resume: bool) -> None:
        place = self.draw_place(data, "place", self.complete())
        out, call, _, _, _ = self.plan("append", place, "resume" if resume else "plain", source)
        self.written("append", place, out, call)

    @precondition(lambda self: bool(self.complete()))
    @rule(data=st.data(), mode=st.sampled_from(["plain", "overwrite", "resume"]))
    def copy(self, data: st.DataObject, mode: str) -> None:
        source = self.draw_place(data, "source", self.complete())
        place = self.draw_place(data, "place")
        out, call, _, _, _ = self.plan("copy", place, mode, source)
        self.written(f"copy {mode}", place, out, call)

    def pending_op(self, place: Place) -> tuple[str, str | Place]:
        pending = self.model[place].pending
        assert pending is not None
        return pending.kind, pending.source

    @precondition(lambda self: bool(self.waiting()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """Continue an interrupted write with the call that began it and ``resume``."""
        place = self.draw_place(data, "place", self.waiting(), only=True)
        kind, source = self.pending_op(place)
        out, call, _, _, _ = self.plan(kind, place, "resume", source)
        self.written(f"resume {kind}", place, out, call)

    # Writes run by the CLI in another process, killed if they reach ``point``.

    @rule(
        data=st.data(),
        source=st.sampled_from(CONVERTIBLE),
        overwrite=st.booleans(),
        point=st.sampled_from(POINTS),
    )
    def killed_convert(self, data: st.DataObject, source: str, overwrite: bool, point: str) -> None:
        place = self.draw_place(data, "place")
        mode = "overwrite" if overwrite else "plain"
        self.run_killed(f"convert {mode}", place, "convert", mode, source, point)

    @precondition(lambda self: bool(self.complete()))
    @rule(data=st.data(), source=st.sampled_from(list(SOURCES)), point=st.sampled_from(POINTS))
    def killed_append(self, data: st.DataObject, source: str, point: str) -> None:
        place = self.draw_place(data, "place", self.complete())
        self.run_killed("append", place, "append", "plain", source, point)

    @precondition(lambda self: bool(self.complete()))
    @rule(data=st.data(), overwrite=st.booleans(), point=st.sampled_from(POINTS))
    def killed_copy(self, data: st.DataObject, overwrite: bool, point: str) -> None:
        source = self.draw_place(data, "source", self.complete())
        place = self.draw_place(data, "place")
        mode = "overwrite" if overwrite else "plain"
        self.run_killed(f"copy {mode}", place, "copy", mode, source, point)

    @precondition(lambda self: bool(self.waiting()))
    @rule(data=st.data(), point=st.sampled_from(POINTS))
    def killed_resume(self, data: st.DataObject, point: str) -> None:
        """Resume an interrupted write by the command its store's error prints, where it
        prints one (else the command that began it, with ``--resume``)."""
        place = self.draw_place(data, "place", self.waiting(), only=True)
        kind, source = self.pending_op(place)
        printed = self.printed_resume(place)
        self.run_killed(f"resume {kind}", place, kind, "resume", source, point, printed)

    def run_killed(
        self,
        what: str,
        place: Place,
        kind: str,
        mode: str,
        source: str | Place,
        point: str,
        printed: list[str] | None = None,
    ) -> None:
        out, _, words, kind, source_serial = self.plan(kind, place, mode, source)
        if printed is not None:
            words = printed
        before = self.disk()
        ended = run_killable(words, point, self.root / f"run{next(self.runs)}")
        said = f"fastdata {shlex.join(words)} ({point}): {ended}"
        how = "killed" if ended.killed else f"{ended.code} {gist(ended.err)}"
        event(f"killed {what} at {point}: {how}")
        store = self.model.get(place, EMPTY)
        if ended.killed and point == "promote" and out.base != store:
            # killed as it began, moving the replacement left complete aside into place
            assert out.base.complete is not None, said
        elif ended.killed:
            assert out.success is not None and out.success != out.base, f"{said}: it wrote"
            now = killed_store(
                out.base, kind, source, out.success, point, source_serial=source_serial
            )
            assert now.pending is not None and (now.pending.aside or point != "promote"), said
            self.model[place] = now
        elif ended.code == 0:
            assert out.success is not None, f"{said}: done, but it should have been refused"
            self.model[place] = out.success
        else:
            assert ended.code in (1, 2) and "Traceback" not in ended.err, said
            assert ended.err.strip(), f"{said}: refused without a word"
            assert out.success is None or out.refusable, f"{said}: refused"
            self.refused(place, out, before)

    def printed_resume(self, place: Place) -> list[str] | None:
        """The command that finishes the interrupted write at ``place``, as words, as the store
        names it: in the error that refuses an incomplete store, or in what its reader says is
        unfinished (an append, a replacement built aside); None when a replacement is complete
        aside (its next writer moves it into place)."""
        pending = self.model[place].pending
        assert pending is not None
        try:
            reader = self.open(place)
        except IncompleteStoreError as exc:
            said = [str(exc)]
        else:
            try:
                said = reader.interrupted()
            finally:
                reader.close()
        if pending.moved:
            return None
        commands = [
            shlex.split(found.group(1))
            for text in said
            for found in re.finditer(r"`fastdata ([^`]*)`", text)
        ]
        assert commands, f"{place}: nothing names the command that finishes it: {said}"
        if "printed-resume-under-a-replacement" not in broken():
            assert len(commands) == 1, f"{place}: {said}"
        elif len(commands) > 1 or (pending.aside and self.model[place].complete is None):
            return None  # an earlier run's command beside it, or in its place
        return commands[0]

    @rule(data=st.data(), mode=st.sampled_from(["fresh", "resume", "overwrite"]))
    def export(self, data: st.DataObject, mode: str) -> None:
        full = self.complete()
        place = self.draw_place(data, "place", full)
        version = self.seen(place).complete
        if mode == "fresh" or not self.exports:
            mode, out = "fresh", self.root / "exports" / f"{next(self.runs)}"
        else:
            out = data.draw(st.sampled_from(sorted(self.exports)), label="into")
        old = self.exports.get(out, {})
        try:
            reader = self.open(place)
        except StoreError as exc:
            assert version is None, f"{place}: {exc}"
            return
        assert version is not None, f"{place} opens, but the model holds no complete store"
        expected, conflict = dict(old), None
        for rec in version.records:
            held = old.get(rec.name)
            if held is None or mode == "overwrite" or held == rec.original:
                expected[rec.name] = rec.original
            elif len(held) < len(rec.original) and rec.original.startswith(held):
                expected[rec.name] = rec.original  # a prefix: completed
            else:
                conflict = rec.name
                break
        try:
            fastdata.export_store(
                reader, out, overwrite=mode == "overwrite", resume=mode == "resume"
            )
        except StoreExistsError as exc:
            event(f"export {mode}: refused")
            assert conflict is not None, f"export of {place} into {out}: {exc}"
        else:
            event(f"export {mode}: done")
            assert conflict is None, f"export of {place} wrote over {conflict}"
        finally:
            reader.close()
        assert snapshot(out) == expected, f"export of {place} into {out}"
        self.exports[out] = expected

    @precondition(lambda self: len(self.readers) < MAX_READERS)
    @precondition(lambda self: bool(self.complete()))
    @rule(data=st.data())
    def open_reader(self, data: st.DataObject) -> None:
        full = self.complete()
        place = self.draw_place(data, "place", full, only=True)
        where, kw = self.target(place)
        version = self.seen(place).complete
        assert version is not None
        event("a reader opened")
        reader = ReaderProcess([where, *kw.values()], place, version)
        self.readers.append(reader)
        assert reader.read() == [version.digest()] * 2, f"a reader of {place} opened it"

    # -- after every step

    @invariant()
    def every_place_as_modelled(self) -> None:
        for place in PLACES:
            self.check_place(place)
        for reader in self.readers:
            self.check_reader(reader)
        assert snapshot(self.workdir / "sources") == self.source_files, "a source changed"

    def check_place(self, place: Place) -> None:
        store = self.seen(place)
        try:
            reader = self.open(place)
        except IncompleteStoreError as exc:
            assert store.complete is None and store.pending is not None, f"{place}: {exc}"
            return
        except StoreError as exc:
            assert store.empty, f"{place} ({store}): {exc}"
            return
        try:
            assert store.complete is not None, f"{place} opens, but the model has {store}"
            self.check_content(place, reader, store.complete)
            report = fastdata.verify_store(reader)
            assert report.ok, f"{place}: verify: {report}"
        finally:
            reader.close()

    def check_content(self, place: Place, reader: Any, version: Version) -> None:
        meta = reader.meta
        classes = list(meta.classes)
        assert classes == list(version.classes), f"{place}: classes"
        got = [(classes[r.header.label], r.header.name, r.data) for r in reader.iter_records()]
        want = [(r.cls, r.name, r.stored) for r in version.records]
        assert got == want, f"{place}: records"
        assert list(reader.labels) == [classes.index(r.cls) for r in version.records]
        assert {s.name for s in reader.skipped_files()} == version.skipped, f"{place}: skipped"
        known = self.ids.setdefault(version.serial, meta.id)
        assert meta.id == known, f"{place}: its id changed, though nothing was written to it"
        others = [s for s, i in self.ids.items() if i == meta.id and s != version.serial]
        assert not others, f"{place}: two stores with one id"

    def check_reader(self, reader: ReaderProcess) -> None:
        now = self.seen(reader.place).complete
        assert now is not None
        opened = reader.version
        grown = now.serial == opened.serial or opened.serial in now.grew_from
        for view in reader.read():
            if view == opened.digest():
                if now.serial != opened.serial:
                    event(f"a reader read on ({'grown' if grown else 'replaced'})")
                continue
            event("a reader failed: replaced")
            assert not grown, f"a reader of {reader.place} read {view}, not what it opened"
            assert "replaced" in view, f"a reader of {reader.place} (replaced) read {view}"


@pytest.mark.mongo
def test_the_stores_life_follows_the_model(mongo_base_uri: str, tmp_path: Path) -> None:
    StoreLife.workdir = tmp_path
    StoreLife.sources = build_sources(tmp_path / "sources")
    StoreLife.source_files = snapshot(tmp_path / "sources")
    StoreLife.mongo = mongo_base_uri
    # what Hypothesis keeps between runs (constants it found in the code) goes here, not into
    # .hypothesis/ in the current folder
    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        run_state_machine_as_test(StoreLife, settings=settings.get_profile(PROFILE))
    finally:
        set_hypothesis_home_dir(None)
