"""Damage is an error, never a crash: whatever happens to a store's file (bits flipped, a page
overwritten, the file cut short), opening it, reading every record through the dataset,
``fastdata verify`` and ``fastdata export --skip-damaged`` end in a fastdata error that names the
store, or succeed; never a signal (SIGSEGV, SIGBUS), a hang or a traceback.

Each damaged copy is read in processes of its own, forked from one process that imported
fastdata once (a new interpreter for each would cost seconds apiece), so that a crash shows as
that process's death, not the test run's; each arms an alarm, so that a hang shows as SIGALRM."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
from pathlib import Path

import lmdb
import pytest

from fastdata import convert

from .conftest import jpeg_bytes, write
from .procs import cli, run_script

PAGE = 4096
SEEDS = range(30)

# For each store in argv[2:], forks: `fastdata verify STORE -q`, `fastdata export STORE OUT -q
# --skip-damaged` (both through the CLI's own entry point), then every index read through
# LMDBImageDataset. Each child arms an alarm (a hang dies of SIGALRM) and writes its exit status
# and output; an exception the child does not expect is printed as Python prints it
# ("Traceback ..."), as an uncaught one would be. The report (JSON) goes to argv[1].
FORKED_PATHS = """
    import io, json, os, signal, sys, traceback
    import fastdata.cli
    from fastdata import LMDBImageDataset
    from fastdata.errors import FastdataError

    def read_all(store):
        try:
            ds = LMDBImageDataset(store, output="bytes")
        except FastdataError as exc:
            print(exc)
            return 1
        failed = 0
        for i in range(len(ds)):
            try:
                ds[i]
            except FastdataError as exc:
                print(exc)
                failed += 1
        try:
            ds.__getitems__(list(range(len(ds))))
        except FastdataError as exc:
            print(exc)
            failed += 1
        return 1 if failed else 0

    def command(argv):
        sys.argv = ["fastdata", *argv]
        try:
            fastdata.cli.main()
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0

    def forked(job, out, err):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd_out, 1)
                os.dup2(fd_err, 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
                signal.alarm(60)  # a hang dies of SIGALRM
                code = job()
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            return -os.WTERMSIG(status)
        return os.WEXITSTATUS(status)

    report = {}
    for store in sys.argv[2:]:
        jobs = {
            "verify": lambda: command(["verify", store, "-q"]),
            "export": lambda: command(["export", store, store + ".out", "-q", "--skip-damaged"]),
            "read": lambda: read_all(store),
        }
        report[store] = {}
        for name, job in jobs.items():
            out, err = f"{store}.{name}.stdout", f"{store}.{name}.stderr"
            code = forked(job, out, err)
            with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
                report[store][name] = [code, f_out.read(), f_err.read()]
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
"""


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 40 records: 30 small images that share leaf pages, 10 larger ones on pages of
    their own (LMDB's overflow pages)."""
    root = tmp_path_factory.mktemp("sound")
    for i in range(30):
        write(root / "src" / "small" / f"{i:03d}.jpg", jpeg_bytes(16, 12, seed=i))
    for i in range(10):
        write(root / "src" / "large" / f"{i:03d}.jpg", jpeg_bytes(120, 120, seed=100 + i))
    store = root / "s.lmdb"
    convert(root / "src", store)
    return store


def pages_used(store: Path) -> int:
    """How many pages of the store's file LMDB uses (the file is longer: LMDB grows it ahead)."""
    env = lmdb.open(str(store), readonly=True, lock=False)
    try:
        return int(env.info()["last_pgno"]) + 1
    finally:
        env.close()


def damage(data_file: Path, pages: int, seed: int) -> str:
    """Damage the first ``pages`` pages of ``data_file`` (those LMDB uses) one of three ways,
    chosen and placed by ``seed``; returns how."""
    rng = random.Random(seed)
    raw = bytearray(data_file.read_bytes())
    how = ("bits", "page", "truncate")[seed % 3]
    if how == "bits":  # bit rot: a few bits anywhere, the meta pages included
        flips = [(rng.randrange(pages * PAGE), rng.randrange(8)) for _ in range(rng.randint(1, 8))]
        for at, bit in flips:
            raw[at] ^= 1 << bit
        what = f"bits flipped at {sorted(at * 8 + bit for at, bit in flips)}"
    elif how == "page":  # a page overwritten: noise, zeros, or another page of the file
        page, other = rng.randrange(pages), rng.randrange(pages)
        fill = rng.choice(("noise", "zeros", "another page"))
        if fill == "noise":
            new = bytes(rng.getrandbits(8) for _ in range(PAGE))
        elif fill == "zeros":
            new = bytes(PAGE)
        else:
            new = bytes(raw[other * PAGE : (other + 1) * PAGE])
        raw[page * PAGE : (page + 1) * PAGE] = new
        what = f"page {page} overwritten with {fill}" + (
            f" {other}" if fill == "another page" else ""
        )
    else:  # cut short: at a page boundary or anywhere
        size = rng.choice((rng.randrange(pages) * PAGE, rng.randrange(pages * PAGE)))
        del raw[size:]
        what = f"cut to {size} bytes"
    data_file.write_bytes(bytes(raw))
    return what


def test_damage_of_every_kind_is_an_error_naming_the_store_never_a_crash(
    sound: Path, tmp_path: Path
) -> None:
    """30 seeded damages of a 40-record store: bits flipped, a page overwritten, the file cut
    short. Every path ends in an exit code (0, 1 or 2), never a signal or a hang; no traceback;
    and whatever it says is wrong names the damaged store."""
    stores: dict[str, str] = {}
    pages = pages_used(sound)
    for seed in SEEDS:
        store = tmp_path / f"damaged-{seed:02d}.lmdb"
        shutil.copytree(sound, store)
        stores[str(store)] = f"seed {seed}: " + damage(store / "data.mdb", pages, seed)
    report_file = tmp_path / "report.json"
    result = run_script(FORKED_PATHS, report_file, *stores, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    problems = []
    for store, how in stores.items():
        for path, (code, out, err) in report[store].items():
            where = f"{how}: {path}"
            if code < 0:
                name = signal.Signals(-code).name
                problems.append(f"{where}: killed by {name}" + (" (a hang)" * (name == "SIGALRM")))
            elif code not in (0, 1, 2):
                problems.append(f"{where}: exit code {code}")
            if "Traceback" in err:
                problems.append(f"{where}: a traceback\n{err}")
            said = (out if path == "read" else err).strip()
            for line in said.splitlines():
                if line.strip() and store not in line:
                    problems.append(f"{where}: a message that does not name the store: {line}")
            if path != "read" and code == 1 and not err.strip() and not out.strip():
                problems.append(f"{where}: failed and said nothing")
    assert not problems, "\n".join(problems)
    assert any(report[s]["verify"][0] == 1 for s in stores)  # (the damage was seen)


def test_a_sound_store_passes_every_path(sound: Path, tmp_path: Path) -> None:
    """The same paths on the undamaged store: all succeed, saying nothing is wrong (so that the
    test above tells damage from its own mistakes)."""
    store = tmp_path / "sound.lmdb"
    shutil.copytree(sound, store)
    report_file = tmp_path / "report.json"
    result = run_script(FORKED_PATHS, report_file, store, timeout=300)
    assert result.returncode == 0, result.stderr
    for path, (code, out, err) in json.loads(report_file.read_text())[str(store)].items():
        assert code == 0 and not err.strip(), (path, code, out, err)
    assert len(list((tmp_path / "sound.lmdb.out").rglob("*.jpg"))) == 40


# -------------------------------------------------------------- MongoDB: a GridFS file missing

READ_EACH = """
    import sys
    from fastdata import MongoImageDataset
    from fastdata.errors import FastdataError
    ds = MongoImageDataset(sys.argv[1], sys.argv[2], output="bytes")
    for i in range(len(ds)):
        try:
            ds[i]
        except FastdataError as exc:
            print(i, exc)
"""


def gridfs_store_losing(
    tmp_path: Path, mongo_uri: str, lost: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Collection ``c``: four images, each in GridFS (the threshold lowered from 15 MB), then
    record 2's GridFS file deleted (``lost``: "the file", its file document and chunks, or "its
    chunks" only, as a partial clean-up or restore leaves it)."""
    from fastdata.stores.mongo import writer as mongo_writer

    from .mongo_server import database

    monkeypatch.setattr(mongo_writer, "GRIDFS_THRESHOLD", 2000)
    for i in range(4):
        write(tmp_path / "src" / "c" / f"{i}.jpg", jpeg_bytes(120, 120, seed=i))
    convert(tmp_path / "src", mongo_uri, collection="c")
    db = database(mongo_uri)
    doc = db["c"].find_one({"_id": 2})
    assert doc is not None and "gridfs_id" in doc and "data" not in doc
    (bucket,) = [n[: -len(".files")] for n in db.list_collection_names() if n.endswith(".files")]
    if lost == "the file":
        assert db[f"{bucket}.files"].delete_one({"_id": doc["gridfs_id"]}).deleted_count == 1
    assert db[f"{bucket}.chunks"].delete_many({"files_id": doc["gridfs_id"]}).deleted_count >= 1


@pytest.mark.mongo
@pytest.mark.parametrize("lost", ["the file", "its chunks"])
def test_a_gridfs_file_that_is_gone_is_an_error_naming_the_store_and_record(
    tmp_path: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """Images too large for a document live in GridFS; one deleted there is an error naming the
    store (and the record) on every path, in one line: the dataset, verify, export."""
    gridfs_store_losing(tmp_path, mongo_uri, lost, monkeypatch)
    read = run_script(READ_EACH, mongo_uri, "c")
    assert read.returncode == 0 and "Traceback" not in read.stderr, read.stderr
    (line,) = read.stdout.splitlines()  # only record 2 fails
    assert line.startswith(f"2 {mongo_uri} collection c: ") and re.search(r"records? 2\b", line)
    verify = cli("verify", mongo_uri, "-c", "c", "-q")
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert f"{mongo_uri} collection c" in verify.stdout and "record 2" in verify.stdout
    export = cli("export", mongo_uri, "-c", "c", str(tmp_path / "out"), "-q")
    assert export.returncode == 1 and "Traceback" not in export.stderr, export.stderr
    (said,) = export.stderr.strip().splitlines()
    assert f"{mongo_uri} collection c" in said


@pytest.mark.mongo
@pytest.mark.parametrize(
    "lost",
    ["the file", "its chunks"],
)
def test_export_skip_damaged_leaves_out_only_a_record_whose_gridfs_file_is_gone(
    tmp_path: Path, mongo_uri: str, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    gridfs_store_losing(tmp_path, mongo_uri, lost, monkeypatch)
    out = tmp_path / "out"
    export = cli("export", mongo_uri, "-c", "c", str(out), "-q", "--skip-damaged")
    assert export.returncode == 1 and "Traceback" not in export.stderr, export.stderr
    assert "left out 1 damaged record(s)" in export.stdout, export.stdout + export.stderr
    assert sorted(p.name for p in out.rglob("*.jpg")) == ["0.jpg", "1.jpg", "3.jpg"]
