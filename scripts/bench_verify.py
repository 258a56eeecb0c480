#!/usr/bin/env python
"""`fastdata verify` against reading the store's file once, each with the page cache evicted.

Interleaved in rounds (each round begins with the next of the three), side by side: verify as the
command runs it (one process per CPU, at most 8), verify in one process, and reading ``data.mdb``
once from start to end with a plain loop (the least any full check must pay). Each verify runs in
a fresh process, as the command does.

    python scripts/bench_verify.py                          # 100,000 tiny JPEGs, temporary
    python scripts/bench_verify.py --images 1000000 --workdir /data/bench --keep
    python scripts/bench_verify.py --store train.lmdb       # a store you have
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchkit import add_workdir_options, evict, workdir

VERIFY_CHILD = """
import json, sys, time
from fastdata import open_store
from fastdata.ops.verify import _processes, verify_store
reader = open_store(sys.argv[1])
workers = None if sys.argv[2] == "auto" else int(sys.argv[2])
processes = _processes(reader, len(reader), workers)
t = time.perf_counter()
report = verify_store(reader, workers=workers)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "ok": report.ok, "checked": report.checked,
                  "processes": processes}))
"""


def verify_in_child(store: Path, workers: str) -> dict[str, float]:
    """``verify_store`` of ``store`` in a fresh process, its pages evicted first."""
    evict(store / "data.mdb")
    out = subprocess.run(
        [sys.executable, "-c", VERIFY_CHILD, str(store), workers],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_once(data_file: Path) -> float:
    """Seconds to read the file once, in 8 MiB reads, its pages evicted first."""
    evict(data_file)
    t = time.perf_counter()
    with open(data_file, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return time.perf_counter() - t


def build(work: Path, n: int) -> Path:
    from bench_scale import make_folder

    from fastdata import convert

    store = work / f"store-{n}.lmdb"
    if not (store / "data.mdb").exists():
        convert(make_folder(work / f"images-{n}", n), store)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100_000, help="records of the store built")
    parser.add_argument("--store", type=Path, help="measure this LMDB store instead")
    parser.add_argument("--rounds", type=int, default=3)
    add_workdir_options(parser)
    args = parser.parse_args()
    with workdir(args, "fastdata-verify-") as work:
        store = args.store or build(work, args.images)
        data_file = store / "data.mdb"
        times: dict[str, list[float]] = {"verify": [], "verify, 1 process": [], "read": []}
        processes = n = 1

        def verify() -> float:
            nonlocal processes, n
            found = verify_in_child(store, "auto")
            assert found["ok"], f"{store}: verify found damage; measure a sound store"
            processes, n = int(found["processes"]), int(found["checked"])
            return found["seconds"]

        runs = {
            "verify": verify,
            "verify, 1 process": lambda: verify_in_child(store, "1")["seconds"],
            "read": lambda: read_once(data_file),
        }
        names = list(runs)
        for r in range(args.rounds):
            # each round begins with the next one: on a virtual machine, what ran just before
            # (two processes reading halves of the file, say) changes the next one's disk speed
            for name in names[r % 3 :] + names[: r % 3]:
                times[name].append(runs[name]())
        size = data_file.stat().st_size
        print(f"{store}: {n:,} records, {size / 1e9:.2f} GB; {args.rounds} rounds, interleaved")
        read = statistics.median(times["read"])
        print(
            f"\n{'pages evicted before each':<32}{'median s':>10}{'best s':>9}{'records/s':>12}"
            f"{'/ read':>8}"
        )
        for name, values in times.items():
            label = (
                f"verify, {processes} process{'' if processes == 1 else 'es'}"
                if name == "verify"
                else name
            )
            if name == "read":
                label = "reading the file once"
            median = statistics.median(values)
            print(
                f"{label:<32}{median:10.2f}{min(values):9.2f}{n / median:12,.0f}"
                f"{median / read:8.2f}"
            )
        print("\n(goal: verify within 1.2x of reading the file once)")


if __name__ == "__main__":
    main()
