"""BackgroundGenerator and ``@background``: run a producer in a thread, a few items ahead.

What the well-known versions get wrong, and this one does not:

- an exception in the producer is re-raised in the consumer, with its original traceback;
- the thread can be stopped: ``close()``, a ``with`` block, breaking out of a loop and dropping
  the generator, or garbage collection all stop it, and nothing stays blocked;
- every queue operation has a timeout and checks a stop event, so exhaustion never deadlocks;
- the thread holds no reference to the generator object, so dropping it is enough to stop it.

Optionally batches are moved to a device in the thread (on a side stream on CUDA, made visible to
the consumer's stream before each batch is handed over).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

__all__ = ["BackgroundGenerator", "background"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLL = 0.05
"""Seconds between checks of the stop event while the queue is full or empty."""
CLOSE_TIMEOUT = 10.0
"""Seconds close() waits for the producer to finish the item it is producing."""


class _End:
    """The producer finished."""


class _Failure:
    """The producer raised ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    iterable: Iterable[Any],
    q: queue.Queue[Any],
    stop: threading.Event,
    transfer: Callable[[Any], Any] | None,
) -> None:
    """The thread's body. It must not reference the BackgroundGenerator (see module doc)."""
    iterator = iter(iterable)
    try:
        for item in iterator:
            if stop.is_set():
                return
            if transfer is not None:
                item = transfer(item)
            if not _put(q, item, stop):
                return
        _put(q, _End(), stop)
    except BaseException as exc:
        _put(q, _Failure(exc), stop)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None and stop.is_set():
            close()  # a generator source runs its finally blocks in this thread


def _shutdown(stop: threading.Event, q: queue.Queue[Any], thread: threading.Thread) -> None:
    stop.set()
    while True:  # unblock a producer waiting on a full queue, and drop what it made
        try:
            q.get_nowait()
        except queue.Empty:
            break
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(CLOSE_TIMEOUT)
        if thread.is_alive():
            log.warning(
                "background producer %s still busy after %.0f s; it stops after its current item",
                thread.name,
                CLOSE_TIMEOUT,
            )


class BackgroundGenerator(Generic[T]):
    """Iterate ``iterable`` in a background thread, up to ``max_prefetch`` items ahead.

    Example::

        with BackgroundGenerator(slow_batches(), max_prefetch=4) as batches:
            for batch in batches:
                train_step(batch)

    Args:
        iterable: the producer.
        max_prefetch: items produced ahead of the consumer (the queue bound), at least 1.
        device: move every batch (tensors in any nesting) to this device in the thread. On CUDA
            the copy runs on the generator's own stream from pinned memory, and the consumer's
            stream waits for it before each batch is handed over.

    Raises (from iteration):
        Whatever the producer raised, with its traceback.
    """

    def __init__(self, iterable: Iterable[T], max_prefetch: int = 2, *, device: Any = None) -> None:
        if max_prefetch < 1:
            raise ValueError(f"max_prefetch must be at least 1, got {max_prefetch}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_prefetch)
        self._stop = threading.Event()
        self._done = False
        self._transfer = _DeviceTransfer(device) if device is not None else None
        self._thread = threading.Thread(
            target=_produce,
            args=(iterable, self._queue, self._stop, self._transfer),
            name=f"fastdata-background-{id(self):x}",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)
        self._thread.start()

    def __iter__(self) -> BackgroundGenerator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if self._stop.is_set() or (not self._thread.is_alive() and self._queue.empty()):
                    self._done = True
                    raise StopIteration from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            exc = item.exc
            if hasattr(exc, "add_note"):
                exc.add_note("(raised in the producer of a BackgroundGenerator)")
            raise exc
        if self._transfer is not None:
            item = self._transfer.hand_over(item)
        return item

    def next(self) -> T:
        """``next(gen)``, by the method name prefetch_generator's users call."""
        return self.__next__()

    def close(self) -> None:
        """Stop the producer thread and wait for it (bounded); iteration then ends."""
        self._done = True
        self._finalizer()

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundGenerator[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _DeviceTransfer:
    """Moves batches to a device inside the producer thread (on a side stream on CUDA)."""

    def __init__(self, device: Any) -> None:
        from .device import SideStream, pinned_device

        self.device = pinned_device(device if device != "auto" else None)
        self._side = SideStream(self.device)

    def __call__(self, batch: Any) -> Any:
        from .device import copy_async, to_device

        if self.device.type != "cuda":
            return to_device(batch, self.device)
        # the producer thread cannot see the consumer's stream: the copy is not ordered after it
        return self._side.copy(batch, lambda t: copy_async(t, self.device), after_consumer=False)

    def hand_over(self, item: Any) -> Any:
        """In the consumer: make its stream wait for the copy, and tie the memory to it."""
        from .device import InFlight

        return self._side.hand_over(item) if isinstance(item, InFlight) else item


def background(
    max_prefetch: int = 2, *, device: Any = None
) -> Callable[[Callable[..., Iterable[T]]], Callable[..., BackgroundGenerator[T]]]:
    """Decorate a generator function so that it runs in a background thread.

    Example::

        @background(max_prefetch=4)
        def batches(path):
            for chunk in read_chunks(path):
                yield decode(chunk)
    """

    def decorate(fn: Callable[..., Iterable[T]]) -> Callable[..., BackgroundGenerator[T]]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> BackgroundGenerator[T]:
            return BackgroundGenerator(fn(*args, **kwargs), max_prefetch, device=device)

        return wrapper

    return decorate
