#!/usr/bin/env python
"""End to end on a CUDA machine: fastdata's loader against timm's feeding ResNet-50 training.

Generates a folder of real-size JPEGs (500x375, ~20,000 by default), converts it to LMDB, and
trains ResNet-50 (bf16 autocast, channels_last, SGD, batch 256) from each loader in turn, at
each worker count, in the same run:

- ``fastdata``: ``create_loader(LMDBImageDataset(store), ...)`` (the built-in train pipeline:
  random-resized-crop to 224 and flip, normalised on the device by its prefetcher);
- ``timm``: ``timm.data.create_loader`` over the folder (``ImageDataset``, Pillow decode, the
  same random-resized-crop and flip, no colour jitter, its CUDA prefetcher, pinned memory);
- ``fastdata-gpu`` (on request): ``create_loader(..., decode="device")``, the JPEGs decoded on
  the GPU.

For each it prints images/s, the share of the time the training loop waited for data (time in
``next()`` over the whole loop, the step's stream waited for every step), and CPU seconds per 1,000
images (the main process and its workers); and the rate of the same steps on a batch already on
the device (the ceiling).

    python scripts/bench_gpu_train.py [--images 20000] [--workers 4,8,14] [--steps 40]
    python scripts/bench_gpu_train.py --loaders fastdata-gpu,fastdata --workers 2,4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from fastdata import LMDBImageDataset, create_loader
from fastdata.images.synthetic import synthetic_jpeg

CLASSES = 100


def _write(job: tuple[str, int, int]) -> None:
    root, c, i = job
    path = Path(root) / f"class_{c:03d}" / f"img_{i:05d}.jpg"
    if not path.exists():
        data = synthetic_jpeg(500, 375, seed=c * 1_000_003 + i, hue=c / CLASSES)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(path)


def make_folder(root: Path, images: int) -> Path:
    """``root/class_XXX/img_XXXXX.jpg``, generated in parallel; files already there are kept."""
    per_class = images // CLASSES
    for c in range(CLASSES):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    jobs = [(str(root), c, i) for c in range(CLASSES) for i in range(per_class)]
    with mp.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write, jobs, chunksize=64)
    return root


def cpu_seconds() -> float:
    """User + system CPU time of this process and all its children alive now."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a worker that just ended
            total += sum(child.cpu_times()[:2])
    return total


def model_and_step(batch: int) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    try:
        from torchvision.models import resnet50

        model: Any = resnet50()
        where = "torchvision"
    except ImportError:
        import timm

        model = timm.create_model("resnet50")
        where = "timm"
    model = model.cuda().to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x.contiguous(memory_format=torch.channels_last)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # wait for this stream's step as a loop logging its loss does: not for the loader's side
        # stream (torch.cuda.synchronize() would), and blocking, not spinning on a core
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()

    return f"ResNet-50 ({where}), bf16 autocast, channels_last, SGD, batch {batch}", step


def train(
    loader: Iterable[Any],
    step: Callable[[torch.Tensor, torch.Tensor], None],
    warmup: int,
    steps: int,
) -> tuple[float, float, float]:
    """(images/s, share of the time waiting for data, CPU s per 1,000 images) over ``steps``
    steps after ``warmup`` ones."""
    it = iter(loader)
    for _ in range(warmup):
        x, y = next(it)
        step(x, y)
    waited, n = 0.0, 0
    start, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - t
        step(x, y)
        n += x.shape[0]
    wall = time.perf_counter() - start
    used = cpu_seconds() - cpu
    return n / wall, waited / wall, 1000 * used / n


def fastdata_loader(store: Path, batch: int, workers: int, decode: str = "cpu") -> Any:
    return create_loader(
        LMDBImageDataset(store),
        batch,
        num_workers=workers,
        device="cuda",
        channels_last=True,
        decode=decode,
    )


