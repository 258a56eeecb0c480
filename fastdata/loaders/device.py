"""Moving batches to a device: nested structures of tensors, and the CUDA side stream.

A batch may be a tensor, a tuple, list, namedtuple or mapping of batches, or any other object,
which is passed through untouched (strings, ints, None, ...).

:class:`SideStream` is the one implementation of a stream-correct copy, used by
``PrefetchLoader`` and ``BackgroundGenerator(device=...)``: the copy runs on a side stream made
once per owner (optionally after the consumer's queued work), from pinned memory without
blocking; an event marks its end; before the consumer gets the batch, its stream waits for that
event and every tensor is ``record_stream``-ed on it, so the caching allocator does not reuse the
memory while the consumer may still use it.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "DecodedBatches",
    "DeviceStep",
    "InFlight",
    "SideStream",
    "copy_async",
    "default_device",
    "intra_op_threads",
    "is_image_batch",
    "map_tensors",
    "pinned_device",
    "record_stream",
    "to_device",
    "threads_beside_workers",
]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``batch`` with ``fn`` applied to every tensor in it, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(b, fn) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, Mapping):
        items = [(k, map_tensors(v, fn)) for k, v in batch.items()]
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # dict, OrderedDict, ...
        except TypeError:
            return dict(items)
    return batch


def threads_beside_workers(loader: Any) -> int | None:
    """The intra-op threads for work on the CPU in the caller's process while ``loader``'s
    worker processes run (NOTE [ Threads beside the workers ]): the cores they leave, at least
    one; None where the loader has no workers, or cannot say how many (the process's own count
    stands)."""
    try:  # (a count of any integer type: numpy's too)
        workers = operator.index(getattr(loader, "num_workers", 0))
    except Exception:  # (no count, or a property of the caller's loader that raised: the
        return None  # conversion is no reason to fail the wrapping, which never asked before)
    if workers <= 0:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - workers)


@contextmanager
def intra_op_threads(most: int | None) -> Iterator[None]:
    """torch's intra-op threads in this thread at most ``most`` while the block runs (None: as
    they are), as many as before again after it."""
    threads = torch.get_num_threads()
    if most is None or threads <= most:
        yield
        return
    torch.set_num_threads(most)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# NOTE [ Threads beside the workers ]
# A loader's worker processes decode on the machine's cores; the caller's process converts each
# batch they hand over (uint8 to normalised floats) on the CPU device. torch runs that conversion
# on its intra-op threads, one a core by default, and after each operation those threads spin,
# waiting for the next, on cores the workers need: on 2 cores with 2 workers, a third of the
# machine's time went to the spinning (32 px images, 40 us an image against 27 with one thread,
# the same as with OMP_WAIT_POLICY=PASSIVE). So the conversion runs on the cores the workers leave
# (at least one), and the caller's own work between batches keeps its threads.


def default_device() -> torch.device:
    """The current accelerator (CUDA, ...) when there is one, else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        found = accelerator.current_accelerator()
        if found is not None:
            return torch.device(found.type, accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pinned_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a device with its index: ``"cuda"`` is the device current in this thread
    now (``torch.cuda.set_device(LOCAL_RANK)``); None is :func:`default_device`.

    A thread starts on device 0 whatever the thread that made it had set, so a bare ``"cuda"``
    used in a prefetch thread meant ``cuda:0`` there, and on every rank."""
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_image_batch(t: torch.Tensor) -> bool:
    """Whether a tensor is a batch of images to normalise: uint8 and 4-D (N, C, H, W)."""
    return t.dtype == torch.uint8 and t.dim() == 4


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def record_stream(batch: Any, stream: Any) -> None:
    """Tie every tensor's memory to ``stream``: the allocator waits for its work before reuse."""
    map_tensors(batch, lambda t: t.record_stream(stream))


def copy_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied without blocking (from page-locked memory: pinned first when
    it is not)."""
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class InFlight:
    """A batch whose copy was queued on a side stream, and the event that marks its end."""

    def __init__(self, batch: Any, event: Any) -> None:
        self.batch = batch
        self.event = event


class SideStream:
    """One CUDA side stream for copies to ``device``, made on first use, kept for the owner's
    life (a stream per epoch leaks device memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def stream(self) -> Any:
        """The side stream (made on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def current(self) -> Any:
        """A context in which the side stream is this thread's current stream."""
        return torch.cuda.stream(self.stream())

    def copy(
        self,
        batch: Any,
        fn: Callable[[torch.Tensor], Any],
        *,
        after_consumer: bool,
        prepare: Callable[[Any], Any] | None = None,
    ) -> InFlight:
        """Queue ``fn`` (a copy, and what follows it on the device) over every tensor of
        ``batch`` on the side stream; with ``after_consumer``, after the work the consumer's
        stream has queued so far. ``prepare`` turns the whole batch into another first, on the
        side stream too (a decode on the device)."""
        stream = self.stream()
        if after_consumer:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if prepare is not None:
                batch = prepare(batch)
            moved = map_tensors(batch, fn)
            event = torch.cuda.Event()
            event.record(stream)
        return InFlight(moved, event)

    def hand_over(self, item: InFlight) -> Any:
        """In the consumer: its stream waits for the copy; the memory is tied to its stream."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(item.event)
        record_stream(item.batch, consumer)
        return item.batch


class DeviceStep:
    """A batch decoded on the device; an image no decoder can read is named by its record."""

    def __init__(self, decoder: Any, dataset: Any) -> None:
        self.decoder = decoder
        self.dataset = dataset

    def __call__(self, encoded: Any) -> Any:
        from ..errors import CorruptImageError
        from ..images.device_decode import BatchImageError

        try:
            return self.decoder.batch(encoded)
        except BatchImageError as exc:
            where = self.dataset.where(encoded.indices[exc.position])
            raise CorruptImageError(where, exc.reason) from None


class DecodedBatches:
    """A DataLoader's batches as the device decoder makes them (what ``num_workers="auto"``
    measures with ``decode="device"``)."""

    def __init__(self, dataloader: Any, decode: Callable[[Any], Any]) -> None:
        self.dataloader = dataloader
        self.decode = decode

    def __iter__(self) -> Iterator[Any]:
        return map(self.decode, self.dataloader)
