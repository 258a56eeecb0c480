#!/usr/bin/env python
"""Per-image fields benchmark: what a caption and boxes cost, side by side in one run.

Converts one manifest of N rows twice, interleaved: each row with a caption and 5 boxes, and
the same rows with their labels only; then reads the store with fields back, raw
(``output="bytes"``), with ``fields=`` and without, in batches of 256 random records. Prints
each figure with its baseline and the ratio.

    python scripts/bench_fields.py                   # 100,000 rows of tiny JPEGs
    python scripts/bench_fields.py --rows 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

from benchkit import add_workdir_options, workdir

from fastdata import LMDBImageDataset, convert
from fastdata.images.synthetic import synthetic_jpeg


def make_rows(work: Path, n: int) -> tuple[Path, Path]:
    """N distinct tiny JPEGs and two manifests naming them: with fields, and labels only."""
    images = work / "img"
    images.mkdir(parents=True, exist_ok=True)
    base = [synthetic_jpeg(32, 32, seed=k) for k in range(64)]
    rng = random.Random(0)
    full, plain = [], []
    for i in range(n):
        name = f"img/{i // 1000:03d}/{i}.jpg"
        path = work / name
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            # distinct files (one file named twice is stored once): a comment segment per image
            data = base[i % 64]
            path.write_bytes(data[:2] + b"\xff\xfe\x00\x08" + i.to_bytes(6, "big") + data[2:])
        label = f"class{i % 100}"
        boxes = [[round(rng.uniform(0, 200), 2) for _ in range(4)] for _ in range(5)]
        caption = f"a photo of object {i} on a table next to a window, seen from the left"
        full.append(json.dumps({"path": name, "label": label, "caption": caption, "boxes": boxes}))
        plain.append(json.dumps({"path": name, "label": label}))
    with_fields, labels_only = work / "fields.jsonl", work / "labels.jsonl"
    with_fields.write_text("\n".join(full) + "\n")
    labels_only.write_text("\n".join(plain) + "\n")
    return with_fields, labels_only


def timed_convert(manifest: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    t = time.perf_counter()
    convert(manifest, dst)
    return time.perf_counter() - t


def read_rate(ds: LMDBImageDataset, batches: list[list[int]], use: str = "") -> float:
    """Records a second read in ``batches``; ``use``: what is done with each batch read with
    fields: ``batch`` (the values as a collate function batches them: ``FieldBatch.arrays``),
    ``samples`` (every sample's values made, as a list of samples gives them), or nothing."""
    t = time.perf_counter()
    n = 0
    for batch in batches:
        got = ds.__getitems__(batch)
        if use == "batch":
            got.arrays()
        elif use == "samples":
            list(got)
        n += len(got)
    return n / (time.perf_counter() - t)


def row(label: str, ours: float, base: float, unit: str) -> None:
    print(f"  {label:<80} {ours:>10.0f} {unit}  vs {base:>10.0f}  ratio {ours / base:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    add_workdir_options(ap)
    args = ap.parse_args()
    with workdir(args, "fastdata-fields-") as work:
        with_fields, labels_only = make_rows(work, args.rows)
        n = args.rows
        print(
            f"{n} rows, each with a caption of 73 characters and 5 boxes (cpu count {os.cpu_count()})"
        )
        print("\nconversion, interleaved rounds, best of each")
        pairs = [
            (
                timed_convert(labels_only, work / "labels.lmdb"),
                timed_convert(with_fields, work / "fields.lmdb"),
            )
            for _ in range(args.rounds)
        ]
        plain_s, fields_s = min(p for p, _ in pairs), min(f for _, f in pairs)
        row("convert with caption + 5 boxes vs labels only", n / fields_s, n / plain_s, "rows/s")

        print("\nreading the store with fields, output='bytes', batches of 256 random records")
        rng = random.Random(1)
        order = list(range(n))
        rng.shuffle(order)
        batches = [order[i : i + 256] for i in range(0, n, 256)]
        store = work / "fields.lmdb"
        without = LMDBImageDataset(store, output="bytes")
        with_all = LMDBImageDataset(store, output="bytes", fields=["caption", "boxes"])
        from_headers = LMDBImageDataset(store, output="bytes", fields=["caption", "boxes"])
        from_headers.reader.field_batch = lambda *_: None  # type: ignore[method-assign]
        ways = [
            ("to a batch (FieldBatch.arrays, what collate uses)", with_all, "batch"),
            ("to every sample's values (list(batch))", with_all, "samples"),
            ("from each record's header (a store without columns)", from_headers, ""),
        ]
        read_rate(without, batches)  # every page touched once by this process (a first touch
        for _, ds, use in ways:  # faults it in), and the columns read once
            read_rate(ds, batches, use)
        for label, ds, use in ways:
            rates = [
                (read_rate(without, batches), read_rate(ds, batches, use))
                for _ in range(args.rounds)
            ]
            row(
                f"fields=['caption', 'boxes'] {label} vs no fields=",
                max(w for _, w in rates),
                max(p for p, _ in rates),
                "rec/s",
            )
        plain_store = LMDBImageDataset(work / "labels.lmdb", output="bytes")
        rates = [
            (read_rate(plain_store, batches), read_rate(without, batches))
            for _ in range(args.rounds)
        ]
        row(
            "no fields=, store with fields vs store without",
            max(w for _, w in rates),
            max(p for p, _ in rates),
            "rec/s",
        )


if __name__ == "__main__":
    main()
