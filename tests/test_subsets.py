"""Subsets of a store read in place: by classes, by indices, both; on LMDB and MongoDB."""

import pickle
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from fastdata import LMDBImageDataset, MongoImageDataset, convert
from fastdata.records import StoreMeta


@pytest.fixture
def lmdb_store(good_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "good.lmdb"
    convert(good_folder, dst)
    return dst


def _check_class_subset(ds, full, good_folder: Path) -> None:  # type: ignore[no-untyped-def]
    # cat = 5 records (0-4), dog = 4 (5-8), eel = 3 (9-11); the view keeps eel then cat
    assert ds.classes == ["eel", "cat"]
    assert ds.class_to_idx == {"eel": 0, "cat": 1}
    assert len(ds) == 8
    assert list(ds.targets) == [1] * 5 + [0] * 3
    names = [name for name, _ in ds.samples]
    assert names == [f"cat/{i:03d}.jpg" for i in range(5)] + [f"eel/{i:03d}.jpg" for i in range(3)]
    assert [label for _, label in ds.samples] == list(ds.targets)
    for i, name in enumerate(names):
        data, label = ds[i]
        assert data == (good_folder / name).read_bytes()
        assert label == ds.targets[i] == ds.class_to_idx[name.split("/")[0]]
    assert full[9][0] == ds[5][0]


def test_a_dataset_of_some_classes_remaps_labels(lmdb_store: Path, good_folder: Path) -> None:
    full = LMDBImageDataset(lmdb_store, output="bytes")
    ds = LMDBImageDataset(lmdb_store, output="bytes", classes=["eel", "cat"])
    _check_class_subset(ds, full, good_folder)
    # the same through subset(), and across a pickle (workers)
    _check_class_subset(full.subset(classes=["eel", "cat"]), full, good_folder)
    blob = pickle.dumps(ds)
    assert len(blob) < 1024
    _check_class_subset(pickle.loads(blob), full, good_folder)


def test_a_dataset_of_some_indices_keeps_their_order(lmdb_store: Path) -> None:
    full = LMDBImageDataset(lmdb_store, output="bytes")
    ds = LMDBImageDataset(lmdb_store, output="bytes", indices=[11, 0, -2, 5])
    assert len(ds) == 4 and ds.classes == full.classes
    assert list(ds.targets) == [2, 0, 2, 1]
    assert [ds[i][0] for i in range(4)] == [full[j][0] for j in (11, 0, 10, 5)]
    # both: the indices that belong to the classes, labels remapped
    both = LMDBImageDataset(lmdb_store, output="bytes", indices=[11, 0, 5, 6], classes=["dog"])
    assert both.classes == ["dog"] and list(both.targets) == [0, 0]
    assert [both[i][0] for i in range(2)] == [full[5][0], full[6][0]]
    # a loader over a view, with workers, sees the view
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=lambda b: b)
    seen = [item for batch in loader for item in batch]
    assert [label for _, label in seen] == [2, 0, 2, 1]


def test_bad_subsets_are_clear_errors(lmdb_store: Path) -> None:
    with pytest.raises(ValueError, match="no class 'cow' in the store"):
        LMDBImageDataset(lmdb_store, classes=["cat", "cow"])
    with pytest.raises(ValueError, match="named twice"):
        LMDBImageDataset(lmdb_store, classes=["cat", "cat"])
    with pytest.raises(IndexError, match="index 12 out of range for 12 records"):
        LMDBImageDataset(lmdb_store, indices=[0, 12])
    ds = LMDBImageDataset(lmdb_store, indices=[3])
    with pytest.raises(IndexError):
        ds[1]


def test_a_class_subset_is_cheap_at_size(tmp_path: Path) -> None:
    """A view over a big store costs its index array, not a read of the store."""
    from fastdata.stores.memory import MemoryReader
    from fastdata.stores.view import StoreView

    n = 2_000_000
    meta = StoreMeta(count=n, classes=[str(c) for c in range(1000)])
    base = MemoryReader(meta, np.arange(n, dtype=np.int64) % 1000)
    view = StoreView(base, classes=["7", "3"])
    assert len(view) == 4000 and base.reads == 0
    assert view.records[:2].tolist() == [3, 7] and view.labels[:2].tolist() == [1, 0]
    assert view.read_samples([0, 1]) == [(b"x", 1), (b"x", 0)]
    assert len(pickle.dumps(view)) < 4096 + len(pickle.dumps(base))


