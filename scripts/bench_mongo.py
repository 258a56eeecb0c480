#!/usr/bin/env python
"""MongoDB path benchmark, side by side against the same server in one run.

- batched reads (``MongoImageDataset.__getitems__``, one ``$in`` query per batch of 64) against
  one ``find_one`` per image (goal: at least 2x);
- conversion images/s against a bare ``insert_many`` loop of the same documents (goal: 0.8).

Starts a SecantusDB server on a free loopback port unless ``--uri`` names one.

    python scripts/bench_mongo.py [--images 3000] [--uri mongodb://host:port]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pymongo
from bson import Binary

from fastdata import MongoImageDataset, convert
from fastdata.sources.folder import scan_folder
from fastdata.records import checksum
from fastdata.images.synthetic import make_image_folder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.mongo_server import SecantusServer

BATCH = 64


def row(label: str, ours: float, base: float, goal: str) -> None:
    print(f"  {label:<46} {ours:>8.0f} img/s  vs {base:>8.0f}  ratio {ours / base:5.2f}  {goal}")


def run(uri: str, work: Path, n_images: int, repeat: int) -> None:
    src = make_image_folder(work / "images", classes=10, per_class=n_images // 10)
    scan = scan_folder(src)
    n = len(scan.samples)
    client = pymongo.MongoClient(uri)
    db = client.get_default_database()
    print(f"{n} JPEGs from {src}, server {uri}")

    def bare_insert(name: str) -> float:
        start = time.perf_counter()
        docs = []
        for i, s in enumerate(scan.samples):
            data = scan.path_of(s).read_bytes()
            docs.append(
                {
                    "_id": i,
                    "name": s.name,
                    "label": s.label,
                    "size": len(data),
                    "crc32": checksum(data),
                    "format": "jpeg",
                    "repaired": False,
                    "data": Binary(data),
                }
            )
            if len(docs) == 128:
                db[name].insert_many(docs, ordered=False)
                docs = []
        if docs:
            db[name].insert_many(docs, ordered=False)
        db[name].create_index("name")  # the same documents, indexed the same way
        return time.perf_counter() - start

    def ours_insert(name: str) -> float:
        start = time.perf_counter()
        convert(src, uri, collection=name)
        return time.perf_counter() - start

    # Both write into a fresh collection, in alternating order; old ones are dropped untimed.
    # The server's own pace varies from run to run, so the best of each side counts.
    bare_times, ours_times = [], []
    for k in range(repeat):
        runs = [(bare_insert, bare_times, f"bare{k}"), (ours_insert, ours_times, f"ours{k}")]
        for fn, times, name in runs if k % 2 == 0 else runs[::-1]:
            times.append(fn(name))
            if name != "ours0":  # kept for the read benchmark
                db.drop_collection(name)
    print("\nconversion")
    row(
        "convert vs bare insert_many loop",
        n / min(ours_times),
        n / min(bare_times),
        "(goal >= 0.80)",
    )

    order = list(range(n))
    random.Random(0).shuffle(order)
    batches = [order[i : i + BATCH] for i in range(0, n, BATCH)]
    ds = MongoImageDataset(uri, "ours0", output="bytes")
    coll = db["ours0"]

    def batched() -> float:
        start = time.perf_counter()
        for b in batches:
            ds.__getitems__(b)
        return time.perf_counter() - start

    def one_by_one() -> float:
        start = time.perf_counter()
        for b in batches:
            for i in b:
                coll.find_one({"_id": i}, {"data": 1})
        return time.perf_counter() - start

    batched(), one_by_one()  # warm
    pairs = [(batched(), one_by_one()) for _ in range(repeat)]  # interleaved, best of each
    t_batched, t_single = min(b for b, _ in pairs), min(s for _, s in pairs)
    print("\nrandom reads of raw bytes")
    row("batches of 64 vs one find_one per image", n / t_batched, n / t_single, "(goal >= 2.0)")
    got = ds.__getitems__(batches[0][:3])
    assert all(
        checksum(d) == coll.find_one({"_id": i})["crc32"] for (d, _), i in zip(got, batches[0])
    )
    client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--uri", help="mongodb://host:port of a running server")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fastdata-bench-mongo-"))
    server = None
    if args.uri:
        base = args.uri.rstrip("/")
    else:
        server = SecantusServer(work / "db").start()
        base = server.uri
    name = f"fastdata_bench_{uuid.uuid4().hex[:8]}"
    try:
        run(f"{base}/{name}", work, args.images, args.repeat)
    finally:
        pymongo.MongoClient(base).drop_database(name)
        if server is not None:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
