#!/usr/bin/env python
"""Prefetcher benchmark: BackgroundGenerator overlap, and with a GPU, PrefetchLoader copy hiding.

Prints, in one run:

- BackgroundGenerator total time for a producer and a consumer that each take a fixed time per
  batch, against the ideal ``max(produce, consume) * n`` (goal: within 10%) and the serial sum;
- with CUDA: PrefetchLoader step time with a ResNet-50 training step in bf16 at batch 256 (or a
  matmul loop where neither torchvision nor timm imports) against the same loop with synchronous
  copies and against compute alone (goal: within 5% of compute alone), and its copy bandwidth
  against a bare pinned ``copy_`` loop.

    python scripts/bench_prefetch.py [--batches 200] [--model resnet50|matmul]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fastdata.loaders import BackgroundGenerator, PrefetchLoader


def busy(seconds: float) -> None:
    """Work that releases the GIL, as decoding or a CUDA launch queue does."""
    time.sleep(seconds)


def background_figures(n: int, produce: float, consume: float) -> None:
    def producer() -> Iterator[int]:
        for i in range(n):
            busy(produce)
            yield i

    start = time.perf_counter()
    for _ in producer():
        busy(consume)
    serial = time.perf_counter() - start

    start = time.perf_counter()
    for _ in BackgroundGenerator(producer(), max_prefetch=4):
        busy(consume)
    overlapped = time.perf_counter() - start

    ideal = max(produce, consume) * n
    print(
        f"BackgroundGenerator, {n} batches, produce {produce * 1e3:.1f} ms, "
        f"consume {consume * 1e3:.1f} ms"
    )
    print(f"  overlapped {overlapped:7.3f} s   ideal {ideal:7.3f} s   serial {serial:7.3f} s")
    print(
        f"  overlapped / ideal {overlapped / ideal:5.2f} (goal <= 1.10)   "
        f"serial / overlapped {serial / overlapped:5.2f}"
    )


def training_step(model_name: str, batch: int, size: int) -> tuple[str, Callable[[Any], None]]:
    """A step of real work per batch: ResNet-50 forward + backward + SGD in bf16 autocast,
    channels_last (torchvision's or timm's model, whichever imports), or a matmul loop of about
    the same length where neither is installed."""
    device = torch.device("cuda")
    model: Any = None
    if model_name == "resnet50":
        try:
            from torchvision.models import resnet50

            model = resnet50()
        except ImportError:
            try:
                import timm

                model = timm.create_model("resnet50")
            except ImportError:
                model = None
    if model is not None:
        model = model.to(device, memory_format=torch.channels_last).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        target = torch.zeros(batch, dtype=torch.long, device=device)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(x: Any) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return f"ResNet-50 forward+backward+SGD, bf16 autocast, batch {batch}", step

    weight = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmuls(x: Any) -> None:
        w = weight
        for _ in range(40):
            w = w @ weight
        x.mean()

    return "40 bf16 8192^3 matmuls (no ResNet-50: install torchvision or timm)", matmuls


def cuda_figures(n: int, batch: int, size: int, model_name: str) -> None:
    device = torch.device("cuda")
    data = [
        (
            torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8).pin_memory(),
            torch.arange(batch).pin_memory(),
        )
        for _ in range(8)
    ]
    rounds = max(1, n // len(data))
    mean = torch.tensor((0.485, 0.456, 0.406), device=device).view(1, 3, 1, 1) * 255
    inv_std = (torch.tensor((0.229, 0.224, 0.225), device=device).view(1, 3, 1, 1) * 255) ** -1
    what, step = training_step(model_name, batch, size)
    resident = [
        ((x.to(device).float() - mean) * inv_std).contiguous(memory_format=torch.channels_last)
        for x, _ in data
    ]

    def step_ms(make_epoch: Callable[[], Iterable[Any]]) -> float:
        """Mean step time (ms) of a loop doing one training step per batch."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rounds):
            for x, _y in make_epoch():
                step(x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / (rounds * len(data))

    def synchronous() -> Iterator[Any]:
        for x, y in data:
            x = ((x.to(device).float() - mean) * inv_std).contiguous(
                memory_format=torch.channels_last
            )
            yield x, y.to(device)

    def alone() -> Iterator[Any]:
        return ((x, None) for x in resident)  # the batches already on the device

    prefetch = PrefetchLoader(data, device=device, normalize=True, channels_last=True)
    for make in (lambda: prefetch, synchronous, alone):  # warm up kernels and the allocator
        step_ms(make)
    times: dict[str, list[float]] = {"alone": [], "sync": [], "ahead": []}
    for _ in range(3):  # interleaved, the median of three of each
        times["alone"].append(step_ms(alone))
        times["sync"].append(step_ms(synchronous))
        times["ahead"].append(step_ms(lambda: prefetch))
    alone_ms, sync_ms, ahead_ms = (sorted(times[k])[1] for k in ("alone", "sync", "ahead"))
    print(
        f"\nPrefetchLoader, batches of {batch}x3x{size}x{size} uint8 -> float32 normalised, "
        f"channels_last, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"  step: {what}")
    print(
        f"  step time (median of 3 x {rounds * len(data)} steps): compute alone {alone_ms:7.2f} ms"
        f"   synchronous copy {sync_ms:7.2f} ms   prefetched {ahead_ms:7.2f} ms"
    )
    print(
        f"  prefetched / compute alone {ahead_ms / alone_ms:5.3f} (goal <= 1.05)   "
        f"synchronous / compute alone {sync_ms / alone_ms:5.3f}"
    )

    def bandwidth(copy_epoch: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            copy_epoch()
        torch.cuda.synchronize()
        return sum(x.numel() for x, _ in data) * rounds / (time.perf_counter() - start) / 1e9

    target = torch.empty_like(data[0][0], device=device)
    moved_only = PrefetchLoader(data, device=device)

    def bare_epoch() -> None:
        for x, _ in data:
            target.copy_(x, non_blocking=True)

    def prefetch_epoch() -> None:
        for _batch in moved_only:
            pass

    bare = bandwidth(bare_epoch)
    ours = bandwidth(prefetch_epoch)
    print(
        f"  copy bandwidth: PrefetchLoader {ours:6.2f} GB/s   bare pinned copy_ {bare:6.2f} GB/s"
        f"   ratio {ours / bare:5.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--produce-ms", type=float, default=5.0)
    ap.add_argument("--consume-ms", type=float, default=5.0)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument(
        "--model",
        choices=("resnet50", "matmul"),
        default="resnet50",
        help="the step on the device: ResNet-50 training (torchvision or timm), or matmuls",
    )
    args = ap.parse_args()
    background_figures(args.batches, args.produce_ms / 1e3, args.consume_ms / 1e3)
    background_figures(args.batches, args.produce_ms / 1e3, args.consume_ms / 2e3)
    if torch.cuda.is_available():
        cuda_figures(args.batches, args.batch_size, args.image_size, args.model)
    else:
        print(
            "\nno CUDA device: PrefetchLoader stream figures need one (run this on a GPU machine)"
        )


if __name__ == "__main__":
    main()
