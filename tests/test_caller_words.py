"""What a user is told is said in the caller's words and works as said: errors advise Python
callers arguments and the command line its flags; each dataset names the other where it is
given the other kind of store; a command printed after Ctrl-C runs as printed; a skipped row
is listed once however many manifests give it."""

from __future__ import annotations

import pickle
import shlex
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, MongoImageDataset, convert, open_store
from fastdata.errors import CorruptImageError, StoreExistsError, UsageError

from .conftest import jpeg_bytes, write
from .procs import cli, run_script


def images(root: Path, n: int = 4) -> Path:
    for i in range(n):
        write(root / ("a" if i % 2 else "b") / f"{i}.jpg", jpeg_bytes(seed=i))
    return root


def test_errors_advise_arguments_in_python_and_flags_on_the_command_line(tmp_path: Path) -> None:
    src, dst = images(tmp_path / "src"), tmp_path / "s.lmdb"
    convert(src, dst)
    with pytest.raises(StoreExistsError) as raised:
        convert(src, dst)
    assert "pass overwrite=True to replace it" in str(raised.value)
    assert "--overwrite" not in str(raised.value)
    on_the_command_line = cli("convert", str(src), str(dst), "-q")
    assert on_the_command_line.returncode == 2
    assert "pass --overwrite to replace it" in on_the_command_line.stderr
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
    for kind in (LMDBWriter, MongoWriter):
        def patched(real):
            calls = [0]
            def write(self, records, progress):
                real(self, records, progress)
                if hasattr(self, "_wait"):
                    self._wait()  # (the Mongo writer sends in the background)
                calls[0] += 1
                if calls[0] == 2:
                    os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C
            return write
        kind.write = patched(kind.write)
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
