"""Damaged LMDB stores give one-line errors, never a crash, a traceback or a huge allocation, on
every path: open, ds[i], __getitems__, info, verify, export. Each damage is made with plain file
writes or the plain ``lmdb`` package, and each reader runs in its own process, so that a crash
(SIGBUS, SIGSEGV) shows as the process's death instead of killing the test run."""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from fastdata import convert
from fastdata.errors import StoreDamagedError
from fastdata.stores.lmdb.pages import advice, check_file
from fastdata.stores.lmdb.pages import format as lmdb_format
from fastdata.stores.lmdb.pages import tree as lmdb_tree
from fastdata.stores.reader import ScanBlock

from .conftest import jpeg_bytes, tiny_store, write
from .procs import child_env, cli, run_script

READ_ALL = """
    import sys
    from fastdata import LMDBImageDataset
    from fastdata.errors import FastdataError
    ok = failed = 0
    try:
        ds = LMDBImageDataset(sys.argv[1], output="bytes")
    except FastdataError as exc:
        print("open:", exc)
        raise SystemExit(0)
    for i in range(len(ds)):
        try:
            ds[i]
            ok += 1
        except FastdataError as exc:
            failed += 1
            print("read:", exc)
    try:
        ds.__getitems__(list(range(len(ds))))
    except FastdataError as exc:
        print("batch:", exc)
    print(f"ok {ok} failed {failed}")
"""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store of 240 small images over a B-tree of several levels."""
    src = tmp_path / "src"
    for c in range(3):
        for i in range(80):
            write(src / f"c{c}" / f"{i:04d}.jpg", jpeg_bytes(24, 16 + i % 9, seed=c * 100 + i))
    dst = tmp_path / "s.lmdb"
    convert(src, dst)
    return dst


def pages(data_file: Path, flags: int) -> list[int]:
    """The page numbers of the tree pages of one kind (leaf or branch)."""
    raw = data_file.read_bytes()
    head = check_file(str(data_file))
    return [
        n
        for n in range(2, head.last_page + 1)
        if struct.unpack_from("<QHH", raw, n * head.psize)[2] == flags
    ]


def smash(data_file: Path, page: int, offset: int, value: bytes) -> None:
    with open(data_file, "r+b") as f:
        f.seek(page * 4096 + offset)
        f.write(value)


def no_crash(result: object) -> None:
    rc, err = result.returncode, result.stderr  # type: ignore[attr-defined]
    assert rc >= 0, f"killed by signal {-rc}"
    assert "Traceback" not in err, err


def every_path(store: Path, tmp_path: Path) -> dict[str, object]:
    """Every way in: the dataset, info, verify and export, each in a new process."""
    results = {
        "read": run_script(READ_ALL, store),
        "info": cli("info", str(store)),
        "verify": cli("verify", str(store), "-q"),
        "export": cli("export", str(store), str(tmp_path / "out"), "-q"),
    }
    for result in results.values():
        no_crash(result)
    return results


def test_truncated_file(store: Path, tmp_path: Path) -> None:
    data_file = store / "data.mdb"
    os.truncate(data_file, data_file.stat().st_size // 2)
    results = every_path(store, tmp_path)
    assert "the file is truncated" in results["read"].stdout  # type: ignore[attr-defined]
    for name in ("info", "verify", "export"):
        result = results[name]
        assert result.returncode == 1 and "truncated" in result.stderr  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "what, kind, offset, value",
    [
        ("a leaf's bounds", lmdb_format.P_LEAF, 12, b"\xf0\xff"),
        ("a leaf's first node offset", lmdb_format.P_LEAF, 16, b"\xf0\xff"),
        ("a branch's first node offset", lmdb_format.P_BRANCH, 16, b"\xf0\xff"),
        ("a leaf overwritten with noise", lmdb_format.P_LEAF, 0, os.urandom(4096)),
    ],
)
def test_damaged_page(
    store: Path, tmp_path: Path, what: str, kind: int, offset: int, value: bytes
) -> None:
    data_file = store / "data.mdb"
    found = pages(data_file, kind)
    page = found[len(found) // 2]
    smash(data_file, page, offset, value)
    results = every_path(store, tmp_path)
    verify = results["verify"]
    assert verify.returncode == 1  # type: ignore[attr-defined]
    assert f"page {page}" in verify.stdout + verify.stderr  # type: ignore[attr-defined]
    assert "damaged" in verify.stdout + verify.stderr  # type: ignore[attr-defined]
    # LMDB matches keys exactly, so a read through the damage either fails, naming `fastdata
    # verify`, or finds the record itself (a branch's first key is never compared)
    read = results["read"].stdout  # type: ignore[attr-defined]
    assert "fastdata verify" in read or "ok 240 failed 0" in read


def test_a_value_whose_size_field_lies(store: Path, tmp_path: Path) -> None:
    """A node claiming a 4 GB value: copying it would read far past the file."""
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    page = pages(data_file, lmdb_format.P_LEAF)[3]
    first_node = struct.unpack_from("<H", raw, page * 4096 + 16)[0]
    smash(data_file, page, first_node, struct.pack("<I", 0xFFFFFFF0))
    results = every_path(store, tmp_path)
    assert "lies outside the file" in results["read"].stdout or "damaged" in (  # type: ignore[attr-defined]
        results["read"].stdout  # type: ignore[attr-defined]
    )
    assert results["verify"].returncode == 1  # type: ignore[attr-defined]


def test_a_large_value_whose_size_runs_past_the_end_of_the_file(tmp_path: Path) -> None:
    """A value on its own pages (an image over a page) whose node claims more bytes than the
    file holds past it: LMDB's reader touches every page of a value before it hands it over,
    which past the end of the file killed the process (SIGBUS) before any check could look."""
    src = tmp_path / "src"
    for i in range(40):
        write(src / "c" / f"{i:03d}.jpg", jpeg_bytes(120, 120, seed=i))  # several pages each
    store = tmp_path / "big.lmdb"
    convert(src, store)
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    firsts = []  # the first node of every leaf of records on their own pages (live or not)
    for page in pages(data_file, lmdb_format.P_LEAF):
        at = page * 4096 + struct.unpack_from("<H", raw, page * 4096 + 16)[0]
        flags, key_size = struct.unpack_from("<HH", raw, at + 4)
        if flags & 1 and raw[at + 8 : at + 9].isdigit():  # F_BIGDATA, a record's key
            firsts.append((page, at - page * 4096))
    assert firsts
    for claim in (len(raw) + 300_000, 0xFFFFFFF0):
        for page, offset in firsts:
            smash(data_file, page, offset, struct.pack("<I", claim))
        results = every_path(store, tmp_path)  # none killed (every_path checks)
        read = results["read"].stdout  # type: ignore[attr-defined]
        # (found by the leaf's check before LMDB is asked, or by the value's own check)
        assert "on pages outside the file" in read or "lies outside the file" in read, read
        assert results["verify"].returncode == 1  # type: ignore[attr-defined]
        data_file.write_bytes(raw)


def put(store: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(key, value)
    env.close()


def meta_with(store: Path, **changes: object) -> None:
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        meta = json.loads(txn.get(b"__fastdata__"))
    env.close()
    meta.update(changes)
    put(store, b"__fastdata__", json.dumps(meta).encode())


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"count": "240"}, "'count'"),
        ({"count": 10**12}, "labels for"),
        ({"classes": "c0"}, "'classes'"),
        ({"skipped": 7}, "'skipped'"),
        ({"skipped_count": -1}, "'skipped_count'"),
        ({"version": "1"}, "'version'"),
    ],
)
def test_damaged_metadata(store: Path, damage: dict[str, object], message: str) -> None:
    meta_with(store, **damage)
    result = cli("info", str(store))
    assert result.returncode == 1 and message in result.stderr
    assert "Traceback" not in result.stderr and "fastdata verify" in result.stderr


def test_labels_outside_the_classes(store: Path) -> None:
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        labels = bytearray(txn.get(b"__labels__"))
    env.close()
    labels[-4:] = struct.pack("<i", 2**31 - 1)  # info's per-class count would allocate 16 GB
    put(store, b"__labels__", bytes(labels))
    result = cli("info", str(store))
    assert result.returncode == 1 and "record 239 has label 2147483647" in result.stderr


def test_damaged_record_header(store: Path, tmp_path: Path) -> None:
    put(store, b"#0000000007", b'{"name": "c0/0007.jpg", "label": 0, "size": "big"}')
    results = every_path(store, tmp_path)
    verify = results["verify"]
    assert verify.returncode == 1  # type: ignore[attr-defined]
    assert "7 record 7: " in verify.stdout and "'size'" in verify.stdout  # type: ignore[attr-defined]
    assert results["export"].returncode == 1  # type: ignore[attr-defined]


def flip_a_byte(store: Path, key: bytes) -> None:
    """Damage one record's image bytes (its checksum then fails), through LMDB itself."""
    env = lmdb.open(str(store), map_size=1 << 26)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[-10] ^= 0xFF
        txn.put(key, bytes(value))
    env.close()


