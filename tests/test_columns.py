"""Fields kept as columns beside an LMDB store's records: what a dataset reads from them, and
what a query selects over them, is what it reads and selects from each record's header (the
source of truth); they span blocks and grow with appends; damage to them is named, and
`fastdata columns` builds them again in place while readers read on."""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch

from fastdata import LMDBImageDataset, convert
from fastdata.errors import StoreDamagedError
from fastdata.loaders.collate import fast_collate
from fastdata.query import check_query, compile_query, record_document
from fastdata.query_columns import column_mask
from fastdata.sample_fields import FieldBatch
from fastdata.stores.lmdb import columns as lmdb_columns
from fastdata.stores.lmdb.reader import LMDBStore

from .conftest import jpeg_bytes, tiny_store, write

FIELDS = (
    "caption:str,meta:json,score:float,n:int,flag:bool,quad:float[4],pair:bool[2],"
    "grid:int[2,2],tags:int[-1],boxes:float[-1,4]"
)


def row(i: int, rng: random.Random) -> dict[str, Any]:
    return {
        "path": f"img/{i}.jpg",
        "label": ["cat", "dog", "eel"][i % 3],
        "caption": f"{'ü' if i % 5 == 0 else 'a'} photo {i}",
        "meta": {"k": i % 4, "xs": [i, None]} if i % 2 else [i, "s"],
        "score": rng.choice([0.5 * rng.randint(-8, 8), float(rng.randint(-3, 3)), 1e300, -2.5]),
        "n": rng.choice([rng.randint(-4, 4), 2**62, -(2**62)]),
        "flag": rng.random() < 0.5,
        "quad": [rng.randint(0, 6) * 0.5 for _ in range(4)],
        "pair": [rng.random() < 0.5, rng.random() < 0.5],
        "grid": [[rng.randint(0, 3), rng.randint(0, 3)], [rng.randint(0, 3), 9]],
        "tags": [rng.randint(0, 5) for _ in range(rng.randint(0, 4))],
        "boxes": [[rng.randint(0, 8) * 0.25 for _ in range(4)] for _ in range(rng.randint(0, 3))],
    }


