import json
import pickle
import zlib
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from fastdata import LMDBImageDataset, convert
from fastdata.errors import (
    CorruptImageError,
    PickleNotAllowedError,
    StoreError,
    StoreNotFoundError,
)
from fastdata.sources.folder import scan_folder

from .conftest import evicted, jpeg_bytes


@pytest.fixture
def store(good_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "good.lmdb"
    convert(good_folder, dst)
    return dst


def to_tensor(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)


def test_behaves_like_imagefolder(store: Path, good_folder: Path) -> None:
    ds = LMDBImageDataset(store)
    scan = scan_folder(good_folder)
    assert len(ds) == 12
    assert ds.classes == ["cat", "dog", "eel"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert list(ds.targets) == [s.label for s in scan.samples]
    img, label = ds[5]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (64, 48)
    assert label == 1
    assert ds[-1][1] == 2
    with pytest.raises(IndexError):
        ds[12]
    assert len(list(ds)) == 12  # iteration stops on IndexError like a sequence


def test_outputs_bytes_numpy_and_transforms(store: Path, good_folder: Path) -> None:
    raw = LMDBImageDataset(store, output="bytes")
    assert raw[0][0] == (good_folder / "cat" / "000.jpg").read_bytes()
    arr, _ = LMDBImageDataset(store, output="numpy")[0]
    assert arr.shape == (48, 64, 3) and arr.dtype == np.uint8
    pil = np.asarray(LMDBImageDataset(store)[0][0])
    assert np.abs(arr.astype(int) - pil.astype(int)).max() <= 2  # same pixels, either decoder
    ds = LMDBImageDataset(store, transform=lambda im: im.size, target_transform=lambda y: y * 10)
    assert ds[11] == ((64, 48), 20)
    with pytest.raises(ValueError, match="output must be one of"):
        LMDBImageDataset(store, output="tensor")  # type: ignore[arg-type]


def test_getitems_reads_a_batch_in_the_order_asked(store: Path) -> None:
    ds = LMDBImageDataset(store, output="bytes")
    batch = ds.__getitems__([7, 2, 7, 0])
    assert [b for b in batch] == [ds[7], ds[2], ds[7], ds[0]]


def test_pickles_without_environment_and_small(store: Path) -> None:
    ds = LMDBImageDataset(store)
    ds[0]  # opens the environment in this process
    blob = pickle.dumps(ds)
    # no handle, and nothing per sample beyond the labels array
    assert len(blob) < 2000 + 8 * len(ds)
    clone = pickle.loads(blob)
    assert clone[3][1] == ds[3][1]


def test_two_datasets_over_one_store_in_one_process(store: Path) -> None:
    a, b = LMDBImageDataset(store), LMDBImageDataset(store, output="bytes")
    a[0]
    b[1]
    a.close()
    assert b[2][1] == 0  # b keeps working after a is closed
    b.close()
    assert a[3][1] == 0  # and a reopens


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(store: Path, context: str) -> None:
    ds = LMDBImageDataset(store, transform=to_tensor, output="numpy")
    ds[0]  # touching the dataset in the parent first is the everyday pattern
    loader = DataLoader(
        ds, batch_size=5, num_workers=2, multiprocessing_context=context, shuffle=False
    )
    images, labels = zip(*loader)
    assert torch.cat(labels).tolist() == list(ds.targets)
    assert torch.cat(images).shape == (12, 3, 48, 64)
    assert torch.equal(torch.cat(images)[4], ds[4][0])


def test_worker_errors_name_store_and_record(tmp_path: Path, store: Path) -> None:
    # one record's image bytes made undecodable in place (same length), its header's checksum
    # made theirs (so the read's check passes and the decode fails), the store otherwise intact
    env = lmdb.open(str(store), map_size=1 << 24)
    with env.begin(write=True) as txn:
        key = b"0000000004"
        value = bytearray(txn.get(key))
        start = value.index(b"\xff\xd8")
        value[start + 2 :] = b"\x00" * (len(value) - start - 2)
        txn.put(key, bytes(value))
        header = json.loads(txn.get(b"#" + key))
        header["crc32"] = zlib.crc32(bytes(value))
        txn.put(b"#" + key, json.dumps(header).encode())
    env.close()
    ds = LMDBImageDataset(store)
    with pytest.raises(CorruptImageError, match=r"good.lmdb: record 4 \(cat/004.jpg\)"):
        ds[4]


def test_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="fastdata convert"):
        LMDBImageDataset(tmp_path / "nothing.lmdb")


def test_foreign_lmdb_is_refused(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "x"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(StoreError, match="without fastdata metadata"):
        LMDBImageDataset(tmp_path / "x")


def write_pickle_store(path: Path, padded: bool, with_len: bool, ndarray: bool) -> list[bytes]:
    images = [jpeg_bytes(seed=s) for s in range(6)]
    env = lmdb.open(str(path), subdir=False, map_size=1 << 24)
    keys = []
    with env.begin(write=True) as txn:
        for i, data in enumerate(images):
            key = (f"{i:08}" if padded else str(i)).encode("ascii")
            img = np.frombuffer(data, dtype=np.uint8) if ndarray else data
            txn.put(key, pickle.dumps((img, i % 2)))
            keys.append(key)
        txn.put(b"__keys__", pickle.dumps(keys))
        if with_len:
            txn.put(b"__len__", pickle.dumps(len(keys)))
    env.close()
    return images


@pytest.mark.parametrize(
    "padded, with_len, ndarray",
    [(False, True, False), (True, False, True)],
    ids=["unpadded-keys-with-len", "padded-keys-ndarray-values"],
)
def test_pickle_stores_need_allow_pickle(
    tmp_path: Path, padded: bool, with_len: bool, ndarray: bool
) -> None:
    path = tmp_path / "legacy.lmdb"
    images = write_pickle_store(path, padded, with_len, ndarray)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        LMDBImageDataset(path)
    ds = LMDBImageDataset(path, allow_pickle=True, output="bytes")
    assert len(ds) == 6
    assert ds[3] == (images[3], 1)
    assert list(ds.targets) == [0, 1, 0, 1, 0, 1]
    assert ds.classes == ["0", "1"]
    loader = DataLoader(
        LMDBImageDataset(path, allow_pickle=True, transform=to_tensor, output="numpy"),
        batch_size=3,
        num_workers=2,
        multiprocessing_context="fork",
    )
    assert sum(len(y) for _, y in loader) == 6


def test_a_pickled_dataset_does_not_grow_with_the_store(tmp_path: Path) -> None:
    sizes = []
    for n in (3, 300):
        src = tmp_path / f"src{n}"
        for i in range(n):
            path = src / "c" / f"{i:04d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg_bytes(16, 16, seed=i))
        convert(src, tmp_path / f"s{n}.lmdb")
        ds = LMDBImageDataset(tmp_path / f"s{n}.lmdb")
        ds[0]
        blob = pickle.dumps(ds)
        sizes.append(len(blob))
        clone = pickle.loads(blob)  # what a spawned worker gets: labels read again there
        assert len(clone) == n and list(clone.targets) == [0] * n and clone[n - 1][1] == 0
    assert sizes[1] - sizes[0] < 16 and max(sizes) < 1024  # no label per record in the pickle


def _disk_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return None


def test_a_cold_random_read_of_a_small_record_reads_about_its_own_pages(tmp_path: Path) -> None:
    """A store larger than memory must not pay megabytes of read-ahead per 2 kB image."""
    import random

    from fastdata.stores.lmdb.reader import LMDBStore

    from .test_hostile_input import write_store_with

    rng = np.random.default_rng(0)
    write_store_with(tmp_path / "s.lmdb", [rng.bytes(2000) for _ in range(20000)])
    data = tmp_path / "s.lmdb" / "data.mdb"
    picks = random.Random(0).sample(range(20000), 50)

    def disk_per_read(read: object) -> float:
        before = _disk_bytes()
        for i in picks:
            read(i)  # type: ignore[operator]
        after = _disk_bytes()
        assert before is not None and after is not None
        return (after - before) / len(picks)

    evicted(data)
    env = lmdb.open(str(data), subdir=False, readonly=True, lock=False, readahead=True)
    with env.begin() as txn:
        control = disk_per_read(lambda i: txn.get(b"%010d" % i))
    env.close()
    if _disk_bytes() is None or control < 64 << 10:
        pytest.skip("this file system shows no read-ahead to measure against")
    evicted(data)
    store = LMDBStore(tmp_path / "s.lmdb")
    ours = disk_per_read(lambda i: store.read_data([i]))
    store.close()
    assert ours <= 64 << 10, (ours, control)
