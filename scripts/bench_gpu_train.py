#!/usr/bin/env python
"""End to end on a CUDA machine: fastdata's loader against timm's feeding ResNet-50 training.

Generates a folder of real-size JPEGs (500x375, ~20,000 by default), converts it to LMDB, and
trains ResNet-50 (bf16 autocast, channels_last, SGD, batch 256) from each loader in turn, at
each worker count, in the same run:

- ``fastdata``: ``create_loader(LMDBImageDataset(store), ...)`` (the built-in train pipeline:
  random-resized-crop to 224 and flip, normalised on the device by its prefetcher);
- ``timm``: ``timm.data.create_loader`` over the folder (``ImageDataset``, Pillow decode, the
  same random-resized-crop and flip, no colour jitter, its CUDA prefetcher, pinned memory);
- ``fastdata-gpu``: ``create_loader(..., decode="device")``, the JPEGs decoded on the GPU;
  ``fastdata-gpu[hardware=0.65,regions=0,threads=1,batched=1]`` sets the
  :class:`~fastdata.images.device_decode.DeviceDecoder`'s options (the share of each batch for
  the hardware JPEG decoders, crop-window decoding, nvImageCodec's host threads, the batched
  resize); ``in=workers`` decodes in the loader's worker processes (``decode_in="workers"``),
  ``switch=0.001`` sets the interpreter's switch interval for that loader;
- ``dali`` where NVIDIA DALI is installed: its GPU pipeline (``fn.readers.file``, mixed decode
  with random-resized-crop, resize, flip, normalise) over the same folder.

For each it prints images/s, the share of the time the training loop waited for data (time in
``next()`` over the whole loop, the step's stream waited for every step), CPU seconds per 1,000
images (the main process and its workers, and the main process alone), the median and 99th
percentile of ``next()``; for the device decode the median and 99th percentile of a batch's
decode on the host (the decode thread's time in the decoder) and on the GPU (CUDA events on the
decode stream); and the rate of the same steps on a batch already on the device (the ceiling).

    python scripts/bench_gpu_train.py [--images 20000] [--workers 1,2,4] [--steps 40]
    python scripts/bench_gpu_train.py --loaders "fastdata-gpu,fastdata-gpu[hardware=1],fastdata"
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
import threading
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


def cpu_seconds() -> tuple[float, float]:
    """User + system CPU time of this process and all its children alive now, and of this
    process alone."""
    import psutil

    me = psutil.Process()
    mine = sum(me.cpu_times()[:2])
    total = mine
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a worker that just ended
            total += sum(child.cpu_times()[:2])
    return total, mine


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Timed:
    """Wraps a device loader's decode step: the host time of each call, and CUDA events around
    its work on the decode stream (read after the run)."""

    def __init__(self, decode: Callable[[Any], Any]) -> None:
        self.decode = decode
        self.host: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, batch: Any) -> Any:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        begin.record()
        out = self.decode(batch)
        end.record()
        with self.lock:
            self.host.append(time.perf_counter() - t)
            self.events.append((begin, end))
        return out

    def reset(self) -> None:
        with self.lock:
            self.host.clear()
            self.events.clear()

    def gpu(self) -> list[float]:
        torch.cuda.synchronize()
        with self.lock:
            return [b.elapsed_time(e) / 1000 for b, e in self.events]


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


class Result:
    def __init__(self) -> None:
        self.rate = self.waiting = self.cpu = self.main_cpu = 0.0
        self.nexts: list[float] = []
        self.decode_host: list[float] = []
        self.decode_gpu: list[float] = []


def train(
    loader: Iterable[Any],
    step: Callable[[torch.Tensor, torch.Tensor], None],
    warmup: int,
    steps: int,
    timed: Timed | None = None,
) -> Result:
    """Images/s, the share of the time waiting for data, CPU s per 1,000 images (all, and the
    main process), each ``next()``'s time, over ``steps`` steps after ``warmup`` ones."""
    it = iter(loader)
    for _ in range(warmup):
        x, y = next(it)
        step(x, y)
    if timed is not None:
        timed.reset()
    r = Result()
    n = 0
    start, (cpu, main) = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(it)
        r.nexts.append(time.perf_counter() - t)
        step(x, y)
        n += x.shape[0]
    wall = time.perf_counter() - start
    cpu_end, main_end = cpu_seconds()
    used, used_main = cpu_end - cpu, main_end - main
    r.rate, r.waiting = n / wall, sum(r.nexts) / wall
    r.cpu, r.main_cpu = 1000 * used / n, 1000 * used_main / n
    if timed is not None:
        r.decode_host, r.decode_gpu = list(timed.host), timed.gpu()
    return r


def decoder_options(name: str) -> dict[str, Any]:
    """``fastdata-gpu[hardware=0.65,regions=0,threads=1,batched=1]`` -> the DeviceDecoder's
    options."""
    if "[" not in name:
        return {}
    inside = name[name.index("[") + 1 : name.rindex("]")]
    options: dict[str, Any] = {}
    for item in filter(None, inside.split(",")):
        key, _, value = item.partition("=")
        if key == "hardware":
            options[key] = None if value == "none" else float(value)
        elif key in ("regions", "batched"):
            options[key] = value not in ("0", "false", "no")
        elif key == "threads":
            options[key] = int(value)
        elif key == "in":  # where the device decode runs: main (a thread here) or workers
            if value not in ("main", "workers"):
                raise SystemExit(f"bench_gpu_train.py: {name}: in= takes main or workers")
            options[key] = value
        elif key == "switch":  # the interpreter's switch interval, seconds (default 0.005)
            options[key] = float(value)
        else:
            raise SystemExit(f"bench_gpu_train.py: {name}: unknown option {key!r}")
    return options


