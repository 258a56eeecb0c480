#!/usr/bin/env python
"""The device decoder alone, with no loader and no training: where a batch's time goes.

Reads batches of stored JPEGs from an LMDB store once, then, for each decoder setting, times
nvImageCodec's call alone (the JPEGs decoded) and the whole ``DeviceDecoder`` call (decoded,
cropped, resized, flipped), synchronised, and the host CPU each batch took.

    python scripts/bench_decoder_alone.py STORE [--batches 8] [--batch-size 256]

STORE: an LMDB store of JPEGs (``scripts/bench_gpu_train.py --workdir DIR`` leaves one in DIR).
Needs a CUDA device and nvImageCodec.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from fastdata import LMDBImageDataset
from fastdata.images.device_decode import DeviceDecoder
from fastdata.images.pipelines import TrainPipeline

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("nvImageCodec's own backends, windows", {}),
    ("hardware=1, whole images", {"hardware": 1.0, "regions": False}),
    ("hardware=0.6, whole images", {"hardware": 0.6, "regions": False}),
    ("hardware=0.8, whole images", {"hardware": 0.8, "regions": False}),
    ("hardware=1, whole, batched", {"hardware": 1.0, "regions": False, "batched": True}),
    ("hardware=1, whole, threads=1", {"hardware": 1.0, "regions": False, "threads": 1}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decoder_alone.py: needs a CUDA device")
    ds = LMDBImageDataset(args.store)
    size, count = args.batch_size, args.batches
    if len(ds) < size * count:
        sys.exit(
            f"bench_decoder_alone.py: {args.store} holds {len(ds)} records, fewer than "
            f"--batches x --batch-size = {size * count}"
        )
    pipeline = TrainPipeline(224)
    datas = [bytes(d) for d in ds.reader.read_data(list(range(size * count)))]
    plans = [pipeline.plan(d, i) for i, d in enumerate(datas)]
    batches = [
        (datas[i * size : (i + 1) * size], plans[i * size : (i + 1) * size]) for i in range(count)
    ]
    print(f"{torch.cuda.get_device_name()}, {count} batches of {size}")
    print(f"{'setting':<40}{'decode ms':>10}{'whole call ms':>14}{'img/s':>8}{'CPU ms/batch':>13}")
    for name, options in SETTINGS:
        decoder = DeviceDecoder("cuda", backend="nvimgcodec", **options)
        decoder(*batches[0])  # the codec is made, the allocator warmed
        torch.cuda.synchronize()
        t = time.perf_counter()
        for d, p in batches:
            decoder._decode(d, p)
        torch.cuda.synchronize()
        alone = (time.perf_counter() - t) / count
        t, c = time.perf_counter(), time.process_time()
        for d, p in batches:
            decoder(d, p)
        torch.cuda.synchronize()
        whole, cpu = (time.perf_counter() - t) / count, (time.process_time() - c) / count
        print(
            f"{name:<40}{1000 * alone:10.1f}{1000 * whole:14.1f}{size / whole:8.0f}"
            f"{1000 * cpu:13.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
