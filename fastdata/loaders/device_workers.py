"""Decoding on the device in the loader's worker processes (``create_loader(decode="device",
decode_in="workers")``): each worker decodes its batches on the GPU and hands them to the
training process through CUDA IPC, so the decode shares neither the training process's
interpreter lock nor its host core.

A decode in a thread of the training process (``decode_in="main"``) took 54-58 ms a batch of 256
alone and 108-140 ms while ResNet-50 trained beside it on an H100, holding the rate near 2,000
img/s (docs/gpu.md): the thread and the training loop take turns at the interpreter lock.

How a batch travels:

1. In a worker (started with ``spawn``: a forked child cannot use CUDA once its parent has), the
   bytes are read and each sample's plan drawn, as with ``decode_in="main"``; the batch is
   decoded, cropped, resized and flipped on the worker's default stream (:class:`DecodingCollate`)
   into a fresh ``N x 3 x H x W`` uint8 tensor.
2. PyTorch shares it by CUDA IPC: the memory's handle and an interprocess event recorded after
   the decode cross, the pixels never leave the device. Before each batch the worker takes back
   the memory of the batches the training process has let go (``torch.cuda.ipc_collect``), so it
   holds a few batches' memory, not one per batch sent.
3. In the training process, in the prefetch thread (:func:`arrivals`), with the loader's side
   stream current: the batch is opened (the side stream waits for the worker's event), converted
   and normalised on the side stream into memory of this process, and the thread waits, without
   the interpreter lock, for that work before it lets the shared batch go. (PyTorch's release of
   memory received by IPC synchronises the stream current at that moment: on the training
   stream, that would wait for the step, holding the interpreter lock.)
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .collate import collate_encoded
from .device import InFlight, SideStream, map_tensors, pinned_device

__all__ = [
    "DecodingCollate",
    "Probed",
    "arrivals",
    "decode_settings",
    "refuse_fields",
    "release_shared",
    "stop_workers",
    "worker_start",
]

log = logging.getLogger(__name__)

CU_CTX_SCHED_BLOCKING_SYNC = 0x04
RELEASE_SECONDS = 10.0
"""How long closing a loader waits for the batches its workers are still making (to let them
go before the workers exit)."""


DECODER_OPTIONS = ("hardware", "regions", "threads", "batched")
"""The :class:`~fastdata.images.device_decode.DeviceDecoder` options ``decode_options`` takes."""


def decode_settings(
    decode: str, decode_in: str, decode_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``create_loader``'s ``decode``, ``decode_in`` and ``decode_options`` checked: the
    decoder's options.

    Raises:
        ValueError: an unknown value or option, or ``decode_in`` / ``decode_options`` without
            ``decode="device"``.
    """
    if decode not in ("cpu", "device"):
        raise ValueError(f"decode must be 'cpu' or 'device', got {decode!r}")
    if decode_in not in ("main", "workers"):
        raise ValueError(f"decode_in must be 'main' or 'workers', got {decode_in!r}")
    if decode != "device" and (decode_in != "main" or decode_options):
        raise ValueError(
            "decode_in and decode_options are for decode='device' (with decode='cpu' the "
            "workers already decode, on the CPU)"
        )
    if decode_options is None:
        return {}
    if not isinstance(decode_options, Mapping):
        raise ValueError(
            "decode_options must be a dict of the decoder's options "
            f"({', '.join(DECODER_OPTIONS)}), got {type(decode_options).__name__} "
            f"{decode_options!r}: e.g. "
            "decode_options={'hardware': 1.0, 'regions': False}"
        )
    unknown = sorted(map(str, set(decode_options) - set(DECODER_OPTIONS)))
    if unknown:
        backend = "; the decoder is chosen by decode_backend=" if "backend" in unknown else ""
        raise ValueError(
            f"decode_options: unknown {', '.join(unknown)} (of {', '.join(DECODER_OPTIONS)}"
            f"{backend})"
        )
    from ..images.device_decode import checked_options

    try:
        return checked_options(dict(decode_options))
    except ValueError as exc:
        raise ValueError(f"decode_options: {exc}") from None