def fastdata_loader(
    store: Path, batch: int, workers: int, decode: str = "cpu", **options: Any
) -> tuple[Any, Timed | None]:
    where = options.pop("in", "main")
    sys.setswitchinterval(options.pop("switch", 0.005))
    loader = create_loader(
        LMDBImageDataset(store),
        batch,
        num_workers=workers,
        device="cuda",
        channels_last=True,
        decode=decode,
        **({"decode_in": where, "decode_options": options} if decode == "device" else {}),
    )
    if decode != "device" or where == "workers":  # (a worker's decode is not timed here)
        return loader, None
    step = loader.device_loader.decode
    timed = Timed(step)
    loader.device_loader.decode = timed
    return loader, timed


def dali_loader(folder: Path, batch: int, workers: int) -> Any:
    """DALI's GPU pipeline over the folder: file reader, mixed (hardware + CUDA) decode with a
    random-resized-crop, resize to 224, flip, normalise to bf16 NCHW."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(batch_size=batch, num_threads=max(1, workers), device_id=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(folder), random_shuffle=True, name="r")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16,
            output_layout="CHW",
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
            mirror=fn.random.coin_flip(),
        )
        return images, labels.gpu()

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["x", "y"], reader_name="r", auto_reset=True)
    return ((b[0]["x"], b[0]["y"].view(-1).long()) for b in it)


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
    if hasattr(loader, "close") and not hasattr(loader, "gi_frame"):
        loader.close()
    inner = getattr(loader, "loader", None)
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def loader_for(name: str, store: Path, folder: Path, batch: int, workers: int) -> Any:
    if name == "timm":
        return timm_loader(folder, batch, workers), None
    if name == "dali":
        return dali_loader(folder, batch, workers), None
    if name == "fastdata":
        return fastdata_loader(store, batch, workers)
    return fastdata_loader(store, batch, workers, decode="device", **decoder_options(name))


def split_names(text: str) -> list[str]:
    """``a,b[x=1,y=2],c`` -> ``["a", "b[x=1,y=2]", "c"]``."""
    names, depth, current = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if current.strip():
                names.append(current.strip())
            current = ""
            continue
        depth += (ch == "[") - (ch == "]")
        current += ch
    return names


def ms(values: list[float], q: float) -> str:
    return f"{1000 * percentile(values, q):.1f}" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per loader and count")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--loaders",
        default="fastdata-gpu,fastdata,timm,dali",
        help="of fastdata, fastdata-gpu (decode='device', options in brackets), timm, dali "
        "(left out where not installed)",
    )
    ap.add_argument("--workdir", type=Path, help="keep the images and the store here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_train.py: needs a CUDA device")
    chosen = split_names(args.loaders)
    unknown = sorted(
        name
        for name in chosen
        if name not in ("fastdata", "timm", "dali") and not name.startswith("fastdata-gpu")
    )
    if unknown:
        ap.error(f"--loaders: unknown {', '.join(unknown)} (of fastdata, fastdata-gpu, timm, dali)")
    for name in chosen:
        decoder_options(name)  # refused now, not after the images are made
    if "dali" in chosen and importlib.util.find_spec("nvidia.dali") is None:
        print("DALI is not installed: its pipeline is left out (pip install nvidia-dali-cuda120)")
        chosen.remove("dali")
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
        f"{'workers':>7}  {'loader':<36}{'img/s':>7}{'of ceil':>8}{'waiting':>8}"
        f"{'CPU s/1k':>9}{'main':>6}{'next p50':>9}{'p99 ms':>7}"
        f"{'decode host p50':>16}{'p99':>6}{'gpu p50':>8}{'p99':>6}"
    )
    for workers in (int(w) for w in args.workers.split(",")):
        rates = {}
        for name in chosen:
            loader, timed = loader_for(name, store, folder, args.batch_size, workers)
            try:
                r = train(loader, step, args.warmup, args.steps, timed)
            finally:
                close(loader)
            rates[name] = r.rate
            print(
                f"{workers:>7}  {name:<36}{r.rate:7.0f}{r.rate / ceiling:8.2f}{r.waiting:8.1%}"
                f"{r.cpu:9.2f}{r.main_cpu:6.2f}{ms(r.nexts, 0.5):>9}{ms(r.nexts, 0.99):>7}"
                f"{ms(r.decode_host, 0.5):>16}{ms(r.decode_host, 0.99):>6}"
                f"{ms(r.decode_gpu, 0.5):>8}{ms(r.decode_gpu, 0.99):>6}",
                flush=True,
            )
        first = chosen[0]
        for other in chosen[1:]:
            print(f"{'':>7}  {first} / {other}: {rates[first] / rates[other]:.2f}x")


if __name__ == "__main__":
    main()
