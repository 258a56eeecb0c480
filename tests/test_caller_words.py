"""What a user is told is said in the caller's words and works as said: errors advise Python
callers arguments and the command line its flags; each dataset names the other where it is
given the other kind of store; a command printed after Ctrl-C runs as printed; a skipped row
is listed once however many manifests give it."""

from __future__ import annotations

import pickle
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, MongoImageDataset, convert, open_store
from fastdata.errors import CorruptImageError, StoreExistsError, StoreNotFoundError, UsageError

from .conftest import jpeg_bytes, write
from .procs import child_env, cli, run_script


def images(root: Path, n: int = 4) -> Path:
    for i in range(n):
        write(root / ("a" if i % 2 else "b") / f"{i}.jpg", jpeg_bytes(seed=i))
    return root


def test_errors_advise_arguments_in_python_and_flags_on_the_command_line(tmp_path: Path) -> None:
    src, dst = images(tmp_path / "src"), tmp_path / "s.lmdb"
    convert(src, dst)
    with pytest.raises(StoreExistsError) as raised:
        convert(src, dst)
    assert "pass append=True to add the images it lacks, or overwrite=True to replace it" in str(
        raised.value
    )
    assert "--overwrite" not in str(raised.value)
    on_the_command_line = cli("convert", str(src), str(dst), "-q")
    assert on_the_command_line.returncode == 2
    assert "pass --append to add the images it lacks, or --overwrite to replace it" in (
        on_the_command_line.stderr
    )
    assert "overwrite=True" not in on_the_command_line.stderr
    # the error keeps its parts across processes (a worker's error, pickled)
    again = pickle.loads(pickle.dumps(raised.value))
    assert str(again) == str(raised.value) and "--overwrite" in again.render(cli=True)

    with pytest.raises(UsageError) as raised_usage:
        convert(src, tmp_path / "t.lmdb", resume=True)
    assert "run the same call without resume=True" in str(raised_usage.value)
    assert "--resume" not in str(raised_usage.value)
    write(src / "a" / "junk.jpg", b"not an image")
    with pytest.raises(CorruptImageError) as corrupt:
        convert(src, tmp_path / "u.lmdb", strict=True)
    assert "strict=True stops at the first" in str(corrupt.value)
    assert corrupt.value.reason == "not a recognised image format"  # (the advice apart)
    again = pickle.loads(pickle.dumps(corrupt.value))
    assert (again.name, again.reason, str(again)) == (
        corrupt.value.name,
        corrupt.value.reason,
        str(corrupt.value),
    )
    strict = cli("convert", str(src), str(tmp_path / "v.lmdb"), "--strict", "-q")
    assert "(--strict stops at the first" in strict.stderr


def test_each_dataset_names_the_other_for_the_other_kind_of_store(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"MongoImageDataset\(uri, collection\)"):
        LMDBImageDataset("mongodb://127.0.0.1:1/db")
    dst = tmp_path / "s.lmdb"
    convert(images(tmp_path / "src"), dst)
    with pytest.raises(UsageError, match=r"LMDBImageDataset\(path\)"):
        MongoImageDataset(str(dst), "c")
    with pytest.raises(UsageError, match=r"name the collection \(collection=NAME\)"):
        open_store("mongodb://127.0.0.1:1/db")


# Ctrl-C (SIGINT) once the writer committed its second batch.
INTERRUPTED = """
    import os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
    from fastdata.stores.lmdb.writer import LMDBWriter
    from fastdata.stores.mongo.writer import MongoWriter
    import fastdata.ops.convert
    fastdata.ops.convert.convert.__kwdefaults__["commit_records"] = 2  # several commits
    AT = int(os.environ.get("CTRL_C_AT", "2"))  # after that many batches (0: before the first)
    for kind in (LMDBWriter, MongoWriter):
        def patched(real):
            calls = [0]
            def write(self, records, progress):
                if AT == 0:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C before the first batch
                real(self, records, progress)
                if hasattr(self, "_wait"):
                    self._wait()  # (the Mongo writer sends in the background)
                calls[0] += 1
                if calls[0] == AT:
                    os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C
            return write
        kind.write = patched(kind.write)
        if AT == -1:  # Ctrl-C as the writer starts, before it saved anything
            def starting(real):
                def start(self, *args, **kwargs):
                    os.kill(os.getpid(), signal.SIGINT)
                    return real(self, *args, **kwargs)
                return start
            kind.start = starting(kind.start)
    from fastdata.cli import main
    sys.argv = ["fastdata", *sys.argv[1:]]
    main()
"""


def check_resumed(target: list[str], tmp_path: Path, n: int) -> None:
    src = images(tmp_path / "my images & more", n)
    result = run_script(INTERRUPTED, "convert", src, *target, "-q", "-j", "1")
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    printed = result.stderr.split("`")[1]
    assert printed.startswith("fastdata convert ") and printed.endswith(" --resume")
    done = cli(*shlex.split(printed)[1:])  # as a shell splits it
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed after 4 images" in done.stdout
    collection = target[target.index("--collection") + 1] if "--collection" in target else None
    assert len(open_store(target[0], collection=collection)) == n


def test_ctrl_c_prints_a_command_that_finishes_the_conversion(tmp_path: Path) -> None:
    check_resumed([str(tmp_path / "a store.lmdb")], tmp_path, 10)


