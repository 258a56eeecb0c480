"""Decoding on the device in the loader's worker processes (``decode_in="workers"``): the same
batches as a decode in the training process, for any worker count and start method; records
named in errors; on CUDA, batches handed over by IPC, deterministic, with steady memory."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.errors import UsageError
from fastdata.images.device_backends import available_backends
from fastdata.images.pipelines import TrainPipeline
from fastdata.images.synthetic import synthetic_jpeg
from fastdata.loaders.device_workers import worker_start

from .conftest import png_bytes, write

BACKEND = "nvimgcodec" if "nvimgcodec" in available_backends("cpu") else "cpu"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    for i in range(24):
        data = synthetic_jpeg(160, 120, seed=i) if i % 8 else png_bytes(100, 90, seed=i)
        write(root / f"c{i % 3}" / f"{i:03d}.{'jpg' if i % 8 else 'png'}", data)
    dst = tmp_path_factory.mktemp("store") / "s.lmdb"
    convert(root, dst)
    return dst


def epochs(store: Path, count: int = 2, **options: object) -> list[tuple[torch.Tensor, ...]]:
    common: dict[str, object] = dict(
        image_size=48, seed=3, batch_size=8, mean=None, std=None, decode="device"
    )
    common.update(options)
    common.setdefault("device", "cpu")
    common.setdefault("decode_backend", BACKEND)
    common.setdefault("pipeline", TrainPipeline(48, fast_decode=False))
    out = []
    with create_loader(LMDBImageDataset(store), **common) as loader:  # type: ignore[arg-type]
        for _ in range(count):
            out += [(x.cpu().clone(), y.cpu().clone()) for x, y in loader]
    return out


def on_cuda(store: Path, **options: object) -> Any:
    """A loader whose 2 workers decode on CUDA, batches of 4 at 48 px, unless ``options`` say
    otherwise (what the gpu-marked tests take)."""
    common: dict[str, object] = dict(
        batch_size=4, image_size=48, device="cuda", num_workers=2, decode="device"
    )
    common["decode_in"] = "workers"
    common.update(options)
    return create_loader(LMDBImageDataset(store), **common)  # type: ignore[arg-type]


def assert_no_worker_warned(capfd: pytest.CaptureFixture[str]) -> None:
    """No worker warned, as it exited, that shared CUDA tensors were not released."""
    err = capfd.readouterr().err
    assert "Producer process" not in err and "Traceback" not in err, err


def same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x0, x1) and torch.equal(y0, y1) for (x0, y0), (x1, y1) in zip(a, b, strict=True)
    )


def test_workers_decode_the_batches_a_decode_in_this_process_gives(store: Path) -> None:
    want = epochs(store, num_workers=0, decode_in="main")
    assert want and want[0][0].shape == (8, 3, 48, 48) and want[0][0].dtype == torch.uint8
    for workers in (0, 2):
        assert same(epochs(store, num_workers=workers, decode_in="workers"), want), workers


def test_spawned_workers_decode_the_same_batches(store: Path) -> None:
    # the start method the workers take on CUDA: the collate and its decoder cross by pickle
    want = epochs(store, count=1, num_workers=0)
    got = epochs(
        store, count=1, num_workers=1, decode_in="workers", multiprocessing_context="spawn"
    )
    assert same(got, want)


def test_a_record_no_decoder_reads_is_named_from_a_worker(tmp_path: Path) -> None:
    root = tmp_path / "src"
    write(root / "a" / "0.jpg", synthetic_jpeg(160, 120, seed=1))
    write(root / "a" / "1.png", png_bytes(40, 30, seed=1))
    store = tmp_path / "s.lmdb"
    convert(root, store)
    with lmdb.open(str(store), subdir=True, lock=False) as env, env.begin(write=True) as txn:
        key = b"%010d" % 1
        txn.put(key, bytes(txn.get(key))[:60])  # the PNG cut short (its checksum fails first)
    code = f"""
from fastdata import LMDBImageDataset, create_loader
loader = create_loader(LMDBImageDataset({str(store)!r}), batch_size=2, device="cpu",
                       num_workers=1, decode="device", decode_in="workers", train=False)
next(iter(loader))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "record 1 (a/1.png)" in result.stderr and "s.lmdb" in result.stderr, result.stderr


