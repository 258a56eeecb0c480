#!/usr/bin/env python
"""LMDB path benchmark: conversion, random reads (warm and cold) and decoding, side by side.

Prints each fastdata figure next to its baseline measured in the same run, with the ratio and the
goal. Absolute numbers drift from run to run and machine to machine; the ratios are what count.

    python scripts/bench_lmdb.py                 # ~3,000 JPEGs of 500x375 in a temporary folder
    python scripts/bench_lmdb.py --images 6000 --workdir /data/bench --keep
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb
from benchkit import add_workdir_options, evict, workdir

from fastdata import convert
from fastdata.sources.folder import scan_folder
from fastdata.loaders.malloc import tune_malloc
from fastdata.stores.lmdb.layout import record_key
from fastdata.images.synthetic import make_image_folder

# LMDBImageDataset (and with it torch) is imported in run(): the memory-measuring child process
# runs this file too, and must weigh what a conversion weighs, not what torch does.

BATCH = 64


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_all(paths: Sequence[Path]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            total += len(f.read())
    return total


def copy_ceiling(paths: Sequence[Path], out: Path) -> None:
    """Read every file and append it to one file, then fsync: the floor any converter pays."""
    with open(out, "wb") as sink:
        for p in paths:
            with open(p, "rb") as f:
                sink.write(f.read())
        sink.flush()
        os.fsync(sink.fileno())


def rss_child(src: str, dst: str) -> None:
    """Convert in this (fresh) process, sampling its resident memory; print the peaks in MiB."""
    import re
    import threading

    peak = {"VmRSS": 0, "RssAnon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            with open("/proc/self/status") as f:
                status = f.read()
            for key in peak:
                found = re.search(key + r":\s+(\d+)", status)
                if found:
                    peak[key] = max(peak[key], int(found.group(1)) // 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    convert(src, dst, overwrite=True, tune_allocator=True)  # as the CLI converts
    done.set()
    sampler.join()
    print(peak["VmRSS"], peak["RssAnon"])


def peak_rss_of_conversion(src: Path, dst: Path) -> tuple[int, int]:
    """Peak resident and anonymous memory (MiB) of a fresh process converting ``src``."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(src), str(dst)],
        check=True,
        capture_output=True,
        text=True,
    )
    rss, anon = out.stdout.split()[-2:]
    return int(rss), int(anon)


def row(label: str, ours: float, base: float, goal: str, unit: str = "img/s") -> None:
    ratio = ours / base if base else float("nan")
    print(f"  {label:<44} {ours:>10.0f} {unit}  vs {base:>10.0f}  ratio {ratio:5.2f}  {goal}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000)
    add_workdir_options(ap)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child)
        return

    # Both sides of every comparison run in this process, under the same allocator settings:
    # those fastdata uses for conversion (see fastdata.loaders.malloc).
    tune_malloc()
    with workdir(args, "fastdata-bench-") as work:
        run(work, args.images, args.repeat)


