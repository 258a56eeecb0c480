"""The device prefetchers on a real CUDA device (skipped without one): results bit-identical to a
synchronous copy, copies that do not block the host, memory that stays put, and consumers that
hold batches, change streams or are compiled."""

from __future__ import annotations

import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.images.synthetic import synthetic_jpeg
from fastdata.loaders import BackgroundGenerator, PrefetchLoader

from ..conftest import write

pytestmark = pytest.mark.gpu

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
Pair = namedtuple("Pair", "image mask")


def batches(
    n: int = 8, size: int = 64, side: int = 64, seed: int = 0, pinned: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (size, 3, side, side), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 1000, (size,), generator=g)
        out.append((x.pin_memory(), y.pin_memory()) if pinned else (x, y))
    return out


def reference(
    x: torch.Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = False
) -> torch.Tensor:
    """What a training script writes without a prefetcher: ``.cuda()``, then normalise."""
    mean = (torch.tensor(MEAN) * 255).view(1, 3, 1, 1).cuda()
    inv_std = (torch.tensor(STD) * 255).reciprocal().view(1, 3, 1, 1).cuda()
    out = (x.cuda().float() - mean) * inv_std
    if channels_last:
        out = out.contiguous(memory_format=torch.channels_last)
    return out.to(dtype)


def long_kernel_queue(ms: float = 300.0) -> torch.Tensor:
    """Queue about ``ms`` of GPU work on the current stream and return its output."""
    a = torch.randn(4096, 4096, device="cuda")
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    b = a @ a
    end.record()
    torch.cuda.synchronize()
    per = max(start.elapsed_time(end), 1e-3)
    for _ in range(int(ms / per) + 1):
        b = torch.tanh(b @ a)
    return b


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bit_identical_to_a_synchronous_copy_over_epochs(
    dtype: torch.dtype, channels_last: bool
) -> None:
    data = batches()
    loader = PrefetchLoader(
        data, device="cuda", dtype=dtype, channels_last=channels_last, normalize=True
    )
    for _ in range(3):
        n = 0
        for (gx, gy), (x, y) in zip(loader, data, strict=True):
            want = reference(x, dtype, channels_last)
            assert gx.device.type == "cuda" and gx.dtype == dtype
            assert gx.is_contiguous(
                memory_format=torch.channels_last if channels_last else torch.contiguous_format
            )
            assert torch.equal(gx, want) and torch.equal(gy, y.cuda())
            n += 1
        assert n == len(data)


def test_uint8_kept_float_moved_and_nested_structures() -> None:
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g)
    floats = torch.rand(4, 3, 8, 8, generator=g)  # already float: moved, not converted
    batch = {
        "pair": Pair(images, torch.ones(4, dtype=torch.bool)),
        "list": [floats, "a string", 7, None],
        "nested": {"ids": torch.arange(4)},
    }
    (kept,) = list(PrefetchLoader([batch], device="cuda"))  # no normalisation asked: uint8 kept
    assert isinstance(kept["pair"], Pair)
    assert kept["pair"].image.dtype == torch.uint8 and kept["pair"].image.is_cuda
    assert torch.equal(kept["pair"].image.cpu(), images)
    assert torch.equal(kept["list"][0].cpu(), floats) and kept["list"][1:] == ["a string", 7, None]
    assert kept["nested"]["ids"].is_cuda

    (normed,) = list(PrefetchLoader([batch], device="cuda", normalize=True))
    assert torch.equal(normed["pair"].image, reference(images))
    assert torch.equal(normed["list"][0].cpu(), floats)  # float images are left as they are
    assert normed["pair"].mask.dtype == torch.bool


def test_copies_do_not_block_the_host() -> None:
    # pinned or not (then pinned first), the host queues the next copy and goes on: with a
    # long queue of work on the consumer's stream, taking a batch returns long before it ends
    for pinned in (True, False):
        loader = PrefetchLoader(batches(n=4, size=256, pinned=pinned), device="cuda")
        it = iter(loader)
        next(it)
        torch.cuda.synchronize()
        out = long_kernel_queue(300)
        start = time.perf_counter()
        next(it)  # hands batch 1 over and queues batch 2's copy behind the queue
        took = time.perf_counter() - start
        done = torch.cuda.Event()
        done.record()
        assert not done.query(), "the queue ended before the host came back"
        assert took < 0.1, f"taking a batch blocked the host for {took * 1e3:.0f} ms"
        out.sum().item()
        list(it)


