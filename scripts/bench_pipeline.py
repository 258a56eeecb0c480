#!/usr/bin/env python
"""The train pipeline's CPU per image, against one whole decode of the same image, and where
the rest goes.

On generated JPEGs of 500x375 (or the first images of a store), in one thread (as in a loader's
worker), in interleaved rounds, prints per image:

- one whole libjpeg-turbo decode (``simplejpeg.decode_jpeg``): the yardstick;
- ``TrainPipeline(224)`` with crop windows decoded alone (fastdata's window decoder, where it
  is built) and without (the whole image, or its top rows), and their ratio to the yardstick
  (goal: at most 1.0);
- the parts: the plan (header read and crop drawn), the window's decode, the resize, and what is
  left (the per-image cost of everything but the decode and the resize);
- what a read does beside the decode, in microseconds, for JPEGs from 160x120 to 4000x3000:
  the record's header read (size, CRC-32 and scan end, as a checked read reads a batch's), the
  CRC-32 of its bytes, the plan, the decoder's look at the header, and the search for the end
  of the first scan that the header's recorded ``scan_end`` saves (NOTE [ Scan ends ] in
  fastdata/images/codec.py), not counted in the totals. All but the CRC-32 and the search stay
  flat as the bytes grow. Printed where the window decoder is not built too (the search then
  runs in Python).

    python scripts/bench_pipeline.py [--images 300] [--rounds 3] [--store STORE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fastdata.images import codec, window
from fastdata.images.decode import turbo_scale
from fastdata.images.pipelines import TrainPipeline, _resize, shrink_for
from fastdata.images.synthetic import synthetic_jpeg
from fastdata.records import RecordHeader, checksum, first_mismatch


def per_image(fn: Callable[[int], object], count: int) -> float:
    """CPU milliseconds per call of ``fn(i)`` over ``i`` in range(count)."""
    start = time.process_time()
    for i in range(count):
        fn(i)
    return 1000 * (time.process_time() - start) / count


def images(args: argparse.Namespace) -> list[bytes]:
    if args.store is None:
        return [synthetic_jpeg(500, 375, seed=i) for i in range(args.images)]
    from fastdata import LMDBImageDataset

    ds = LMDBImageDataset(args.store, output="bytes")
    return [bytes(ds[i][0]) for i in range(min(args.images, len(ds)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", help="an LMDB store of JPEGs (default: generated 500x375)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a loader's worker runs one thread)
    import simplejpeg

    datas = images(args)
    ends = [codec.scan_end(d) for d in datas]  # (as each record's header gives it)
    n = len(datas)
    pipeline = TrainPipeline(224)
    plans = [pipeline.plan(d, i) for i, d in enumerate(datas)]
    boxes = []
    for plan in plans:
        _, _, kept_h, kept_w = plan.box
        shrink = shrink_for(kept_h, kept_w, 224, 224)
        h, w = plan.full
        boxes.append((shrink, plan.pixels(-(-h // shrink), -(-w // shrink))))
    regions = [window.decode_window(d, s, b, False) for d, (s, b) in zip(datas, boxes, strict=True)]

    def with_windows(on: bool) -> Callable[[int], object]:
        def run(i: int) -> object:
            before = window.set_enabled(on)
            try:
                return pipeline(datas[i], i, scan_end=ends[i])
            finally:
                window.set_enabled(before)

        return run

    parts: dict[str, Callable[[int], object]] = {
        "whole decode (simplejpeg)": lambda i: simplejpeg.decode_jpeg(datas[i], colorspace="RGB"),
        "pipeline, windows alone": with_windows(True),
        "pipeline, without": with_windows(False),
        "  plan (header, crop drawn)": lambda i: pipeline.plan(datas[i], i),
        "  window decode": lambda i: window.decode_window(datas[i], *boxes[i], False, ends[i]),
        "  resize to 224": lambda i: (
            _resize(regions[i], 224, 224, plans[i].flip) if regions[i] is not None else None
        ),
    }
    if not window.available():  # both pipeline rows would be the same path, the parts nothing
        for name in ("pipeline, windows alone", "  window decode", "  resize to 224"):
            del parts[name]
    results: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(max(1, args.rounds)):  # interleaved: a busy stretch hits every row
        for name, fn in parts.items():
            results[name].append(per_image(fn, n))
    med = {name: statistics.median(v) for name, v in results.items()}
    whole = med["whole decode (simplejpeg)"]
    rounds = f"{args.rounds} rounds" if args.rounds != 1 else "1 round"
    print(f"{n} JPEGs, {window.describe()}; CPU ms per image, median of {rounds}")
    for name, value in med.items():
        print(f"{name:<32}{value:8.3f} ms  {value / whole:5.2f}x one whole decode")
    if not window.available():
        print("(crop windows are not decoded alone here: the pipeline above is its other path)")
        beside_the_decode(args.rounds)
        return
    taken = sum(r is not None for r in regions)
    if taken == n:
        rest = med["pipeline, windows alone"] - med["  window decode"] - med["  resize to 224"]
        print(f"{'  the rest':<32}{rest:8.3f} ms  (the pipeline less the decode and the resize)")
    else:
        print(f"  ({n - taken} of {n} images not taken by the window decoder)")
    ratio = med["pipeline, windows alone"] / med["pipeline, without"]
    print(f"pipeline with windows / without: {ratio:.2f}")
    beside_the_decode(args.rounds)


SIDES = ((160, 120), (500, 375), (1600, 1200), (4000, 3000))
"""The image sizes of the table of what a read does beside the decode."""


def per_call_us(fn: Callable[[], object], least: float = 0.05) -> float:
    """CPU microseconds per call of ``fn``, called until ``least`` seconds have gone by."""
    calls, start = 0, time.process_time()
    while True:
        for _ in range(16):
            fn()
        calls += 16
        spent = time.process_time() - start
        if spent >= least:
            return 1e6 * spent / calls


def costs_beside(data: bytes, rounds: int) -> dict[str, float]:
    """CPU microseconds per read of ``data`` for each step beside its decode (medians)."""
    pipeline = TrainPipeline(224)
    end = codec.scan_end(data)
    datas = [data] * 256  # (a batch's records checked at once)
    # a batch's headers read alone: each describes one byte, whose CRC-32 costs nothing beside
    # them (the image's is the next row; a timing of both less it could come out below zero)
    head = RecordHeader("class/image.jpg", 3, 1, checksum(b"\0"), "jpeg", scan_end=end)
    heads, stubs = [head.to_json()] * 256, [b"\0"] * 256
    start = codec._first_scan(data)[0]
    steps: dict[str, tuple[Callable[[], object], int]] = {
        "header read (size, CRC-32, scan end)": (lambda: first_mismatch(heads, stubs, str), 256),
        "CRC-32 of the bytes": (lambda: [checksum(d) for d in datas], 256),
        "plan (image size, crop drawn)": (lambda: pipeline.plan(data, 1), 1),
        "decoder's look at the header": (lambda: turbo_scale(data, 2), 1),
        "scan end, recorded (2 bytes)": (lambda: data[end : end + 2] == codec.EOI, 1),
        "scan end, searched (saved)": (lambda: codec.marker_after(data, start), 1),
    }
    found = {
        name: statistics.median(per_call_us(fn) for _ in range(max(1, rounds))) / reads
        for name, (fn, reads) in steps.items()
    }
    crc = "CRC-32 of the bytes"  # (the header's row names the CRC-32 too: compared whole)
    flat = sum(v for k, v in found.items() if k != crc and "searched" not in k)
    found["all beside the decode, less the CRC"] = flat
    found["all beside the decode"] = flat + found[crc]
    return found


def beside_the_decode(rounds: int) -> None:
    """Print, per image size, the microseconds a read spends beside the decode (median of
    ``rounds``): each a flat cost (the header's) or one that grows with the bytes."""
    rows: dict[str, list[str]] = {}
    for width, height in SIDES:
        data = synthetic_jpeg(width, height, seed=7)
        rows.setdefault("image bytes", []).append(f"{len(data):,}")
        for name, value in costs_beside(data, rounds).items():
            rows.setdefault(name, []).append(f"{value:.2f}")
    print()
    search = "in C" if codec._jpegwindow is not None else "in Python"
    print(f"Beside the decode, per read (CPU us; the scan searched {search}):")
    print(f"{'':<40}" + "".join(f"{f'{w}x{h}':>12}" for w, h in SIDES))
    for name, values in rows.items():
        print(f"{name:<40}" + "".join(f"{v:>12}" for v in values))


if __name__ == "__main__":
    main()