def test_what_decode_in_and_decode_options_take_is_checked(store: Path) -> None:
    ds = LMDBImageDataset(store)
    with pytest.raises(ValueError, match="'main' or 'workers'"):
        create_loader(ds, 4, device="cpu", decode="device", decode_in="gpu")
    with pytest.raises(ValueError, match="for decode='device'"):
        create_loader(ds, 4, device="cpu", decode_in="workers")
    with pytest.raises(ValueError, match="unknown hw"):
        create_loader(ds, 4, device="cpu", decode="device", decode_options={"hw": 1})
    with pytest.raises(ValueError, match="hardware=2"):
        create_loader(ds, 4, device="cpu", decode="device", decode_options={"hardware": 2})


def test_workers_that_decode_on_cuda_are_spawned_and_pin_nothing() -> None:
    # (the rule create_loader applies where the device is CUDA; checked here without one)
    assert worker_start(True, None, None) == "spawn"
    assert worker_start(True, None, "forkserver") == "forkserver"
    assert worker_start(False, True, "fork") == "fork" and worker_start(False, None, None) is None
    with pytest.raises(ValueError, match="forked worker cannot use CUDA"):
        worker_start(True, None, "fork")
    with pytest.raises(ValueError, match="nothing to pin"):
        worker_start(True, True, None)


def test_decode_options_reach_the_decoder(store: Path) -> None:
    with create_loader(
        LMDBImageDataset(store),
        4,
        device="cpu",
        num_workers=0,
        decode="device",
        decode_in="workers",
        decode_options={"regions": False, "batched": True},
    ) as loader:
        decoder = loader.dataloader.collate_fn.decoder  # type: ignore[attr-defined]
        assert decoder.regions is False and decoder.batched is True


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"hardware": 1.0, "regions": False, "batched": True}])
def test_on_cuda_workers_hand_over_the_batches_a_decode_in_this_process_gives(
    store: Path, options: dict[str, object]
) -> None:
    common: dict[str, object] = dict(device="cuda", decode_backend="auto", decode_options=options)
    want = epochs(store, num_workers=0, decode_in="main", **common)
    for workers in (1, 2):
        got = epochs(store, num_workers=workers, decode_in="workers", **common)
        assert same(got, want), (workers, options)


@pytest.mark.gpu
def test_on_cuda_the_workers_memory_and_this_process_stay_steady(store: Path) -> None:
    # the workers take back what this process let go (ipc_collect): over many epochs the
    # device's free memory and this process's reserved memory do not shrink
    with on_cuda(store, batch_size=8) as loader:
        for _ in range(3):
            for x, _y in loader:
                assert x.device.type == "cuda" and x.dtype == torch.float32
        torch.cuda.synchronize()
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        for _ in range(12):
            for _x, _y in loader:
                pass
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() == reserved
        assert torch.cuda.mem_get_info()[0] >= free - (64 << 20), (
            free - torch.cuda.mem_get_info()[0]
        )


@pytest.mark.gpu
def test_on_cuda_workers_refuse_fork_and_pinning(store: Path) -> None:
    ds = LMDBImageDataset(store)
    common: dict[str, object] = dict(device="cuda", decode="device", decode_in="workers")
    with pytest.raises(ValueError, match="forked worker"):
        create_loader(ds, 4, multiprocessing_context="fork", **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing to pin"):
        create_loader(ds, 4, pin_memory=True, **common)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_on_cuda_closing_mid_epoch_releases_what_the_workers_shared(
    store: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # batches still on their way when the loader closes are taken and let go before the
    # workers exit: no worker warns that shared CUDA tensors were not released
    with on_cuda(store) as loader:
        for i, (x, _y) in enumerate(loader):
            assert x.device.type == "cuda"
            if i == 1:
                break
    assert_no_worker_warned(capfd)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"hardware": "0.5"}, "hardware='0.5'"),
        ({"hardware": True}, "hardware=True"),
        ({"threads": "4"}, "threads='4'"),
        ({"threads": None}, "threads=None"),
        ({"threads": 10**6}, "threads=1000000"),
        ({"batched": "false"}, "batched='false'"),
        ({"regions": None}, "regions=None"),
        ("hardware", "must be a dict"),
        ([("threads", 1)], "must be a dict"),
    ],
)
def test_decode_options_of_the_wrong_type_are_refused_up_front_by_name(
    store: Path, options: object, named: str
) -> None:
    # before: a TypeError from a comparison, "false" taken as True, a bool as a share, or a
    # thread count the decoder only refused at its first batch, in a worker
    with pytest.raises(ValueError, match=f"decode_options.*{re.escape(named)}"):
        create_loader(
            LMDBImageDataset(store),
            4,
            device="cpu",
            num_workers=0,
            decode="device",
            decode_in="workers",
            decode_options=options,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("carries", [{"as_dict": True}, {"fields": []}, {"fields": "*"}])
@pytest.mark.parametrize("decode_in", ["main", "workers"])
def test_samples_with_fields_are_refused_for_the_device_before_the_first_batch(
    store: Path, carries: dict[str, object], decode_in: str
) -> None:
    # a store without fields, read with fields= or as dicts: before, the loader was made and
    # its first batch failed ("too many values to unpack", "invalid literal for int()")
    ds = LMDBImageDataset(store, **carries)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"images and targets only.*decode='cpu'"):
        create_loader(ds, 4, device="cpu", num_workers=0, decode="device", decode_in=decode_in)
    with create_loader(ds, 4, device="cpu", num_workers=0) as loader:  # (the CPU batches them)
        assert len(next(iter(loader))) in (2, 3)  # (a dict of image and target, or a triple)


