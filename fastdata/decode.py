"""Encoded image bytes to pixels.

Decoding is where a data loader spends its time (reading the bytes costs about 1% of decoding
them), so this module keeps the path short: Pillow by default, and ``simplejpeg`` (libjpeg-turbo)
for JPEGs to numpy when it is installed (``pip install fastdata[turbo]``).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from .errors import CorruptImageError

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = ["decode_check", "decode_numpy", "decode_pil", "has_turbo"]

try:  # optional libjpeg-turbo decoder
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    _simplejpeg = None


def has_turbo() -> bool:
    """Whether the libjpeg-turbo JPEG decoder (``simplejpeg``) is available."""
    return _simplejpeg is not None


def _open(data: bytes | memoryview) -> Image.Image:
    from PIL import Image

    return Image.open(io.BytesIO(data))


def decode_pil(data: bytes | memoryview, name: str = "<bytes>") -> Image.Image:
    """Decode bytes into an RGB ``PIL.Image`` (grayscale, palette and CMYK are converted).

    Raises:
        CorruptImageError: the bytes cannot be decoded; the message names ``name``.
    """
    try:
        img = _open(data)
        img.load()
    except Exception as exc:
        raise CorruptImageError(name, f"cannot decode image: {exc}") from exc
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def decode_numpy(data: bytes | memoryview, name: str = "<bytes>") -> np.ndarray:
    """Decode bytes into an ``HxWx3`` uint8 RGB array.

    JPEGs go through libjpeg-turbo when ``simplejpeg`` is installed; everything else through Pillow.

    Raises:
        CorruptImageError: the bytes cannot be decoded; the message names ``name``.
    """
    import numpy as np

    if _simplejpeg is not None and bytes(data[:2]) == b"\xff\xd8":
        try:
            return _simplejpeg.decode_jpeg(data, colorspace="RGB")
        except (ValueError, RuntimeError):
            pass  # CMYK and a few other JPEGs are outside libjpeg-turbo's fast path: use Pillow
    return np.asarray(decode_pil(data, name))


def decode_check(data: bytes | memoryview, name: str) -> None:
    """Decode fully and discard the pixels: raise :class:`CorruptImageError` if that fails."""
    decode_pil(data, name)
