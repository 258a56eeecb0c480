"""A JPEG's crop window decoded alone, by fastdata's own small compiled module
(``fastdata/images/_jpegwindow.c``, libjpeg-turbo's ``jpeg_skip_scanlines`` and
``jpeg_crop_scanline``): the rows above the window are skipped, the columns beside it cropped,
the rows below it never read. Built by ``pip install`` where a C compiler and the headers of
Python and libjpeg-turbo are found (Debian, Ubuntu: ``apt install gcc python3-dev libjpeg-dev``),
and never required: without it, or for a JPEG it does not take (progressive, arithmetic-coded,
CMYK, damaged: any warning), the pipelines decode as before (the whole image, or its top rows).

A window it decodes has the pixels of the same window of the whole image's decode, at the same
scale and with the same IDCT and upsampling (tests/test_window_decode.py checks it bit for bit,
and runs it under AddressSanitizer on damaged files). It takes only JPEGs that the whole decode
gives to libjpeg-turbo at exactly ``1/shrink`` (:func:`~fastdata.images.decode.turbo_scale`):
not where simplejpeg is missing or refuses the header (Pillow decodes those), nor images of a few
pixels that TurboJPEG decodes at another of its scales.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from .decode import decode_array, has_turbo, pixel_limit, turbo_scale

if TYPE_CHECKING:
    import numpy as np

try:
    from . import _jpegwindow  # type: ignore[attr-defined]
except ImportError:  # not built here: the pipelines decode as before
    _jpegwindow = None
_stale = _jpegwindow is not None and getattr(_jpegwindow, "ABI", 1) < 2
"""Built from an older source (its arguments differ): not used until pip builds it again."""
if _stale:
    _jpegwindow = None

__all__ = ["available", "decode_window", "describe", "set_enabled"]

log = logging.getLogger(__name__)

_enabled = [True]
_agrees: list[bool] = []  # [whether this machine's two libjpeg-turbos agree], checked once
_check_lock = threading.Lock()


def available() -> bool:
    """Whether crop windows are decoded alone in this process (never without simplejpeg: the
    pipelines' other path then decodes JPEGs with Pillow, whose pixels differ; nor where the
    system's libjpeg-turbo, which the module links, decodes otherwise than simplejpeg's own)."""
    return _jpegwindow is not None and _enabled[0] and has_turbo() and _libraries_agree()


def _libraries_agree() -> bool:
    """Whether windows of a few small JPEGs (three subsamplings, two scales, both IDCTs)
    decoded by the module are the same windows of simplejpeg's whole decodes: the module
    links the system's libjpeg-turbo, simplejpeg its own, and another version could round
    otherwise. Checked once per process (about a millisecond); where they differ, crops are
    decoded as without the module, said once in the log."""
    if _agrees:
        return _agrees[0]
    with _check_lock:
        if not _agrees:
            _agrees.append(_same_pixels())
            if not _agrees[0]:
                log.warning(
                    "fastdata's window decoder (%s) does not give the pixels simplejpeg's "
                    "libjpeg-turbo gives; crops are decoded whole instead",
                    _jpegwindow.version(),
                )
    return _agrees[0]


def _same_pixels() -> bool:
    import numpy as np
    import simplejpeg

    y, x = np.mgrid[0:40, 0:56]
    image = np.stack([x * 4, y * 6, (x * y) % 251], -1).astype(np.uint8)
    for subsampling in ("420", "422", "444"):
        data = simplejpeg.encode_jpeg(image, quality=85, colorsubsampling=subsampling)
        for shrink in (1, 2):
            for fast in (False, True):
                whole = decode_array(data, shrink=shrink, fast=fast)
                y1, x1 = whole.shape[0] - 3, whole.shape[1] - 5
                try:
                    raw = _jpegwindow.decode(data, shrink, 3, 5, y1, x1, fast, 1 << 20)
                except ValueError:
                    return False
                if raw is None:
                    return False
                window = np.frombuffer(raw, np.uint8).reshape(y1 - 3, x1 - 5, 3)
                if not np.array_equal(window, whole[3:y1, 5:x1]):
                    return False
    return True


def set_enabled(enabled: bool) -> bool:
    """Turn the window decode on or off in this process (forked workers inherit it; benchmarks
    compare the two paths); returns the setting before."""
    before, _enabled[0] = _enabled[0], enabled
    return before


def describe() -> str:
    """What decodes crop windows here, said for a person."""
    if _stale:
        return (
            "whole images or their top rows (fastdata's window decoder was built from an older "
            "source: run pip install -v -e . again in fastdata's checkout)"
        )
    if _jpegwindow is None:
        return (
            "whole images or their top rows (fastdata's window decoder is not built here: "
            "install a C compiler and the headers of Python and libjpeg-turbo, then run "
            "pip install -v -e . again in fastdata's checkout, which shows any build error)"
        )
    if not has_turbo():
        return (
            "whole images or their top rows (fastdata's window decoder matches libjpeg-turbo's "
            "pixels, and simplejpeg is missing: pip install simplejpeg)"
        )
    if not _libraries_agree():
        return (
            f"whole images or their top rows ({_jpegwindow.__name__}, linked to the system's "
            f"{_jpegwindow.version()}, does not give simplejpeg's pixels here)"
        )
    state = "" if _enabled[0] else ", turned off"
    return f"windows alone ({_jpegwindow.__name__}, {_jpegwindow.version()}{state})"


def decode_window(
    data: bytes | memoryview,
    shrink: int,
    box: tuple[int, int, int, int],
    fast: bool,
    scan_end: int = -1,
) -> np.ndarray | None:
    """The window ``box`` = ``(y0, x0, y1, x1)`` of the JPEG ``data`` decoded at ``1/shrink``
    (pixels of that scale): an ``h x w x 3`` uint8 array, or None where the window decoder does
    not take the image (the caller decodes it otherwise; a damaged image too). ``scan_end``: where
    its first scan ends as the record's header gives it (NOTE [ Scan ends ] in
    :mod:`~fastdata.images.codec`); -1: searched."""
    if not available() or not turbo_scale(data, shrink):  # the other path decodes it otherwise
        return None
    import numpy as np

    y0, x0, y1, x1 = box
    most = pixel_limit() or (1 << 62)
    try:
        raw = _jpegwindow.decode(data, shrink, y0, x0, y1, x1, fast, most, scan_end)
    except (ValueError, OverflowError):  # refused by libjpeg: the other path names the problem
        return None
    if raw is None:
        return None
    return np.frombuffer(raw, np.uint8).reshape(y1 - y0, x1 - x0, 3)