def make_store(tmp_path: Path, n: int, name: str = "s.lmdb", seed: int = 0) -> Path:
    rng = random.Random(seed)
    image = jpeg_bytes(16, 16)
    rows = []
    for i in range(n):
        write(
            tmp_path / "img" / f"{i}.jpg",
            image[:2] + b"\xff\xfe\x00\x06" + i.to_bytes(4) + image[2:],
        )
        rows.append(json.dumps(row(i, rng)))
    manifest = tmp_path / f"{name}.jsonl"
    manifest.write_text("\n".join(rows) + "\n")
    convert(manifest, tmp_path / name, fields=FIELDS)
    return tmp_path / name


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types (arrays: dtype, shape and every element)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def headers_only(ds: LMDBImageDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read this dataset's fields from the records' headers, as a store without columns."""
    monkeypatch.setattr(ds.reader, "field_batch", lambda indices, names: None)


@pytest.mark.parametrize("as_dict", [False, True])
def test_fields_read_from_columns_are_the_headers_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_dict: bool
) -> None:
    store = make_store(tmp_path, 40)
    columns = LMDBImageDataset(store, output="numpy", fields="*", as_dict=as_dict)
    headers = LMDBImageDataset(store, output="numpy", fields="*", as_dict=as_dict)
    headers_only(headers, monkeypatch)
    batch = [3, 0, 39, 17, 17, -1]
    got, want = columns.__getitems__(batch), headers.__getitems__(batch)
    assert isinstance(got, FieldBatch) and not isinstance(want, FieldBatch)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert same(a, b), (a, b)
    assert got[2][2 if not as_dict else "tags"] is not None
    for pad in (False, True):
        assert same(fast_collate(got, pad=pad), fast_collate(want, pad=pad))
    single = columns[5]
    assert same(single, headers[5])


def test_a_view_reads_its_records_fields_from_the_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path, 30)
    view = LMDBImageDataset(store, output="bytes", fields=["boxes", "caption"]).subset(
        classes=["eel", "cat"]
    )
    plain = LMDBImageDataset(store, output="bytes", fields=["boxes", "caption"])
    headers_only(plain, monkeypatch)
    records = view.reader.records
    for j, sample in enumerate(view.__getitems__(list(range(len(view))))):
        want = plain[int(records[j])]
        assert same(sample[0], want[0]) and same(sample[2], want[2])


def queries(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Random queries over every field and operator, with values of every kind: numbers
    between and past the stored ones, ints past 2**53 and 2**63, infinities, NaN, strings,
    booleans, null."""
    paths = [
        "_id", "label", "fields.score", "fields.n", "fields.flag", "fields.caption",
        "fields.quad", "fields.quad.1", "fields.quad.7", "fields.pair", "fields.pair.0",
        "fields.grid", "fields.grid.1", "fields.grid.0.1", "fields.grid.1.5", "fields.tags",
        "fields.tags.0", "fields.tags.2", "fields.boxes", "fields.boxes.0", "fields.boxes.1.2",
        "fields.boxes.0.9", "fields.score.0", "fields.caption.1",
    ]  # fmt: skip
    values: list[Any] = [
        0, 1, 2, 3, -1, 0.5, 1.25, 2.5, -2.5, 2**53 + 1, 2**62, 2**63, -(2**64), 1e300,
        float("inf"), float("-inf"), float("nan"), True, False, None, "a photo 3", "ü", "b",
    ]  # fmt: skip

    def condition() -> Any:
        op = rng.choice(
            [
                "$eq",
                "$ne",
                "$gt",
                "$gte",
                "$lt",
                "$lte",
                "$in",
                "$nin",
                "$exists",
                "$size",
                "$all",
                "$not",
                "$regex",
                "value",
            ]  # fmt: skip
        )
        if op == "value":
            return rng.choice(values)
        if op in ("$in", "$nin", "$all"):
            return {op: rng.sample(values, rng.randint(0, 3))}
        if op == "$exists":
            return {op: rng.choice([True, False])}
        if op == "$size":
            return {op: rng.randint(0, 4)}
        if op == "$regex":
            return {op: rng.choice(["photo 1", "^ü", "3$", "A"]), "$options": rng.choice(["", "i"])}
        if op == "$not":
            return {op: {rng.choice(["$gt", "$eq", "$in"]): rng.choice([1, 0.5, [1, 2]])}}
        return {op: rng.choice(values)}

    def document(depth: int = 0) -> dict[str, Any]:
        if depth < 2 and rng.random() < 0.25:
            return {rng.choice(["$and", "$or", "$nor"]): [document(depth + 1) for _ in range(2)]}
        return {rng.choice(paths): condition() for _ in range(rng.randint(1, 2))}

    out = []
    while len(out) < n:
        q = document()
        if "$not" in json.dumps(q, default=str) and "[1, 2]" in json.dumps(q, default=str):
            continue  # ($not over $gt of a list is refused by check_query: not a test of this)
        try:
            check_query(q, [f.split(":")[0] for f in FIELDS.split(",")])
        except Exception:
            continue
        out.append(q)
    return out


def test_a_query_over_the_columns_selects_what_it_selects_over_the_headers(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path, 120)
    reader = LMDBStore(store)
    names = reader.meta.schema.names
    docs = [record_document(i, h) for i, h in enumerate(reader.iter_headers())]
    ran = 0
    for q in queries(random.Random(7), 1500):
        query = check_query(q, names)
        mask = column_mask(query, len(reader), reader.labels, reader.field_column)
        if mask is None:
            continue
        ran += 1
        test = compile_query(query, names)
        want = [i for i, doc in enumerate(docs) if test(doc)]
        assert np.flatnonzero(mask).tolist() == want, q
    assert ran >= 1200  # (the columns answer almost every one of these)


def test_columns_span_blocks_and_an_append_extends_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lmdb_columns, "BLOCK", 16)
    rng = random.Random(3)
    image = jpeg_bytes(16, 16)
    rows = []
    for i in range(70):
        write(
            tmp_path / "img" / f"{i}.jpg",
            image[:2] + b"\xff\xfe\x00\x06" + i.to_bytes(4) + image[2:],
        )
        rows.append(json.dumps(row(i, rng)))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(rows[:40]) + "\n")
    store = tmp_path / "s.lmdb"
    convert(manifest, store, fields=FIELDS)
    before = LMDBImageDataset(store, output="bytes", fields="*")
    old = before.reader.field_column("boxes")
    assert old is not None and len(old) == 40
    index_before = column_index(store)
    assert index_before["block"] == 16 and len(index_before["blocks"]["boxes"]) == 3
    manifest.write_text("\n".join(rows) + "\n")
    before.close()  # (an append refuses a store open in its own process)
    before.reader.__dict__["_columns"] = {}
    convert(manifest, store, fields=FIELDS, append=True)
    index_after = column_index(store)
    assert index_after["count"] == 70 and len(index_after["blocks"]["boxes"]) == 5
    # the whole blocks stayed as they were; the partial one was built again, longer
    assert index_after["blocks"]["boxes"][:2] == index_before["blocks"]["boxes"][:2]
    assert index_after["blocks"]["boxes"][2] != index_before["blocks"]["boxes"][2]
    # a dataset opened before the append reads its 40 records' fields, now from the new columns
    fresh = LMDBImageDataset(store, output="bytes", fields="*")
    assert len(before) == 40 and len(fresh) == 70
    assert same(before.__getitems__([0, 39])[1][2], fresh.__getitems__([0, 39])[1][2])
    headers = LMDBImageDataset(store, output="bytes", fields="*")
    headers_only(headers, monkeypatch)
    everything = list(range(70))
    assert same(list(fresh.__getitems__(everything)), headers.__getitems__(everything))
    assert not LMDBStore(store).columns_problems()


