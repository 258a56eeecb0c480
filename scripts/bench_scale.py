#!/usr/bin/env python
"""Every cost per image, at several dataset sizes: are they flat?

Generates folders of small JPEGs (10k and 100k by default; add 1000000 for the full table), then
for each size measures, in one run: conversion images/s with the folder cold (its pages dropped
from the page cache) and warm, the conversion's peak RSS, the store's open time, a pickled
dataset's size, the first batch's latency and the images/s of ``create_loader``, its workers'
private memory, verify with the store's pages dropped against reading the store's file once,
and export against writing the same files with a plain loop. Each row is printed per image where
it should be flat, so a growing figure is easy to spot.

    python scripts/bench_scale.py                        # 10k and 100k images
    python scripts/bench_scale.py --sizes 10000 100000 1000000 --workdir /data/scale --keep
    python scripts/bench_scale.py --sweep                # also every --workers count, cold and warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchkit import add_workdir_options, evict, evict_folder, workdir

# The peak RSS is this process's own (VmHWM): getrusage's ru_maxrss also counts the RSS of the
# process it was started from, since Linux carries that over the exec. The anonymous part (what
# the process allocates, not the store's pages it has mapped) has no high-water mark of its own:
# a thread samples it.
CONVERT_CHILD = """
import json, sys, threading, time
from fastdata import convert

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

anon, done = [0], threading.Event()
def sample():
    while not done.wait(0.005):
        anon[0] = max(anon[0], status("RssAnon"))
threading.Thread(target=sample, daemon=True).start()
workers = None if sys.argv[3] == "auto" else int(sys.argv[3])
t = time.perf_counter()
report = convert(sys.argv[1], sys.argv[2], workers=workers)
seconds = time.perf_counter() - t
done.set()
print(json.dumps({"seconds": seconds, "count": report.count, "threads": report.reader_threads,
                  "peak_rss": status("VmHWM"), "peak_anon": anon[0]}))
"""


def convert_in_child(src: Path, dst: Path, workers: str, cold: bool) -> dict[str, float]:
    shutil.rmtree(dst, ignore_errors=True)
    if cold:
        evict_folder(src)
    out = subprocess.run(
        [sys.executable, "-c", CONVERT_CHILD, str(src), str(dst), workers],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# Opening, pickling and loading, in a fresh process: a DataLoader worker forked from this one
# would share (and copy, as it touches them) the pages of this process, whatever they hold.
LOADER_CHILD = """
import json, multiprocessing, pickle, sys, time
import torch
sys.path.insert(0, sys.argv[2])
from bench_scale import private_bytes
from fastdata import LMDBImageDataset, create_loader

row = {}
t = time.perf_counter()
ds = LMDBImageDataset(sys.argv[1])
row["open ms"] = (time.perf_counter() - t) * 1000
row["pickled dataset B"] = len(pickle.dumps(ds))
torch.manual_seed(0)
loader = create_loader(ds, 256, image_size=32, num_workers=2, device="cpu")
t = time.perf_counter()
it = iter(loader)
next(it)
row["first batch ms"] = (time.perf_counter() - t) * 1000
t, seen = time.perf_counter(), 0
for images, _ in it:
    seen += len(images)
row["loader img/s"] = seen / (time.perf_counter() - t)
workers = multiprocessing.active_children()
row["worker private dirty MiB"] = (
    max(private_bytes(p.pid) for p in workers) / (1 << 20) if workers else 0.0
)
loader.close()
print(json.dumps(row))
"""


def loader_in_child(store: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", LOADER_CHILD, str(store), str(Path(__file__).resolve().parent)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def private_bytes(pid: int) -> int:
    """Memory a process wrote that no other process shares (Private_Dirty, from
    /proc/PID/smaps_rollup): its own objects. Pages of the store it read are clean, file-backed
    page cache, not its memory, and are left out."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                total += int(line.split()[1]) * 1024
    return total


