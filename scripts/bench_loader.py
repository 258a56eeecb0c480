#!/usr/bin/env python
"""Training loader benchmark: create_loader against a plain DataLoader and against the ceiling.

On a generated folder of ~3,000 JPEGs of 500x375 converted to LMDB, with 2 workers, batch 64 and
the train pipeline at 224 px, prints side by side in one run:

- ``create_loader`` images/s against a plain ``DataLoader`` over the folder that decodes with
  Pillow and draws the same random-resized-crop and flip (goal: at least 1.5x);
- against the two-process ceiling: the same pipeline on the same bytes held in memory, in two
  processes (goal: at least 0.9);
- the workers' memory at the end of every epoch (goal: flat).

    python scripts/bench_loader.py [--images 3000] [--workers 2] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from fastdata import LMDBImageDataset, create_loader
from fastdata.sources.folder import scan_folder
from fastdata.images.pipelines import TrainPipeline, sample_crop
from fastdata.images.synthetic import make_image_folder

# the plain loader's Pillow arrays are read-only; torch warns once when it wraps them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class PillowFolder(Dataset):  # type: ignore[type-arg]
    """What people write today: ImageFolder-style files, Pillow decode, the same crop and flip."""

    def __init__(self, root: Path, size: int) -> None:
        scan = scan_folder(root)
        self.paths = [str(scan.path_of(s)) for s in scan.samples]
        self.labels = [s.label for s in scan.samples]
        self.size = size
        self.pipeline = TrainPipeline(size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        img = Image.open(self.paths[i]).convert("RGB")
        rng = random.Random()
        p = self.pipeline
        top, left, h, w = sample_crop(rng, img.height, img.width, p.scale, p.ratio)
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < p.hflip:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(img), self.labels[i]


def memory_mib(pid: int) -> tuple[int, int, int]:
    """Anonymous, file-backed (the store's mapped pages: page cache) and shared-memory (batch
    slots) resident MiB of a process."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return tuple(int(status[k].split()[0]) // 1024 for k in ("RssAnon", "RssFile", "RssShmem"))  # type: ignore[return-value]


def run_epoch(loader: Any) -> float:
    """Images/s after the first batch."""
    it = iter(loader)
    first = next(it)
    n, start = 0, time.perf_counter()
    for batch in it:
        n += len(batch[1])
    rate = n / (time.perf_counter() - start)
    del first
    return rate


def _ceiling_worker(args: tuple[str, list[int], int, Any]) -> tuple[int, float]:
    store, indices, size, barrier = args
    torch.set_num_threads(1)
    ds = LMDBImageDataset(store, output="bytes")
    blobs = [data for data, _ in ds.__getitems__(indices)]
    pipeline = TrainPipeline(size)
    barrier.wait()
    start = time.perf_counter()
    for i, data in enumerate(blobs):
        pipeline(data, i)
    return len(blobs), time.perf_counter() - start


def ceiling(store: Path, n: int, processes: int, size: int) -> float:
    """The pipeline on bytes already in memory, in ``processes`` processes: images/s."""
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(processes)
        shares = [list(range(n))[p::processes] for p in range(processes)]
        with ctx.Pool(processes) as pool:
            results = pool.map(_ceiling_worker, [(str(store), s, size, barrier) for s in shares])
    return sum(k for k, _ in results) / max(t for _, t in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=4, help="rounds timed (best counts)")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fastdata-bench-loader-"))
    try:
        src = make_image_folder(work / "images", classes=10, per_class=args.images // 10)
        store = work / "images.lmdb"
        if not (store / "data.mdb").exists():
            # in a process of its own, so the workers fork from a lean parent
            subprocess.run(
                [sys.executable, "-m", "fastdata", "convert", str(src), str(store), "-q"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        n = args.images // 10 * 10
        size, bs, w = args.image_size, args.batch_size, args.workers
        print(f"{n} JPEGs of 500x375, batch {bs}, {w} workers, train pipeline at {size} px")

        ours = create_loader(
            LMDBImageDataset(store),
            bs,
            num_workers=w,
            image_size=size,
            device="cpu",
            mean=None,
            std=None,  # uint8 batches: the same work as the plain loader
        )

        def workers() -> list[int]:
            return [p.pid for p in ours.dataloader._iterator._workers]  # type: ignore[union-attr]

        plain = DataLoader(
            PillowFolder(src, size),
            batch_size=bs,
            shuffle=True,
            num_workers=w,
            drop_last=True,
            persistent_workers=True,
        )
        # Rounds of the three side by side, so that all see the machine in the same state; the
        # best epoch of each counts.
        rates: dict[str, list[float]] = {"ours": [], "plain": [], "ceiling": []}
        memory = []
        for _ in range(args.epochs):
            rates["ours"].append(run_epoch(ours))
            memory.append([memory_mib(p) for p in workers()])
            rates["plain"].append(run_epoch(plain))
            rates["ceiling"].append(ceiling(store, n, w, size))
        ours_rate, plain_rate, top = (max(rates[k]) for k in ("ours", "plain", "ceiling"))

        print(f"  create_loader                 {ours_rate:8.0f} img/s")
        print(
            f"  plain DataLoader, Pillow      {plain_rate:8.0f} img/s   "
            f"ratio {ours_rate / plain_rate:5.2f}  (goal >= 1.5)"
        )
        print(
            f"  {w}-process ceiling, in memory {top:8.0f} img/s   "
            f"ratio {ours_rate / top:5.2f}  (goal >= 0.9)"
        )
        print("  worker memory at the end of each epoch (anonymous / file-backed / shared MiB):")
        for i in range(w):
            line = "  ->  ".join("{} / {} / {}".format(*epoch[i]) for epoch in memory)
            print(f"    worker {i}: {line}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