def column_index(store: Path) -> dict[str, Any]:
    """The store's index of columns, as stored (read by a reader of this process)."""
    found = lmdb_columns.read_index(LMDBStore(store)._env(), str(store))
    assert found is not None
    return dict(json.loads(found[0]))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastdata", *args], capture_output=True, text=True, timeout=120
    )


def test_a_damaged_column_is_named_and_built_again_in_place(tmp_path: Path) -> None:
    store = make_store(tmp_path, 20)
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = b"__columns__/score/000000"
        raw = bytearray(txn.get(key))
        raw[8:16] = np.float64(12345.5).tobytes()  # record 1's score, same length
        txn.put(key, bytes(raw))
    ds = LMDBImageDataset(store, output="bytes", fields=["score"])
    with pytest.raises(
        StoreDamagedError, match=r"field 'score' for records 0\.\.19.*fastdata columns"
    ):
        ds.__getitems__([0])
    checked = run_cli("verify", str(store))
    assert checked.returncode != 0 and "Traceback" not in checked.stderr
    said = checked.stdout + checked.stderr
    assert "column of field 'score'" in said and "fastdata columns" in said
    # the command as printed builds them again
    command = said[said.index("`fastdata columns") + 1 :].split("`")[0]
    rebuilt = run_cli(*command.split()[1:])
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "built and read back" in rebuilt.stdout
    assert run_cli("verify", str(store)).returncode == 0
    fresh = LMDBImageDataset(store, output="bytes", fields=["score"])
    assert fresh[1][2]["score"] == LMDBStore(store).read_records([1])[0].header.fields["score"]


