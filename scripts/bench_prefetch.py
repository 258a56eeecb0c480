#!/usr/bin/env python
"""Prefetcher benchmark: BackgroundGenerator overlap, and with a GPU, PrefetchLoader copy hiding.

Prints, in one run:

- BackgroundGenerator total time for a producer and a consumer that each take a fixed time per
  batch, against the ideal ``max(produce, consume) * n`` (goal: within 10%) and the serial sum;
- with CUDA: PrefetchLoader step time with a fixed compute step against the same loop with
  synchronous copies and against compute alone (goal: copy hidden, within 10% of compute alone),
  and its copy bandwidth against a bare pinned ``copy_`` loop.

    python scripts/bench_prefetch.py [--batches 200] [--produce-ms 5] [--consume-ms 5]
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


def cuda_figures(n: int, batch: int, size: int) -> None:
    device = torch.device("cuda")
    data = [
        (
            torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8).pin_memory(),
            torch.arange(batch).pin_memory(),
        )
        for _ in range(8)
    ]
    rounds = max(1, n // len(data))
    weight = torch.randn(4096, 4096, device=device)
    mean = torch.tensor((0.485, 0.456, 0.406), device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor((0.229, 0.224, 0.225), device=device).view(1, 3, 1, 1) * 255

    def step_ms(make_epoch: Callable[[], Iterable[Any]]) -> float:
        """Mean step time (ms) of a loop doing a fixed compute step per batch."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rounds):
            for _batch in make_epoch():
                w = weight
                for _ in range(6):
                    w = w @ weight
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / (rounds * len(data))

    def synchronous() -> Iterator[Any]:
        for x, y in data:
            yield (x.to(device).float() - mean) / std, y.to(device)

    prefetch = PrefetchLoader(data, device=device, normalize=True)
    step_ms(lambda: prefetch)  # warm up kernels and the allocator
    alone = step_ms(lambda: [None] * len(data))
    sync = step_ms(synchronous)
    ahead = step_ms(lambda: prefetch)
    print(
        f"\nPrefetchLoader, batches of {batch}x3x{size}x{size} uint8 -> float32 normalised, "
        f"{torch.cuda.get_device_name()}"
    )
    print(
        f"  step: compute alone {alone:6.2f} ms   synchronous copy {sync:6.2f} ms   "
        f"prefetched {ahead:6.2f} ms"
    )
    print(
        f"  prefetched / compute alone {ahead / alone:5.2f} (goal <= 1.10)   "
        f"synchronous / prefetched {sync / ahead:5.2f}"
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
    args = ap.parse_args()
    background_figures(args.batches, args.produce_ms / 1e3, args.consume_ms / 1e3)
    background_figures(args.batches, args.produce_ms / 1e3, args.consume_ms / 2e3)
    if torch.cuda.is_available():
        cuda_figures(args.batches, args.batch_size, args.image_size)
    else:
        print(
            "\nno CUDA device: PrefetchLoader stream figures need one (run this on a GPU machine)"
        )


if __name__ == "__main__":
    main()
