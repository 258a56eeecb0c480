#!/usr/bin/env python
"""What a loader's saved position costs: ``state_dict()`` and ``load_state_dict()`` of a loader
over 10,000,000 samples, mid-epoch, in time per call and in bytes of JSON, beside the targets
(under 1 ms and under 1 KB per rank).

    python scripts/bench_resume.py
    python scripts/bench_resume.py --samples 100000000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fastdata import create_loader


class Many(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``samples`` tiny images (the position's cost does not depend on what they hold)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros((3, 2, 2), dtype=torch.uint8), i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    loader = create_loader(Many(args.samples), 256, num_workers=0, device="cpu")
    batches = iter(loader)
    for _ in range(10):
        next(batches)
    times = []
    for _ in range(args.calls):
        t = time.perf_counter()
        state = loader.state_dict()
        times.append(time.perf_counter() - t)
    size = len(json.dumps(state))
    loads = []
    for _ in range(args.calls // 10):
        other = create_loader(Many(args.samples), 512, num_workers=0, device="cpu")
        t = time.perf_counter()
        other.load_state_dict(state)
        loads.append(time.perf_counter() - t)
    print(f"{args.samples:,} samples, position {state['position']:,}:")
    print(f"  state_dict():      {statistics.median(times) * 1e6:8.1f} us a call (target < 1000)")
    print(f"  load_state_dict(): {statistics.median(loads) * 1e6:8.1f} us a call")
    print(f"  the state as JSON: {size} bytes (target < 1024): {json.dumps(state)}")


if __name__ == "__main__":
    main()