@pytest.mark.parametrize(
    ("damage", "holds"),
    [("one name short", "19 names"), ("not names at all", "1 name "), ("empty", "0 names")],
)
@pytest.mark.parametrize("fields", [True, False])
def test_an_index_of_names_not_one_name_a_record_is_named_and_built_again_as_printed(
    tmp_path: Path, damage: str, holds: str, fields: bool
) -> None:
    """Reads and appends take each name from its header when the index does not hold one a
    record: nothing reads wrong, but verify said the store was sound; now it names the index
    and the command that builds it again (with the columns, which it keeps as they were)."""
    store = make_store(tmp_path, 20) if fields else tiny_store(tmp_path, 20)
    index = LMDBStore(store).names_index()
    assert index is not None and len(index) == 20
    names = index.joined()
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        whole = bytes(txn.get(b"__names__"))
        damaged = {
            "one name short": whole.rsplit(b"\0", 1)[0],
            "not names at all": b"\xff" * 7,
            "empty": b"",
        }[damage]
        txn.put(b"__names__", damaged)
    checked = run_cli("verify", str(store))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"its index of names holds {holds}" in checked.stdout, checked.stdout
    assert "every record is sound" in checked.stdout
    printed = set(re.findall(r"`(fastdata [^`]+)`", checked.stdout))
    assert len(printed) == 1, checked.stdout
    rebuilt = run_cli(*shlex.split(printed.pop())[1:])
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "index of names" in rebuilt.stdout and "built and read back" in rebuilt.stdout
    again = run_cli("verify", str(store))
    assert again.returncode == 0, again.stdout + again.stderr
    reader = LMDBStore(store)
    rebuilt_index = reader.names_index()
    assert rebuilt_index is not None and rebuilt_index.joined() == names
    if fields:
        assert reader.columns_cover() == 20 and not reader.columns_problems()


def _index_renamed(store: Path, old: bytes, new: bytes) -> None:
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        names = bytes(txn.get(b"__names__")).split(b"\0")
        names[names.index(old)] = new
        txn.put(b"__names__", b"\0".join(names))


def _printed(said: str) -> list[str]:
    (command,) = set(re.findall(r"`(fastdata [^`]+)`", said))
    return shlex.split(command)[1:]


@pytest.mark.parametrize(
    "new", [b"c/gone.jpg", b"c/0002.jpg"], ids=["a name not in the source", "another record's"]
)
def test_an_append_over_an_index_of_names_that_lost_a_name_stores_nothing_twice(
    tmp_path: Path, new: bytes
) -> None:
    """The append took the index's names for the store's: a name the index lost was "not in
    the store", and its image was stored a second time (exit 0, and verify failed after)."""
    store = tiny_store(tmp_path, 8)
    _index_renamed(store, b"c/0001.jpg", new)
    write(tmp_path / "src" / "c" / "0008.jpg", jpeg_bytes(16, 16, seed=8))
    before = (store / "data.mdb").read_bytes()
    appended = run_cli("convert", str(tmp_path / "src"), str(store), "--append")
    assert appended.returncode == 1 and "Traceback" not in appended.stderr, appended.stderr
    assert "record 1 is c/0001.jpg, the index says" in appended.stderr, appended.stderr
    assert (store / "data.mdb").read_bytes() == before
    rebuilt = run_cli(*_printed(appended.stderr))
    assert rebuilt.returncode == 0, rebuilt.stderr
    again = run_cli("convert", str(tmp_path / "src"), str(store), "--append")
    assert again.returncode == 0, again.stderr
    assert run_cli("verify", str(store)).returncode == 0
    names = sorted(r.header.name for r in LMDBStore(store).read_records(range(9)))
    assert len(LMDBStore(store)) == 9 and names == sorted(f"c/{i:04d}.jpg" for i in range(9))