@pytest.mark.mongo
def test_ctrl_c_in_a_mongodb_conversion_prints_a_command_that_finishes_it(
    tmp_path: Path, mongo_uri: str
) -> None:
    uri = f"{mongo_uri}?appName=x&connectTimeoutMS=20000"
    check_resumed([uri, "--collection", "big coll"], tmp_path, 10)


@pytest.mark.parametrize("verb", ["convert", "copy"])
def test_ctrl_c_with_relative_paths_and_a_dash_prints_a_command_that_runs_anywhere(
    tmp_path: Path, verb: str
) -> None:
    """A store named ``-x`` given after ``--``, both paths relative: the printed command names
    them absolute (so it runs from any folder, and ``-x`` is not read as an option)."""
    work = tmp_path / "work"
    images(work / "src", 10)
    if verb == "copy":
        convert(work / "src", work / "s.lmdb", commit_records=100)
    source = "src" if verb == "convert" else "s.lmdb"
    code = textwrap.dedent(INTERRUPTED)
    if verb == "copy":
        code = code.replace(
            '["commit_records"] = 2',
            '["commit_records"] = 2\n'
            "import fastdata.ops.copy\n"
            'fastdata.ops.copy.copy_store.__kwdefaults__["batch_size"] = 2',
        )
    result = subprocess.run(
        [sys.executable, "-c", code, verb, "-q", "--", source, "-x"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    printed = result.stderr.split("`")[1]
    done = cli(*shlex.split(printed)[1:])  # from the tests' own folder, not work/
    assert done.returncode == 0, printed + "\n" + done.stdout + done.stderr
    assert len(open_store(work / "-x")) == 10


@pytest.mark.parametrize("at", [-1, 0])
@pytest.mark.parametrize("backend", ["lmdb", pytest.param("mongo", marks=pytest.mark.mongo)])
def test_ctrl_c_before_the_first_batch_says_what_is_left_and_its_advice_works(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str, at: int
) -> None:
    """Ctrl-C as the writer starts (-1) or before its first batch (0): what the message says is
    so (nothing kept, or an interrupted store and the command that finishes it), and following
    it gives the store."""
    src = images(tmp_path / "src", 10)
    if backend == "lmdb":
        target = [str(tmp_path / "new.lmdb")]
    else:
        target = [request.getfixturevalue("mongo_uri"), "--collection", "new"]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INTERRUPTED), "convert", str(src), *target, "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**child_env(), "CTRL_C_AT": str(at)},
    )
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    collection = target[2] if len(target) > 1 else None
    if "`" in result.stderr:
        assert "what was committed is kept" in result.stderr, result.stderr
        done = cli(*shlex.split(result.stderr.split("`")[1])[1:])
    else:
        assert "nothing was kept" in result.stderr or "nothing was written" in result.stderr
        with pytest.raises(StoreNotFoundError):
            open_store(target[0], collection=collection)
        done = cli("convert", str(src), *target, "-q")  # the same command again
    assert done.returncode == 0, result.stderr + done.stdout + done.stderr
    assert len(open_store(target[0], collection=collection)) == 10


def test_a_row_skipped_by_two_manifests_is_listed_once(tmp_path: Path) -> None:
    images(tmp_path / "imgs")
    write(tmp_path / "imgs" / "junk.jpg", b"not an image")
    rows = "imgs/a/1.jpg,a\nimgs/junk.jpg,a\n,a\nimgs/b/0.jpg,zebra\n"
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    first.write_text("path,label\n" + rows)
    second.write_text("path,label\nimgs/b/2.jpg,b\n" + rows)  # the same rows, a line further
    dst = tmp_path / "s.lmdb"
    convert(first, dst, classes=["a", "b"], drop_unlisted=True)
    convert(second, dst, append=True, classes=["a", "b"], drop_unlisted=True)
    listed = [(s.name, s.reason) for s in open_store(dst).skipped_files()]
    assert sorted(listed) == [  # each once: where the first manifest gave it
        ("first.csv:4", "line 4: empty path"),
        ("first.csv:5", "line 5: imgs/b/0.jpg: unknown class 'zebra'"),
        ("imgs/junk.jpg", "not a recognised image format"),
    ]


def test_a_damaged_store_error_keeps_its_class_and_one_hint_across_a_worker() -> None:
    """An error whose class carries a hint (the store is damaged: run `fastdata verify STORE`),
    raised in a DataLoader worker, comes back in the training process as the same class, its
    hint said once; pickled, it keeps the store its command names. (A method named `message`
    made torch re-raise it as `type(message=...)`, a TypeError.)"""
    from torch._utils import ExceptionWrapper

    from fastdata.errors import RecordError

    try:
        raise RecordError("/data/s.lmdb: record 3 fails its checksum", store="/data/s.lmdb")
    except RecordError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(RecordError) as raised:
        wrapped.reraise()
    assert str(raised.value).count("`fastdata verify /data/s.lmdb`") == 1
    again = pickle.loads(pickle.dumps(RecordError("x: record 1", store="/data/s.lmdb")))
    assert type(again) is RecordError and again.store == "/data/s.lmdb"
    assert str(again) == "x: record 1; " + again.advice()[0]
