"""Which device decoders this machine has (:func:`available_backends`): nvImageCodec, imported
once per process with its C-level chatter held back (:func:`load_nvimgcodec`), and torchvision's
GPU JPEG decoder; the command that installs nvImageCodec for this torch's CUDA."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "available_backends",
    "has_torchvision_decode",
    "load_nvimgcodec",
    "nvimgcodec_install_hint",
]

BACKENDS: tuple[str, ...] = ("auto", "nvimgcodec", "torchvision", "cpu")
"""The names :class:`DeviceDecoder` takes for ``backend``."""


_import_lock = threading.Lock()
_nvimgcodec: list[Any] = []  # [module or None], filled once per process


def load_nvimgcodec() -> Any:
    """nvImageCodec's module, or None. Its import prints to the C-level stderr about every
    CUDA library it cannot find (all of them on a machine without CUDA, where its CPU backend
    still works): that output is held back, and the module's own errors come as exceptions."""
    with _import_lock:
        if not _nvimgcodec:
            # its decoders' messages (one or two per damaged image) go to the C-level stderr,
            # past logging's reach: off unless the user asks (we log one line per batch)
            os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
            saved = os.dup(2)
            try:
                with open(os.devnull, "wb") as devnull:
                    os.dup2(devnull.fileno(), 2)
                    try:
                        from nvidia import nvimgcodec
                    except Exception:  # not installed, or a build for another platform
                        nvimgcodec = None
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            _nvimgcodec.append(nvimgcodec)
        return _nvimgcodec[0]


def has_torchvision_decode() -> bool:
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception:  # not installed, or a build that does not load with this torch
        return False
    return True


def nvimgcodec_install_hint() -> str:
    """The command that installs nvImageCodec built for this torch's CUDA (12 or 13)."""
    import torch

    if (torch.version.cuda or "").split(".")[0] == "13":
        return "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (the gpu-cu13 extra)"
    return "pip install nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12 (the gpu extra)"


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can decode for ``device`` on this machine, best first (``cpu`` always
    last)."""
    import torch

    found = []
    if load_nvimgcodec() is not None:
        found.append("nvimgcodec")
    if torch.device(device).type == "cuda" and has_torchvision_decode():
        found.append("torchvision")
    return [*found, "cpu"]
