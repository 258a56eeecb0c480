"""The LMDB writer: a fastdata store written in place, aside for a replacement, or grown in
place by an append."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import shutil
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ...errors import (
    SAME_COMMAND,
    Phrase,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    WriteFailedError,
    option,
)
from ...packed import PackedStrings
from ...records import LABEL_DTYPE, Progress, Record, StoreMeta
from ..files import fsync_file, no_space_left, open_regular
from ..locks import boot_id, describe_holder, holder
from ..names import (
    DATA_FILE,
    LOCK_FILE,
    OWN_FILES,
    WRITER_LOCK,
    aside_folder,
    check_lmdb_store,
    data_file,
    writer_lock,
)
from ..policy import Completion, Existing, StoreWriter
from ..reader import StoreReader
from . import file as lmdb_file
from .columns import finish_columns, index_of_names
from .env import bump_epoch, ensure_epoch, open_reader, open_writable, reading
from .layout import (
    COLUMNS_KEY,
    INITIAL_MAP_SIZE,
    KEYS_KEY,
    LABELS_KEY,
    LEN_KEY,
    META_KEY,
    NAMES_KEY,
    PROGRESS_KEY,
    header_key,
    keys_past,
    record_key,
    record_key_list,
    records_problem,
    skipped_entries,
    skipped_key,
)
from .lease import Lease
from .look import peek
from .own import check_room, refuse_shared, taken
from .reader import LMDBStore

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- writer


class LMDBWriter(StoreWriter):
    """Writes a fastdata store into an LMDB folder.

    The writer lock is ``writer.lock`` in the store folder (``flock``: the kernel releases it if
    the process dies), over a ``data.mdb`` of the store's own, never a link (NOTE [ A data file
    of its own ] in ``own.py``). A fresh store is written in place; a store that replaces
    another is built in ``.replacement/`` inside the folder and its ``data.mdb`` renamed over
    the old one when complete, so readers see either store whole, never a mix. Each batch and
    its progress are committed in one transaction. The map grows (doubling) when LMDB reports it
    full, so no size needs guessing.

    Args:
        path: the store folder (created if missing; must be empty or hold an LMDB store; not a
            name fastdata keeps for its own files, see NOTE [ Reserved names ] in
            ``stores/names.py``).
        map_size: the initial map size in bytes.

    Raises:
        ReservedNameError: ``path`` is one of the names fastdata keeps (before anything is
            written).
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = INITIAL_MAP_SIZE) -> None:
        check_lmdb_store(path)
        self.path = os.fspath(path)
        self.location = self.path
        self._map_size = map_size
        self._lease: Lease | None = None
        self._lock_fd: int | None = None

    @property
    def _aside_path(self) -> str:
        return aside_folder(self.path)

    def _target(self) -> str:
        return self._aside_path if self.building_aside else self.path

    # -- the policy's steps (see StoreWriter.start)

    def _lock(self) -> None:
        folder = Path(self.path)
        if folder.exists() and not folder.is_dir():
            raise StoreExistsError(
                f"{folder}: a file is in the way; give a new or empty folder for the store"
            )
        if folder.is_dir() and not (folder / DATA_FILE).exists():
            foreign = sorted(p.name for p in folder.iterdir() if p.name not in OWN_FILES)
            if foreign:
                raise StoreExistsError(
                    f"{folder}: the folder is not empty ({foreign[0]}, ...) and holds no LMDB "
                    "store; give a new or empty folder for the store"
                )
        refuse_shared(self.path)  # (NOTE [ A data file of its own ])
        # the folders this writer creates: removed again if it ends without writing a store (a
        # refused command leaves nothing behind)
        self._created = tuple(p for p in [folder, *folder.parents] if not p.exists())
        self._lock_created = not (folder / WRITER_LOCK).exists()
        lock = folder / WRITER_LOCK
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = open_regular(lock, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise StoreError(f"{folder}: cannot create the store: {exc.strerror or exc}") from None
        if isinstance(fd, str):  # (written through, a link would change the file it names)
            remove = (
                "move it out of the store folder"
                if fd == "a folder"
                else f"remove it (`rm {shlex.quote(os.path.abspath(lock))}`)"
            )
            raise StoreError(
                f"{lock}: {fd}, not the lock file fastdata keeps there; {remove} and run the "
                "same command again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                info = json.loads(os.pread(fd, 4096, 0) or b"null")
            except ValueError:
                info = None
            os.close(fd)
            raise StoreLockedError(
                f"{self.path}: another conversion is writing this store "
                f"({describe_holder(info)}); wait for it to finish, or stop it and run ",
                SAME_COMMAND,
                " with ",
                option("resume"),
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder()).encode("ascii"), 0)
        self._lock_fd = fd

    def _inspect(self) -> Existing:
        meta = progress = aside = None
        aside_complete = False
        other: tuple[str | Phrase, ...] = ()
        if os.path.exists(data_file(self.path)):
            try:
                meta, progress, has_keys = peek(self.path)
            except StoreError as exc:
                other = ("holds a damaged LMDB store (", *exc.said(), ")")
            else:
                if meta is None and progress is None and has_keys is not None:
                    other = (
                        "holds an LMDB store written by another tool"
                        if has_keys
                        else "holds an LMDB store without fastdata metadata",
                    )
        appending = None
        if meta is not None and progress is not None:
            appending, progress = progress, None
        if os.path.exists(data_file(self._aside_path)):
            try:
                aside_meta, aside, _ = peek(self._aside_path)
                aside_complete = aside_meta is not None
            except StoreError as exc:
                log.warning("%s: discarding a damaged replacement: %s", self.path, exc)
                self._discard_aside()
        return Existing(meta, progress, aside, aside_complete, other, appending)

    def _check_resumable(self, saved: Progress) -> None:
        if saved.boot_id and saved.boot_id != boot_id():
            raise StoreError(
                f"{self.path}: the machine restarted while this conversion was running, and "
                "its last batches may not have reached the disk intact; convert again with ",
                option("overwrite"),
            )

    def _open(self, progress: Progress, *, new: bool) -> None:
        if self.appending:
            check_room(self.path, progress.next_index)
        target = self._target()
        if new and self.building_aside:
            self._discard_aside()
        os.makedirs(target, exist_ok=True)
        if self._lease is None:  # (a discarded append left it open, and pinned)
            self._lease = open_writable(target, self._map_size, durable=self.appending)
        if self.appending and self._pin is None:
            self._pin_readers()
        if new:
            progress.boot_id = boot_id()
            state = progress.to_json()
            # the skipped entries the progress counts go with it (a copy starts with the source's
            # list): a run stopped before its first batch leaves a progress that reads back
            skipped = skipped_entries(progress.skipped, self._take_skipped(progress.skipped))

            def fill(txn: Any) -> None:
                txn.cursor().putmulti(skipped)
                txn.put(PROGRESS_KEY, state)

            self._commit(fill)

    def _discard_aside(self) -> None:
        shutil.rmtree(self._aside_path, ignore_errors=True)

    def _discard_new(self) -> None:
        self._close_env()
        if self.building_aside:
            self._discard_aside()
            return
        for name in (DATA_FILE, LOCK_FILE):  # (close() then removes the folders it made)
            with suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))

    # -- appends in place
    #
    # NOTE [ Appends against readers ]
    #
    # Readers map the store without LMDB's lock table (they may not be able to write its lock
    # file), so LMDB cannot see them, and a commit may reuse pages that a reader is still
    # reading. Two rules keep every reader's bytes right, without a time margin:
    #
    # 1. An append holds a read transaction of the store as it found it (version V) for as long
    #    as it writes. LMDB reuses no page freed after its oldest reader began, so every version
    #    from V on stays intact while the append runs: a reader that began at V or later reads
    #    what it would have read.
    # 2. Pages freed before V (by an earlier append) may be reused. A reader that began before V
    #    may be on them, however long ago it began (a stopped process, a debugger). So, after
    #    taking its read transaction and before its first write, an append advances the append
    #    epoch (a counter in ``data.mdb``'s first page, mapped by every reader: "the append
    #    epoch" in ``env.py`` says why it lies there and not in a file of its own). A reader reads
    #    the epoch, begins its transaction, copies what it reads, and reads the epoch again
    #    (``Lease.read``): if it moved, an append may have begun writing while it read, and the
    #    read is done again in a new transaction (it sees V or later: rule 1). If it did not
    #    move, no append began: any append writing then began before the reader's transaction,
    #    so the reader is at its V or later.
    # 3. The append advances the epoch again once its last batch is committed (before it lets
    #    its read transaction go). A reader checks the tree's pages before LMDB is sent to them
    #    (NOTE [ Damaged branches ] in ``lease.py``), once per epoch: one that checked them after
    #    the first advance saw the tree as it was before the append's commits, whose new branches
    #    and leaves LMDB meets from then on; the second advance has it check the tree as the
    #    append left it. (Between the two, a reader checks the tree as it found it: the pages the
    #    append writes meanwhile are LMDB's own, met unchecked until the append ends.)
    #
    # The first append to a store never reuses a page a reader needs (pages freed before the
    # store was complete belong to versions without metadata, which readers never read); pages
    # freed by a conversion or a replacement belong to such versions too. The epoch is a live
    # signal between processes of one machine (one page cache), as LMDB itself is.
    #
    # Power loss: an append writes into the complete store, so its commits are durable (LMDB's
    # sync: the pages, then the meta page that points at them, each flushed): a crash at any
    # point leaves the store as it was, or with some of the append's batches (unseen by readers
    # until the metadata is written), never damaged. Conversions and replacements write stores
    # that readers do not read until they are complete, and are flushed once, before their
    # metadata (see ``open_writable``).

    _pin: Any = None

    def _pin_readers(self) -> None:
        assert self._lease is not None, "_open() opens the store"
        self._pin = self._lease.env.begin()
        bump_epoch(self._lease)  # after the pin, before any write (see the note above)

    def _kept_skipped(self, base: StoreMeta) -> int:
        """The store's skipped entries are kept as keys, except in stores of the first format,
        which kept the list in their metadata: an append writes it out as keys."""
        if not base.skipped_count:
            return 0
        lease = open_reader(self.path)
        try:
            with reading(self.path), lease.env.begin() as txn:
                return base.skipped_count if txn.get(skipped_key(0)) is not None else 0
        finally:
            lease.release()

    def _discard_append(self, base: StoreMeta, pending: Progress) -> None:
        self._lease = open_writable(self.path, self._map_size, durable=True)
        self._pin_readers()

        def fill(txn: Any) -> None:
            # an append whose saved progress is damaged, or whose skipped list is, says nothing
            # (or not all) of what it wrote: the records, headers and skipped entries past the
            # store up to the first gap are its (another tool's past a gap stay)
            if pending.source and not pending.unreadable:
                past = [
                    key
                    for i in range(base.count, pending.next_index)
                    for key in (record_key(i), header_key(i))
                ]
                past += [skipped_key(n) for n in range(base.skipped_count, len(pending.skipped))]
            else:
                past = keys_past(txn, base.count, base.skipped_count)
            for key in past:
                txn.delete(key)
            txn.delete(PROGRESS_KEY)

        # the pin stays for the append that follows: the pages freed here stay untouched too
        self._commit(fill)

    def open_reader(self) -> StoreReader:
        return LMDBStore(self.path)

    def written_names(self, count: int) -> PackedStrings:
        assert self._lease is not None and not self.appending, "a resumed conversion's"
        return PackedStrings.from_joined(index_of_names(self._lease.env, count, self._target()))

    def build_columns(self) -> StoreMeta:
        """Build the complete store's columns and its index of names again from its records'
        headers, in place (a store written before fastdata kept them, or whose columns or index
        is damaged), as an append writes: readers read on, and see the new columns once they
        are whole. Its records, metadata and id do not change. Use inside ``with``: the lock is
        released on leaving.

        Raises:
            StoreNotFoundError, StoreError: no complete store here, an interrupted conversion,
                replacement or append in the way (named, with the command that finishes it).
            StoreLockedError: another writer holds the store.
        """
        from ..existing import refuse_unfinished

        found = self._lock_and_look()
        refuse_unfinished(self, found, "building its columns")
        assert found.meta is not None
        self._lease = open_writable(self.path, self._map_size, durable=True)
        self._pin_readers()
        target = self.path
        self._commit(lambda txn: txn.delete(COLUMNS_KEY))  # (readers read the headers meanwhile)
        columns, stale = finish_columns(
            self._lease.env, self._commit, found.meta.schema, found.meta.count, target
        )
        names = index_of_names(self._lease.env, found.meta.count, target)
        try:
            self._lease.env.sync(True)
        except lmdb.Error as exc:
            raise _write_failed(target, exc) from None

        def fill(txn: Any) -> None:
            for key in stale:
                txn.delete(key)
            txn.cursor().putmulti(columns)
            txn.put(NAMES_KEY, names)

        self._commit(fill)
        return found.meta

    def _promote(self) -> None:
        self._close_env()
        source = data_file(self._aside_path)
        try:
            fsync_file(source)
            # One rename: a reader opening the store gets the old file or the new one, whole;
            # readers that have the old one mapped keep reading it.
            os.replace(source, data_file(self.path))
            fsync_file(self.path)
        except OSError as exc:
            raise StoreError(
                f"{self.path}: could not move the new store into place: {exc.strerror or exc}; "
                "the old store is unchanged: fix the cause and run ",
                SAME_COMMAND,
                " with ",
                option("resume"),
            ) from None
        self._discard_aside()

    def _commit(self, fill: Callable[[Any], None]) -> None:
        assert self._lease is not None, "start() opens the store"
        env = self._lease.env
        while True:
            try:
                with env.begin(write=True) as txn:
                    fill(txn)
                return
            except lmdb.MapFullError:
                size = env.info()["map_size"] * 2
                log.info("%s: map full, growing it to %d MiB", self.path, size >> 20)
                env.set_mapsize(size)
            except lmdb.Error as exc:
                raise _write_failed(self._target(), exc) from None

    def write(self, records: Sequence[Record], progress: Progress) -> None:
        data = [(record_key(r.index), r.data) for r in records]
        headers = [(header_key(r.index), r.header.to_json()) for r in records]
        skipped = skipped_entries(progress.skipped, self._take_skipped(progress.skipped))
        progress.boot_id = boot_id()
        state = progress.to_json()

        def fill(txn: Any) -> None:
            # One call per batch: a put per record would hand the GIL back and forth with the
            # reader threads for every image, and wait out the switch interval each time.
            cursor = txn.cursor()
            # at the end of the B-tree (MDB_APPEND) in a new store; an append goes before the
            # metadata keys, which sort after the records
            _, added = cursor.putmulti(data, overwrite=False, append=not self.appending)
            if added != len(data):
                raise taken(self.path, self._target(), records[0].index, self.appending)
            cursor.putmulti(headers + skipped)
            txn.put(PROGRESS_KEY, state)

        self._commit(fill)

    def _count_records(self, count: int) -> str | None:
        """Records and headers are exactly the keys of ``0 .. count-1``: the last ones are
        there, nothing lies past them, and the entries add up (every other key counted)."""
        assert self._lease is not None, "start() opens the store"
        lease = self._lease
        with reading(self.path), lease.env.begin() as txn:
            return records_problem(txn, int(lease.env.stat()["entries"]), count, exact=True)

    def _write_meta(self, done: Completion) -> None:
        meta, labels, skipped, names = done.meta, done.labels, done.skipped, done.names
        assert self._lease is not None, "start() opens the store"
        skipped_items = skipped_entries(skipped, self._take_skipped(skipped))
        # the columns' blocks no reader reads yet are written now, before the sync
        columns, old_columns = finish_columns(
            self._lease.env, self._commit, meta.schema, meta.count, self._target()
        )
        try:
            self._lease.env.sync(True)  # every record on disk before the metadata says it's whole
        except lmdb.Error as exc:
            raise _write_failed(self._target(), exc) from None
        count = meta.count
        keys = record_key_list(count)
        label_bytes = np.asarray(labels, dtype=LABEL_DTYPE).tobytes()

        whole = names is not None and (names.count(b"\0") + 1 if names else 0) == count
        names_value = names if whole else None

        stale = [skipped_key(n) for n in range(len(skipped), self._skipped_stale)]
        stale += old_columns

        def fill(txn: Any) -> None:
            txn.cursor().putmulti(skipped_items)
            for key in stale:
                txn.delete(key)
            if names_value is not None:
                txn.put(NAMES_KEY, names_value)
            else:
                txn.delete(NAMES_KEY)  # an index of other records would mislead
            txn.put(LABELS_KEY, label_bytes)
            txn.put(LEN_KEY, str(count).encode("ascii"))
            txn.put(KEYS_KEY, keys)
            txn.cursor().putmulti(columns)
            txn.put(META_KEY, meta.to_json())

        self._commit(fill)
        try:
            ensure_epoch(self.path)  # readers of earlier versions map it when they open it
        except OSError as exc:
            raise _write_failed(self.path, exc) from None

    def _close_env(self) -> None:
        pin, self._pin = self._pin, None
        if pin is not None:
            if self._lease is not None:  # its writes are done (NOTE [ Appends against readers ], 3)
                with suppress(StoreError):  # (replaced meanwhile: readers open the new file)
                    bump_epoch(self._lease)
            pin.abort()
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            lease.env.sync(True)
        except lmdb.Error as exc:
            raise _write_failed(self._target(), exc) from None
        finally:
            lease.release()
        with suppress(OSError, StoreError):
            lmdb_file.pad(data_file(self._target()))

    _created: tuple[Path, ...] = ()
    _lock_created = False

    def _nothing_here(self) -> bool:
        return not any(
            os.path.exists(data_file(folder)) for folder in (self.path, self._aside_path)
        )

    def close(self) -> None:
        """Flush and close the store, then release the writer lock (even if flushing fails);
        a folder this writer created and wrote no store into is removed."""
        try:
            self._close_env()
        finally:
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                if (self._created or self._lock_created) and not os.path.exists(
                    data_file(self.path)
                ):
                    with suppress(OSError):
                        os.unlink(writer_lock(self.path))
                    for folder in self._created:  # deepest first; only while empty
                        with suppress(OSError):
                            os.rmdir(folder)
                os.close(fd)  # releases the flock


def _write_failed(where: str, exc: BaseException) -> WriteFailedError:
    """A failed write, said with the cause a full disk hides: LMDB meets some (a full tmpfs,
    mostly) as an I/O error, whose text would send the user to check the disk for faults."""
    said = str(exc)
    if "No space left" not in said and no_space_left(where):
        said += " (the file system holding the store has no space left)"
    return WriteFailedError(f"{where}: writing the store failed: {said}")
