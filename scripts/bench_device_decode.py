#!/usr/bin/env python
"""Device decode against CPU decode: the same loader, the same crops, side by side in one run.

On a generated folder of JPEGs of 500x375 converted to LMDB, ``create_loader`` with
``decode="cpu"`` (the workers decode, crop and resize) and with ``decode="device"`` (the workers
only read bytes and draw crops; the batch is decoded on the device), in interleaved rounds,
printing for each images/s and CPU seconds per 1,000 images (the main process and its workers),
and the ratio of images per CPU second (goal on a GPU: >= 3).

    python scripts/bench_device_decode.py --workers 4                 # on a CUDA machine
    python scripts/bench_device_decode.py --device cpu --images 600 --workers 2 --batch-size 64

Without CUDA the device path decodes in the main process with nvImageCodec's CPU backend, which
only checks that it runs: expect a ratio below 1 there (the CPU path decodes in every worker).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastdata import LMDBImageDataset, create_loader
from fastdata.images.synthetic import make_image_folder

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU time of this process and of ``pids``."""
    total = time.process_time()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def epoch(loader) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """One epoch: (wall s, CPU s, images); the first batch (workers starting) is not timed."""
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    t, c, n = time.perf_counter(), cpu_seconds(pids), 0
    for images, _ in it:
        n += images.shape[0]
    if images.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, cpu_seconds(pids) - c, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default=None, help="default: the current accelerator")
    ap.add_argument("--backend", default="auto", help="nvimgcodec, torchvision, cpu or auto")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    n = args.images // 10 * 10
    if n < 2 * args.batch_size:
        ap.error(f"--images {args.images} makes less than two batches of {args.batch_size}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fastdata-bench-device-"))
    try:
        src = make_image_folder(work / "images", classes=10, per_class=args.images // 10)
        store = work / "images.lmdb"
        if not (store / "data.mdb").exists() or len(LMDBImageDataset(store)) != n:
            subprocess.run(
                [sys.executable, "-m", "fastdata", "convert", str(src), str(store), "-q"]
                + ["--overwrite"] * (store / "data.mdb").exists(),
                check=True,
                stdout=subprocess.DEVNULL,
            )
        try:
            loaders = {
                mode: create_loader(
                    LMDBImageDataset(store),
                    args.batch_size,
                    num_workers=args.workers,
                    device=args.device,
                    decode=mode,
                    decode_backend=args.backend,
                )
                for mode in ("cpu", "device")
            }
        except ValueError as exc:  # a backend that cannot run here: the message says why
            sys.exit(f"bench_device_decode.py: {exc}")
        device = loaders["cpu"].device
        decoder = loaders["device"].device_loader.decode
        timed = (n // args.batch_size - 1) * args.batch_size
        print(
            f"{n} JPEGs of 500x375 ({timed} timed an epoch: the first batch and a partial last "
            f"one are not), batch {args.batch_size}, "
            f"{args.workers} workers, device {device}, torch {torch.__version__}, "
            f"device decoder: {getattr(decoder, 'decoder', decoder)!r}"
        )
        results: dict[str, list[tuple[float, float, int]]] = {m: [] for m in loaders}
        for _ in range(args.rounds):
            for mode, loader in loaders.items():
                results[mode].append(epoch(loader))
        per_cpu = {}
        for mode, runs in results.items():
            wall, cpu, n = min(runs)  # the fastest round of each
            per_cpu[mode] = n / cpu
            print(
                f"  decode={mode:<7} {n / wall:8.0f} img/s   {1000 * cpu / n:6.2f} CPU s / 1k img"
                f"   (rounds: {', '.join(f'{r[2] / r[0]:.0f}' for r in runs)} img/s)"
            )
        print(
            f"  images per CPU second, device / cpu: {per_cpu['device'] / per_cpu['cpu']:.2f}"
            "  (goal on a GPU: >= 3)"
        )
        for loader in loaders.values():
            loader.close()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