def test_subsets_of_a_mongo_store(good_folder: Path, mongo_uri: str) -> None:
    convert(good_folder, mongo_uri, collection="good")
    full = MongoImageDataset(mongo_uri, "good", output="bytes")
    ds = MongoImageDataset(mongo_uri, "good", output="bytes", classes=["eel", "cat"])
    _check_class_subset(ds, full, good_folder)
    _check_class_subset(pickle.loads(pickle.dumps(ds)), full, good_folder)
    idx = MongoImageDataset(mongo_uri, "good", output="bytes", indices=[11, 0])
    assert list(idx.targets) == [2, 0] and idx[0][0] == full[11][0]


def test_a_boolean_mask_selects_like_numpy_and_anything_else_unintegral_is_refused(
    lmdb_store: Path,
) -> None:
    import torch

    full = LMDBImageDataset(lmdb_store, output="bytes")
    targets = np.asarray(full.targets)
    for mask in (targets == 2, torch.as_tensor(targets == 2)):
        eel = full.subset(indices=mask)
        assert len(eel) == 3 and list(eel.targets) == [2, 2, 2]
        assert [eel[i][0] for i in range(3)] == [full[i][0] for i in (9, 10, 11)]
    assert len(LMDBImageDataset(lmdb_store, indices=[False] * 12)) == 0
    with pytest.raises(TypeError, match="store's length"):
        full.subset(indices=[True, False])
    with pytest.raises(TypeError, match="not float64"):
        full.subset(indices=[0.5, 2.9])
    with pytest.raises(TypeError, match="integers or a boolean mask"):
        LMDBImageDataset(lmdb_store, indices=np.array([1.0, 2.0]))
    assert list(full.subset(indices=np.array([3, 1], dtype=np.uint8)).targets) == [0, 0]


def scored_manifest(tmp_path: Path) -> Path:
    """Six images of two classes, a and b, each with a score: its number."""
    import json

    from .conftest import jpeg_bytes, write

    rows = []
    for i in range(6):
        write(tmp_path / "img" / f"{i}.jpg", jpeg_bytes(seed=i))
        rows.append({"path": f"img/{i}.jpg", "label": "ab"[i % 2], "score": float(i)})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


@pytest.mark.mongo
def test_a_subset_by_query_of_a_replaced_mongo_store_is_refused_as_a_read_is(
    tmp_path: Path, mongo_uri: str
) -> None:
    from fastdata.errors import StoreReplacedError

    manifest = scored_manifest(tmp_path)
    convert(manifest, mongo_uri, collection="s")
    ds = MongoImageDataset(mongo_uri, "s", output="bytes", fields="*")
    assert len(ds.subset(where={"fields.score": {"$gte": 2}})) == 4
    convert(manifest, mongo_uri, collection="s", overwrite=True)  # the same rows, a new store
    for where in ({"fields.score": {"$gte": 2}}, {"fields.score": {"$gte": 100}}):
        with pytest.raises(StoreReplacedError, match="the store was replaced"):
            ds.subset(where=where)
    with pytest.raises(StoreReplacedError, match="the store was replaced"):
        ds.subset(where=lambda f: f["score"] >= 2)
    with pytest.raises(StoreReplacedError):
        ds[0]


@pytest.mark.mongo
def test_a_query_filter_narrows_a_subset_of_a_mongo_store(tmp_path: Path, mongo_uri: str) -> None:
    convert(scored_manifest(tmp_path), mongo_uri, collection="s")
    ds = MongoImageDataset(mongo_uri, "s", output="bytes", fields="*")
    high = {"fields.score": {"$gte": 2}}
    bs = ds.subset(classes=["b"]).subset(where=high)  # records 3 and 5, in class b (label 0)
    assert [v["score"] for _, _, v in bs.__getitems__(range(len(bs)))] == [3.0, 5.0]
    assert bs.classes == ["b"] and bs.targets.tolist() == [0, 0]
    picked = ds.subset(indices=[5, 0, 4, 1]).subset(where=high)  # the order picked, kept
    assert [v["score"] for _, _, v in picked.__getitems__(range(len(picked)))] == [5.0, 4.0]
    both = ds.subset(classes=["a"], where=high)  # in one call, the same
    assert [v["score"] for _, _, v in both.__getitems__(range(len(both)))] == [2.0, 4.0]
    lmdb = tmp_path / "s.lmdb"
    convert(scored_manifest(tmp_path), lmdb)
    local = LMDBImageDataset(lmdb, fields="*").subset(classes=["b"]).subset(where=high)
    assert [v["score"] for _, _, v in local.__getitems__(range(len(local)))] == [3.0, 5.0]