def test_export_refuses_a_record_that_fails_its_checksum(store: Path, tmp_path: Path) -> None:
    flip_a_byte(store, b"0000000005")
    out = tmp_path / "out"
    result = cli("export", str(store), str(out), "-q")
    assert result.returncode == 1
    assert "record 5 (c0/0005.jpg) fails its checksum" in result.stderr
    assert not (out / "c0" / "0005.jpg").exists()
    result = cli("export", str(store), str(out), "-q", "--resume", "--skip-damaged")
    assert result.returncode == 1 and "left out 1 damaged record(s)" in result.stdout
    assert len(list(out.rglob("*.jpg"))) == 239 and not (out / "c0" / "0005.jpg").exists()


def test_a_pickle_store_with_an_absurd_label(tmp_path: Path) -> None:
    import pickle

    from fastdata import LMDBImageDataset
    from fastdata.errors import StoreError

    path = tmp_path / "legacy.lmdb"
    env = lmdb.open(str(path), subdir=False, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"0", pickle.dumps((jpeg_bytes(), 2**40)))  # a list of 2**40 class names?
        txn.put(b"__keys__", pickle.dumps([b"0"]))
    env.close()
    ds = LMDBImageDataset(path, allow_pickle=True)
    with pytest.raises(StoreError, match="label 1099511627776 is out of range"):
        ds.classes


def big_store(tmp_path: Path, n: int = 30) -> Path:
    """A store whose images each lie on pages of their own (LMDB's overflow pages)."""
    src = tmp_path / "big"
    for i in range(n):
        write(src / "c" / f"{i:03d}.jpg", jpeg_bytes(120, 120, seed=i))
    store = tmp_path / "big.lmdb"
    convert(src, store)
    return store


def test_a_damaged_page_under_an_image_is_found(tmp_path: Path) -> None:
    """An image's own pages begin with a header LMDB never checks: overwritten, the image still
    reads back whole, so only the file's own check can tell that the page is not what the tree
    says it is."""
    store = big_store(tmp_path)
    data_file = store / "data.mdb"
    overflow = pages(data_file, lmdb_format.P_OVERFLOW)
    assert len(overflow) >= 30
    page = overflow[len(overflow) // 2]
    smash(data_file, page, 0, struct.pack("<Q", 7))  # its page number
    result = cli("verify", str(store), "-q")
    no_crash(result)
    assert result.returncode == 1, result.stdout
    out = result.stdout + result.stderr
    assert f"page {page} (the value of key 0000000015): damaged (its header says page 7)" in out
    assert "1 of 30 records failed (29 read)" in out and "damaged page" in out, out


def test_keys_out_of_order_are_damage(store: Path) -> None:
    """A record's key whose digits changed on the page: LMDB's search goes wrong around it."""
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    for page in pages(data_file, lmdb_format.P_LEAF):
        at = page * 4096 + struct.unpack_from("<H", raw, page * 4096 + 16)[0]
        if raw[at + 8 : at + 9].isdigit():  # a leaf of records: its first key made the largest
            smash(data_file, page, at + 8 - page * 4096, b"9")
            break
    result = cli("verify", str(store), "-q")
    no_crash(result)
    assert result.returncode == 1
    assert f"page {page}" in result.stdout and "out of order" in result.stdout, result.stdout


def test_damage_past_the_listed_pages_is_counted(store: Path) -> None:
    data_file = store / "data.mdb"
    leaves = pages(data_file, lmdb_format.P_LEAF)
    for page in leaves[:12]:
        smash(data_file, page, 0, struct.pack("<Q", 1))
    found = lmdb_tree.walk(str(data_file))
    assert len(found) >= 3  # (some leaves are pages of earlier versions, no longer in the tree)
    with lmdb_tree.Tree(str(data_file), limit=2) as tree:
        assert sum(1 for _ in tree.entries()) < 480  # (the entries under them are not given)
        assert tree.damage == found[:2] and tree.more == len(found) - 2


def test_an_append_during_verify_is_not_taken_for_damage(tmp_path: Path) -> None:
    """An append may reuse pages a check has yet to read: the check is refused, not reported
    as damage, and the command it prints checks the store once the append is done."""
    from fastdata import open_store
    from fastdata.errors import StoreError
    from fastdata.ops.verify import verify_store
    from fastdata.stores.reader import ScanBlock

    store = big_store(tmp_path)
    more = tmp_path / "more"
    for i in range(5):
        write(more / "c" / f"new{i}.jpg", jpeg_bytes(120, 120, seed=100 + i))
    reader = open_store(store)
    damage: list[str] = []
    scan = reader.scan_records(damage)
    first = next(scan)  # the check has begun: a block of records, or one record, all sound
    assert isinstance(first, ScanBlock) or first[3] is None
    appended = cli("convert", str(more), str(store), "--append", "-q")
    assert appended.returncode == 0, appended.stderr
    with pytest.raises(StoreError, match="an append began while") as caught:
        for _ in scan:
            pass
    assert not damage
    command = str(caught.value).split("`")[1]
    result = subprocess.run(command, shell=True, capture_output=True, text=True, env=_cli_env())
    assert result.returncode == 0 and "35 records OK" in result.stdout, result.stdout
    reader.close()
    assert verify_store(open_store(store)).ok


def _cli_env() -> dict[str, str]:
    """An environment where `fastdata` on the PATH is this checkout's."""
    import sys

    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent)])
    return env


