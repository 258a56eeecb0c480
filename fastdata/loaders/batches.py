"""Batches as nested structures: map a function over their tensors, move them to a device.

A batch may be a tensor, a tuple, list, namedtuple or mapping of batches, or any other object,
which is passed through untouched (strings, ints, None, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["default_device", "is_image_batch", "map_tensors", "record_stream", "to_device"]


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


def is_image_batch(t: torch.Tensor) -> bool:
    """Whether a tensor is a batch of images to normalise: uint8 and 4-D (N, C, H, W)."""
    return t.dtype == torch.uint8 and t.dim() == 4


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def record_stream(batch: Any, stream: Any) -> None:
    """Tie every tensor's memory to ``stream``: the allocator waits for its work before reuse."""
    map_tensors(batch, lambda t: t.record_stream(stream))
