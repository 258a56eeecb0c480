#!/usr/bin/env python
"""The loader's cost per image against the store's size, side by side: is it flat?

Makes stores of small JPEGs (32x32, about 1.4 kB each, where the per-read costs around the
decode weigh most) at each size, then in interleaved rounds reads the same number of images from
each (``--images``; by default one epoch of the largest store, less its last short batch: a
hundred epochs of a store of ten thousand for one of a million) through ``create_loader`` (2
workers, random crops to 32 px, batches of 256), each in a fresh process with the store in the
page cache, and prints its images/s, CPU per image (the process and its workers) and its time
per image against the smallest store's, the best of each size's rounds; then each round's ratio
of the larger stores to the smallest read in the same round, and their median. The first epoch of a
store also checks its pages once (NOTE [ Leaves beside a read ] in
``fastdata/stores/lmdb/leaves.py``): that is counted, as a training run's first epoch meets it.

    python scripts/bench_store_size.py                              # 10k and 1M records
    python scripts/bench_store_size.py --sizes 10000 100000 1000000 --workdir /data/sizes
    python scripts/bench_store_size.py --stores small.lmdb big.lmdb # stores made already

Making the 1M store takes a few minutes (its folder, then ``fastdata convert``); ``--workdir DIR``
keeps the folders and stores for the next run (``--keep`` keeps the temporary folder made without
it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchkit import add_workdir_options, workdir

EPOCH_CHILD = """
import json, os, resource, sys, time
import torch
from fastdata import LMDBImageDataset, create_loader

ds = LMDBImageDataset(sys.argv[1])
torch.manual_seed(int(sys.argv[2]))
loader = create_loader(ds, 256, image_size=32, num_workers=2, device="cpu")
wanted = int(sys.argv[3])
def cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
t, c, seen = time.perf_counter(), cpu(), 0
while seen < wanted:  # (epoch after epoch, the workers kept; each epoch's last short batch is
    for images, _ in loader:  # dropped, as in training)
        seen += len(images)
        if seen >= wanted:
            break
seconds = time.perf_counter() - t
loader.close()  # (the workers reaped: their CPU counted)
print(json.dumps({"images": seen, "seconds": seconds, "cpu": cpu() - c}))
"""


def run(store: Path, seed: int, images: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", EPOCH_CHILD, str(store), str(seed), str(images)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        sys.exit(f"reading {store} failed:\n{out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(store: Path) -> None:
    """Read the store's file once, so that every round finds it in the page cache."""
    with open(store / "data.mdb", "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def make_store(work: Path, n: int) -> Path:
    from fastdata import convert
    from fastdata.images.synthetic import make_image_folder

    store = work / f"store-{n}.lmdb"
    if (store / "data.mdb").exists():
        return store
    classes = 100  # (n a multiple of 100: checked by main)
    src = make_image_folder(
        work / f"images-{n}", classes=classes, per_class=n // classes, width=32, height=32
    )
    t = time.perf_counter()
    convert(src, store)
    print(f"made {store} ({n:,} records) in {time.perf_counter() - t:.0f} s", flush=True)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[10_000, 1_000_000],
        help="records of each store made (multiples of 100, at least 1,000)",
    )
    parser.add_argument("--stores", type=Path, nargs="+", help="stores made already, instead")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best kept)")
    parser.add_argument(
        "--images",
        type=int,
        help="images read from each store (default: one epoch of the largest, less its last "
        "short batch)",
    )
    add_workdir_options(parser)
    args = parser.parse_args()
    if not args.stores and any(n < 1000 or n % 100 for n in args.sizes):
        parser.error("--sizes: multiples of 100, at least 1,000 (a batch is 256 images)")
    with workdir(args, "fastdata-sizes-") as work:
        stores = args.stores or [make_store(work, n) for n in sorted(args.sizes)]
        from fastdata import open_store

        sizes = {}
        for store in stores:
            reader = open_store(store)
            sizes[store] = len(reader)
            reader.close()
        stores.sort(key=sizes.__getitem__)
        images = args.images or sizes[stores[-1]] // 256 * 256
        best: dict[Path, dict[str, float]] = {}
        paired: dict[Path, list[float]] = {store: [] for store in stores}
        for r in range(args.rounds):
            this: dict[Path, float] = {}
            for store in stores:
                warm(store)
                got = run(store, r, images)
                per = this[store] = got["seconds"] / got["images"]
                if store not in best or per < best[store]["seconds"] / best[store]["images"]:
                    best[store] = got
            for store in stores:  # (each against the smallest store of the same round)
                paired[store].append(this[store] / this[stores[0]])
            print(f"round {r + 1} of {args.rounds} done", flush=True)
        base = best[stores[0]]["seconds"] / best[stores[0]]["images"]
        rounds = f"{args.rounds} round{'s' if args.rounds > 1 else ''}"
        print(f"\ncreate_loader, 2 workers, {images:,} images from each store, best of {rounds}:")
        head = ("records", "img/s", "us/img", "CPU us/img", "time/img vs smallest")
        print("{:>12} {:>9} {:>8} {:>11} {:>21}".format(*head))
        for store in stores:
            got = best[store]
            per = got["seconds"] / got["images"]
            print(
                f"{sizes[store]:>12,} {1 / per:>9,.0f} {per * 1e6:>8.1f} "
                f"{got['cpu'] / got['images'] * 1e6:>11.1f} {per / base:>21.2f}"
            )
        larger = [best[s]["seconds"] / best[s]["images"] for s in stores[1:]]
        largest = max(larger, default=base) / base
        verdict = "met" if largest <= 1.10 else "not met"
        print(
            f"largest time per image of the larger stores against the smallest store's: "
            f"{largest:.2f} "
            f"(target <= 1.10: {verdict}; below 1: faster than the smallest)"
        )
        for store in stores[1:]:  # (less moved by a slow stretch of the machine than the best)
            ratios = paired[store]
            print(
                f"{sizes[store]:,} against {sizes[stores[0]]:,}, round by round: "
                f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})"
            )


if __name__ == "__main__":
    main()