def test_batches_held_across_steps_keep_their_data() -> None:
    # gradient accumulation, logging, a replay buffer: the consumer keeps every batch while the
    # loader goes on allocating, and frees others while its work on them is still queued
    data = batches(n=12, size=128)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    sums: list[torch.Tensor] = []
    for epoch in range(3):
        for i, (x, y) in enumerate(PrefetchLoader(data, device="cuda", normalize=True)):
            long_kernel_queue(5)
            sums.append(x.double().sum())  # queued behind the kernels; x freed right after
            if epoch == 0 and i % 2 == 0:
                held.append((x, y))
            del x, y
    torch.cuda.synchronize()
    want = [reference(x).double().sum() for x, _ in data]
    for k, s in enumerate(sums):
        assert torch.equal(s, want[k % len(data)]), k
    for (hx, hy), (x, y) in zip(held, data[::2], strict=True):
        assert torch.equal(hx, reference(x)) and torch.equal(hy, y.cuda())


def test_consumer_on_its_own_stream() -> None:
    # a consumer iterating under another stream gets batches that are ready on that stream
    data = batches(n=6, size=256)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for (gx, _), (x, _) in zip(PrefetchLoader(data, device="cuda"), data, strict=True):
            long_kernel_queue(5)
            assert torch.equal(gx.cpu(), x)


def test_consumer_work_queued_before_does_not_race_the_copy() -> None:
    # heavy work on the consumer's stream right before each batch: every result must still be
    # exactly the batch's data (the side stream waits for the consumer before copying).
    data = batches(n=6, size=256)
    big = torch.randn(4096, 4096, device="cuda")
    for (gx, gy), (x, y) in zip(PrefetchLoader(data, device="cuda"), data, strict=True):
        for _ in range(3):
            big = big @ big
            big /= big.norm()
        assert torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)


def test_copy_overlaps_compute() -> None:
    data = batches(n=20, size=256, side=224)
    weight = torch.randn(4096, 4096, device="cuda")

    def step(x: torch.Tensor) -> None:
        w = weight
        for _ in range(4):
            w = w @ weight
        x.float().mean()

    def run(loader) -> float:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x, _ in loader:
            step(x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    run(PrefetchLoader(data, device="cuda"))  # warm up
    sync_ms = run(((x.cuda(), y.cuda()) for x, y in data))
    prefetch_ms = run(PrefetchLoader(data, device="cuda"))
    compute_ms = run((torch.empty(1, 3, 1, 1, device="cuda"), None) for _ in data)
    # the copies are hidden behind compute: close to compute alone, clearly below synchronous
    assert prefetch_ms < sync_ms
    assert prefetch_ms < compute_ms * 1.25 + 1.0


def test_gpu_memory_steady_over_epochs() -> None:
    data = batches(n=4, size=128)
    loader = PrefetchLoader(data, device="cuda", normalize=True)
    for _ in range(3):
        for x, _ in loader:
            x.sum()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(30):
        for x, _ in loader:
            x.sum()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= reserved  # one side stream, not one per epoch


# torch's compiler imports modules of its own that warn about its own deprecations
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_compiled_consumer() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    ).cuda()
    model = model.to(memory_format=torch.channels_last)
    compiled = torch.compile(model)
    data = batches(n=4, size=32, side=32)
    loader = PrefetchLoader(
        data, device="cuda", normalize=True, dtype=torch.bfloat16, channels_last=True
    )
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(2):
            for x, _ in loader:
                got = compiled(x)
                want = model(x)
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_background_generator_device_copy_on_side_stream() -> None:
    data = batches(n=5)
    out = list(BackgroundGenerator(iter(data), device="cuda"))
    for (gx, gy), (x, y) in zip(out, data, strict=True):
        assert gx.device.type == "cuda" and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)


def test_create_loader_on_cuda_gives_the_cpu_loaders_batches(tmp_path: Path) -> None:
    # the same seed on the CPU and on the device: the same batches, bit for bit, for two epochs
    for i in range(24):
        write(tmp_path / "src" / f"c{i % 3}" / f"{i:03d}.jpg", synthetic_jpeg(120, 90, seed=i))
    convert(tmp_path / "src", tmp_path / "s.lmdb")
    common = dict(batch_size=8, image_size=32, num_workers=2, seed=5)
    with (
        create_loader(LMDBImageDataset(tmp_path / "s.lmdb"), device="cpu", **common) as cpu,  # type: ignore[arg-type]
        create_loader(LMDBImageDataset(tmp_path / "s.lmdb"), device="cuda", **common) as gpu,  # type: ignore[arg-type]
    ):
        for _ in range(2):
            pairs = list(zip(cpu, gpu, strict=True))
            assert len(pairs) == 3
            for (cx, cy), (gx, gy) in pairs:
                assert gx.is_cuda and gx.dtype == torch.float32
                assert torch.equal(gx.cpu(), cx) and torch.equal(gy.cpu(), cy)