def refuse_fields(dataset: Any) -> None:
    """A dataset whose samples are more than ``(image, target)`` refused for ``decode="device"``.

    Raises:
        ValueError: samples with fields (``fields=``, even none) or as dicts (``as_dict``).
    """
    if not dataset.samples_carry_fields:
        return
    if dataset.fields:
        carries = f"reads the fields {', '.join(dataset.fields)}"
    elif dataset.as_dict:
        carries = "gives each sample as a dict (as_dict=True)"
    else:  # (fields=[], or "*" over a store without fields)
        carries = "gives each sample as (image, target, fields) (fields= given)"
    raise ValueError(
        f"decode='device' batches images and targets only, and this dataset {carries}: "
        "decode on the CPU (decode='cpu', the default) to batch them, or leave fields= and "
        "as_dict= out"
    )


def worker_start(in_workers: bool, pin_memory: bool | None, multiprocessing_context: Any) -> Any:
    """The workers' start method (a name, or a context as ``multiprocessing.get_context``
    gives it). Workers that decode on CUDA start with ``spawn`` (a forked child cannot use CUDA
    once its parent has), and their batches arrive on the device, with nothing to pin.

    Raises:
        ValueError: ``fork`` (by name or context) or ``pin_memory=True`` for workers that
            decode on CUDA.
    """
    method = multiprocessing_context
    if method is not None and not isinstance(method, str):
        method = getattr(method, "get_start_method", lambda: None)()
    if in_workers and pin_memory:
        raise ValueError(
            "decode_in='workers': the batches arrive on the device, there is nothing to pin: "
            "leave pin_memory out"
        )
    if in_workers and method == "fork":
        raise ValueError(
            "decode_in='workers' on CUDA: a forked worker cannot use CUDA once this process "
            "has; leave multiprocessing_context out (spawn) or pass 'spawn' or 'forkserver'"
        )
    return multiprocessing_context or ("spawn" if in_workers else None)


class DecodingCollate:
    """A worker's collate: the samples' bytes and plans, decoded on the device into
    ``(uint8 images, labels)``; an image no decoder can read is named by its record.

    Args:
        decoder: a :class:`~fastdata.images.device_decode.DeviceDecoder` (its native decoder is
            made again in each worker, on first use).
        dataset: the dataset, to name a record in an error (in a worker, the worker's copy of it
            is used: the collate does not carry it across).
    """

    def __init__(self, decoder: Any, dataset: Any) -> None:
        # the workers use the device this process uses now (set_device(LOCAL_RANK), ...)
        decoder.device = pinned_device(decoder.device)
        self.decoder = decoder
        self.dataset = dataset
        self._ready = False  # this process has set its device

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["dataset"] = None  # the worker has its own copy (get_worker_info().dataset)
        state["_ready"] = False
        return state

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        from ..errors import CorruptImageError
        from ..images.device_decode import BatchImageError

        encoded = collate_encoded(samples)
        device = self.decoder.device
        if device.type == "cuda":
            if not self._ready:
                _sleep_while_waiting(device.index or 0)
                torch.cuda.set_device(device)
                self._ready = True
            # the memory of batches the training process has let go, back to this process's
            # allocator (otherwise held until the device is full)
            torch.cuda.ipc_collect()
        try:
            return self.decoder.batch(encoded)
        except BatchImageError as exc:
            dataset = self.dataset
            if dataset is None:
                info = torch.utils.data.get_worker_info()
                dataset = info.dataset if info is not None else None
            index = encoded.indices[exc.position]
            where = dataset.where(index) if dataset is not None else f"record {index}"
            raise CorruptImageError(where, exc.reason) from None

    def __repr__(self) -> str:
        return f"DecodingCollate({self.decoder!r})"