def test_an_index_of_names_that_disagrees_with_the_headers_is_built_again_by_columns(
    tmp_path: Path,
) -> None:
    """The headers are the source of truth (the index is built from them): verify names the
    index, not the store's invariants on the index's names, and the repair is the index's."""
    store = tiny_store(tmp_path, 8)
    _index_renamed(store, b"c/0001.jpg", b"c/0002.jpg")  # (c/0002.jpg twice in the index)
    checked = run_cli("verify", str(store))
    assert checked.returncode == 1, checked.stderr
    assert "breaks its invariants" not in checked.stdout, checked.stdout
    assert "record 1 is c/0001.jpg, the index says c/0002.jpg" in checked.stdout
    assert "--overwrite" not in checked.stdout and "export" not in checked.stdout
    assert run_cli(*_printed(checked.stdout)).returncode == 0
    assert run_cli("verify", str(store)).returncode == 0


def test_a_column_that_disagrees_with_its_headers_is_named_by_verify(tmp_path: Path) -> None:
    """A block whose checksum holds (rewritten whole, its index with it) but whose values are
    not the headers': verify compares them, the header being the source of truth."""
    store = make_store(tmp_path, 20)
    reader = LMDBStore(store)
    column = reader.field_column("n")
    assert column is not None
    values = column.values.copy()
    values[7] += 1
    reader.close()
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        index = json.loads(txn.get(b"__columns__"))
        data = values.tobytes()
        import zlib

        index["blocks"]["n"][0] = [zlib.crc32(data), len(data)]
        txn.put(b"__columns__/n/000000", data)
        txn.put(b"__columns__", json.dumps(index).encode())
    problems = LMDBStore(store).columns_problems()
    assert len(problems) == 1 and "record 7's value" in problems[0]
    assert "fastdata columns" in problems[0]


def test_a_store_without_columns_reads_its_headers_and_gains_them_while_read(
    tmp_path: Path,
) -> None:
    """A store written before columns (their keys removed here): fields and queries go by the
    headers, info says so and prints the command that builds them, which runs while another
    process reads the store's fields."""
    store = make_store(tmp_path, 60)
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        keys = [
            bytes(k)
            for k in txn.cursor().iternext(values=False)
            if bytes(k).startswith(b"__columns__")
        ]
        for k in keys:
            txn.delete(k)
    ds = LMDBImageDataset(store, output="bytes", fields="*")
    assert not isinstance(ds.__getitems__([0, 1]), FieldBatch)
    query = {"fields.tags.1": {"$exists": True}, "fields.score": {"$lt": 1}}
    before = ds.reader.matching(query).tolist()
    info = run_cli("info", str(store))
    assert "columns:    none: queries and fields read each record" in info.stdout
    command = info.stdout[info.stdout.index("`fastdata columns") + 1 :].split("`")[0]
    reading = subprocess.Popen(
        [sys.executable, "-c", READ_ON, str(store)], stdout=subprocess.PIPE, text=True
    )
    try:
        built = run_cli(*command.split()[1:])
    finally:
        out, _ = reading.communicate(timeout=120)
    assert built.returncode == 0, built.stderr
    assert reading.returncode == 0 and out.strip().startswith("read "), out
    after = LMDBImageDataset(store, output="bytes", fields="*")
    assert isinstance(after.__getitems__([0, 1]), FieldBatch)
    assert after.reader.matching(query).tolist() == before
    assert "columns:    every field" in run_cli("info", str(store)).stdout


READ_ON = """
import sys, time
from fastdata import LMDBImageDataset
n = 0
end = time.monotonic() + 3
while time.monotonic() < end:
    ds = LMDBImageDataset(sys.argv[1], output="bytes", fields="*")
    for j, s in enumerate(ds.__getitems__(list(range(60)))):
        assert s[2]["caption"].endswith(f" photo {j}"), (j, s[2])
    n += 1
print(f"read {n} times")
"""


