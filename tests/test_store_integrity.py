"""An LMDB store is never mixed, half-replaced or silently wrong, under the operations users run:
a second conversion, a resume from the wrong folder, an overwrite while training reads, two
writers at once, a kill at any point, a full disk."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shlex
import shutil
import signal
import time
from pathlib import Path

import lmdb
import pytest

from fastdata import LMDBImageDataset, convert, export_store, open_store
from fastdata.errors import (
    IncompleteStoreError,
    SourceError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
    StoreReplacedError,
    UnsafePathError,
)

from .conftest import jpeg_bytes, snapshot, write
from .procs import HOLDING_CONVERT, KILLED_CONVERT, cli, run_script, script, wait_for

SIZES = ((40, 30), (20, 50))


def sized_folder(root: Path, classes: tuple[str, str], per_class: int, swap: bool) -> Path:
    """Two classes whose images have a size of their own (swapped with ``swap``), so that an
    image read with the wrong store's label shows it."""
    for label, cls in enumerate(classes):
        w, h = SIZES[label ^ swap]
        for i in range(per_class):
            write(root / cls / f"{i:04d}.jpg", jpeg_bytes(w, h, seed=i + 100 * label))
    return root


@pytest.fixture
def folder_a(tmp_path: Path) -> Path:
    return sized_folder(tmp_path / "A", ("a0", "a1"), 30, swap=False)


@pytest.fixture
def folder_b(tmp_path: Path) -> Path:
    return sized_folder(tmp_path / "B", ("b0", "b1"), 24, swap=True)