def test_the_read_ahead_of_a_large_file_changes_nothing(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files over twice the read-ahead window are read ahead by a thread (here a window of a
    few pages stands in for a large store): the walk sees the same entries and the same damage,
    and the thread is gone once the walk is closed, finished or not."""
    import threading

    data_file = store / "data.mdb"
    leaf = pages(data_file, lmdb_format.P_LEAF)[-3]
    smash(data_file, leaf, 0, struct.pack("<Q", 1))
    with lmdb_tree.Tree(str(data_file)) as tree:
        plain, plain_damage = list(tree.entries()), tree.damage
    assert plain_damage and len(plain) > 240
    monkeypatch.setattr(advice, "AHEAD", 8 * 4096)
    monkeypatch.setattr(advice, "AHEAD_CHUNK", 4096)
    started: list[threading.Thread] = []

    class Counted(advice.ReadAhead):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            started.append(self._thread)

    monkeypatch.setattr(advice, "ReadAhead", Counted)
    with lmdb_tree.Tree(str(data_file)) as tree:
        assert list(tree.entries()) == plain and tree.damage == plain_damage
    assert len(started) == 1  # (it may have reached the end of the file before the walk did)
    with lmdb_tree.Tree(str(data_file)) as tree:
        next(tree.entries())  # left after one entry
    assert len(started) == 2 and not any(t.is_alive() for t in started)
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


PARALLEL = """
    import json, os, sys
    from fastdata import open_store
    from fastdata.ops import verify
    if sys.argv[2] == "die":  # the process checking the second part dies
        check = verify._check_range
        def dying(reader, report, damage, index, start, *args):
            if start:
                os._exit(3)
            return check(reader, report, damage, index, start, *args)
        verify._check_range = dying
    seen = []
    reader = open_store(sys.argv[1])
    processes = verify._processes(reader, len(reader), int(sys.argv[3]))
    try:
        report = verify.verify_store(
            reader, workers=int(sys.argv[3]),
            progress=lambda done, total: seen.append((done, total)),
        )
    except Exception as exc:
        print(json.dumps({"error": str(exc)}))
        raise SystemExit(0)
    print(json.dumps({
        "failures": [[f.index, f.name, f.reason] for f in report.failures],
        "pages": report.damaged_pages, "checked": report.checked, "last": seen[-1],
        "processes": processes,
    }))
"""


def test_verify_in_several_processes_finds_what_one_does(store: Path) -> None:
    data_file = store / "data.mdb"
    names = value_page(data_file, b"__names__")  # (a page the first process alone checks)
    for page in [*pages(data_file, lmdb_format.P_LEAF)[-6:], names]:  # (some in the tree)
        smash(data_file, page, 0, struct.pack("<Q", 1))
    flip_a_byte(store, b"0000000005")
    one = json.loads(run_script(PARALLEL, store, "-", 1).stdout)
    three = json.loads(run_script(PARALLEL, store, "-", 3).stdout)
    assert one["pages"] and [5, "c0/0005.jpg", "checksum mismatch"] in one["failures"]
    assert three.pop("processes") == 3 and one.pop("processes") == 1  # (-j 256: also 3, 240 // 64)
    assert one == three and three["last"] == [240, 240]
    by_cli = [cli("verify", str(store), "-q", "-j", j) for j in ("1", "3")]
    assert by_cli[0].returncode == by_cli[1].returncode == 1
    assert by_cli[0].stdout == by_cli[1].stdout


def test_a_checking_process_that_dies_is_named(store: Path) -> None:
    found = json.loads(run_script(PARALLEL, store, "die", 2).stdout)
    assert "the process checking records 120 to 239 ended without a report" in found["error"]
    assert "(exit code 3)" in found["error"]
    command = found["error"].split("`")[1]
    assert command.startswith("fastdata verify --workers 1 ")
    result = subprocess.run(command, shell=True, capture_output=True, text=True, env=_cli_env())
    assert result.returncode == 0 and "240 records OK" in result.stdout, result.stdout


def test_verify_stays_in_one_process_beside_other_threads(store: Path) -> None:
    """Forking a process with other threads running can leave the child stuck on a lock one
    of them held: then the check runs here."""
    import threading

    from fastdata import open_store
    from fastdata.ops.verify import _processes

    reader = open_store(store)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert _processes(reader, 1_000_000, None) == 1
        assert _processes(reader, 1_000_000, 4) == 1
    finally:
        release.set()
        other.join()
    reader.close()


def nodes(data_file: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """Every node of every leaf page (live or not): its page, its offset in the page, its
    flags and its key."""
    raw = data_file.read_bytes()
    for page in pages(data_file, lmdb_format.P_LEAF):
        base = page * 4096
        lower = struct.unpack_from("<H", raw, base + 12)[0]
        for n in range((lower - 16) // 2):
            at = struct.unpack_from("<H", raw, base + 16 + 2 * n)[0]
            flags, size = struct.unpack_from("<HH", raw, base + at + 4)
            yield page, at, flags, raw[base + at + 8 : base + at + 8 + size]


def value_page(data_file: Path, key: bytes) -> int:
    """The first page of ``key``'s value, where it lies on pages of its own."""
    with lmdb_tree.Tree(str(data_file)) as tree:
        live = {key for key, _ in tree.entries(values=False)}
    assert key in live
    raw = data_file.read_bytes()
    for page, at, flags, found in nodes(data_file):
        if found == key and flags & lmdb_format.F_BIGDATA:
            return int(struct.unpack_from("<Q", raw, page * 4096 + at + 8 + len(key))[0])
    raise AssertionError(f"no value pages for {key!r}")


def test_a_damaged_page_under_the_names_is_listed_and_the_rest_checked(
    store: Path, tmp_path: Path
) -> None:
    """The pages of the store's own values (the names index) are checked like a record's; a
    check the damage stops is named, and nothing in the report sends the user back to verify."""
    data_file = store / "data.mdb"
    page = value_page(data_file, b"__names__")
    smash(data_file, page, 0, struct.pack("<QHH", 1, 0, 0))  # its number and its kind
    result = cli("verify", str(store), "-q")
    no_crash(result)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"page {page} (the value of key __names__): damaged" in out
    assert "all 240 records read and sound; the damage lies in pages of the store's own" in out
    assert "run `fastdata verify`" not in out
    command = result.stdout.strip().splitlines()[-1].split("`")[1]
    assert command.startswith("fastdata export ") and command.endswith(" --skip-damaged")
    exported = subprocess.run(
        command, shell=True, capture_output=True, text=True, env=_cli_env(), cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert len(list((tmp_path / "s-sound").rglob("*.jpg"))) == 240


def test_verify_keeps_its_exit_code_when_its_reader_goes_away(store: Path) -> None:
    """`fastdata verify STORE | head`: the pipe closes before the report is printed."""
    import sys

    def closed_pipe() -> int:
        with subprocess.Popen(
            [sys.executable, "-m", "fastdata", "verify", str(store), "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_cli_env(),
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            err = proc.stderr.read().decode()
            assert "Traceback" not in err, err
            return proc.wait(timeout=120)

    assert closed_pipe() == 0
    flip_a_byte(store, b"0000000005")
    assert closed_pipe() == 1


def test_damage_that_stops_the_whole_store_checks_keeps_the_report(tmp_path: Path) -> None:
    """The first image's pages overwritten: LMDB's own cursor then fails on them too, in the
    check of the record count, which does not end the report (nor is said beside the damaged
    page that is its cause)."""
    store = big_store(tmp_path)
    data_file = store / "data.mdb"
    page = value_page(data_file, b"0000000000")
    smash(data_file, page, 0, bytes(range(7, 23)))
    result = cli("verify", str(store), "-q")
    no_crash(result)
    out = result.stdout
    assert result.returncode == 1, result.stderr
    assert "its records cannot be counted" not in out and "MDB_CORRUPTED" not in out, out
    assert f"page {page} (the value of key 0000000000): damaged" in out
    assert "1 of 30 records failed (29 read):" in out and "run `fastdata verify`" not in out


def test_many_damaged_pages_are_counted_alike_by_any_number_of_processes(tmp_path: Path) -> None:
    store = tiny_store(tmp_path, 1000)
    data_file = store / "data.mdb"
    leaves = pages(data_file, lmdb_format.P_LEAF)
    for page in leaves:
        smash(data_file, page, 0, struct.pack("<Q", 1))
    found = len(lmdb_tree.walk(str(data_file), limit=10**6))
    assert found > 100
    runs = [cli("verify", str(store), "-q", "-j", j) for j in ("1", "2", "5")]
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout
    assert f"{found} damaged page(s):" in runs[0].stdout
    assert f"  ... and {found - 100} more" in runs[0].stdout


def test_a_value_size_that_lies_allocates_nothing_for_it(tmp_path: Path) -> None:
    """A record's node claiming most of the file as its value: its first page's own count
    tells the lie before anything is read for it."""
    import sys

    from PIL import Image

    src = tmp_path / "src"
    rng = __import__("random").Random(0)
    for i in range(24):  # ~3 MB each: a ~70 MB file
        noise = Image.frombytes("RGB", (1000, 1000), rng.randbytes(3_000_000))
        (src / "c").mkdir(parents=True, exist_ok=True)
        noise.save(src / "c" / f"{i:02d}.png", compress_level=0)
    store = tmp_path / "s.lmdb"
    convert(src, store)
    data_file = store / "data.mdb"
    size = data_file.stat().st_size
    code = """
import sys
from fastdata import open_store
from fastdata.ops.verify import verify_store
report = verify_store(open_store(sys.argv[1]), workers=1)
with open("/proc/self/status") as f:  # (this process's peak: ru_maxrss counts its parent's)
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(len(report.failures), peak)
"""

    def peak() -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", code, str(store)],
            capture_output=True,
            text=True,
            env=_cli_env(),
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1]) * 1024

    intact = peak()
    for page, at, _flags, key in list(nodes(data_file)):  # the first record's: its size lies
        if key == b"0000000000":
            smash(data_file, page, at, struct.pack("<I", size - 200_000))
    failures, damaged = peak()
    assert intact[0] == 0 and failures == 1
    assert damaged < intact[1] + 20 * (1 << 20), (damaged, intact, size)


def test_verify_in_a_daemonic_process_checks_in_it(store: Path) -> None:
    """A DataLoader worker is daemonic, and a daemonic process may not start processes."""
    code = """
import multiprocessing, sys
from fastdata import open_store
from fastdata.ops.verify import verify_store

def check(queue):
    report = verify_store(open_store(sys.argv[1]), workers=2)
    queue.put((report.ok, report.checked))

if __name__ == "__main__":
    queue = multiprocessing.get_context("fork").Queue()
    worker = multiprocessing.get_context("fork").Process(target=check, args=(queue,), daemon=True)
    worker.start()
    print(queue.get(timeout=60))
    worker.join()
"""
    result = run_script(code, store)
    assert result.returncode == 0 and result.stdout.strip() == "(True, 240)", result.stderr


def test_a_fifo_for_a_data_file_is_refused_at_once(tmp_path: Path) -> None:
    store = tmp_path / "fifo.lmdb"
    store.mkdir()
    os.mkfifo(store / "data.mdb")
    for command in ("verify", "info"):
        result = cli(command, str(store), timeout=30)
        no_crash(result)
        assert result.returncode == 1 and "not a regular file" in result.stderr, result.stderr


def test_a_checking_process_ends_itself_once_its_parent_is_gone(tmp_path: Path) -> None:
    """A parent killed (SIGKILL: nothing of it runs) leaves its children to the system; each
    looks for its parent between batches and ends once it is gone, instead of checking its
    part to the end. Here the parent's disappearance is what ``getppid`` reports after the
    first look."""
    store = tiny_store(tmp_path, 1200)
    code = """
import os, sys
from fastdata import open_store
from fastdata.ops import verify
real, looks = os.getppid, []
def getppid():
    looks.append(1)
    return real() if len(looks) == 1 else 1  # (then adopted by init)
verify.os.getppid = getppid
try:
    verify.verify_store(open_store(sys.argv[1]), workers=2)
except Exception as exc:
    print(exc)
"""
    result = run_script(code, store)
    assert "the process checking records 0 to 599 ended without a report (exit code 1)" in (
        result.stdout
    ), result.stdout + result.stderr


def test_an_index_of_names_that_differs_from_the_headers_is_named(store: Path) -> None:
    """Appends go by the index of names: one that lost a name would let an append store that
    image twice."""
    env = lmdb.open(str(store), map_size=1 << 26)
    with env.begin(write=True) as txn:
        names = txn.get(b"__names__")
        assert b"c0/0001.jpg" in names
        txn.put(b"__names__", names.replace(b"c0/0001.jpg", b"c0/0999.jpg"))
    env.close()
    result = cli("verify", str(store), "-q")
    no_crash(result)
    assert result.returncode == 1
    assert (
        "each record's name is the one the index of names gives: record 1 is c0/0001.jpg, the "
        "index says c0/0999.jpg"
    ) in result.stdout, result.stdout


def test_a_node_marked_as_a_sub_database_is_damage(store: Path) -> None:
    """fastdata stores have no sub-databases: LMDB would read such a node's value as one."""
    data_file = store / "data.mdb"
    marked = 0
    for page, at, flags, key in list(nodes(data_file)):
        if key == b"__labels__":
            smash(data_file, page, at + 4, struct.pack("<H", flags | 0x02))
            marked += 1
    assert marked
    result = cli("verify", str(store), "-q")
    no_crash(result)
    # (the labels' node: the store cannot be opened, and the page is named)
    said = result.stdout + result.stderr
    assert result.returncode == 1 and "of a sub-database" in said, said


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_header_whose_name_no_file_could_have_is_reported_not_a_traceback(
    tmp_path: Path, workers: str
) -> None:
    # valid JSON, a lone surrogate: no file name encodes to it, so it cannot match the index
    store = tiny_store(tmp_path, 200)
    env = lmdb.open(str(store), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        header = json.loads(bytes(txn.get(b"#0000000003")))
        header["name"] = "\ud800"
        txn.put(b"#0000000003", json.dumps(header).encode())
    env.close()
    result = cli("verify", str(store), "-q", "-j", workers)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "record 3 is '\\ud800'" in result.stdout + result.stderr


def _walks(data_file: Path, low: bytes | None, high: bytes | None, *, side_by_side: bool):
    """A walk's entries (keys and values) and damage, its leaves checked under each branch side
    by side or (with the depth its header gives hidden from it) one page at a time."""
    import dataclasses

    with lmdb_tree.Tree(str(data_file)) as tree:
        if not side_by_side:
            tree.head = dataclasses.replace(tree.head, depth=0)
        got = [(k, None if v is None else bytes(v)) for k, v in tree.entries(low, high)]
        return got, [str(d) for d in tree.found]


def deep_tree(path: Path) -> Path:
    """An LMDB file of three levels: 3,000 records' headers and values under keys as a store
    has them, a fifth of the values on overflow pages of their own, and two keys of other
    lengths (so that some branches hold keys of different lengths)."""
    import random

    rng = random.Random(7)
    env = lmdb.open(str(path), map_size=64 << 20, subdir=True)
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"#%010d" % i, b'{"name":"c/%d.jpg","size":1}' % i)
            size = rng.randrange(2100, 6000) if i % 5 == 0 else rng.randrange(1, 900)
            txn.put(b"%010d" % i, rng.randbytes(size))
        txn.put(b"__len__", b"3000")
        txn.put(b"__keys__", b"x" * 50)
    env.close()
    return path / "data.mdb"


@pytest.mark.parametrize(
    "trials",
    [15, pytest.param(300, marks=pytest.mark.slow)],  # (a walk of one page at a time
)  # checks each page as an array of one: seconds per hundred trials)
def test_leaves_checked_side_by_side_find_what_one_page_at_a_time_finds(
    tmp_path: Path, trials: int
) -> None:
    """Random damage to the tree's pages (headers, node offsets, node headers, keys, overflow
    pointers): the walk that checks a branch's leaves all at once gives the same entries and
    names the same damage as the walk that checks them one page at a time, over the whole tree
    and over ranges."""
    import random

    source = deep_tree(tmp_path / "deep")
    assert check_file(str(source)).depth == 3
    raw = source.read_bytes()
    tree_pages = pages(source, lmdb_format.P_LEAF) + pages(source, lmdb_format.P_BRANCH) * 20
    ranges = [(None, None), (b"#0000000100", b"0000000050"), (b"0000001007", b"0000002500")]
    rng = random.Random(1234)
    damaged = tmp_path / "damaged.mdb"
    differences, found = [], 0
    for trial in range(trials):
        data = bytearray(raw)
        for _ in range(rng.choice([1, 1, 1, 3])):
            page = rng.choice(tree_pages) * 4096
            count = (struct.unpack_from("<H", data, page + 12)[0] - 16) // 2
            node = struct.unpack_from("<H", data, page + 16 + 2 * rng.randrange(max(1, count)))[0]
            at = rng.choice(
                [
                    rng.randrange(0, 16),  # the page header
                    16 + rng.randrange(max(1, 2 * count)),  # the node offsets
                    node + rng.randrange(0, 8),  # a node's header
                    node + 8 + rng.randrange(0, 19),  # its key, or its overflow page
                ]
            )
            data[page + min(at, 4095)] ^= 1 << rng.randrange(8)
        damaged.write_bytes(bytes(data))
        for low, high in ranges:
            side = _walks(damaged, low, high, side_by_side=True)
            single = _walks(damaged, low, high, side_by_side=False)
            found += bool(single[1])
            if side != single:
                differences.append((trial, low, high, side[1], single[1]))
    assert not differences, differences[:3]
    assert found > trials  # (the damage was found, not missed by both)
    whole = _walks(source, None, None, side_by_side=True)
    assert whole == _walks(source, None, None, side_by_side=False) and len(whole[0]) == 6002


@pytest.mark.parametrize(
    "step", [29, pytest.param(3, marks=pytest.mark.slow)]  # (two whole walks a damaged leaf)
)
@pytest.mark.parametrize(
    "field", ["odd lower", "offset at the page's end", "last key past the next page's first"]
)
def test_leaves_checked_side_by_side_name_each_damage_as_one_page_at_a_time(
    tmp_path: Path, field: str, step: int
) -> None:
    """Damage the random flips above rarely reach, to leaves of every place under their
    branch (the last one's check reads nothing past its page): every ``step``-th leaf, and the
    last three."""
    source = deep_tree(tmp_path / "deep")
    raw = source.read_bytes()
    damaged = tmp_path / "damaged.mdb"
    leaves = pages(source, lmdb_format.P_LEAF)
    for page in leaves[::step] + leaves[-3:]:
        data = bytearray(raw)
        base = page * 4096
        lower = struct.unpack_from("<H", data, base + 12)[0]
        count = (lower - 16) // 2
        last_node = struct.unpack_from("<H", data, base + 16 + 2 * (count - 1))[0]
        if field == "odd lower":
            struct.pack_into("<H", data, base + 12, lower | 1)
        elif field == "offset at the page's end":
            struct.pack_into("<H", data, base + 16 + 2 * (count - 1), 4096 - 6)
        else:  # its last key made the largest of its length: past its bound
            size = struct.unpack_from("<H", data, base + last_node + 6)[0]
            data[base + last_node + 8 : base + last_node + 8 + size] = b"9" * size
        damaged.write_bytes(bytes(data))
        side = _walks(damaged, None, None, side_by_side=True)
        assert side[1], page
        assert side == _walks(damaged, None, None, side_by_side=False), page


def test_leaves_below_the_deepest_level_a_walk_follows_are_a_loop_either_way(
    tmp_path: Path,
) -> None:
    """A chain of branch pages above the root puts the leaves at level 65: the walk a page at
    a time takes them for a loop, and the walk side by side does too. (Each branch of the chain
    has two nodes, as LMDB's branches do: the next page of the chain, and a leaf of one key
    past all the keys below.)"""
    source = deep_tree(tmp_path / "deep")
    head = check_file(str(source))
    data = bytearray(source.read_bytes()[: (head.last_page + 1) * 4096])
    chain, first = 63, head.last_page + 1
    leaves = first + chain  # (leaf k beside branch k of the chain)
    for k in range(chain):
        child = first + k + 1 if k + 1 < chain else head.root
        key = b"\xff" + bytes([255 - k])  # (smaller at each level down: every bound holds)
        page = bytearray(4096)
        upper = 4096 - 8 - 10
        struct.pack_into("<QHHHH", page, 0, first + k, 0, lmdb_format.P_BRANCH, 20, upper)
        struct.pack_into("<HH", page, 16, 4096 - 8, upper)
        struct.pack_into("<HHHH", page, 4096 - 8, child & 0xFFFF, child >> 16, 0, 0)
        side = leaves + k
        struct.pack_into("<HHHH", page, upper, side & 0xFFFF, side >> 16, 0, len(key))
        page[upper + 8 : upper + 8 + len(key)] = key
        data += page
    for k in range(chain):
        key = b"\xff" + bytes([255 - k])
        page = bytearray(4096)
        upper = 4096 - 8 - 4
        struct.pack_into("<QHHHH", page, 0, leaves + k, 0, lmdb_format.P_LEAF, 18, upper)
        struct.pack_into("<H", page, 16, upper)
        struct.pack_into("<HHHH", page, upper, 2, 0, 0, len(key))
        page[upper + 8 : upper + 12] = key + b"ok"
        data += page
    for meta in (0, 4096):  # the root, the depth and the last page, in both meta pages
        struct.pack_into("<H", data, meta + 94, head.depth + chain)
        struct.pack_into("<QQ", data, meta + 128, first, leaves + chain - 1)
    damaged = tmp_path / "chained.mdb"
    damaged.write_bytes(bytes(data) + bytes(128 << 10))
    side = _walks(damaged, None, None, side_by_side=True)
    assert side == _walks(damaged, None, None, side_by_side=False)
    beside = sorted(b"\xff" + bytes([255 - k]) for k in range(chain))
    assert [key for key, _ in side[0]] == beside  # (only the leaves above level 65)
    assert "reached twice (a loop in the tree)" in side[1][0]


def test_a_check_reads_each_damaged_value_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every value on pages of its own damaged, under leaves checked side by side: each record
    is reported, and its pages are read at most twice (not once for every record checked after
    it in the run)."""
    from fastdata.stores.lmdb.reader import LMDBStore

    source = deep_tree(tmp_path / "deep")
    raw = source.read_bytes()
    runs = [
        p
        for p in pages(source, lmdb_format.P_OVERFLOW)
        if struct.unpack_from("<I", raw, p * 4096 + 12)[0] > 0
    ]
    assert len(runs) == 600
    for page in runs:
        smash(source, page, 0, struct.pack("<Q", 1))
    reads = [0]
    overflow = lmdb_tree.Tree._overflow

    def counted(self: lmdb_tree.Tree, *args: object) -> object:
        reads[0] += 1
        return overflow(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lmdb_tree.Tree, "_overflow", counted)
    reader = object.__new__(LMDBStore)
    reader.path = str(tmp_path / "deep")
    with lmdb_tree.Tree(str(source)) as tree:
        got = list(reader._paired(tree, 0, 3000))
    unread = [
        i
        for item in got
        if not isinstance(item, ScanBlock) and "damaged" in str(item[3])
        for i in [item[0]]
    ]
    assert unread == list(range(0, 3000, 5))
    assert reads[0] <= 2 * 600, reads[0]


def _paired_records(source: Path, folder: Path) -> tuple[list[object], list[str]]:
    """What a check reads of records 0 .. 2999 of ``source``: each record as one would be read
    alone (index, header, bytes, why not), and the damage found."""
    from fastdata.stores.lmdb.reader import LMDBStore
    from fastdata.stores.reader import scan_item

    reader = object.__new__(LMDBStore)
    reader.path = str(folder)
    out: list[object] = []
    with lmdb_tree.Tree(str(source)) as tree:
        for item in reader._paired(tree, 0, 3000):
            if isinstance(item, ScanBlock):
                records = [
                    scan_item(reader.path, item.start + j, h, d)
                    for j, (h, d) in enumerate(zip(item.heads, item.data, strict=True))
                ]
            else:
                records = [item]
            for i, header, data, why in records:
                out.append((i, header, bytes(data), why))
        return out, [str(d) for d in tree.found]


@pytest.mark.parametrize("trials", [10, pytest.param(60, marks=pytest.mark.slow)])
def test_values_on_pages_of_their_own_are_read_in_stretches_and_checked_as_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trials: int
) -> None:
    """A check reads values on pages of their own that lie one after the other in one call per
    stretch, not one or two per value; with random damage to their pages' headers and to the
    leaves, it reads the same records, bytes and damage as reading each value alone."""
    import random

    from .test_hostile_input import write_store_with

    rng = random.Random(99)
    write_store_with(
        tmp_path / "own", [rng.randbytes(rng.randrange(2100, 7000)) for _ in range(3000)]
    )
    reads = [0]
    real_pread = os.pread

    def counted(fd: int, n: int, offset: int) -> bytes:
        reads[0] += 1
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counted)
    clean = _paired_records(tmp_path / "own" / "data.mdb", tmp_path / "own")
    assert reads[0] < 300, reads[0]  # (3,000 values on pages of their own)
    monkeypatch.undo()
    assert len(clean[0]) == 3000 and not clean[1]
    assert all(why is None for *_, why in clean[0])
    for source in (tmp_path / "own" / "data.mdb", deep_tree(tmp_path / "deep")):
        raw = source.read_bytes()
        overflow = [
            p
            for p in pages(source, lmdb_format.P_OVERFLOW)
            if struct.unpack_from("<I", raw, p * 4096 + 12)[0] > 0
        ]
        leaves = pages(source, lmdb_format.P_LEAF)
        damaged = tmp_path / "damaged" / "data.mdb"
        damaged.parent.mkdir(exist_ok=True)
        differences, found = [], 0
        for trial in range(trials):
            data = bytearray(raw)
            for _ in range(rng.choice([1, 2, 5])):
                if rng.random() < 0.7:  # an overflow run's header: its page number, flags, count
                    at = rng.choice(overflow) * 4096 + rng.choice([0, 1, 10, 12, 13])
                else:  # a leaf's node: its size or its overflow page
                    page = rng.choice(leaves) * 4096
                    # (the page as written: a flip earlier in this trial may have hit its bounds)
                    count = (struct.unpack_from("<H", raw, page + 12)[0] - 16) // 2
                    node = struct.unpack_from("<H", raw, page + 16 + 2 * rng.randrange(count))[0]
                    at = page + node + rng.choice([0, 1, 19, 20])
                data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
            damaged.write_bytes(bytes(data))
            stretched = _paired_records(damaged, damaged.parent)
            monkeypatch.setattr(lmdb_tree, "STRETCH_BYTES", 0)  # (every value read alone)
            alone = _paired_records(damaged, damaged.parent)
            monkeypatch.undo()
            found += bool(alone[1])
            if stretched != alone:
                differences.append((source, trial, stretched[1], alone[1]))
        assert not differences, differences[:2]
        assert found > trials // 2


def test_a_check_in_blocks_reports_in_the_order_of_one_record_at_a_time(tmp_path: Path) -> None:
    """Names that differ from the index early and more than 4,096 records later (compared a
    block at a time), and a label that differs from the labels list between them: each listed
    in the order the records come, as when every record is read one at a time."""
    from fastdata import open_store
    from fastdata.ops.verify import verify_store

    store = tiny_store(tmp_path, 5000)
    env = lmdb.open(str(store), map_size=1 << 30, subdir=True)
    with env.begin(write=True) as txn:
        head = json.loads(txn.get(b"#0000004500"))
        head["label"] = 7
        txn.put(b"#0000004500", json.dumps(head, separators=(",", ":")).encode())
        names = txn.get(b"__names__")
        for name in (b"c/0063.jpg", b"c/4900.jpg"):
            at = names.index(name)
            names = names[:at] + name.replace(b"/", b"/X")[:10] + names[at + 10 :]
        txn.put(b"__names__", names)
    env.close()
    report = verify_store(open_store(store), workers=1)
    assert len(report.broken) == 1 and "record 4500" in report.broken[0], report.broken
    index = report.columns
    assert len(index) == 2 and "record 63 " in index[0] and "record 4900" in index[1], index


def one_node(data_file: Path, page: int) -> None:
    """Make a branch page hold only its first node (its lower bound moved down)."""
    smash(data_file, page, 12, struct.pack("<H", 16 + 2))


def test_a_branch_of_one_node_is_damage_not_the_end_of_the_process(tmp_path: Path) -> None:
    """LMDB stops the process (an assertion, then abort) on a branch page with one node. At the
    root, every read would meet it: it is refused before LMDB maps the file, as a damaged store.
    Deeper, the walk names it as damage, as any other damaged page."""
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    head = check_file(str(data_file))
    assert head.depth == 3
    raw = data_file.read_bytes()
    at = head.root * 4096
    count = (struct.unpack_from("<H", raw, at + 12)[0] - 16) // 2
    assert count >= 3
    middle = struct.unpack_from("<H", raw, at + 16 + 2 * (count // 2))[0]  # a middle child:
    lo, hi, flags = struct.unpack_from("<HHH", raw, at + middle)  # records, away from the
    inner = lo | (hi << 16) | (flags << 32)  # keys an open reads (the progress, the metadata)
    one_node(data_file, inner)
    with lmdb_tree.Tree(str(data_file)) as tree:
        list(tree.entries())
        found = {d.page: d.what for d in tree.damage}
    assert "1 node" in found[inner]
    result = cli("verify", str(store), "-q")
    no_crash(result)
    assert result.returncode == 1 and f"page {inner}" in result.stdout + result.stderr
    one_node(data_file, head.root)
    for result in (cli("info", str(store)), cli("verify", str(store), "-q")):
        no_crash(result)
        assert result.returncode == 1 and f"page {head.root}" in result.stderr


def _first_child_of_root(data_file: Path) -> int:
    """The page number of the first child of a sound file's root (a branch, in a tree three
    deep)."""
    raw = data_file.read_bytes()
    at = check_file(str(data_file)).root * 4096
    first = struct.unpack_from("<H", raw, at + 16)[0]
    lo, hi, flags = struct.unpack_from("<HHH", raw, at + first)
    return lo | (hi << 16) | (flags << 32)


def test_a_loop_in_the_tree_costs_the_records_under_it_not_the_export(tmp_path: Path) -> None:
    """A branch whose child is the branch itself: LMDB's lookup goes down it until its cursor
    is full (MDB_CURSOR_FULL). That is the damage of the records under it: the export that
    verify advises leaves them out and writes the rest, not nothing."""
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    inner = _first_child_of_root(data_file)  # a branch
    second = struct.unpack_from("<H", raw, inner * 4096 + 18)[0]
    smash(data_file, inner, second, struct.pack("<HHH", inner & 0xFFFF, inner >> 16, 0))
    verified = cli("verify", str(store), "-q")
    no_crash(verified)
    assert verified.returncode == 1 and "--skip-damaged" in verified.stdout + verified.stderr
    out = tmp_path / "sound"
    exported = cli("export", str(store), str(out), "--skip-damaged", "-q")
    no_crash(exported)
    assert exported.returncode == 1 and "left out" in exported.stdout + exported.stderr
    written = sum(1 for p in out.rglob("*.jpg"))
    assert 2000 < written < 3000, exported.stderr


def _leaves(data_file: Path) -> list[tuple[int, list[bytes]]]:
    """The leaf pages of a sound file's tree, each with its keys, in key order."""
    raw = data_file.read_bytes()
    out: list[tuple[int, list[bytes]]] = []

    def nodes(page: int) -> list[int]:
        lower = struct.unpack_from("<H", raw, page * 4096 + 12)[0]
        return list(struct.unpack_from(f"<{(lower - 16) // 2}H", raw, page * 4096 + 16))

    def down(page: int) -> None:
        flags = struct.unpack_from("<H", raw, page * 4096 + 10)[0]
        if flags & 1:  # a branch: its children in order
            for off in nodes(page):
                lo, hi, top = struct.unpack_from("<HHH", raw, page * 4096 + off)
                down(lo | (hi << 16) | (top << 32))
            return
        keys = []
        for off in nodes(page):
            ksize = struct.unpack_from("<H", raw, page * 4096 + off + 6)[0]
            keys.append(raw[page * 4096 + off + 8 : page * 4096 + off + 8 + ksize])
        out.append((page, keys))

    down(check_file(str(data_file)).root)
    return out


def _read_every_record(store: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\nfrom fastdata import LMDBImageDataset\nfrom fastdata.errors import "
        "RecordError\nds = LMDBImageDataset(sys.argv[1], output='bytes')\nbad = 0\n"
        "for i in range(len(ds)):\n    try:\n        ds[i]\n    except RecordError:\n"
        "        bad += 1\nprint('bad', bad, 'of', len(ds))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=120
    )


def test_a_branch_of_one_node_below_the_root_costs_its_records_not_the_process(
    tmp_path: Path,
) -> None:
    """LMDB ends the process on a branch of one node met on its way down to a key. Below the
    root, such a page is found when the file is opened: the records under it are damaged
    (RecordError), the rest read, the advised export writes them, and an append is refused
    before it writes anything."""
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    inner = _first_child_of_root(data_file)  # a branch over headers and records
    one_node(data_file, inner)
    read = _read_every_record(store)
    assert read.returncode == 0, read.stderr  # (SIGABRT: -6)
    bad = int(read.stdout.split()[1])
    assert 0 < bad < 3000
    out = tmp_path / "sound"
    exported = cli("export", str(store), str(out), "--skip-damaged", "-q")
    no_crash(exported)
    assert exported.returncode == 1 and "left out" in exported.stdout + exported.stderr
    assert sum(1 for _ in out.rglob("*.jpg")) == 3000 - bad
    before = data_file.read_bytes()
    appended = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q")
    no_crash(appended)
    assert appended.returncode == 1 and f"damaged page {inner}" in appended.stderr
    assert data_file.read_bytes() == before


def test_a_header_leaf_that_is_no_leaf_is_an_error_of_the_scan_not_the_end_of_the_process(
    tmp_path: Path,
) -> None:
    """LMDB's cursor, stepping from leaf to leaf, ends the process on a page there that is not
    a leaf. The header scan (an append, a query) reads the pages itself and names it."""
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    header_leaves = [p for p, keys in _leaves(data_file) if keys and keys[0].startswith(b"#0")]
    page = header_leaves[1]
    smash(data_file, page, 10, struct.pack("<H", 0))  # its flags: no kind of page
    code = (
        "import sys\nfrom fastdata import open_store\n"
        "print(sum(1 for _ in open_store(sys.argv[1]).iter_headers()))\n"
    )
    scan = subprocess.run(
        [sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=120
    )
    assert scan.returncode == 1, scan.stderr  # (SIGABRT: -6)
    assert f"lies under damaged page {page}" in scan.stderr
    for args in (
        ("convert", str(tmp_path / "src"), str(store), "--append", "-q"),
        ("info", str(store), "--where", '{"name": "c/0.jpg"}'),  # (a name: in the headers)
    ):
        result = cli(*args)
        no_crash(result)
        assert result.returncode == 1 and f"damaged page {page}" in result.stderr


def test_a_lying_value_size_under_a_limit_on_address_space_is_an_error_not_a_fault(
    tmp_path: Path,
) -> None:
    """Where a limit on address space (``ulimit -v``) leaves the reader's map no room past the
    file, nothing covers a value that claims to run past it: every page is checked when the
    file is opened instead, and a value of 4 GiB in a small file is damage, named."""
    import resource

    from .test_hostile_input import write_store_with

    store = tmp_path / "s.lmdb"
    write_store_with(store, [jpeg_bytes(seed=i) + bytes(6000) for i in range(40)])
    data_file = store / "data.mdb"
    raw = data_file.read_bytes()
    for page, _ in _leaves(data_file):
        lower = struct.unpack_from("<H", raw, page * 4096 + 12)[0]
        offsets = struct.unpack_from(f"<{(lower - 16) // 2}H", raw, page * 4096 + 16)
        big = [o for o in offsets if struct.unpack_from("<H", raw, page * 4096 + o + 4)[0] & 1]
        if big:
            smash(data_file, page, big[0], struct.pack("<HH", 0xFFFF, 0xFFFF))
            break
    else:
        raise AssertionError("no value on pages of its own")

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    for args in (
        ("verify", str(store), "-q"),
        ("export", str(store), str(tmp_path / "o"), "--skip-damaged", "-q"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "fastdata", *args],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=limited,
        )
        assert result.returncode == 1, (args, result.returncode, result.stderr)  # (SIGSEGV: -11)
        said = result.stdout + result.stderr
        assert "Traceback" not in said
        if args[0] == "verify":
            assert "4294967295 bytes" in said, said
        else:
            assert "left out 1 damaged record" in said, said


@pytest.mark.parametrize(("flags", "words"), [(0x08, "as integers"), (0x02, "reversed")])
def test_a_main_database_whose_keys_are_ordered_otherwise_is_damage_not_another_tool(
    tmp_path: Path, flags: int, words: str
) -> None:
    """A store's main database compares its keys as bytes. Flags in its record that order them
    otherwise (as integers, reversed) are damage to the meta page: named as such, not taken for
    another tool's pickle store, and verify does not advise running verify."""
    store = tiny_store(tmp_path, 30)
    data_file = store / "data.mdb"
    head = check_file(str(data_file))
    for meta in (0, 1):  # (md_flags of the main database, in both meta pages)
        smash(data_file, meta, 16 + 24 + 48 + 4, struct.pack("<H", flags))
    for args in (("info", str(store)), ("verify", str(store), "-q")):
        result = cli(*args)
        no_crash(result)
        assert result.returncode == 1 and f"compared {words}" in result.stderr, result.stderr
        assert "pickle" not in result.stderr
    verified = cli("verify", str(store), "-q")
    assert "run `fastdata verify" not in verified.stderr and "convert it again" in verified.stderr
    assert head.flags == 0


def test_pages_lmdb_meets_below_the_branches_are_checked_before_it_meets_them(
    tmp_path: Path,
) -> None:
    """LMDB goes down by the pages' flags, not the header's depth: a branch of one node below a
    header that says the tree is shallower, a leaf made a branch of one node, and a record
    marked as one of several values under a key each ended the process. Each leaf is checked
    when a key under it is first wanted: the records there are damaged, the rest read."""
    store = tiny_store(tmp_path, 3000)
    data_file = store / "data.mdb"
    pristine = data_file.read_bytes()
    leaves = [(p, keys) for p, keys in _leaves(data_file) if keys and keys[0][:1].isdigit()]
    inner = _first_child_of_root(data_file)
    leaf = leaves[len(leaves) // 2][0]

    def lying_depth() -> None:  # the header says 1 level; a branch of 1 node lies below
        for meta in (0, 1):
            smash(data_file, meta, 16 + 24 + 48 + 6, struct.pack("<H", 1))
        one_node(data_file, inner)

    def leaf_made_branch() -> None:
        smash(data_file, leaf, 10, struct.pack("<HH", 0x01, 16 + 2))

    def marked_duplicate() -> None:  # the main database sorts duplicates; a node says it has some
        for meta in (0, 1):
            smash(data_file, meta, 16 + 24 + 48 + 4, struct.pack("<H", 0x04))
        node = struct.unpack_from("<H", pristine, leaf * 4096 + 16)[0]
        smash(data_file, leaf, node + 4, struct.pack("<H", 0x04))

    for damage in (lying_depth, leaf_made_branch, marked_duplicate):
        data_file.write_bytes(pristine)
        damage()
        read = _read_every_record(store)
        assert read.returncode == 0, (damage.__name__, read.stderr)  # (SIGABRT: -6)
        assert 0 < int(read.stdout.split()[1]) < 3000, (damage.__name__, read.stdout)
        exported = cli("export", str(store), str(tmp_path / damage.__name__), "--skip-damaged")
        no_crash(exported)
        assert exported.returncode == 1 and "left out" in exported.stdout, damage.__name__


def test_a_copy_resumed_into_a_damaged_half_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A copy that stopped half-way, its half damaged since: the resume checks every page of
    the store it would complete, and writes nothing into it."""
    from fastdata import open_store
    from fastdata.errors import StoreDamagedError
    from fastdata.ops.copy import copy_store

    source = tiny_store(tmp_path, 3000)
    dst = tmp_path / "half.lmdb"

    def stop(done: int, total: int) -> None:
        if done >= 1500:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        copy_store(str(source), str(dst), progress=stop)
    data_file = dst / "data.mdb"
    header_leaves = [p for p, keys in _leaves(data_file) if keys and keys[0].startswith(b"#0")]
    smash(data_file, header_leaves[1], 10, struct.pack("<H", 0))
    before = data_file.read_bytes()
    with pytest.raises(StoreDamagedError, match=f"damaged page {header_leaves[1]}"):
        copy_store(str(source), str(dst), resume=True)
    assert data_file.read_bytes() == before
    with pytest.raises(Exception, match="incomplete|damaged"):
        open_store(str(dst))


STALE_AFTER_APPEND = """
import struct, subprocess, sys
from pathlib import Path
from fastdata import LMDBImageDataset
store, src = sys.argv[1], sys.argv[2]
ds = LMDBImageDataset(store, output="bytes", check=False)
for i in range(len(ds)):
    ds[i]  # every leaf of the records checked: the shortest read path from here on
last = len(ds) - 1
from PIL import Image
for i in range(3):  # new images: the append writes the last leaves anew
    Image.new("RGB", (16, 16), (i, 9, 9)).save(f"{src}/c/new{i}.jpg")
appended = subprocess.run([sys.executable, "-m", "fastdata", "convert", src, store, "--append",
                           "-q"], capture_output=True, text=True)
assert appended.returncode == 0, appended.stderr
# the leaf that holds the last record now (the append wrote it anew): made a branch of one node
data = Path(store) / "data.mdb"
raw = data.read_bytes()
head = max((0, 1), key=lambda n: struct.unpack_from("<Q", raw, n * 4096 + 16 + 24 + 96 + 8)[0])
page = struct.unpack_from("<Q", raw, head * 4096 + 16 + 24 + 48 + 40)[0]
key = b"%010d" % last  # (a record the process read before the append)
while struct.unpack_from("<H", raw, page * 4096 + 10)[0] & 1:  # down the branches
    lower = struct.unpack_from("<H", raw, page * 4096 + 12)[0]
    offs = struct.unpack_from(f"<{(lower - 16) // 2}H", raw, page * 4096 + 16)
    child = None
    for j, off in enumerate(offs):
        lo, hi, top, ks = struct.unpack_from("<HHHH", raw, page * 4096 + off)
        k = raw[page * 4096 + off + 8 : page * 4096 + off + 8 + ks]
        if j == 0 or k <= key:
            child = lo | (hi << 16) | (top << 32)
    page = child
with open(data, "r+b") as f:
    f.seek(page * 4096 + 10)
    f.write(struct.pack("<HH", 1, 18))
try:
    ds[last]
except Exception as exc:
    print(type(exc).__name__)
"""


def test_reads_after_an_append_check_the_pages_the_append_wrote(tmp_path: Path) -> None:
    """A process that had checked every leaf of its records reads on after an append: the
    append wrote new leaves, and they are checked before LMDB is sent to them (a leaf damaged
    since is that record's error, not the end of the process)."""
    store = tiny_store(tmp_path, 300)
    result = run_script(STALE_AFTER_APPEND, store, tmp_path / "src")
    assert result.returncode == 0, result.stderr  # (SIGABRT: -6)
    assert "RecordError" in result.stdout, result.stdout + result.stderr


# A reader that checked every leaf, then reads while an append writes (argv[2]: the source):
# the append, once it has advanced the append epoch and before its first write, waits for the
# reader's read; the reader then reads the last record again after the append ended and the leaf
# that holds it now was damaged (stdin: a line each time the test lets it go on).
READ_DURING_AN_APPEND = """
import subprocess, sys
from fastdata import LMDBImageDataset
store, src = sys.argv[1], sys.argv[2]
APPEND = '''
import sys
import fastdata.stores.lmdb.writer as writer
from fastdata import convert
bump, bumped = writer.bump_epoch, []
def bump_and_wait(lease):
    bump(lease)
    if not bumped:  # (the first: before the append's first write)
        bumped.append(True)
        print("bumped", flush=True)
        sys.stdin.readline()
writer.bump_epoch = bump_and_wait
convert(sys.argv[1], sys.argv[2], append=True)
'''
ds = LMDBImageDataset(store, output="bytes", check=False)
for i in range(len(ds)):
    ds[i]  # every leaf of the records checked
last = len(ds) - 1
append = subprocess.Popen([sys.executable, "-c", APPEND, src, store], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert append.stdout.readline() == "bumped\\n"
ds[last]  # read while the append holds the store, its writes to come
append.stdin.write("\\n")
append.stdin.flush()
assert append.wait() == 0
print("appended", flush=True)
sys.stdin.readline()  # the leaf that holds the last record now is damaged
try:
    ds[last]
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_reads_during_an_append_check_the_pages_it_wrote_once_it_ends(tmp_path: Path) -> None:
    """A reader that read while an append wrote (after the append epoch moved, before the
    append's commits) reads on once the append has ended: the append's new branches and leaves
    are checked before LMDB is sent to them, as they are for a reader that began after it (a
    leaf damaged since is that record's error, not the end of the process: SIGABRT)."""
    store = tiny_store(tmp_path, 300)
    for i in range(3):  # new images: the append writes the last leaves anew
        write(tmp_path / "src" / "c" / f"new{i}.jpg", jpeg_bytes(16, 16, seed=1000 + i))
    reader = subprocess.Popen(
        [sys.executable, "-c", READ_DURING_AN_APPEND, str(store), str(tmp_path / "src")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline() == "appended\n", reader.communicate()
        page = _leaf_of(store / "data.mdb", b"%010d" % 299)
        smash(store / "data.mdb", page, 10, struct.pack("<HH", 1, 18))  # a branch of 1 node
        out, err = reader.communicate("\n", timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0, err  # (SIGABRT: -6)
    assert out.startswith("RecordError") and f"page {page}" in out, out + err


def _leaf_of(data_file: Path, key: bytes) -> int:
    """The leaf page that holds ``key`` in the file's tree as its newest meta page has it."""
    raw = data_file.read_bytes()
    meta = max((0, 1), key=lambda n: struct.unpack_from("<Q", raw, n * 4096 + 16 + 24 + 96 + 8)[0])
    page = struct.unpack_from("<Q", raw, meta * 4096 + 16 + 24 + 48 + 40)[0]
    while struct.unpack_from("<H", raw, page * 4096 + 10)[0] & 1:  # down the branches
        lower = struct.unpack_from("<H", raw, page * 4096 + 12)[0]
        offsets = struct.unpack_from(f"<{(lower - 16) // 2}H", raw, page * 4096 + 16)
        for j, off in enumerate(offsets):
            lo, hi, top, size = struct.unpack_from("<HHHH", raw, page * 4096 + off)
            if j == 0 or raw[page * 4096 + off + 8 : page * 4096 + off + 8 + size] <= key:
                child = lo | (hi << 16) | (top << 32)
        page = child
    return page


def printed_verify(said: str) -> subprocess.CompletedProcess:
    """The first ``fastdata verify`` command ``said`` prints, run as printed (as a shell splits
    it), which must not crash."""
    printed = re.findall(r"`(fastdata verify [^`]*)`", said)
    assert printed, said
    verified = cli(*shlex.split(printed[0])[1:])
    no_crash(verified)
    return verified


def _damage(store: Path, what: str) -> None:
    """One kind of damage that only a parse of bytes finds (a header, the metadata), which
    knows nothing of the store it was read from."""
    if what == "a header that is not JSON":
        put(store, b"#0000000007", b"{not json")
    elif what == "a header of the wrong types":
        put(store, b"#0000000007", b'{"name": "c0/0007.jpg", "label": 0, "size": "big"}')
    elif what == "metadata that is not JSON":
        put(store, b"__fastdata__", b"{not json")
    elif what == "metadata of the wrong types":
        meta_with(store, version="1")
    else:
        meta_with(store, skipped=7)


@pytest.mark.parametrize(
    "what, command",
    [
        ("a header that is not JSON", "export"),
        ("a header that is not JSON", "copy"),
        ("a header of the wrong types", "export"),
        ("metadata that is not JSON", "info"),
        ("metadata of the wrong types", "export"),
        ("a skipped list of the wrong type", "info"),
    ],
)
def test_the_verify_a_damage_message_names_runs_as_printed(
    store: Path, tmp_path: Path, what: str, command: str
) -> None:
    """Damage found by parsing bytes alone (a record's header, the metadata) is named with the
    store it was read from: the hint's ``fastdata verify`` command runs as printed and lists
    the damage (it said "`fastdata verify` on it", which runs nothing)."""
    _damage(store, what)
    args = {
        "export": ["export", str(store), str(tmp_path / "out"), "-q"],
        "copy": ["copy", str(store), str(tmp_path / "c.lmdb"), "-q"],
        "info": ["info", str(store)],
    }[command]
    result = cli(*args)
    no_crash(result)
    assert result.returncode == 1, result.stderr
    verified = printed_verify(result.stderr)
    assert verified.returncode == 1, verified.stderr  # (damage, not a usage error: 2)
    said = verified.stdout + verified.stderr
    assert "record 7" in said if "header" in what else "metadata" in said, said


def test_a_header_giving_a_size_past_int64_is_damage_an_append_names(
    store: Path, tmp_path: Path
) -> None:
    """A header whose size no int64 holds is a damaged header: an append into the store names
    it with a ``fastdata verify`` that runs as printed (it crashed with an OverflowError while
    gathering the stored sizes to compare with the source)."""
    key = b"#0000000007"
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        header = json.loads(txn.get(key))
    env.close()
    put(store, key, json.dumps({**header, "size": 10**30}).encode())
    result = cli("convert", str(tmp_path / "src"), str(store), "--append", "-q")
    no_crash(result)
    assert result.returncode == 1, result.stderr
    assert "record 7" in result.stderr, result.stderr
    verified = printed_verify(result.stderr)
    assert verified.returncode == 1 and "record 7" in verified.stdout, verified.stdout


def test_a_writer_finding_damage_prints_commands_that_run(store: Path, tmp_path: Path) -> None:
    """A conversion or append that finds the store at its target damaged says the damage's own
    advice in the command line's words: its ``fastdata verify`` names the store absolute, which
    runs as printed from anywhere, whatever the path given (here one that begins with a dash;
    it printed it as given, which reads as an option), and its options are flags (it said
    ``overwrite=True``, a Python caller's words)."""
    dashed = tmp_path / "-s.lmdb"
    store.rename(dashed)
    put(dashed, b"__fastdata__", b"{not json")
    appended = subprocess.run(
        [sys.executable, "-m", "fastdata", "convert", "src", "--append", "-q", "--", "-s.lmdb"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child_env(),
        timeout=120,
    )
    no_crash(appended)
    assert appended.returncode == 1, appended.stderr
    verified = printed_verify(appended.stderr)
    assert verified.returncode == 1 and "metadata" in verified.stderr, verified.stderr

    put(dashed, b"__fastdata__", b"")  # (an interrupted conversion, its progress damaged)
    env = lmdb.open(str(dashed), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.delete(b"__fastdata__")
        txn.put(b"#progress", b"{not json")
    env.close()
    resumed = cli("convert", str(tmp_path / "src"), str(dashed), "--resume", "-q")
    no_crash(resumed)
    assert resumed.returncode == 2, resumed.stderr
    assert "convert again with --overwrite" in resumed.stderr, resumed.stderr
    assert "overwrite=True" not in resumed.stderr, resumed.stderr


def test_a_copy_checks_a_scan_end_as_verify_does(store: Path, tmp_path: Path) -> None:
    """A header that gives its record's scan end, right, under a format other than "jpeg" (as
    another version or tool may name one) passes verify, and so a copy: the copy refused it as
    damage ("its header says byte N, not -1") and sent the user to a verify that found none."""
    key = b"#0000000007"
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        header = json.loads(txn.get(key))
    env.close()
    assert header["scan_end"] > 0
    put(store, key, json.dumps({**header, "format": "jpg"}).encode())
    verified = cli("verify", str(store), "-q")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    copied = cli("copy", str(store), str(tmp_path / "c.lmdb"), "-q")
    no_crash(copied)
    assert copied.returncode == 0, copied.stderr
    assert cli("verify", str(tmp_path / "c.lmdb"), "-q").returncode == 0


@pytest.mark.parametrize("name", ["../../escaped.jpg", "c0/0003.jpg"])
def test_the_export_verify_advises_leaves_out_a_record_whose_name_is_damaged(
    store: Path, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header whose name no conversion gives (one that climbs out of the folder, or an
    earlier record's) is damage that verify names; the export it advises leaves that record out
    and writes every other (it refused the unsafe name without naming the store or a fix, and
    took the second file of one name for a file of the user's: "exists already")."""
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        header = json.loads(txn.get(b"#0000000007"))
    env.close()
    put(store, b"#0000000007", json.dumps({**header, "name": name}).encode())
    verified = cli("verify", str(store))
    no_crash(verified)
    assert verified.returncode == 1, verified.stdout
    advised = re.findall(r"`(fastdata export [^`]*)`", verified.stdout + verified.stderr)
    assert advised, verified.stdout
    monkeypatch.chdir(tmp_path)  # (where a name that climbs out would land: beside the export)
    exported = cli(*shlex.split(advised[0])[1:])
    no_crash(exported)
    assert exported.returncode == 1 and "left out 1 damaged record(s)" in exported.stdout
    out = Path(shlex.split(advised[0])[3])
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jpg"))
    assert len(files) == 239 and "c0/0007.jpg" not in files
    assert not list(tmp_path.rglob("escaped.jpg"))
    plain = cli("export", str(store), str(tmp_path / "plain"), "-q")
    assert plain.returncode == 1 and f"({name}) has a name that" in plain.stderr
    assert "--skip-damaged" in plain.stderr and f"fastdata verify {store}" in plain.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_name_that_climbs_out_is_damage_verify_names_though_the_index_agrees(
    store: Path, tmp_path: Path, workers: str
) -> None:
    """A header whose name climbs out of the folder, with the index of names damaged to agree,
    is a record verify names (it said "240 records OK" while export refused that record and
    pointed to verify: a dead end); export's advice, run as printed, leaves it out."""
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        header = json.loads(txn.get(b"#0000000007"))
        names = txn.get(b"__names__").split(b"\0")
    env.close()
    put(store, b"#0000000007", json.dumps({**header, "name": "../../x.jpg"}).encode())
    names[7] = b"../../x.jpg"
    put(store, b"__names__", b"\0".join(names))
    verified = cli("verify", str(store), "--workers", workers)
    no_crash(verified)
    assert verified.returncode == 1, verified.stdout
    assert "7 ../../x.jpg: its name is not a safe relative path" in verified.stdout
    advised = re.findall(r"`(fastdata export [^`]*)`", verified.stdout)
    assert advised, verified.stdout
    exported = cli(*shlex.split(advised[0])[1:])
    assert exported.returncode == 1 and "left out 1 damaged record(s)" in exported.stdout
    assert not list(tmp_path.rglob("x.jpg"))


@pytest.mark.parametrize(
    "damage",
    [
        {"max_file_bytes": "1 --overwrite"},
        {"source": "-rf"},
        {"source": "elsewhere/src"},
        {"fingerprint": "store:x", "source": "x.lmdb --overwrite"},
        {"fingerprint": "store:x", "source": "--collection c"},
        {"fingerprint": "store:x", "source": "other.lmdb"},
        {"fingerprint": "store:x", "source": "other.lmdb --source-collection c"},
        {"verify_decode": "--overwrite"},
        {"fields": ["--overwrite"]},
    ],
    ids=repr,
)
def test_a_progress_that_would_print_another_command_is_damage(
    store: Path, tmp_path: Path, damage: dict[str, Any]
) -> None:
    """The command that resumes an interrupted run is printed from its saved progress: a
    damaged one printed options of its own (``--max-file-size 1 --overwrite``, a source read
    as an option) into the command the user is told to run."""
    from fastdata.records import Progress

    saved = json.loads(Progress(str(tmp_path / "src"), "f", 240, 120, 120).to_json())
    env = lmdb.open(str(store), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.delete(b"__fastdata__")
        txn.put(b"#progress", json.dumps({**saved, **damage}).encode())
    env.close()
    for args in (["info", str(store)], ["convert", str(tmp_path / "src"), str(store), "--resume"]):
        said = cli(*args)
        no_crash(said)
        assert "damaged conversion progress" in said.stderr, said.stderr
        assert "`" not in said.stderr and "convert again with --overwrite" in said.stderr


def test_a_damaged_record_read_in_a_worker_says_its_hint_once_naming_the_store(
    store: Path,
) -> None:
    """torch's DataLoader raises a worker's error again from its text alone: the error it
    rebuilt added a second hint, without the store, after the one the text held."""
    from torch.utils.data import DataLoader

    from fastdata import LMDBImageDataset

    flip_a_byte(store, b"0000000005")
    loader = DataLoader(
        LMDBImageDataset(store, output="bytes"),
        batch_size=4,
        num_workers=2,
        collate_fn=lambda batch: batch,
        multiprocessing_context="fork",
    )
    with pytest.raises(StoreDamagedError) as raised:
        for _ in loader:
            pass
    said = str(raised.value)
    assert said.count("the store is damaged") == 1, said
    assert f"`fastdata verify {store}`" in said, said