def test_an_index_into_an_array_past_64_bits_or_not_in_ascii_digits_reaches_nothing(
    tmp_path: Path,
) -> None:
    """An array's index as MongoDB reads one (ASCII 0-9 only; an Arabic-Indic one, a
    superscript two are keys, which an array of numbers does not have), of any size: nothing there, on the columns and the headers, and
    no traceback from the command line."""
    store = make_store(tmp_path, 20)
    ds = LMDBImageDataset(store, output="bytes", fields="*")
    everyone = list(range(20))
    huge = "99999999999999999999"
    for path in (
        f"fields.tags.{huge}",
        f"fields.boxes.{huge}.0",
        "fields.tags.\u00b2",
        "fields.tags.\u0661",
    ):
        assert ds.reader.matching({path: {"$exists": True}}).tolist() == [], path
        assert ds.reader.matching({path: {"$exists": False}}).tolist() == everyone, path
        assert ds.reader.matching({path: 1}).tolist() == [], path
    said = run_cli("info", str(store), "--where", json.dumps({f"fields.tags.{huge}": 3}))
    assert said.returncode == 0 and "Traceback" not in said.stderr, said.stderr
    assert "selected:   0 of 20" in said.stdout


@pytest.mark.parametrize("index", [b"[" * 100_000 + b"]" * 100_000, b'{"version": 2}'])
def test_a_damaged_index_of_columns_names_the_command_that_builds_them_again(
    tmp_path: Path, index: bytes
) -> None:
    """An index nested past json's parser, or of a later version: one line from every command
    that reads it, naming the store in a command that works as printed."""
    store = make_store(tmp_path, 10)
    with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
        txn.put(b"__columns__", index)
    for args in (["info", str(store)], ["verify", str(store)]):
        said = run_cli(*args)
        assert said.returncode != 0 and "Traceback" not in said.stderr, said.stderr
        out = said.stdout + said.stderr
        assert "the index of the store's columns is damaged" in out
        command = out[out.index("`fastdata columns") + 1 :].split("`")[0]
        assert command == f"fastdata columns {store.resolve()}"
    assert run_cli(*command.split()[1:]).returncode == 0
    assert run_cli("verify", str(store)).returncode == 0


def test_a_column_of_values_no_field_holds_is_damaged_whatever_its_checksum(
    tmp_path: Path,
) -> None:
    """Blocks rewritten with their checksums: a string's value that begins inside a character
    ('ü' cut in two), a boolean byte that is neither 0 nor 1: named with the command that
    builds the columns again, not a UnicodeDecodeError or a bool tensor holding 2."""
    import zlib

    store = make_store(tmp_path, 10)

    def rewrite(field: str, change: Any) -> None:
        with lmdb.open(str(store), map_size=1 << 30) as env, env.begin(write=True) as txn:
            key = f"__columns__/{field}/000000".encode()
            data = change(bytearray(txn.get(key)))
            index = json.loads(txn.get(b"__columns__"))
            index["blocks"][field][0] = [zlib.crc32(data), len(data)]
            txn.put(key, data)
            txn.put(b"__columns__", json.dumps(index).encode())

    def cut(raw: bytearray) -> bytes:
        lengths = np.frombuffer(raw[:80], np.int64).copy()
        assert lengths[0] == len("ü photo 0".encode())
        lengths[0], lengths[1] = 1, lengths[1] + lengths[0] - 1  # (record 1 begins in 'ü')
        return lengths.tobytes() + raw[80:]

    def two(raw: bytearray) -> bytes:
        raw[3] = 2
        return bytes(raw)

    def shifted(raw: bytearray) -> bytes:  # (a JSON value's first byte given to the one before)
        lengths = np.frombuffer(raw[:80], np.int64).copy()
        lengths[0], lengths[1] = lengths[0] + 1, lengths[1] - 1
        return lengths.tobytes() + raw[80:]

    for field, change in (("caption", cut), ("flag", two), ("meta", shifted)):
        rewrite(field, change)
        ds = LMDBImageDataset(store, output="bytes", fields=[field])
        with pytest.raises(StoreDamagedError, match=rf"field '{field}'.*fastdata columns"):
            list(ds.__getitems__([0, 1, 3]))  # (a JSON value is parsed when looked at)
        ds.close()
        if field != "meta":  # (a query reads no JSON column: the headers answer it)
            where = {"fields.caption": {"$regex": "photo"}, "fields.flag": True}
            said = run_cli("info", str(store), "--where", json.dumps(where))
            assert said.returncode != 0 and "Traceback" not in said.stderr, said.stderr
            assert f"fastdata columns {store.resolve()}" in said.stderr
        assert run_cli("columns", str(store)).returncode == 0