def exported(store: Path, tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / f"export-{time.monotonic_ns()}"
    reader = open_store(store)
    export_store(reader, out)
    reader.close()
    return snapshot(out)


def records(store: Path) -> list[tuple[object, bytes]]:
    reader = open_store(store)
    try:
        return [(r.header, r.data) for r in reader.iter_records()]
    finally:
        reader.close()


# -------------------------------------------------------------- a second conversion, a resume


def test_second_conversion_into_a_store_is_refused_even_with_resume(
    folder_a: Path, folder_b: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    before = exported(dst, tmp_path)
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        convert(folder_b, dst)
    with pytest.raises(StoreExistsError, match=r"complete store converted from .*A"):
        convert(folder_b, dst, resume=True)
    assert exported(dst, tmp_path) == before  # not one record of B got in


def test_resume_continues_only_the_same_conversion(
    folder_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    result = run_script(KILLED_CONVERT, folder_a, dst, 3)
    assert result.returncode == -signal.SIGKILL
    copy = tmp_path / "copy-of-A"
    shutil.copytree(folder_a, copy)  # same names and labels: the same fingerprint
    with pytest.raises(StoreError, match=r"started from .*A, not .*copy-of-A"):
        convert(copy, dst, resume=True)
    with pytest.raises(StoreError, match="without --verify-decode"):
        convert(folder_a, dst, resume=True, verify_decode=True)
    link = tmp_path / "link-to-A"
    link.symlink_to(folder_a)  # the same folder through a link is the same source
    report = convert(link, dst, resume=True)
    assert report.resumed_from > 0 and report.count == 60
    assert records(dst) == records(_fresh(folder_a, tmp_path))


def _fresh(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / f"fresh-{folder.name}.lmdb"
    if not dst.exists():
        convert(folder, dst)
    return dst


def test_a_conversion_killed_before_its_first_commit_says_resume(
    folder_a: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    result = run_script(KILLED_CONVERT, folder_a, dst, 0)
    assert result.returncode == -signal.SIGKILL
    with pytest.raises(IncompleteStoreError, match=r"stopped after 0 of 60 images.*--resume"):
        LMDBImageDataset(dst)
    info = cli("info", str(dst))
    assert info.returncode == 1 and "--resume" in info.stderr and "Traceback" not in info.stderr
    assert convert(folder_a, dst, resume=True).count == 60


# -------------------------------------------------------------- overwrite, atomically


def test_training_reads_while_another_process_overwrites(
    folder_a: Path, folder_b: Path, tmp_path: Path
) -> None:
    """A training loop keeps its consistent view or fails loudly: never A's labels on B's
    images."""
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    ready, replaced = tmp_path / "ready", tmp_path / "replaced"
    trainer = script(
        """
        import sys, time
        from pathlib import Path
        import numpy as np, torch
        from torch.utils.data import DataLoader
        from fastdata import LMDBImageDataset
        from fastdata.errors import StoreReplacedError

        store, ready, replaced = sys.argv[1:4]
        sizes = {0: (30, 40), 1: (50, 20)}  # (H, W) of each class in store A
        ds = LMDBImageDataset(store, output="numpy", transform=lambda a: torch.tensor(a.shape))
        def epoch(workers):
            loader = DataLoader(ds, batch_size=8, num_workers=workers, shuffle=True)
            seen = 0
            for shapes, labels in loader:
                for shape, label in zip(shapes.tolist(), labels.tolist()):
                    assert tuple(shape[:2]) == sizes[label], ("mixed", shape, label)
                    seen += 1
            return seen
        assert epoch(0) == 60
        Path(ready).touch()
        while not Path(replaced).exists():
            assert epoch(0) == 60  # this process keeps reading the store it opened
        assert epoch(0) == 60
        try:
            epoch(2)  # new workers open the store again: it is not the one opened
        except StoreReplacedError as exc:
            print("replaced:", exc)
        else:
            print("workers read the replaced store")
        """,
        dst,
        ready,
        replaced,
    )
    wait_for(ready, trainer)
    result = cli("convert", str(folder_b), str(dst), "--overwrite", "-q")
    assert result.returncode == 0, result.stderr
    replaced.touch()
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, err
    assert "replaced: " in out and "create the dataset" in out
    assert LMDBImageDataset(dst).classes == ["b0", "b1"]
    assert records(dst) == records(_fresh(folder_b, tmp_path))
    ids = [cli("info", str(store), "--json").stdout for store in (dst, _fresh(folder_b, tmp_path))]
    assert len({json.loads(i)["id"] for i in ids}) == 2  # every conversion has its own id


def test_kill_during_overwrite_leaves_the_old_store_whole(
    folder_a: Path, folder_b: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    before = exported(dst, tmp_path)
    result = run_script(KILLED_CONVERT, folder_b, dst, 4, "--overwrite")
    assert result.returncode == -signal.SIGKILL
    assert exported(dst, tmp_path) == before  # readable, and exactly what it was
    assert open_store(dst).meta.classes == ["a0", "a1"]
    with pytest.raises(StoreExistsError, match="replacement of it was interrupted"):
        convert(folder_b, dst)
    report = convert(folder_b, dst, resume=True)  # finishes the replacement
    assert report.resumed_from > 0
    assert records(dst) == records(_fresh(folder_b, tmp_path))
    assert not (dst / ".replacement").exists()


def test_a_failed_overwrite_leaves_the_old_store(folder_a: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    before = exported(dst, tmp_path)
    empty = tmp_path / "unusable"
    write(empty / "c" / "x.jpg", b"")  # nothing usable: the overwrite fails
    with pytest.raises(SourceError, match="none of its 1 images"):
        convert(empty, dst, overwrite=True)
    assert exported(dst, tmp_path) == before
    convert(folder_a, tmp_path / "other.lmdb")
    assert convert(folder_a, dst, overwrite=True).count == 60  # a later overwrite starts over
    assert not (dst / ".replacement").exists()


def test_twenty_random_kills_then_resume_lose_and_duplicate_nothing(
    folder_a: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    assert run_script(KILLED_CONVERT, folder_a, dst, 1).returncode == -signal.SIGKILL
    rng = random.Random(7)
    code = KILLED_CONVERT.replace("commits = ", "commits = 10**9 or ")  # killed from outside
    for _ in range(20):
        proc = script(code, folder_a, dst, 0, "--resume")
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    report = convert(folder_a, dst, resume=True)
    assert report.count == 60
    assert records(dst) == records(_fresh(folder_a, tmp_path))


def test_ctrl_c_keeps_what_was_committed(folder_a: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    result = run_script(
        """
        import os, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
        from fastdata.stores.lmdb.writer import LMDBWriter
        from fastdata.cli import main
        real = LMDBWriter.write
        calls = [0]
        def write(self, records, progress):
            real(self, records, progress)
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C
        LMDBWriter.write = write
        import fastdata.ops.convert
        fastdata.ops.convert.convert.__kwdefaults__["commit_records"] = 4  # several commits
        sys.argv = ["fastdata", "convert", sys.argv[1], sys.argv[2], "-q", "-j", "1"]
        main()
        """,
        folder_a,
        dst,
    )
    assert result.returncode == 130 and "--resume" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(IncompleteStoreError):
        open_store(dst)
    result = cli("convert", str(folder_a), str(dst), "--resume", "-q")
    assert result.returncode == 0 and "resumed after" in result.stdout
    assert records(dst) == records(_fresh(folder_a, tmp_path))


# -------------------------------------------------------------- one writer at a time


def test_two_conversions_racing_on_one_store(
    folder_a: Path, folder_b: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, dst, started, go)
    wait_for(started, first)
    for extra in ([], ["--overwrite"], ["--resume"]):
        second = cli("convert", str(folder_b), str(dst), "-q", *extra)
        assert second.returncode == 1, second.stderr
        assert "another conversion is writing this store" in second.stderr
        assert f"pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
    go.touch()
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert records(dst) == records(_fresh(folder_a, tmp_path))  # nothing of B, nothing lost


def test_a_store_being_written_is_said_to_be_written_not_stopped(
    folder_a: Path, tmp_path: Path
) -> None:
    """Opened while its conversion runs, a store is named as being written, by whom, and not
    as stopped with a resume to run (which the writer lock would refuse); once the writer is
    gone, the resume is what it says."""
    dst = tmp_path / "s.lmdb"
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, dst, started, go)
    wait_for(started, first)
    shown = cli("info", str(dst))
    assert shown.returncode == 1 and "Traceback" not in shown.stderr
    assert f"being written now (pid {first.pid} on host" in shown.stderr, shown.stderr
    assert "--resume" not in shown.stderr and "stopped" not in shown.stderr
    first.send_signal(signal.SIGKILL)
    first.communicate()
    stopped = cli("info", str(dst))
    assert (
        "its conversion stopped after" in stopped.stderr and "being written" not in stopped.stderr
    )
    assert "--resume" in stopped.stderr


def test_the_lock_dies_with_its_holder(folder_a: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    started, go = tmp_path / "started", tmp_path / "go"
    first = script(HOLDING_CONVERT, folder_a, dst, started, go)
    wait_for(started, first)
    with pytest.raises(StoreLockedError):
        convert(folder_a, dst, resume=True)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert convert(folder_a, dst, resume=True).count == 60  # the kernel released the flock


# -------------------------------------------------------------- handles in one process


def test_a_dataset_open_in_this_process_and_a_conversion_to_its_path(
    folder_a: Path, folder_b: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    ds = LMDBImageDataset(dst, output="bytes")
    old = [ds[i] for i in range(len(ds))]
    with pytest.raises(StoreExistsError, match="overwrite=True"):  # not lmdb's "already open"
        convert(folder_b, dst)
    convert(folder_b, dst, overwrite=True)
    assert [ds[i] for i in range(len(ds))] == old  # the open dataset keeps its view
    assert len(LMDBImageDataset(dst)) == 48  # a new one sees the new store
    ds.close()
    with pytest.raises(StoreReplacedError, match="create the dataset"):
        ds[0]  # reopened: no longer the store it opened


def test_the_environment_is_opened_once(
    folder_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    opened: list[str] = []
    real = lmdb.open

    def counting(path, **kw):  # type: ignore[no-untyped-def]
        opened.append(path)
        return real(path, **kw)

    monkeypatch.setattr(lmdb, "open", counting)
    ds = LMDBImageDataset(dst)
    ds[0]
    ds.__getitems__([1, 2, 3])
    LMDBImageDataset(dst)[5]  # a second dataset shares the handle
    assert len(opened) == 1


def open_data_files(store: Path) -> int:
    target = os.path.realpath(store / "data.mdb")
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_dropped_dataset_releases_its_file_descriptors(folder_a: Path, tmp_path: Path) -> None:
    dst = tmp_path / "s.lmdb"
    convert(folder_a, dst)
    a, b = LMDBImageDataset(dst), LMDBImageDataset(dst, output="bytes")
    a[0], b[1]
    assert open_data_files(dst) >= 1
    del a
    gc.collect()
    assert b[2][1] == 0 and open_data_files(dst) >= 1  # b still holds it
    del b
    gc.collect()
    assert open_data_files(dst) == 0


# -------------------------------------------------------------- paths, full disks


def test_destination_inside_the_source_through_a_link_is_refused(
    folder_a: Path, tmp_path: Path
) -> None:
    before = snapshot(folder_a)
    link = tmp_path / "elsewhere"
    link.symlink_to(folder_a / "a0")
    with pytest.raises(SourceError, match="inside the source folder"):
        convert(folder_a, link / "store.lmdb")
    assert snapshot(folder_a) == before and not (folder_a / "a0" / "store.lmdb").exists()


def test_a_full_disk_during_conversion_ends_in_one_line_and_resumes(
    folder_a: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "s.lmdb"
    result = cli("convert", str(folder_a), str(dst), "-q", fsize=64 << 10)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    # LMDB reports the short write as an I/O error
    assert len(lines) == 1 and "writing the store failed" in lines[0] and "--resume" in lines[0]
    result = cli("convert", str(folder_a), str(dst), "--resume", "-q")
    assert result.returncode == 0, result.stderr
    assert records(dst) == records(_fresh(folder_a, tmp_path))


KILLED_EXPORT = """
    import os, signal, sys
    import fastdata.ops.export_files as export_files
    from fastdata import export_store, open_store

    written, write_all = [0], export_files._write_all

    def dying(fd, data):  # the fifth file: half of it written, then the process is killed
        written[0] += 1
        if written[0] == 5:
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write_all(fd, data)

    export_files._write_all = dying
    export_store(open_store(sys.argv[1]), sys.argv[2])
"""


def test_an_export_killed_while_writing_a_file_resumes_to_every_file_whole(
    folder_a: Path, tmp_path: Path
) -> None:
    dst, out = tmp_path / "s.lmdb", tmp_path / "out"
    convert(folder_a, dst)
    killed = run_script(KILLED_EXPORT, dst, out)
    assert killed.returncode == -signal.SIGKILL
    source = snapshot(folder_a)
    written = snapshot(out)
    whole = {name: data for name, data in written.items() if source.get(name) == data}
    assert len(whole) == 4  # four whole files under their names
    (temporary,) = set(written) - set(whole)  # and the fifth half written, under another name
    assert os.path.basename(temporary).startswith(".fastdata-")
    assert any(data.startswith(written[temporary]) for data in source.values())
    again = cli("export", str(dst), str(out), "-q")  # without --resume: refused, says how
    assert again.returncode == 2 and "--resume" in again.stderr
    result = cli("export", str(dst), str(out), "--resume", "-q")
    assert result.returncode == 0, result.stderr
    assert snapshot(out) == source  # (the killed export's temporary file removed)


INTERRUPTED_EXPORT = """
    import os, signal, sys
    import fastdata.ops.export_files as export_files
    from fastdata.cli import main

    signalled, write_all, written = sys.argv[1], export_files._write_all, [0]

    def waiting(fd, data):  # the fifth file: half of it written, then Ctrl-C is waited for
        written[0] += 1
        if written[0] == 5:
            os.write(fd, data[: len(data) // 2])
            open(signalled, "w").close()
            signal.pause()
        write_all(fd, data)

    export_files._write_all = waiting
    sys.argv = ["fastdata", *sys.argv[2:]]
    main()
"""


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("mongodb", marks=pytest.mark.mongo)])
def test_ctrl_c_during_export_leaves_every_file_whole_and_prints_how_to_finish(
    folder_a: Path, tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    out = tmp_path / "it's out"  # (a name the shell needs quoted)
    if backend == "lmdb":
        dst, store = str(tmp_path / "s.lmdb"), []
    else:  # words the shell needs quoted too
        dst = request.getfixturevalue("mongo_uri") + "?appName=x&connectTimeoutMS=20000"
        store = ["--collection", "big coll"]
    convert(folder_a, dst, collection=store[1] if store else None)
    signalled = tmp_path / "signalled"
    args = ("export", dst, *store, out, "--repaired", "-q")
    proc = script(INTERRUPTED_EXPORT, signalled, *args)
    wait_for(signalled, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    source = snapshot(folder_a)
    written = snapshot(out)
    assert len(written) == 4 and all(source[name] == data for name, data in written.items())
    printed = re.search(r"run `(fastdata export [^`]+)` to finish", err)
    assert printed is not None, err
    words = shlex.split(printed.group(1))
    assert words[2:4] == [dst, str(out)] and "--repaired" in words and "--resume" in words
    result = cli(*words[1:])
    assert result.returncode == 0, result.stderr
    assert "kept 4 files that were already complete" in result.stdout
    assert snapshot(out) == source


def test_a_resume_completes_only_files_that_hold_a_prefix_of_their_bytes(
    folder_a: Path, tmp_path: Path
) -> None:
    dst, out = tmp_path / "s.lmdb", tmp_path / "out"
    convert(folder_a, dst)
    export_store(open_store(dst), out)
    exported = snapshot(out)
    first, second = sorted(exported)[:2]
    (out / first).write_bytes(exported[first][:100])  # a killed export's
    (out / second).write_bytes(b"mine" + exported[second][4:50])  # someone's own, shorter
    with pytest.raises(StoreExistsError, match="differs from the record"):
        export_store(open_store(dst), out, resume=True)
    assert (out / second).read_bytes()[:4] == b"mine"  # left as it was
    report = export_store(open_store(dst), out, resume=True, overwrite=True)
    # the partial file was completed by whichever run reached it first; the other replaced
    assert report.files + report.kept == len(exported) and report.files in (1, 2)
    assert snapshot(out) == exported


def test_a_full_disk_during_export_leaves_no_partial_file(folder_a: Path, tmp_path: Path) -> None:
    dst, out = tmp_path / "s.lmdb", tmp_path / "out"
    write(folder_a / "a0" / "0010-big.jpg", jpeg_bytes(300, 300, seed=5))
    convert(folder_a, dst)
    result = cli("export", str(dst), str(out), "-q", fsize=8192)  # the big one does not fit
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0] and "--resume" in lines[0]
    written = snapshot(out)
    source = snapshot(folder_a)
    assert 0 < len(written) < len(source)
    assert all(source[name] == data for name, data in written.items())  # every file whole
    result = cli("export", str(dst), str(out), "--resume", "-q")
    assert result.returncode == 0, result.stderr
    assert snapshot(out) == source


def test_an_export_makes_no_folder_outside_its_own_and_replaces_long_names(
    tmp_path: Path,
) -> None:
    src, dst, out = tmp_path / "src", tmp_path / "s.lmdb", tmp_path / "out"
    long_name = "x" * 251 + ".jpg"  # 255 bytes: no room for a longer temporary name
    write(src / "c0" / "sub" / "deep" / "0.jpg", jpeg_bytes(40, 30, seed=1))
    write(src / "c1" / long_name, jpeg_bytes(40, 30, seed=2))
    convert(src, dst)
    outside = tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    (out / "c0").symlink_to(outside)  # a link that leads out of the export folder
    with pytest.raises(UnsafePathError, match="outside"):
        export_store(open_store(dst), out)
    assert list(outside.iterdir()) == []  # no folder made through the link
    (out / "c0").unlink()
    export_store(open_store(dst), out)
    report = export_store(open_store(dst), out, overwrite=True)
    assert report.files == 2 and snapshot(out) == snapshot(src)
