"""One filter language on both backends: the same MongoDB query document selects the same
records from an LMDB store (run here, over its headers) and from its copy in MongoDB (run by the
server), and anything outside the language is refused by name on both, before a record is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdata import LMDBImageDataset, MongoImageDataset, convert
from fastdata.errors import QueryError
from fastdata.ops.copy import copy_store
from fastdata.query import compile_query

from .conftest import jpeg_bytes, write


def rows(n: int) -> list[dict[str, Any]]:
    """Fields of every kind, with values that MongoDB's rules treat unlike Python's: ints and
    floats, booleans beside numbers, strings of digits, nulls, arrays of arrays, documents."""
    out = []
    for i in range(n):
        meta: Any = {"source": ["web", "scan", "phone"][i % 3], "ok": i % 2 == 0, "n": i}
        if i % 5 == 0:
            meta = {"source": None, "n": str(i)}  # null, and a number as a string
        if i % 7 == 3:
            meta = [1, {"a": i}, "x"]  # another kind at the same path
        out.append(
            {
                "path": f"img/{i}.jpg",
                "label": ["cat", "dog", "eel"][i % 3],
                "caption": f"{'A' if i % 4 == 0 else 'a'} photo of thing {i}",
                "boxes": [[1.5 * k, 2.0, 3.0, 4.0 + i] for k in range(i % 4)],
                "score": 0.25 * i if i % 6 else i // 6,
                "tags": [i % 3, i % 5],
                "flag": i % 3 == 0,
                "meta": meta,
            }
        )
    return out


QUERIES: list[dict[str, Any]] = [
    {},
    {"label": 1},
    {"name": "img/3.jpg"},
    {"_id": {"$in": [0, 4, 99]}},
    {"fields.score": {"$gt": 2}},
    {"fields.score": {"$gte": 1, "$lt": 3.5}},
    {"fields.score": 2},  # an int matches a float of the same value
    {"fields.score": {"$lte": "9"}},  # a string against numbers: nothing
    {"fields.flag": True},
    {"fields.flag": 1},  # a number is not a boolean
    {"fields.flag": {"$ne": True}},
    {"fields.boxes.2": {"$exists": True}},
    {"fields.boxes.0": {"$exists": False}},
    {"fields.boxes": {"$size": 2}},
    {"fields.boxes": {"$size": 0}},
    {"fields.boxes.1.3": {"$gt": 10}},
    {"fields.boxes": {"$elemMatch": {"$elemMatch": {"$gt": 12}}}},
    {"fields.boxes": [[0.0, 2.0, 3.0, 5.0]]},
    {"fields.tags": 2},  # an element of an array
    {"fields.tags": [0, 0]},  # the whole array
    {"fields.tags": {"$all": [0, 2]}},
    {"fields.tags": {"$in": [4, 7]}},
    {"fields.tags": {"$nin": [0, 1]}},
    {"fields.tags": {"$gt": 3}},  # any element
    {"fields.tags": {"$elemMatch": {"$gt": 1, "$lt": 3}}},
    {"fields.tags.1": {"$lt": 2}},
    {"fields.caption": {"$regex": "thing 1"}},
    {"fields.caption": {"$regex": "^a photo", "$options": "i"}},
    {"fields.caption": {"$not": {"$regex": "^A"}}},
    {"fields.caption": {"$gt": "a photo of thing 5"}},
    {"fields.meta.source": "web"},
    {"fields.meta.source": None},  # null, or missing
    {"fields.meta.source": {"$ne": None}},
    {"fields.meta.source": {"$exists": False}},
    {"fields.meta.source": {"$in": [None, "scan"]}},
    {"fields.meta.n": {"$gte": 10}},
    {"fields.meta.n": {"$regex": "^1"}},  # only the strings
    {"fields.meta.a": {"$exists": True}},  # across an array's documents
    {"fields.meta.1.a": 10},
    {"fields.meta": {"$size": 3}},
    {"fields.meta.ok": {"$not": {"$eq": True}}},
    {"fields.meta": {"$elemMatch": {"a": {"$gt": 5}}}},
    {"$or": [{"label": 0}, {"fields.score": {"$gt": 4}}]},
    {"$and": [{"label": {"$ne": 2}}, {"fields.flag": False}]},
    {"$nor": [{"label": 0}, {"fields.tags": 4}]},
    {"fields.score": {"$not": {"$gt": 2}}},
    # null through arrays: a document without the key is missing, an array's numbers are not
    {"fields.meta.a": None},
    {"fields.meta.n.x": None},  # (a number has no field: missing)
    {"fields.tags.5": None},  # (past an array's end: missing)
    {"fields.tags.5": {"$exists": True}},
    # an array's own elements are not looked into where they are arrays
    {"fields.boxes": {"$elemMatch": {"$gt": 1}}},
    {"fields.boxes": {"$elemMatch": {}}},
    {"fields.boxes.0": 0.0},  # (the first box, reached by index: compared whole)
    {"fields.boxes.0": [0.0, 2.0, 3.0, 5.0]},
    {"fields.score": {"$in": [1, 2, True, "3", None]}},  # (1 is 1.0, not true, not "1")
    {"fields.caption": {"$regex": "thing 1\\z"}},  # (PCRE's end of string)
]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("query")
    data = rows(40)
    for row in data:
        write(root / row["path"], jpeg_bytes(seed=len(row["path"])))
    manifest = root / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    convert(manifest, root / "s.lmdb")
    return root / "s.lmdb", data


def lmdb_selects(store: Path, query: dict[str, Any]) -> list[int]:
    return LMDBImageDataset(store, output="bytes").reader.matching(query).tolist()


@pytest.mark.mongo
def test_the_same_query_selects_the_same_records_from_a_store_and_its_copy_in_mongodb(
    stores: tuple[Path, list[dict[str, Any]]], mongo_uri: str
) -> None:
    store, _ = stores
    copy_store(str(store), mongo_uri, collection="q")
    mongo = MongoImageDataset(mongo_uri, "q", output="bytes")
    chosen = set()
    for query in QUERIES:
        here, there = lmdb_selects(store, query), mongo.reader.matching(query).tolist()
        assert here == there, f"{query}: LMDB {here}, MongoDB {there}"
        chosen.add(len(here))
    assert len(chosen) > 15  # the queries select many different sets, not all or nothing


def test_mongodbs_rules_hold_on_lmdb(stores: tuple[Path, list[dict[str, Any]]]) -> None:
    """Each rule that differs from Python's, checked against the rows written."""
    store, data = stores

    def where(test: Any) -> list[int]:
        return [i for i, r in enumerate(data) if test(r)]

    # ints and floats are one type; a string of digits or a boolean is not a number
    assert lmdb_selects(store, {"fields.score": 2}) == where(lambda r: r["score"] == 2)
    assert lmdb_selects(store, {"fields.score": {"$lte": "9"}}) == []
    assert lmdb_selects(store, {"fields.flag": 1}) == []
    # a condition on an array: the array itself or any element
    assert lmdb_selects(store, {"fields.tags": 2}) == where(lambda r: 2 in r["tags"])
    assert lmdb_selects(store, {"fields.tags": {"$gt": 3}}) == where(lambda r: max(r["tags"]) > 3)
    # null matches a missing value too; $ne null and $exists tell them apart
    missing = where(lambda r: not isinstance(r["meta"], dict) or "source" not in r["meta"])
    null = where(lambda r: isinstance(r["meta"], dict) and r["meta"].get("source", 0) is None)
    assert lmdb_selects(store, {"fields.meta.source": None}) == sorted(missing + null)
    assert lmdb_selects(store, {"fields.meta.source": {"$exists": False}}) == missing
    # into arrays by index, and across an array's documents
    assert lmdb_selects(store, {"fields.boxes.2": {"$exists": True}}) == where(
        lambda r: len(r["boxes"]) > 2
    )
    assert lmdb_selects(store, {"fields.meta.a": {"$exists": True}}) == where(
        lambda r: isinstance(r["meta"], list)
    )
    # records in store order, whatever the query
    assert lmdb_selects(store, {"$or": [{"label": 2}, {"label": 0}]}) == where(
        lambda r: r["label"] in ("cat", "eel")
    )


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ({"fields.score": {"$where": "1"}}, r"\$where is not an operator fastdata's queries take"),
        ({"$expr": {"$gt": ["$label", 0]}}, r"\$expr at the top of a query is not an operator"),
        ({"fields.score": {"$type": "double"}}, r"\$type is not an operator"),
        ({"fields.captoin": "x"}, r"no field 'captoin'; its fields: .*caption"),
        ({"score": 3}, r"'score': use 'fields.score': the fields are under 'fields'"),
        ({"path": "x"}, r"'path' is no key of a record"),
        ({"fields.score": {"$gt": 1, "x": 2}}, r"all operators or a value to equal"),
        ({"fields.caption": {"$regex": "("}}, r"\$regex '\(' does not compile"),
        ({"fields.caption": {"$regex": "a", "$options": "u"}}, r"\$options 'u'"),
        ({"fields.score": {"$in": 3}}, r"\$in takes a list"),
        ({"$or": []}, r"\$or takes a non-empty list"),
        ({"fields.score": {"$gt": object()}}, r"\$gt compares with object"),
        (["label", 1], r"a query is a document"),
        ({"fields.score": {"$gt": [1]}}, r"\$gt with an array or a document"),
        ({"fields.tags": {"$all": [1, {"$elemMatch": {"$gt": 0}}]}}, r"not both"),
        ({"fields.tags": {"$all": [{"$gt": 0}]}}, r"not other operators"),
        ({"fields.tags": {"$size": -1}}, r"not a negative one"),
        ({"fields.tags": {"$in": [{"$gt": 1}]}}, r"\$in takes values, not operators"),
        ({"fields.score": 2**64}, r"beyond 64 bits"),
        ({"label": "cat"}, r"'label' is a record's class index \(an int"),  # (matches nothing)
        ({"label": {"$in": [0, "dog"]}}, r"class index"),
    ],
)
def test_a_query_outside_the_language_is_refused_by_name_on_both_backends(
    stores: tuple[Path, list[dict[str, Any]]], query: Any, words: str
) -> None:
    store, _ = stores
    with pytest.raises(QueryError, match=words):
        LMDBImageDataset(store, output="bytes", where=query)
    # (the Mongo store refuses it with the same check, before it sends anything)
    with pytest.raises(QueryError, match=words):
        compile_query(query, ["boxes", "caption", "flag", "meta", "score", "tags"])


