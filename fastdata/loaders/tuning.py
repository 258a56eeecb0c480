"""Worker-count tuning: how many ``DataLoader`` workers keep up, found by measuring.

Used by ``create_loader(num_workers="auto")`` and by ``fastdata bench``; it depends on neither.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "choose_workers",
    "cpu_count",
    "measure_loader",
    "measure_workers",
    "median",
    "pick_workers",
    "timed_loop",
    "worker_candidates",
]

log = logging.getLogger(__name__)


def timed_loop(step: Callable[[], int], seconds: float, min_steps: int = 1) -> float:
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


def measure_loader(
    make_loader: Callable[[int], Iterable[Any]],
    workers: int,
    *,
    seconds: float = 2.0,
    batch_size: int,
) -> float:
    """Images per second of ``make_loader(workers)`` in steady state.

    The batches the workers prepared while starting up (``prefetch_factor`` each) are taken
    before the clock starts: counted, they made short measurements of several workers look
    faster than the CPUs can decode.
    """
    loader = make_loader(workers)
    source = getattr(loader, "dataloader", loader)  # create_loader's Loader wraps a DataLoader
    ready = 1 + workers * (getattr(source, "prefetch_factor", None) or 0)
    it = iter(loader)
    for _ in range(ready):
        try:
            next(it)  # worker start-up and the batches it queued are not throughput
        except StopIteration:
            break

    def step() -> int:
        nonlocal it
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)  # a small store is read again: another epoch
            try:
                batch = next(it)
            except StopIteration:
                return 0
        return _batch_len(batch, batch_size)

    return timed_loop(step, seconds)  # the workers stop when the iterator is dropped


def cpu_count() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def _batch_len(batch: Any, default: int) -> int:
    """Samples in a batch ``(images, labels, ...)`` (the last one of an epoch may be short)."""
    try:
        return len(batch[1])
    except (TypeError, IndexError):
        return default


def worker_candidates(cpus: int | None = None) -> list[int]:
    """Worker counts worth measuring: 1, a quarter, half and all of the CPUs (at most 32).

    More workers than CPUs only pay where reading waits on a network; pass an integer then.
    """
    cpus = min(32, cpus if cpus is not None else cpu_count())
    return sorted({1, max(1, cpus // 4), max(1, cpus // 2), cpus})


def choose_workers(rates: dict[int, float], tolerance: float = 0.10) -> int:
    """The fewest workers within ``tolerance`` of the best measured throughput (10%: closer
    than that, repeated runs on a quiet machine disagree about which is faster)."""
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= best * (1 - tolerance))


def measure_workers(
    make_loader: Callable[[int], Iterable[Any]],
    candidates: Sequence[int],
    *,
    batch_size: int,
    seconds: float,
    rounds: int = 1,
) -> dict[int, list[float]]:
    """Loader throughput for each worker count, ``rounds`` times, the counts interleaved (so that
    a change in the machine's load touches them all alike)."""
    rates: dict[int, list[float]] = {w: [] for w in candidates}
    for _ in range(rounds):
        for w in candidates:
            rate = measure_loader(make_loader, w, seconds=seconds, batch_size=batch_size)
            rates[w].append(rate)
            log.debug("%d workers: %.0f images/s", w, rate)
    return rates


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def pick_workers(
    make_loader: Callable[[int], Any],
    *,
    batch_size: int,
    seconds: float = 1.0,
    candidates: Sequence[int] | None = None,
) -> tuple[int, dict[int, float]]:
    """Measure a few worker counts on the real data and return the fewest within 10% of the best.

    Each candidate runs for about ``seconds`` after its first batch. Returns the choice and the
    measured images/s per count.
    """
    started = time.perf_counter()
    rates = {
        w: r[0]
        for w, r in measure_workers(
            make_loader,
            list(candidates or worker_candidates()),
            batch_size=batch_size,
            seconds=seconds,
        ).items()
    }
    chosen = choose_workers(rates)
    log.info(
        "num_workers=auto: measured %s images/s in %.1f s; chose %d (the fewest within 10%% of "
        "the best)",
        ", ".join(f"{w}: {r:.0f}" for w, r in sorted(rates.items())),
        time.perf_counter() - started,
        chosen,
    )
    return chosen, rates