def test_a_read_past_64_bits_is_an_index_error(tmp_path: Path) -> None:
    ds = LMDBImageDataset(make_store(tmp_path, 5), output="bytes", fields=["caption"])
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([0, 2**64])


def test_the_columns_of_a_store_of_no_records_are_built(tmp_path: Path) -> None:
    from fastdata import copy_store

    empty = tmp_path / "empty.lmdb"
    copy_store(make_store(tmp_path, 5), empty, where={"_id": {"$lt": 0}})
    built = run_cli("columns", str(empty))
    assert built.returncode == 0, built.stderr
    assert "columns of 10 fields and the index of names over 0 records built and read back" in (
        built.stdout
    )
    ds = LMDBImageDataset(empty, output="bytes", fields="*")
    assert len(ds) == 0 and ds.reader.matching({"fields.tags.1": 3}).tolist() == []


KILLED_BUILDING = """
import os, signal, sys
from fastdata.stores.lmdb import columns

build = columns.build_block
made = []

def build_then_die(field, values):
    made.append(field.name)
    if len(made) == int(sys.argv[2]):  # (blocks before this one were committed)
        os.kill(os.getpid(), signal.SIGKILL)
    return build(field, values)

columns.build_block = build_then_die
columns.BLOCK = 8
from fastdata.ops.columns import build_columns
build_columns(sys.argv[1])
"""


def test_a_build_of_columns_killed_on_its_way_leaves_the_records_read_and_a_rebuild(
    tmp_path: Path,
) -> None:
    """`fastdata columns` SIGKILLed after some blocks were committed, before its index: the
    store reads its fields and queries from the headers (info says so), verify finds the records
    sound, and the same command builds the columns whole."""
    store = make_store(tmp_path, 40)
    want = LMDBImageDataset(store, output="bytes", fields="*")
    expected = [s[2] for s in want.__getitems__(list(range(40)))]
    want.close()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BUILDING, str(store), "25"], capture_output=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr
    ds = LMDBImageDataset(store, output="bytes", fields="*")
    got = ds.__getitems__(list(range(40)))
    assert not isinstance(got, FieldBatch)  # (no index: the headers answer)
    assert all(same(a[2], b) for a, b in zip(got, expected, strict=True))
    assert "columns:    none" in run_cli("info", str(store)).stdout
    assert run_cli("verify", str(store)).returncode == 0
    ds.close()
    assert run_cli("columns", str(store)).returncode == 0
    again = LMDBImageDataset(store, output="bytes", fields="*").__getitems__(list(range(40)))
    assert isinstance(again, FieldBatch)
    assert all(same(a[2], b) for a, b in zip(again, expected, strict=True))
    assert not LMDBStore(store).columns_problems()


def test_index_on_an_lmdb_store_prints_commands_that_run(tmp_path: Path) -> None:
    """An LMDB store has no server to index a key: `fastdata index` says so, and the commands it
    prints (info, columns) run as printed."""
    store = make_store(tmp_path, 12)
    said = run_cli("index", str(store), "fields.score")
    assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr
    commands = [part for part in said.stderr.split("`")[1::2] if part.startswith("fastdata ")]
    assert [c.split()[1] for c in commands] == ["info", "columns"], said.stderr
    for command in commands:
        ran = run_cli(*shlex.split(command)[1:])
        assert ran.returncode == 0, (command, ran.stderr)