def test_a_fork_context_is_refused_for_workers_that_decode_on_cuda_as_fork_is() -> None:
    # DataLoader takes a context as well as a name: multiprocessing.get_context("fork") went
    # past the refusal, and the forked workers failed at their first CUDA call
    fork = multiprocessing.get_context("fork")
    with pytest.raises(ValueError, match="forked worker cannot use CUDA"):
        worker_start(True, None, fork)
    spawn = multiprocessing.get_context("spawn")
    assert worker_start(True, None, spawn) is spawn and worker_start(False, None, fork) is fork


@pytest.mark.gpu
@pytest.mark.parametrize("decode_in", ["main", "workers"])
def test_on_cuda_batches_land_on_the_device_current_when_the_loader_was_made(
    store: Path, decode_in: str
) -> None:
    # torch.cuda.set_device(LOCAL_RANK), then device="cuda": the prefetch thread, which starts
    # on device 0, decoded (decode_in="main") or received (decode_in="workers") and moved the
    # batches to cuda:0 on every rank. (With one GPU the loader's device must still say which.)
    last = torch.cuda.device_count() - 1
    with (
        torch.cuda.device(last),
        on_cuda(store, num_workers=1, decode_in=decode_in) as loader,
    ):
        assert loader.device == torch.device("cuda", last)
        for x, y in loader:
            assert x.device == y.device == torch.device("cuda", last)


@pytest.mark.gpu
def test_on_cuda_num_workers_auto_lets_go_what_the_measured_workers_shared(
    store: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each count measured stops in the middle of an epoch: its workers exited holding batches
    # this process had not taken, and each warned ("Producer process has been terminated ...")
    import fastdata.loaders.tuning as tuning

    monkeypatch.setattr(tuning, "worker_candidates", lambda: [1, 2])
    with on_cuda(store, num_workers="auto", auto_seconds=0.05) as loader:
        assert set(loader.worker_rates) == {1, 2}
        assert sum(len(y) for _x, y in loader) == 24
    assert_no_worker_warned(capfd)


@pytest.mark.parametrize("decode_in", ["main", "workers"])
def test_a_loop_the_loader_was_closed_under_says_so_and_the_rest_follows(
    store: Path, decode_in: str
) -> None:
    # before: the loop took the few batches already made, then ended as if the epoch were
    # done (the loader's position moved to the next epoch: the rest was never delivered)
    want = epochs(store, count=1, num_workers=0, decode_in="main")
    options: dict[str, object] = dict(
        image_size=48, seed=3, batch_size=8, mean=None, std=None, decode="device"
    )
    options.update(device="cpu", decode_backend=BACKEND, decode_in=decode_in)
    options.update(pipeline=TrainPipeline(48, fast_decode=False), num_workers=2)
    loader = create_loader(LMDBImageDataset(store), **options)  # type: ignore[arg-type]
    got = []
    with pytest.raises(UsageError, match="closed during epoch 0, after 1 of its 3 batches"):
        for x, y in loader:
            got.append((x.clone(), y.clone()))
            loader.close()
    assert loader.state_dict()["epoch"] == 0
    got += [(x.clone(), y.clone()) for x, y in loader]  # (the workers start again)
    loader.close()
    assert same(got, want)


@pytest.mark.gpu
def test_on_cuda_workers_of_one_epoch_let_go_what_they_shared_when_it_is_left_early(
    store: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # persistent_workers=False: the epoch's iterator is not the loader's to close; left in the
    # middle, its workers exited holding batches this process had not taken, each warning
    with on_cuda(store, persistent_workers=False) as loader:
        for _ in range(2):
            for i, (x, _y) in enumerate(loader):
                assert x.device.type == "cuda"
                if i == 1:
                    break
        assert sum(len(y) for _x, y in loader) == 24 - 16  # (the epoch goes on where it was)
    assert_no_worker_warned(capfd)
