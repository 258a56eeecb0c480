#!/usr/bin/env python
"""Stores that grow and move, side by side in one run:

- ``convert --append`` of 1% more images against converting the whole grown folder again
  (goal: the append at least 20x faster);
- ``copy`` LMDB -> LMDB and LMDB -> MongoDB, records/s, against ``convert`` from the folder into
  the same kind of store.

Each figure is the best of ``--repeat`` runs, interleaved, each run in a fresh process with the
folder warm in the page cache. MongoDB is a SecantusDB server started on a free loopback port
unless ``--uri`` names one.

    python scripts/bench_grow.py [--images 20000] [--repeat 3] [--uri mongodb://host:port/db]
    python scripts/bench_grow.py --width 64 --height 48     # tiny images: the hardest case
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from benchkit import add_workdir_options, workdir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHILD = """
import json, sys, time
from fastdata import convert, copy_store
import fastdata.ops.append, fastdata.ops.copy, fastdata.stores.lmdb.layout, fastdata.stores.mongo.connection
what, src, dst, coll = sys.argv[1:5]  # modules imported first: the clock times the work
coll = coll or None
t = time.perf_counter()
if what == "convert":
    report = convert(src, dst, collection=coll)
    count = report.count
elif what == "append":
    report = convert(src, dst, append=True, collection=coll)
    count = report.count - report.already_stored
else:
    report = copy_store(src, dst, collection=coll)
    count = report.count
print(json.dumps({"seconds": time.perf_counter() - t, "count": count}))
"""


def child(what: str, src: Path | str, dst: Path | str, collection: str = "") -> dict[str, float]:
    os.sync()  # no run pays for flushing what an earlier step (a copy of a store) left dirty
    out = subprocess.run(
        [sys.executable, "-c", CHILD, what, str(src), str(dst), collection],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop(uri: str, collection: str) -> None:
    """Remove a store (and its metadata) from the server, so a run can write it again."""
    import pymongo

    from fastdata.stores import names

    db = pymongo.MongoClient(uri).get_default_database()
    for name in db.list_collection_names():
        if name == collection or name.startswith(f"{collection}."):
            db.drop_collection(name)
    db[names.META_COLLECTION].delete_many({"_id": {"$in": names.mongo_documents(collection)}})


def run(work: Path, n: int, repeat: int, uri: str, width: int, height: int) -> None:
    from fastdata.images.synthetic import make_image_folder

    classes, size = 100, {"width": width, "height": height}
    base = make_image_folder(work / "base", classes=classes, per_class=n // classes, **size)
    grown = work / "grown"
    shutil.copytree(base, grown, dirs_exist_ok=True)
    per_class = max(1, n // 100 // (classes // 2))
    more = make_image_folder(
        work / "more", classes=classes // 2, per_class=per_class, seed=7, **size
    )
    for folder in more.iterdir():  # 1% more images: new files in half of the classes
        for f in folder.iterdir():
            shutil.copyfile(f, grown / folder.name / f"new_{f.name}")
    added = sum(1 for _ in grown.rglob("*.jpg")) - sum(1 for _ in base.rglob("*.jpg"))
    print(
        f"{n} JPEGs of {width}x{height}, then {added} more ({added / n:.1%}); best of {repeat} runs"
    )

    base_store, store = work / "base.lmdb", work / "s.lmdb"
    shutil.rmtree(base_store, ignore_errors=True)
    child("convert", base, base_store)
    times: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}

    def note(key: str, r: dict[str, float]) -> None:
        times.setdefault(key, []).append(r["seconds"])
        rates.setdefault(key, []).append(r["count"] / r["seconds"])

    for _ in range(repeat):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(base_store, store)
        note("append 1%", child("append", grown, store))
        shutil.rmtree(store, ignore_errors=True)
        note("convert grown folder -> LMDB", child("convert", grown, store))
        shutil.rmtree(store, ignore_errors=True)
        note("copy LMDB -> LMDB", child("copy", base_store, store))
        coll = f"bench_{uuid.uuid4().hex[:8]}"
        note("convert folder -> MongoDB", child("convert", base, uri, coll))
        drop(uri, coll)
        note("copy LMDB -> MongoDB", child("copy", base_store, uri, coll))
        drop(uri, coll)
        shutil.rmtree(store, ignore_errors=True)
        note("convert folder -> LMDB", child("convert", base, store))

    best = {k: min(v) for k, v in times.items()}
    fast = {k: max(v) for k, v in rates.items()}
    print(f"\n{'':<32}{'seconds':>10}{'records/s':>12}")
    for key in times:
        print(f"{key:<32}{best[key]:>10.2f}{fast[key]:>12.0f}")
    ratio = best["convert grown folder -> LMDB"] / best["append 1%"]
    print(f"\nappend 1% vs converting again:  {ratio:6.1f}x faster  (goal >= 20x)")
    for kind in ("LMDB", "MongoDB"):
        r = fast[f"copy LMDB -> {kind}"] / fast[f"convert folder -> {kind}"]
        print(f"copy LMDB -> {kind} / convert:   {r:6.2f}x the records/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--width", type=int, default=500, help="image width (default 500)")
    parser.add_argument("--height", type=int, default=375, help="image height (default 375)")
    parser.add_argument("--uri", help="mongodb://host:port/DB (default: start SecantusDB)")
    add_workdir_options(parser)
    args = parser.parse_args()
    with workdir(args, "fastdata-grow-") as work:
        if args.uri:
            run(work, args.images, args.repeat, args.uri, args.width, args.height)
            return
        from tests.mongo_server import SecantusServer

        server = SecantusServer(work / "secantus").start()
        try:
            run(work, args.images, args.repeat, f"{server.uri}/bench", args.width, args.height)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
