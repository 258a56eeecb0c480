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
  left (the per-image cost of everything but the decode and the resize).

    python scripts/bench_pipeline.py [--images 300] [--rounds 3] [--store STORE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fastdata.images import window
from fastdata.images.pipelines import TrainPipeline, _resize, shrink_for
from fastdata.images.synthetic import synthetic_jpeg


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
                return pipeline(datas[i], i)
            finally:
                window.set_enabled(before)

        return run

    parts: dict[str, Callable[[int], object]] = {
        "whole decode (simplejpeg)": lambda i: simplejpeg.decode_jpeg(datas[i], colorspace="RGB"),
        "pipeline, windows alone": with_windows(True),
        "pipeline, without": with_windows(False),
        "  plan (header, crop drawn)": lambda i: pipeline.plan(datas[i], i),
        "  window decode": lambda i: window.decode_window(datas[i], *boxes[i], False),
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
    print(f"{n} JPEGs, {window.describe()}; CPU ms per image, median of {args.rounds} rounds")
    for name, value in med.items():
        print(f"{name:<32}{value:8.3f} ms  {value / whole:5.2f}x one whole decode")
    if not window.available():
        print("(crop windows are not decoded alone here: the pipeline above is its other path)")
        return
    taken = sum(r is not None for r in regions)
    if taken == n:
        rest = med["pipeline, windows alone"] - med["  window decode"] - med["  resize to 224"]
        print(f"{'  the rest':<32}{rest:8.3f} ms  (the pipeline less the decode and the resize)")
    else:
        print(f"  ({n - taken} of {n} images not taken by the window decoder)")
    ratio = med["pipeline, windows alone"] / med["pipeline, without"]
    print(f"pipeline with windows / without: {ratio:.2f}")


if __name__ == "__main__":
    main()
