#!/usr/bin/env python
"""Build a sample image folder, convert it to LMDB, read it back, print what happened.

python scripts/quickstart.py [--workdir sample-data] [--classes 10] [--per-class 60]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from torch.utils.data import DataLoader

from fastdata import LMDBImageDataset, convert, open_store, store_info
from fastdata.images.synthetic import make_image_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("sample-data"))
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=60)
    args = ap.parse_args()

    images = args.workdir / "images"
    t = time.perf_counter()
    make_image_folder(images, classes=args.classes, per_class=args.per_class)
    print(f"sample folder: {images} ({time.perf_counter() - t:.1f} s)")

    store = args.workdir / "images.lmdb"
    report = convert(images, store, overwrite=True)
    print(
        f"converted:     {report.count} images, {report.total_bytes / 2**20:.1f} MiB -> {store} "
        f"at {report.images_per_second:.0f} images/s"
    )

    info = store_info(open_store(store))
    print(f"store:         {info['count']} images, {info['classes']} classes, v{info['version']}")

    raw = LMDBImageDataset(store, output="bytes")
    t = time.perf_counter()
    for start in range(0, len(raw), 64):
        raw.__getitems__(range(start, min(len(raw), start + 64)))
    print(f"raw reads:     {len(raw) / (time.perf_counter() - t):.0f} records/s, 64 per batch")

    ds = LMDBImageDataset(store, output="numpy")
    loader = DataLoader(ds, batch_size=32, num_workers=2, collate_fn=lambda batch: batch)
    t = time.perf_counter()
    seen = sum(len(batch) for batch in loader)
    dt = time.perf_counter() - t
    image, label = ds[0]
    print(
        f"decoded:       {seen} images through a DataLoader with 2 workers at {seen / dt:.0f} "
        f"images/s; first: {image.shape} {image.dtype}, class {ds.classes[label]!r}"
    )


if __name__ == "__main__":
    main()
