"""PrefetchLoader: the next batch is copied to the device and normalised while this one trains.

On CUDA the copy runs on one side stream per loader (not per epoch), stream-correct:

1. before copying batch k+1, the side stream waits for the consumer's stream, so the copy never
   overtakes work the consumer queued earlier;
2. the copy is ``non_blocking`` from pinned memory, and normalisation runs on the side stream;
3. before batch k+1 is handed over, the consumer's stream waits for the side stream, and every
   tensor handed over is ``record_stream``-ed on the consumer's stream, so the caching allocator
   does not reuse its memory while the consumer may still use it.

Without CUDA the same loader runs on the CPU (or any other device) synchronously and makes no
CUDA call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .background import BackgroundGenerator
from .device import (
    SideStream,
    copy_async,
    intra_op_threads,
    map_tensors,
    pinned_device,
    threads_beside_workers,
)
from .normalize import IMAGENET_MEAN, IMAGENET_STD, Normalizer

__all__ = ["PrefetchLoader"]


class PrefetchLoader:
    """Wrap an iterable of batches; yield them on ``device``, normalised, one batch ahead.

    Example::

        loader = PrefetchLoader(DataLoader(ds, batch_size=256, pin_memory=True), normalize=True)
        for images, targets in loader:   # float32 on the GPU, ImageNet-normalised
            ...

    Args:
        loader: any iterable of batches (tensor, tuple, list, namedtuple, dict, nested).
        device: where batches go; None picks the current accelerator, else the CPU.
        mean: per-channel mean in 0-1 units. Giving ``mean`` or ``std`` (or ``normalize=True``)
            normalises uint8 image batches; the other defaults to the ImageNet constants.
        std: per-channel standard deviation in 0-1 units.
        dtype: floating-point type of the images (float32 when normalising and not given;
            float16 and bfloat16 on request). With neither ``dtype`` nor normalisation, images
            keep their dtype.
        channels_last: give image batches the ``channels_last`` memory format on the device.
        normalize: normalise with the ImageNet constants (or ``mean``/``std`` when given).
        decode: a function of a whole batch applied before it is moved, on the device's side
            stream: a :class:`~fastdata.images.device_decode.DeviceDecoder` turning each
            :class:`~fastdata.loaders.collate.EncodedBatch` into ``(uint8 images, labels)``.
            It runs in a thread, up to two batches ahead of the caller.
        on_device: the loader's batches arrive already on ``device`` (decoded there by its
            worker processes and shared by CUDA IPC, :mod:`fastdata.loaders.device_workers`):
            a thread takes them up to two batches ahead of the caller, converts and normalises
            them on the side stream into this process's memory, and lets the shared memory go.

    Only uint8 4-D tensors (``N x C x H x W`` images) are converted; every other tensor (targets)
    is only moved, and other leaves (strings, ints, None) pass through untouched.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        *,
        normalize: bool = False,
        decode: Callable[[Any], Any] | None = None,
        on_device: bool = False,
    ) -> None:
        self.loader = loader
        self.decode = decode
        self.on_device = on_device
        self.device = pinned_device(device)
        if normalize or mean is not None or std is not None:
            mean = tuple(mean) if mean is not None else IMAGENET_MEAN
            std = tuple(std) if std is not None else IMAGENET_STD
        self.normalizer = Normalizer(mean, std, dtype, channels_last)
        self._constants = self.normalizer.constants(self.device)
        self._side = SideStream(self.device)  # one side stream for the loader's lifetime
        self._threads = threads_beside_workers(loader) if self.device.type == "cpu" else None
        """The intra-op threads a batch is converted with on the CPU (NOTE [ Threads beside the
        workers ] in ``device.py``)."""

    # -- pass-through to the wrapped loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Any:
        return self.loader.dataset  # type: ignore[attr-defined]

    @property
    def sampler(self) -> Any:
        return self.loader.sampler  # type: ignore[attr-defined]

    @property
    def batch_size(self) -> Any:
        return self.loader.batch_size  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        """Forward to the loader's ``set_epoch``, or its sampler's (``DistributedSampler``)."""
        target: Any = self.loader
        if not hasattr(target, "set_epoch"):
            target = getattr(target, "sampler", None)
        if target is None or not hasattr(target, "set_epoch"):
            raise AttributeError(f"{type(self.loader).__name__} has no set_epoch (nor its sampler)")
        target.set_epoch(epoch)

    # -- iteration

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        """The synchronous path: copy, then convert and normalise."""
        return self.normalizer.apply(t.to(self.device), self._constants)

    def _moved(self, batch: Any) -> Any:
        """``batch`` moved as :meth:`_move` moves each tensor (on the CPU, on the cores the
        loader's workers leave)."""
        with intra_op_threads(self._threads):
            return map_tensors(batch, self._move)

    def _move_async(self, t: torch.Tensor) -> torch.Tensor:
        """On the side stream: copy without blocking, then convert and normalise there."""
        return self.normalizer.apply(copy_async(t, self.device), self._constants)

    def __iter__(self) -> Iterator[Any]:
        if self.decode is not None:
            return self._iter_decoding(self.decode)
        if self.on_device and self.device.type == "cuda":
            return self._iter_arriving()
        if self.device.type == "cuda":
            return self._iter_cuda()
        return (self._moved(batch) for batch in self.loader)

    def _iter_decoding(self, decode: Callable[[Any], Any]) -> Iterator[Any]:
        """Decoding a batch takes about as long as a training step: a thread decodes (and moves)
        up to two batches ahead while the caller trains on this one. On CUDA the decode runs on
        the side stream; the caller's stream waits for it before each batch is handed over."""
        if self.device.type == "cuda":
            side = self._side

            def ahead(batch: Any) -> Any:
                # the thread cannot see the caller's stream; the memory handed over is tied to
                # it (record_stream), which is what keeps the allocator from reusing it early
                return side.copy(batch, self._move_async, after_consumer=False, prepare=decode)

            hand_over: Callable[[Any], Any] = side.hand_over
        else:

            def ahead(batch: Any) -> Any:
                return self._moved(decode(batch))

            def hand_over(item: Any) -> Any:
                return item

        # torch sets up a thread's intra-op threads on its first use, from the process's count,
        # which a decode on the CPU lowers to one while it runs: the caller's are set up now
        torch.get_num_threads()
        # (a generator, not map(): a StopIteration that a decode raises is then an error, not
        # the end of the epoch)
        decoded = (ahead(batch) for batch in self.loader)
        with BackgroundGenerator(decoded, max_prefetch=2) as batches:
            for item in batches:
                yield hand_over(item)

    def _iter_arriving(self) -> Iterator[Any]:
        from .device_workers import arrivals

        torch.get_num_threads()  # (as in _iter_decoding)
        taken = arrivals(self.loader, self._side, self._move_async)
        with BackgroundGenerator(taken, max_prefetch=2) as batches:
            for item in batches:
                yield self._side.hand_over(item)

    def _iter_cuda(self) -> Iterator[Any]:
        source = iter(self.loader)

        def preload() -> tuple[bool, Any, Exception | None]:
            try:
                batch = next(source)
            except StopIteration:
                return False, None, None
            except Exception as exc:  # handed to the caller after the batch before it
                return False, None, exc
            moved = self._side.copy(
                batch, self._move_async, after_consumer=True, prepare=self.decode
            )
            return True, moved, None

        ok, pending, error = preload()
        while ok:
            batch = self._side.hand_over(pending)
            ok, pending, error = preload()  # the next copy overlaps the caller's work on this one
            yield batch
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"PrefetchLoader({self.loader!r}, device={str(self.device)!r})"