def test_a_view_by_query_pickles_and_reads_like_one_by_predicate(
    stores: tuple[Path, list[dict[str, Any]]],
) -> None:
    import pickle

    store, data = stores
    by_query = LMDBImageDataset(store, output="bytes", fields="*", where={"fields.flag": True})
    by_code = LMDBImageDataset(store, output="bytes", fields="*", where=lambda f: f["flag"])
    assert len(by_query) == sum(r["flag"] for r in data) > 0
    again = pickle.loads(pickle.dumps(by_query))
    got = again.__getitems__(range(len(again)))
    assert [(b, y) for b, y, _ in got] == [
        (b, y) for b, y, _ in by_code.__getitems__(range(len(by_code)))
    ]
    assert all(bool(v["flag"]) for _, _, v in got)


def test_info_counts_what_a_query_selects_and_refuses_a_bad_one_in_a_line(
    stores: tuple[Path, list[dict[str, Any]]],
) -> None:
    from .procs import cli

    store, data = stores
    query = '{"fields.boxes.2": {"$exists": true}}'
    wanted = [r for r in data if len(r["boxes"]) > 2]
    shown = cli("info", str(store), "--where", query)
    assert shown.returncode == 0, shown.stderr
    assert f"selected:   {len(wanted)} of {len(data)}" in shown.stdout
    facts = json.loads(cli("info", str(store), "--where", query, "--json").stdout)["where"]
    assert facts["count"] == len(wanted) and facts["query"] == json.loads(query)
    assert facts["images_per_class"] == {
        c: sum(r["label"] == c for r in wanted) for c in ("cat", "dog", "eel")
    }
    for bad, words in (
        ('{"fields.score": {"$where": "1"}}', "--where: $where is not an operator"),
        ('{"fields.scor": 1}', "no field 'scor'"),
        ("{fields", "is not JSON"),
    ):
        refused = cli("info", str(store), "--where", bad)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and "lambda" not in refused.stderr


