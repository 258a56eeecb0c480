"""Reads are checked: a record whose bytes are not the ones stored (its LMDB node sent to another
record's pages or to a page of the tree, bit rot, a document edited in place) is an error naming
the store, the record and a `fastdata verify` command that runs as printed, never wrong bytes
handed on, whether the dataset decodes them or gives them raw; ``check=False`` is the explicit
way to raw bytes unchecked."""

from __future__ import annotations

import json
import shlex
import struct
import subprocess
from pathlib import Path

import pytest
from bson import Binary

from fastdata import MongoImageDataset, convert
from fastdata.errors import RecordError
from fastdata.stores.lmdb.pages import format as lmdb_format

from .conftest import jpeg_bytes, write
from .mongo_server import database
from .procs import run_script
from .test_damaged_stores import _cli_env, big_store, nodes, pages, value_page

READ_ONE = """
    import sys
    from fastdata import LMDBImageDataset
    from fastdata.errors import FastdataError
    store, i, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kw = {} if sys.argv[4] == "1" else {"check": False}  # (the default, or the choice)
    ds = LMDBImageDataset(store, output=output, **kw)
    for how in ("ds[i]", "batch", "fields"):
        try:
            if how == "ds[i]":
                got = ds[i][0]
            elif how == "batch":
                got = ds.__getitems__([i - 1, i, i + 1])[1][0]
            else:
                got = LMDBImageDataset(store, output=output, as_dict=True, **kw)[i]["image"]
        except FastdataError as exc:
            print(how, "error:", type(exc).__name__, exc)
            continue
        print(how, "read:", got.hex() if isinstance(got, bytes) else type(got).__name__)
    print("neighbours", ds[i - 1][0] is not None, ds[i + 1][0] is not None)
"""


def _send_value(data_file: Path, key: bytes, page: int) -> None:
    """Point ``key``'s value (on pages of its own) at ``page``, leaving its size."""
    raw = data_file.read_bytes()
    for leaf, at, flags, found in nodes(data_file):
        if found == key and flags & lmdb_format.F_BIGDATA:
            with open(data_file, "r+b") as f:
                f.seek(leaf * 4096 + at + 8 + len(key))
                f.write(struct.pack("<Q", page))
    assert raw != data_file.read_bytes()


def _read(store: Path, i: int, output: str, check: bool = True) -> dict[str, str]:
    result = run_script(READ_ONE, store, i, output, "1" if check else "0", timeout=60)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


@pytest.mark.parametrize("to", ["another record's pages", "a branch page"])
def test_a_record_sent_to_other_pages_is_an_error_not_wrong_bytes(tmp_path: Path, to: str) -> None:
    store = big_store(tmp_path)  # (each image on pages of its own)
    data_file = store / "data.mdb"
    original = (tmp_path / "big" / "c" / "015.jpg").read_bytes()
    if to == "a branch page":
        target = pages(data_file, lmdb_format.P_BRANCH)[0]
    else:
        target = value_page(data_file, b"0000000016")
    _send_value(data_file, b"0000000015", target)
    command = f"fastdata verify {shlex.quote(str(store.resolve()))}"
    for output in ("pil", "bytes"):
        seen = _read(store, 15, output)
        for how in ("ds[i]", "batch", "fields"):
            assert seen[how].startswith("error: RecordError"), (output, how, seen[how])
            assert "record 15 (c/015.jpg) fails its checksum" in seen[how]
            assert f"`{command}`" in seen[how] and str(store) in seen[how]
        assert seen["neighbours"] == "True True"
    unchecked = _read(store, 15, "bytes", check=False)  # (the explicit choice: as LMDB gives)
    assert unchecked["ds[i]"].startswith("read:")
    assert bytes.fromhex(unchecked["ds[i]"].split(" ", 1)[1]) != original
    verify = subprocess.run(command, shell=True, capture_output=True, text=True, env=_cli_env())
    assert verify.returncode == 1 and "\n  15 " in verify.stdout, verify.stdout + verify.stderr


def test_checked_reads_give_every_sound_record(tmp_path: Path) -> None:
    """``check=True`` (the default, here given) passes every sound record: headers with
    fields and names that JSON escapes are read as they are written, through every way of
    reading, a subset's too."""
    from fastdata import LMDBImageDataset

    src = tmp_path / "src"
    names = ['a "quoted" name.jpg', "back\\slash.jpg", "café.jpg", "plain.jpg"]
    lines = []
    for k, name in enumerate(names):
        write(src / "c" / name, jpeg_bytes(16, 16, seed=k))
        lines.append(json.dumps({"path": f"c/{name}", "label": "c", "caption": f"size {k}"}))
    (src / "m.jsonl").write_text("\n".join(lines) + "\n")
    store = tmp_path / "s.lmdb"
    convert(src / "m.jsonl", store)
    for output in ("bytes", "pil"):
        ds = LMDBImageDataset(store, output=output, check=True)
        assert len(ds.__getitems__(list(range(4)))) == 4 and all(ds[i] for i in range(4))
        assert len(ds.subset(indices=[3, 1]).__getitems__([0, 1])) == 2
        with_fields = LMDBImageDataset(store, output=output, fields="*", as_dict=True, check=True)
        assert [s["caption"] for s in with_fields] == [f"size {k}" for k in range(4)]
    raw = LMDBImageDataset(store, output="bytes", check=True)
    assert sorted(raw[i][0] for i in range(4)) == sorted(
        (src / "c" / n).read_bytes() for n in names
    )


@pytest.mark.mongo
def test_a_document_whose_bytes_changed_is_an_error_not_wrong_bytes(
    tmp_path: Path, mongo_uri: str
) -> None:
    src = tmp_path / "src"
    for i in range(6):
        write(src / "c" / f"{i:03d}.jpg", jpeg_bytes(32, 32, seed=i))
    convert(src, mongo_uri, collection="imgs")
    coll = database(mongo_uri)["imgs"]
    doc = coll.find_one({"_id": 3})
    flipped = bytearray(doc["data"])
    flipped[-10] ^= 0xFF  # (bit rot in the scan data: it still decodes)
    coll.update_one({"_id": 3}, {"$set": {"data": Binary(bytes(flipped))}})
    for output in ("pil", "bytes"):
        ds = MongoImageDataset(mongo_uri, "imgs", output=output)
        for batch in ([3], [2, 3]):
            with pytest.raises(
                RecordError, match=r"record 3 \(c/003.jpg\) fails its checksum"
            ) as e:
                ds.__getitems__(batch) if len(batch) > 1 else ds[3]
            assert "`fastdata verify " in str(e.value) and "--collection imgs`" in str(e.value)
        assert ds[2] and ds[4]
    unchecked = MongoImageDataset(mongo_uri, "imgs", output="bytes", check=False)
    assert unchecked[3][0] == bytes(flipped)
