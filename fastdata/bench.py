"""Throughput measurement shared by ``fastdata bench``, ``create_loader(num_workers="auto")`` and
the scripts: raw record reads, decode+pipeline per process, and whole loaders per worker count."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BenchReport",
    "choose_workers",
    "input_bound",
    "measure_loader",
    "measure_pipeline",
    "measure_reads",
    "worker_candidates",
]

log = logging.getLogger(__name__)


def _timed_loop(step: Callable[[], int], seconds: float, min_steps: int = 1) -> float:
    """Run ``step`` (returning items done) for about ``seconds``; items per second."""
    done = 0
    steps = 0
    start = time.perf_counter()
    while steps < min_steps or time.perf_counter() - start < seconds:
        n = step()
        if n == 0:
            break
        done += n
        steps += 1
    elapsed = time.perf_counter() - start
    return done / elapsed if elapsed > 0 else 0.0


def _random_batches(n: int, batch_size: int, seed: int = 0) -> Iterable[list[int]]:
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(n) for _ in range(batch_size)]


def measure_reads(reader: Any, *, batch_size: int = 64, seconds: float = 1.0) -> float:
    """Raw record reads per second: random batches of encoded bytes, no decoding."""
    batches = iter(_random_batches(len(reader), batch_size))
    return _timed_loop(lambda: len(reader.read_samples(next(batches))), seconds)


def measure_pipeline(dataset: Any, *, seconds: float = 1.0) -> float:
    """Decode+pipeline images per second in this one process (the per-worker ceiling)."""
    batches = iter(_random_batches(len(dataset), 16, seed=1))

    def step() -> int:
        return len(dataset.__getitems__([(i, i) for i in next(batches)]))

    step()  # warm caches
    return _timed_loop(step, seconds)


def measure_loader(
    make_loader: Callable[[int], Iterable[Any]],
    workers: int,
    *,
    seconds: float = 2.0,
    batch_size: int,
) -> float:
    """Images per second of ``make_loader(workers)`` once its first batch has arrived."""
    loader = make_loader(workers)
    it = iter(loader)
    try:
        next(it)  # worker start-up is not throughput
    except StopIteration:
        return 0.0

    def step() -> int:
        try:
            next(it)
        except StopIteration:
            return 0
        return batch_size

    return _timed_loop(step, seconds)  # the workers stop when the iterator is dropped


def worker_candidates(cpus: int | None = None) -> list[int]:
    """Worker counts worth measuring: 1, a quarter, half and all of the CPUs (at most 32).

    More workers than CPUs only pay where reading waits on a network; pass an integer then.
    """
    if cpus is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    cpus = min(32, cpus)
    return sorted({1, max(1, cpus // 4), max(1, cpus // 2), cpus})


def choose_workers(rates: dict[int, float], tolerance: float = 0.05) -> int:
    """The fewest workers within ``tolerance`` of the best measured throughput."""
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= best * (1 - tolerance))


def input_bound(images_per_s: float, batch_size: int, step_ms: float) -> dict[str, float]:
    """Whether a training step of ``step_ms`` would wait for data, and for what share of time.

    Returns:
        ``data_ms`` (time to produce one batch), ``wait_ms`` per step, and ``wait_fraction`` of
        the step's wall time spent waiting (0 when the loader keeps up).
    """
    data_ms = batch_size / images_per_s * 1000 if images_per_s > 0 else float("inf")
    wait_ms = max(0.0, data_ms - step_ms)
    wall = max(data_ms, step_ms)
    return {
        "data_ms": data_ms,
        "wait_ms": wait_ms,
        "wait_fraction": wait_ms / wall if wall else 0.0,
    }


@dataclass
class BenchReport:
    """What ``fastdata bench`` measured."""

    store: str
    records: int
    batch_size: int
    reads_per_s: float
    pipeline_per_s: float
    loader_per_s: dict[int, float] = field(default_factory=dict)
    chosen_workers: int = 0
    step_ms: float | None = None
    verdict: dict[str, float] | None = None
    decoder: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loader_per_s"] = {str(k): v for k, v in self.loader_per_s.items()}
        return d


def measure_workers(
    make_loader: Callable[[int], Iterable[Any]],
    candidates: Sequence[int],
    *,
    batch_size: int,
    seconds: float,
) -> dict[int, float]:
    """Loader throughput for each worker count."""
    rates = {}
    for w in candidates:
        rates[w] = measure_loader(make_loader, w, seconds=seconds, batch_size=batch_size)
        log.debug("%d workers: %.0f images/s", w, rates[w])
    return rates