def test_export_and_copy_move_a_selection_and_an_interrupted_copy_resumes_the_same_one(
    stores: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    import shlex

    from fastdata import open_store
    from fastdata.errors import IncompleteStoreError

    from .procs import cli

    store, data = stores
    query = {"fields.flag": True}
    wanted = [r["path"] for r in data if r["flag"]]
    out = tmp_path / "out"
    exported = cli("export", str(store), str(out), "--where", json.dumps(query), "-q")
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jpg")) == sorted(wanted)
    # a copy of the selection, interrupted after its first commit: its resume names the query
    dst = tmp_path / "c.lmdb"

    def stop(done: int, total: int) -> None:
        if done >= 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        copy_store(str(store), str(dst), where=query, batch_size=2, progress=stop)
    with pytest.raises(IncompleteStoreError) as info:
        open_store(str(dst))
    resume = str(info.value).split("`")[1]
    assert "--where" in resume
    other = [w if w != json.dumps(query) else '{"fields.flag": false}' for w in shlex.split(resume)]
    refused = cli(*other[1:])
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    finished = cli(*shlex.split(resume)[1:])  # as printed
    assert finished.returncode == 0, finished.stderr
    copied = open_store(str(dst))
    assert [h.name for h in copied.iter_headers()] == wanted  # each once, in store order


def test_a_loader_resumes_only_over_the_selection_it_saved(
    stores: tuple[Path, list[dict[str, Any]]],
) -> None:
    from fastdata import create_loader
    from fastdata.errors import UsageError

    store, _ = stores

    def loader(where: Any) -> Any:
        ds = LMDBImageDataset(store, output="bytes", where=where)
        return create_loader(ds, 4, num_workers=0, collate_fn=list, device="cpu", seed=1)

    first = loader({"fields.flag": True})
    iterator = iter(first)
    next(iterator)
    state = json.loads(json.dumps(first.state_dict()))  # plain types only
    assert state["dataset"]["selected"] == len(first.dataset)
    same = loader({"fields.flag": True})
    same.load_state_dict(state)

    def plain(batches: Any) -> list[list[tuple[bytes, int]]]:
        return [[(bytes(np.asarray(x)), int(y)) for x, y in batch] for batch in batches]

    rest = plain(iterator)
    assert len(rest) == 2 and plain(same) == rest  # the rest (of 3 whole batches), exactly
    with pytest.raises(ValueError, match="cannot resume: the saved loader read store .* selection"):
        loader({"fields.flag": False}).load_state_dict(state)
    with pytest.raises(UsageError, match="the dataset is empty"):
        loader({"label": 99})


@pytest.mark.mongo
def test_an_index_spares_the_server_a_scan_and_a_scan_of_a_large_store_is_said_once(
    stores: tuple[Path, list[dict[str, Any]]],
    mongo_uri: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fastdata.stores.mongo import queries as mongo_queries

    from .mongo_server import database
    from .procs import cli

    store, _ = stores
    copy_store(str(store), mongo_uri, collection="q")
    monkeypatch.setattr(mongo_queries, "SCAN_WORTH_SAYING", 0)  # (40 records: "large")
    query = {"fields.score": {"$gt": 2}}
    with caplog.at_level("WARNING"):
        MongoImageDataset(mongo_uri, "q", output="bytes").reader.matching(query)
        MongoImageDataset(mongo_uri, "q", output="bytes").reader.matching(query)
    said = [r.getMessage() for r in caplog.records if "read the whole collection" in r.message]
    assert len(said) == 1 and "fastdata index" in said[0]  # once, with the command
    command = said[0].split("`")[1].split()
    made = cli(*command[1:])  # as printed
    assert made.returncode == 0, made.stderr
    assert "fields.score_1" in database(mongo_uri)["q"].index_information()
    mongo_queries.SAID_SCANNED.clear()
    caplog.clear()
    with caplog.at_level("WARNING"):
        MongoImageDataset(mongo_uri, "q", output="bytes").reader.matching(query)
    assert not [r for r in caplog.records if "read the whole collection" in r.message]
    refused = cli("index", str(store), "fields.score")
    assert refused.returncode == 2 and "LMDB store has no server" in refused.stderr
    unknown = cli("index", mongo_uri, "-c", "q", "fields.scroe")
    assert unknown.returncode == 2 and "no field 'scroe'" in unknown.stderr
