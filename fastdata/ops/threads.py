"""Reading files on a pool of threads, in order, with the thread count chosen by measurement.

Reading a file and checksumming it release the interpreter lock; parsing headers does not. No
fixed count is right everywhere, so a conversion measures a few as it goes and keeps the fewest
within 10% of the fastest (``loaders.tuning.choose_workers``: the rule the loader's
``num_workers="auto"`` follows too).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import TypeVar

from ..loaders.tuning import choose_workers

__all__ = ["CHUNK", "chunks", "default_workers", "ordered_map", "tuned_map", "window"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

CHUNK = 8
"""Samples per task handed to a reader thread."""
READ_AHEAD = 256
"""Samples read ahead of the writer (about one commit's worth of typical JPEGs)."""
PROBE_CHUNKS = 48
"""Chunks each candidate thread count converts while the conversion measures them."""
RETUNE_CHUNKS = 5000
"""Chunks converted with the chosen count before the candidates are measured again (the folder
may turn from cold to warm, or the other way, as it goes)."""


def default_workers() -> int:
    """The largest reader-thread count a conversion without ``--workers`` tries (see
    :func:`tuned_map`): twice the CPUs, at least 8, at most 32."""
    return min(32, max(8, 2 * (os.cpu_count() or 1)))


def tuned_map(
    fn: Callable[[T], R], items: Iterable[T], most: int, chosen: list[int]
) -> Iterator[R]:
    """``map(fn, items)`` in order, with the reader-thread count chosen by measurement.

    No fixed count is right everywhere: on a warm folder and few CPUs, reading in the writing
    thread is fastest (threads only compete for the interpreter lock); on a cold folder or a
    network file system, where reads wait, several threads are. So the candidates (none, 2, 4, ...
    up to ``most``, stopping once one is clearly slower than the best so far) each convert
    ``PROBE_CHUNKS`` chunks, end to end, and the fewest within 10% of the fastest converts the
    next ``RETUNE_CHUNKS``, then
    they are measured again. ``chosen`` gets each count chosen.
    """
    it = iter(items)
    candidates = [1] + [k for k in (2, 4, 8, 16, 32) if k <= most]
    while True:
        rates: list[tuple[float, int]] = []
        for k in candidates:
            t = time.perf_counter()
            done = yield from _counted_map(fn, it, PROBE_CHUNKS, k)
            if done < PROBE_CHUNKS:
                if done or not chosen:
                    chosen.append(k)  # it ended while this count read (a short conversion)
                return
            rates.append((done / (time.perf_counter() - t), k))
            if rates[-1][0] < 0.8 * max(rates)[0]:
                break  # past the peak: more threads only compete for the same cores
        # the fewest threads within 10% of the fastest: a probe is short, and a count that only
        # looks faster by chance costs more (threads compete for the CPUs) than it could gain
        best = choose_workers({k: rate for rate, k in rates})
        chosen.append(best)
        log.debug("reader threads: %s; chose %d", rates, best)
        if (yield from _counted_map(fn, it, RETUNE_CHUNKS, best)) < RETUNE_CHUNKS:
            return


def _counted_map(
    fn: Callable[[T], R], it: Iterator[T], n: int, workers: int
) -> Generator[R, None, int]:
    """The next ``n`` items of ``it`` mapped by ``workers`` threads; returns how many there were."""
    done = 0
    for out in ordered_map(fn, islice(it, n), workers, window(workers)):
        done += 1
        yield out
    return done


def window(workers: int) -> int:
    """Chunks in flight: about one commit's worth, so the readers keep working while a batch
    is flushed, and memory stays bounded."""
    return max(2 * workers + 2, READ_AHEAD // CHUNK)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, window: int) -> Iterator[R]:
    """``map(fn, items)`` on a thread pool, in order, with at most ``window`` items in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastdata-convert")
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def chunks(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])