def _own(moved: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``moved`` in memory of this process: a copy where it is still ``received``'s memory (an
    image batch passed through without conversion)."""
    if (
        received.device.type == "cuda"
        and moved.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    ):
        return moved.clone(memory_format=torch.preserve_format)
    return moved


def arrivals(
    loader: Iterable[Any], side: SideStream, move: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[InFlight]:
    """The loader's batches, decoded on the device by its workers, each ``move``-d (converted,
    normalised; labels copied) on ``side``'s stream into this process's memory, the shared
    memory let go once that work is done. Runs in the prefetch thread."""
    with side.current():  # (what persistent workers made for an epoch left early is let go as
        source = iter(loader)  # they start again: on the side stream, not the training one)
    try:
        while True:
            with side.current():
                try:
                    received = next(source)  # the side stream waits for the worker's decode
                except StopIteration:
                    return
                moved = map_tensors(received, lambda t: _own(move(t), t))
                done = torch.cuda.Event(blocking=True)
                done.record()
                done.synchronize()  # (asleep, without the interpreter lock)
                del received  # its release synchronises the side stream: nothing is left on it
            yield InFlight(moved, done)
    finally:
        if source is not getattr(loader, "_iterator", None):  # workers of this epoch only:
            stop_workers(source, side.device)  # they stop now, the batches they shared let go


def _sleep_while_waiting(index: int) -> bool:
    """Before this process's first CUDA call: ask the driver for a device context whose waits
    put the thread to sleep instead of spinning on a core (``CU_CTX_SCHED_BLOCKING_SYNC``).

    A worker spends most of a batch waiting for the decoders (nvImageCodec's call returns when
    the batch is decoded); spinning, that wait took a core. Best effort: without the driver's
    library, or once CUDA is set up here, nothing changes."""
    if torch.cuda.is_initialized():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), index) != 0:
            return False
        return bool(driver.cuDevicePrimaryCtxSetFlags_v2(device, CU_CTX_SCHED_BLOCKING_SYNC) == 0)
    except (OSError, AttributeError):  # no driver library, or one without the call
        return False


def release_shared(
    iterator: Any, device: torch.device | None = None, seconds: float = RELEASE_SECONDS
) -> None:
    """Before a loader's decoding workers stop: take the batches they have sent or are still
    making, and let them go, so that each worker's memory shared with this process is
    released before it exits (PyTorch warns on the worker's stderr otherwise).

    ``iterator`` is the DataLoader's multi-process iterator; a batch's release synchronises
    the stream current then on the batch's ``device``, here a fresh one with nothing on it.
    Bounded by ``seconds``."""
    deadline = time.monotonic() + seconds
    try:
        with torch.cuda.stream(torch.cuda.Stream(device=device)):
            info = getattr(iterator, "_task_info", {})
            for key in [k for k, v in info.items() if len(v) > 1]:
                del info[key]  # batches that came early, held for their turn
            while iterator._tasks_outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ok, data = iterator._try_get_data(timeout=min(left, 1.0))
                if ok:
                    iterator._tasks_outstanding -= 1
                    del data
    except Exception as exc:  # (a worker that failed, a PyTorch without these internals)
        log.debug("releasing the workers' shared batches: %s", exc)


def stop_workers(iterator: Any, device: torch.device) -> None:
    """Stop the workers of a DataLoader's iterator (none: nothing to do), the batches they
    shared with this process on ``device`` let go first (:func:`release_shared`)."""
    if hasattr(iterator, "_shutdown_workers"):  # (workers, not this process)
        release_shared(iterator, device)
        iterator._shutdown_workers()


class Probed:
    """A loader of workers that decode on CUDA as ``num_workers="auto"`` measures it: an
    iteration left in the middle (where the measurement stops) takes and lets go the batches
    the workers still share before they stop, as closing a loader does."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.dataloader)
        try:
            yield from iterator
        finally:
            stop_workers(iterator, self.dataloader.collate_fn.decoder.device)