def timm_loader(folder: Path, batch: int, workers: int) -> Any:
    import timm.data

    return timm.data.create_loader(
        timm.data.ImageDataset(str(folder)),
        input_size=(3, 224, 224),
        batch_size=batch,
        is_training=True,
        color_jitter=0.0,
        num_workers=workers,
        pin_memory=True,
        use_prefetcher=True,
        device=torch.device("cuda"),
    )


def close(loader: Any) -> None:
    if hasattr(loader, "close"):
        loader.close()
    inner = getattr(loader, "loader", None)
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--workers", default="4,8,14", help="comma-separated worker counts")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per loader and count")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--loaders",
        default="fastdata,timm",
        help="of fastdata, timm and fastdata-gpu (create_loader(..., decode='device'))",
    )
    ap.add_argument("--workdir", type=Path, help="keep the images and the store here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_train.py: needs a CUDA device")
    chosen = [name.strip() for name in args.loaders.split(",")]
    unknown = sorted(set(chosen) - {"fastdata", "timm", "fastdata-gpu"})
    if unknown:
        ap.error(f"--loaders: unknown {', '.join(unknown)} (of fastdata, timm, fastdata-gpu)")
    needed = ["psutil"] + ["timm"] * ("timm" in chosen)
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if not any(importlib.util.find_spec(m) for m in ("torchvision", "timm")):
        missing.append("torchvision or timm (for ResNet-50)")
    if missing:  # said before twenty thousand images are generated
        sys.exit(f"bench_gpu_train.py: needs {', '.join(missing)}: pip install them first")
    if (args.warmup + args.steps) * args.batch_size > args.images:
        ap.error("--images must hold (--warmup + --steps) batches: one epoch per measurement")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fastdata-bench-gpu-"))
    folder = work / "images"
    store = work / "images.lmdb"
    t = time.perf_counter()
    make_folder(folder, args.images)
    made = time.perf_counter() - t
    if not (store / "data.mdb").exists():
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "fastdata", "convert", str(folder), str(store), "-q"],
            check=True,
        )
        print(f"folder generated in {made:.0f} s, converted in {time.perf_counter() - t:.0f} s")
    n = len(LMDBImageDataset(store))
    what, step = model_and_step(args.batch_size)
    print(
        f"{n} JPEGs of 500x375 in {CLASSES} classes; {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs\n{what}; "
        f"{args.warmup} warm-up + {args.steps} timed steps per measurement"
    )
    resident = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    labels = torch.randint(0, CLASSES, (args.batch_size,), device="cuda")
    for _ in range(args.warmup):
        step(resident, labels)
    t = time.perf_counter()
    for _ in range(args.steps):
        step(resident, labels)
    ceiling = args.steps * args.batch_size / (time.perf_counter() - t)
    print(f"compute alone (the batch already on the device): {ceiling:7.0f} img/s\n")
    print(
        f"{'workers':>7}  {'loader':<9}{'img/s':>8}{'of ceiling':>12}{'waiting':>9}"
        f"{'CPU s/1k img':>14}"
    )
    makers = {
        "fastdata": lambda w: fastdata_loader(store, args.batch_size, w),
        "timm": lambda w: timm_loader(folder, args.batch_size, w),
        # the workers only read bytes and draw crops; the GPU decodes (nvImageCodec or torchvision)
        "fastdata-gpu": lambda w: fastdata_loader(store, args.batch_size, w, decode="device"),
    }
    for workers in (int(w) for w in args.workers.split(",")):
        rates = {}
        for name in chosen:
            loader = makers[name](workers)
            try:
                rate, waiting, cpu = train(loader, step, args.warmup, args.steps)
            finally:
                close(loader)
            rates[name] = rate
            print(
                f"{workers:>7}  {name:<9}{rate:8.0f}{rate / ceiling:12.2f}{waiting:9.1%}{cpu:14.2f}"
            )
        for other in chosen[1:]:
            first = chosen[0]
            print(f"{'':>7}  {first} / {other}: {rates[first] / rates[other]:.2f}x")


if __name__ == "__main__":
    main()