def make_folder(root: Path, n: int) -> Path:
    from fastdata.images.synthetic import make_image_folder

    classes = 100
    return make_image_folder(root, classes=classes, per_class=n // classes, width=64, height=48)


def with_unusable(src: Path, dst: Path, bad: int) -> Path:
    """The folder ``src`` (hard links) plus ``bad`` empty ``.jpg`` files, which are skipped."""
    if not dst.exists():
        shutil.copytree(src, dst, copy_function=os.link)
        classes = sorted(p for p in dst.iterdir() if p.is_dir())
        for i in range(bad):
            (classes[i % len(classes)] / f"empty_{i:07d}.jpg").touch()
    return dst


def measure(src: Path, work: Path, n: int, repeat: int) -> dict[str, float]:
    from fastdata import export_store, open_store, verify_store

    dst = work / f"store-{n}.lmdb"
    row: dict[str, float] = {}
    cold = [convert_in_child(src, dst, "auto", cold=True) for _ in range(repeat)]
    warm = [convert_in_child(src, dst, "auto", cold=False) for _ in range(repeat)]
    row["convert cold img/s"] = max(r["count"] / r["seconds"] for r in cold)
    row["convert warm img/s"] = max(r["count"] / r["seconds"] for r in warm)
    row["convert peak RSS MiB"] = max(r["peak_rss"] for r in cold + warm) / (1 << 20)
    row["convert peak anon MiB"] = max(r["peak_anon"] for r in cold + warm) / (1 << 20)
    bad = with_unusable(src, work / f"images-{n}-2pct-unusable", n // 50)
    dirty = [convert_in_child(bad, dst, "auto", cold=False) for _ in range(repeat)]
    row["time 2% unusable/clean"] = min(r["seconds"] for r in dirty) / min(
        r["seconds"] for r in warm
    )

    row.update(loader_in_child(dst))
    reader = open_store(dst)
    data_file = dst / "data.mdb"
    verify_s, read_s = [], []
    for _ in range(repeat):  # cold: the store's pages dropped before each, interleaved
        reader.close()
        evict(data_file)
        t = time.perf_counter()
        verify_store(reader)
        verify_s.append(time.perf_counter() - t)
        reader.close()  # (pages it has mapped could not be evicted)
        evict(data_file)
        t = time.perf_counter()
        with open(data_file, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        read_s.append(time.perf_counter() - t)
    row["verify cold img/s"] = n / min(verify_s)
    row["verify / read file"] = min(verify_s) / min(read_s)

    records = [(r.header.name, r.data) for r in reader.iter_records()]
    out, plain = work / f"export-{n}", work / f"plain-{n}"
    export_s, plain_s = [], []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        export_store(reader, out)
        export_s.append(time.perf_counter() - t)
        shutil.rmtree(plain, ignore_errors=True)
        t = time.perf_counter()
        write_plainly(plain, records)
        plain_s.append(time.perf_counter() - t)
    row["export img/s"] = n / min(export_s)
    row["export / plain writes"] = min(export_s) / min(plain_s)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(plain, ignore_errors=True)
    return row


def write_plainly(root: Path, records: list[tuple[str, bytes]]) -> None:
    """What an export is measured against: the same files, written by the plainest loop."""
    made: set[Path] = set()
    for name, data in records:
        path = root / name
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        with open(path, "wb") as f:
            f.write(data)


def sweep(src: Path, work: Path, repeat: int) -> None:
    """Conversion images/s for the default and each fixed --workers, cold and warm, interleaved."""
    counts = ["auto", "1", "2", "4", "8"]
    dst = work / "sweep.lmdb"
    for cold in (True, False):
        rates: dict[str, list[float]] = {c: [] for c in counts}
        chosen: list[int] = []
        for _ in range(repeat):
            for c in counts:
                r = convert_in_child(src, dst, c, cold)
                rates[c].append(r["count"] / r["seconds"])
                if c == "auto":
                    chosen += r["threads"]
        best = max(max(rates[c]) for c in counts[1:])
        label = "cold" if cold else "warm"
        print(f"\nconversion, {label} folder, best of {repeat} interleaved runs:")
        for c in counts:
            print(f"  --workers {c:<5} {max(rates[c]):9.0f} img/s  ({max(rates[c]) / best:.2f})")
        print(
            f"  default / best fixed: {max(rates['auto']) / best:.2f} (goal >= 0.9); chose {chosen}"
        )


def epoch_order(n: int = 1_281_167) -> None:
    """The time and memory of one epoch's order at ImageNet's size (the array is built in place
    by torch and viewed by numpy: what it holds is all it takes)."""
    from fastdata.loaders import EpochSampler

    sampler = EpochSampler(n, seed=0)
    times = []
    for epoch in range(5):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        order = sampler.indices()
        times.append(time.perf_counter() - t)
    print(
        f"\nepoch order at {n:,} samples: {min(times) * 1000:.1f} ms (best of 5), "
        f"{order.nbytes / (1 << 20):.1f} MiB (goal < 50 ms, < 12 MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=2, help="conversions per measure (best)")
    parser.add_argument("--sweep", action="store_true", help="also compare --workers counts")
    add_workdir_options(parser)
    args = parser.parse_args()
    with workdir(args, "fastdata-scale-") as work:
        rows = {}
        for n in args.sizes:
            src = make_folder(work / f"images-{n}", n)
            rows[n] = measure(src, work, n, args.repeat)
        names = list(next(iter(rows.values())))
        print(f"\n{'measure':<24}" + "".join(f"{n:>14,}" for n in rows) + "   last/first")
        for name in names:
            values = [rows[n][name] for n in rows]
            print(
                f"{name:<24}"
                + "".join(f"{v:14.1f}" for v in values)
                + f"   {values[-1] / values[0]:9.2f}"
            )
        first, last = args.sizes[0], args.sizes[-1]
        if last > first:
            for key in ("convert peak anon MiB", "convert peak RSS MiB"):
                slope = (rows[last][key] - rows[first][key]) * (1 << 20) / (last - first)
                print(f"{key.removesuffix(' MiB')}: {slope:.0f} B more per image")
        print(
            "\nflat means: rates (img/s) about the same at every size; open time, pickled size,\n"
            "first-batch latency and worker memory about the same, not growing with n; the\n"
            "converter's memory grows by a small, constant amount per image (the scan's packed\n"
            "names and labels, the labels and name index it writes; RSS also counts the pages\n"
            "of the store that LMDB touched, which are page cache)."
        )
        epoch_order()
        if args.sweep:
            sweep(work / f"images-{args.sizes[-1]}", work, max(args.repeat, 3))


if __name__ == "__main__":
    main()