def run(work: Path, n_images: int, repeat: int) -> None:
    from fastdata import LMDBImageDataset
    from fastdata.images.decode import decode_pil

    classes = 10
    src = make_image_folder(work / "images", classes=classes, per_class=n_images // classes)
    scan = scan_folder(src)
    paths = [scan.path_of(s) for s in scan.samples]
    n = len(paths)
    size = read_all(paths)
    print(f"{n} JPEGs, {size / n / 1000:.0f} kB mean, in {src}  (cpu count {os.cpu_count()})")

    # ---------------------------------------------------------------- conversion
    print("\nconversion (warm page cache)")
    dst = work / "store.lmdb"

    def convert_fresh() -> float:
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        convert(src, dst)
        return time.perf_counter() - t

    def ceiling_fresh() -> float:
        (work / "ceiling.bin").unlink(missing_ok=True)
        os.sync()
        t = time.perf_counter()
        copy_ceiling(paths, work / "ceiling.bin")
        return time.perf_counter() - t

    # Interleaved, so both see the same state of the disk and page cache; best of several
    # because single runs on a small virtual machine vary by 2x.
    pairs = [(ceiling_fresh(), convert_fresh()) for _ in range(repeat + 2)]
    ceiling = min(c for c, _ in pairs)
    ours = min(v for _, v in pairs)
    row("convert vs read+append+fsync ceiling", n / ours, n / ceiling, "(goal >= 0.80)")

    third = work / "images-third"
    if not third.exists():
        for p in paths[: n // 3]:
            target = third / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, target)
    small, full = (
        peak_rss_of_conversion(third, work / "third.lmdb"),
        peak_rss_of_conversion(src, work / "full.lmdb"),
    )
    print(
        f"  peak RSS converting {n // 3} images: {small[0]} MiB ({small[1]} anonymous); "
        f"{n} images: {full[0]} MiB ({full[1]} anonymous); ratio {full[0] / small[0]:.2f} "
        "(goal: flat, ~1.0)"
    )

    # ---------------------------------------------------------------- random raw reads
    rng = random.Random(0)
    order = list(range(n))
    rng.shuffle(order)
    batches = [order[i : i + BATCH] for i in range(0, n, BATCH)]
    keys = [[record_key(i) for i in b] for b in batches]

    # A reader opens its handle, reads, and closes it: py-lmdb refuses a second handle on one
    # environment in a process, so the two LMDB readers cannot be open at once.
    class Reader:
        def open(self) -> None:
            pass

        def read(self) -> None:
            raise NotImplementedError

        def close(self) -> None:
            pass

        def once(self) -> None:
            self.open()
            self.read()
            self.close()

    class Ours(Reader):
        check = False  # (the figures before reads were checked; Checked: the default)

        def open(self) -> None:
            self.ds = LMDBImageDataset(dst, output="bytes", check=self.check)

        def read(self) -> None:
            for b in batches:
                self.ds.__getitems__(b)

        def close(self) -> None:
            self.ds.close()

    class Bare(Reader):
        def open(self) -> None:
            self.env = lmdb.open(str(dst), readonly=True, lock=False)

        def read(self) -> None:
            for kb in keys:
                with self.env.begin() as txn:
                    batch = [txn.get(k) for k in kb]  # noqa: F841 - kept, as a loader does

        def close(self) -> None:
            self.env.close()

    flat = [k for kb in keys for k in kb]

    class OursOne(Ours):
        def read(self) -> None:
            ds = self.ds
            for b in batches:
                for i in b:
                    ds[i]

    class Checked(Ours):
        check = True

    class CheckedOne(OursOne):
        check = True

    class BareOne(Bare):
        def read(self) -> None:
            for k in flat:
                with self.env.begin() as txn:
                    txn.get(k)

    class Files(Reader):
        def read(self) -> None:
            for b in batches:
                batch = []
                for i in b:
                    with open(paths[i], "rb") as f:
                        batch.append(f.read())

    readers = (Ours(), Bare(), Files())

    def warm(reader: Reader) -> float:
        """A training run opens its store once and reads it epoch after epoch: the handle stays
        open over the passes timed (after one untimed pass)."""
        reader.open()
        try:
            reader.read()
            return best_of(repeat, reader.read)
        finally:
            reader.close()

    print("\nrandom reads of raw bytes (output='bytes', check=False), warm page cache")
    singles = (OursOne(), BareOne())
    checked = (Checked(), CheckedOne())
    rounds = [[warm(r) for r in readers + singles + checked] for _ in range(3)]
    t_ours, t_bare, t_files, t_one, t_bare_one, t_checked, t_checked_one = (
        min(ts) for ts in zip(*rounds, strict=True)
    )
    row("ds[i] vs one bare lmdb transaction per get", n / t_one, n / t_bare_one, "(goal >= 0.85)")
    row("__getitems__(64) vs one bare transaction per 64", n / t_ours, n / t_bare, "(goal >= 0.90)")
    row("__getitems__(64) vs files from the folder", n / t_ours, n / t_files, "(goal >= 2.5)")
    print("  checked reads (check=True, the default) against check=False, the same run:")
    row("ds[i] checked vs unchecked", n / t_checked_one, n / t_one, "(its cost)")
    row("__getitems__(64) checked vs unchecked", n / t_checked, n / t_ours, "(its cost)")

    print("\nrandom reads of raw bytes, pages evicted from the page cache before each pass")

    def cold(reader: Reader) -> float:
        """Each pass opens its handle after the eviction (mapped pages cannot be evicted)."""
        times = []
        for _ in range(repeat):
            evict(dst / "data.mdb")
            for p in paths:
                evict(p)
            t = time.perf_counter()
            reader.once()
            times.append(time.perf_counter() - t)
        return min(times)

    c_ours, c_bare, c_files, c_checked = (cold(r) for r in (*readers, Checked()))
    row("LMDBImageDataset vs bare lmdb get loop", n / c_ours, n / c_bare, "(goal >= 0.80)")
    row("LMDBImageDataset vs files from the folder", n / c_ours, n / c_files, "(goal >= 1.5)")
    row("__getitems__(64) checked vs unchecked", n / c_checked, n / c_ours, "(its cost)")

    # ---------------------------------------------------------------- decoding
    print("\ndecoding to RGB PIL images, random order, one process")
    pil = LMDBImageDataset(dst)
    blobs = [p.read_bytes() for p in paths]  # the store keeps scan order: none was skipped
    pil.__getitems__(batches[0])

    def decode_ours() -> None:
        for b in batches:
            pil.__getitems__(b)

    def decode_memory() -> None:
        for b in batches:
            batch = [decode_pil(blobs[i]) for i in b]  # noqa: F841 - kept, as a loader does

    unchecked = LMDBImageDataset(dst, output="bytes", check=False)

    def decode_unchecked() -> None:  # (the same reads and decodes, less the check)
        for b in batches:
            batch = [decode_pil(data) for data, _ in unchecked.__getitems__(b)]  # noqa: F841

    timed = [  # (interleaved: each round times the three in turn)
        [best_of(1, fn) for fn in (decode_ours, decode_memory, decode_unchecked)]
        for _ in range(repeat)
    ]
    d_ours, d_mem, d_unchecked = (min(ts) for ts in zip(*timed, strict=True))
    row("LMDBImageDataset vs decoding bytes in memory", n / d_ours, n / d_mem, "(goal >= 0.95)")
    row("checked (always, decoding) vs unchecked reads", n / d_ours, n / d_unchecked, "(its cost)")


if __name__ == "__main__":
    main()
