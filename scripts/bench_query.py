#!/usr/bin/env python
"""Selecting records: what a query costs on LMDB, side by side in one run.

Converts a manifest of N rows of tiny JPEGs, each with a score (a float), 5 boxes and a caption,
then selects the records whose score is above a threshold (1% of them), interleaved over
rounds: with the query document (``where={"fields.score": {"$gt": ...}}``) over the store's
columns, the same query over each record's header (a store without columns), the same
selection as a Python predicate, and, as the floor any selection that reads every record once
is measured against, a bare ``lmdb`` cursor reading every key and value of the store once.
Then the time from opening the store to the first batch of a loader over the selection, and
``create_loader`` over the selection against over the whole store, images per second.

    python scripts/bench_query.py                 # 100,000 rows
    python scripts/bench_query.py --rows 1000000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import lmdb
from bench_fields import timed_convert
from benchkit import add_workdir_options, workdir

from fastdata import LMDBImageDataset, create_loader
from fastdata.images.synthetic import synthetic_jpeg


def make_manifest(work: Path, n: int) -> Path:
    images = work / "img"
    images.mkdir(parents=True, exist_ok=True)
    base = [synthetic_jpeg(32, 32, seed=k) for k in range(64)]
    rng = random.Random(0)
    rows = []
    for i in range(n):
        name = f"img/{i // 1000:03d}/{i}.jpg"
        path = work / name
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            data = base[i % 64]  # (a comment segment makes each file distinct)
            path.write_bytes(data[:2] + b"\xff\xfe\x00\x08" + i.to_bytes(6, "big") + data[2:])
        boxes = [[round(rng.uniform(0, 200), 2) for _ in range(4)] for _ in range(5)]
        rows.append(
            json.dumps(
                {
                    "path": name,
                    "label": f"class{i % 100}",
                    "score": rng.random(),
                    "boxes": boxes,
                    "caption": f"a photo of object {i} on a table",
                }
            )
        )
    manifest = work / "scored.jsonl"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest


def bare_scan(store: Path) -> float:
    """Seconds for a bare lmdb cursor to read every key and value of the store once."""
    env = lmdb.open(str(store), readonly=True, lock=False)
    t = time.perf_counter()
    with env.begin(buffers=True) as txn:
        total = 0
        for _, value in txn.cursor():
            total += len(value)
    spent = time.perf_counter() - t
    env.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per loader measurement")
    add_workdir_options(parser)
    args = parser.parse_args()
    with workdir(args, "fastdata-bench-query-") as work:
        store = work / "scored.lmdb"
        spent = timed_convert(make_manifest(work, args.rows), store)
        print(f"{args.rows:,} rows converted in {spent:.1f} s")
        cut = 0.99
        query = {"fields.score": {"$gt": cut}}
        times: dict[str, list[float]] = {"query": [], "headers": [], "predicate": [], "bare": []}
        selected = 0
        for _ in range(args.rounds):
            reader = LMDBImageDataset(store, output="bytes").reader
            t = time.perf_counter()
            selected = len(reader.matching(query))
            times["query"].append(time.perf_counter() - t)
            reader.close()
            reader = LMDBImageDataset(store, output="bytes").reader
            reader.field_column = lambda name, keep=True: None  # type: ignore[method-assign]
            t = time.perf_counter()
            by_headers = len(reader.matching(query))
            times["headers"].append(time.perf_counter() - t)
            assert by_headers == selected
            t = time.perf_counter()
            by_code = len(reader.matching(lambda f: f["score"] > cut))
            times["predicate"].append(time.perf_counter() - t)
            assert by_code == selected
            reader.close()  # (py-lmdb opens a file once a process)
            times["bare"].append(bare_scan(store))
        median = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"selecting {selected:,} of {args.rows:,} records (score > {cut}), median of "
            f"{args.rounds}:"
        )
        said = {
            "query": "query (columns)",
            "headers": "query (headers)",
            "predicate": "predicate",
            "bare": "bare lmdb scan",
        }
        for name in ("query", "headers", "predicate", "bare"):
            per = median[name] / args.rows * 1e6
            print(f"  {said[name]:<16} {median[name]:7.3f} s  ({per:.3f} us a record)")
        print(
            f"  query over the columns / bare lmdb scan of every value: "
            f"{median['query'] / median['bare']:.3f} of the time (target: <= 1.0)"
        )
        print(
            f"  query over the columns / over the headers: "
            f"{median['query'] / median['headers']:.3f} of the time"
        )

        firsts = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            ds = LMDBImageDataset(store, where=query)
            loader = create_loader(
                ds, 64, train=False, image_size=32, num_workers=2, device="cpu", drop_last=False
            )
            next(iter(loader))
            firsts.append(time.perf_counter() - t)
            ds.close()
            del loader
        print(
            f"open the store, select, start a loader (2 workers) and take its first batch: "
            f"{statistics.median(firsts):.2f} s (target: <= 1 s)"
        )

        def rate(where: object) -> float:
            ds = LMDBImageDataset(store, where=where)
            loader = create_loader(
                ds, 64, train=False, image_size=32, num_workers=2, device="cpu", drop_last=False
            )
            t, images = time.perf_counter(), 0
            while time.perf_counter() - t < args.seconds:
                for images_, _ in loader:
                    images += len(images_)
                    if time.perf_counter() - t >= args.seconds:
                        break
            return images / (time.perf_counter() - t)

        whole, picked = rate(None), rate(query)
        print(
            f"create_loader, 2 workers: over the selection {picked:,.0f} img/s, over the whole "
            f"store {whole:,.0f} img/s: {picked / whole:.2f} (target >= 0.9)"
        )


if __name__ == "__main__":
    main()
