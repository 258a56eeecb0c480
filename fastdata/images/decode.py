"""Encoded image bytes to pixels: the only place that decodes an image or reads its size.

Decoding is where a data loader spends its time (reading the bytes costs about 1% of decoding
them), so this module keeps the path short: ``simplejpeg`` (libjpeg-turbo) for JPEGs when it is
installed (``pip install 'fastdata-images[turbo]'``), Pillow for everything else.

Every path reads the image's size from its header first and refuses an image that declares more
pixels than :func:`pixel_limit` before any decoder allocates for it: a 2 kB file can declare
60000 x 60000 pixels (10.8 GB decoded).

Decoding is lenient by default, as training wants (a JPEG whose scan data ends early still gives
an image); ``strict=True``, used by ``--verify-decode`` and ``verify --decode``, turns the
decoder's warnings about corrupt or missing scan data into errors. Pillow does not report them:
without libjpeg-turbo, :func:`decode_check` finds a JPEG cut short by decoding it twice (see
:func:`check_repaired`).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING

from ..errors import CorruptImageError
from .codec import EOI, first_rows
from .codec import is_jpeg as _is_jpeg
from .scans import read_scans

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = [
    "TRUNCATED",
    "check_repaired",
    "check_scans",
    "decode_array",
    "decode_check",
    "decode_numpy",
    "decode_pil",
    "decoder_name",
    "has_turbo",
    "image_size",
    "load_pillow",
    "pixel_limit",
    "set_pixel_limit",
    "turbo_scale",
]

log = logging.getLogger(__name__)

try:  # libjpeg-turbo, installed with fastdata; Pillow where no wheel exists
    import simplejpeg as _simplejpeg
except ImportError as _missing:  # pragma: no cover - a platform without a simplejpeg wheel
    _simplejpeg = None
    log.warning(
        "JPEGs are decoded with Pillow: libjpeg-turbo's decoder (simplejpeg) could not be "
        "imported (%s); pip install simplejpeg for the fast path and strict JPEG checks",
        _missing,
    )


def decoder_name() -> str:
    """The JPEG decoder in use, and how crops are decoded, for ``fastdata info`` and
    ``fastdata bench``."""
    from .window import describe  # (it reads this module's pixel limit)

    if _simplejpeg is not None:
        name = f"libjpeg-turbo (simplejpeg {getattr(_simplejpeg, '__version__', '?')})"
    else:
        name = "Pillow (simplejpeg missing: slower, and no strict JPEG checks)"
    return f"{name}; crops: {describe()}"


_limit: list[int | None] = [None]
"""The pixel limit set by :func:`set_pixel_limit` (one owner: this module; a forked worker
inherits it, a spawned one has the default)."""


def set_pixel_limit(limit: int | None) -> int | None:
    """Set the most pixels an image may declare, for this process; None follows Pillow's
    ``PIL.Image.MAX_IMAGE_PIXELS`` (about 89 million unless changed there; None there too means
    no limit). Returns the limit set before, so a caller can put it back."""
    before, _limit[0] = _limit[0], limit
    return before


def has_turbo() -> bool:
    """Whether the libjpeg-turbo JPEG decoder (``simplejpeg``) is available."""
    return _simplejpeg is not None


PILLOW_DEFAULT_LIMIT = 1024 * 1024 * 1024 // 4 // 3
"""Pillow's own ``MAX_IMAGE_PIXELS`` as it ships (what the limit is while nothing changed it)."""


def pixel_limit() -> int | None:
    """The pixel limit in force (see :func:`set_pixel_limit`)."""
    if _limit[0] is not None:
        return _limit[0]
    # Pillow's setting, if Pillow was imported (only then can anyone have changed it): a
    # conversion of JPEGs checks headers without importing Pillow at all. A module that another
    # thread is still importing may not have the setting yet, and nobody can have changed it.
    pil = sys.modules.get("PIL.Image")
    limit: int | None = getattr(pil, "MAX_IMAGE_PIXELS", PILLOW_DEFAULT_LIMIT)
    return limit


_pillow_loaded = threading.Event()
_pillow_lock = threading.Lock()


def _new_pillow_lock() -> None:
    """A forked child gets a lock of its own (the parent's may have been held by a thread
    that the child does not have)."""
    global _pillow_lock
    _pillow_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pillow_lock)


def load_pillow() -> None:
    """Import ``PIL.Image`` and register every file-format plugin, once per process.

    Threads decode side by side (a conversion's readers, a loader's background thread). Left to
    Pillow, the first image each thread opens imports ``PIL.Image`` and then its plugins (all of
    them for a file that is not one of the five common formats), and a thread can see a module
    that another is still importing: ``partially initialized module 'PIL.Image'``. So the first
    caller imports them all, in Pillow's own order, under a lock, and every other waits for it.
    """
    if _pillow_loaded.is_set():
        return
    with _pillow_lock:
        if not _pillow_loaded.is_set():
            from PIL import Image

            Image.preinit()  # the five common formats first, as Image.open tries them
            Image.init()  # then every other plugin, which Image.open would import later
            _pillow_loaded.set()


def _check_pixels(height: int, width: int, name: str) -> None:
    limit = pixel_limit()
    if limit is not None and height * width > limit:
        raise CorruptImageError(
            name,
            f"declares {width} x {height} pixels, over the limit of {limit} "
            "(fastdata.images.decode.set_pixel_limit); refused before decoding",
        )


def _open(data: bytes | memoryview, name: str) -> Image.Image:
    """Pillow's lazy image (header read, nothing decoded), checked against the pixel limit."""
    load_pillow()
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # the limit is checked below, with fastdata's message
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise CorruptImageError(
            name,
            f"declares more pixels than the limit of {pixel_limit()} "
            f"(fastdata.images.decode.set_pixel_limit); refused before decoding ({exc})",
        ) from None
    except Image.UnidentifiedImageError:  # (its text names a BytesIO's address: a reason
        # stored in the skipped list would differ from one run to the next)
        raise CorruptImageError(name, "cannot decode image: no image format Pillow knows") from None
    except Exception as exc:
        raise CorruptImageError(name, f"cannot decode image: {exc}") from exc
    _check_pixels(img.height, img.width, name)
    return img


def image_size(data: bytes | memoryview, name: str = "<bytes>") -> tuple[int, int]:
    """``(height, width)`` from the header, without decoding.

    Raises:
        CorruptImageError: no readable header, or more pixels than the limit.
    """
    if _simplejpeg is not None and _is_jpeg(data):
        try:
            h, w, _, _ = _simplejpeg.decode_jpeg_header(data)
        except (ValueError, KeyError):  # (KeyError: a subsampling it has no name for, 4:4:1)
            pass  # Pillow below reads it, or says what is wrong
        else:
            _check_pixels(int(h), int(w), name)
            return int(h), int(w)
    img = _open(data, name)
    return img.height, img.width


def _corrupt_scan(exc: ValueError) -> bool:
    """Whether libjpeg-turbo's error is about damaged data (not an unsupported feature)."""
    text = str(exc).lower()
    return "corrupt" in text or "premature" in text or "truncated" in text


TRUNCATED = "truncated JPEG: scan data ends early"
"""Why a JPEG cut short is refused: its scan data ends before its last blocks (a decoder fills
them with grey)."""


def _ends_early(exc: ValueError) -> bool:
    """Whether libjpeg-turbo's error says the scan data ended before the image did: it met a
    marker where the scan's next bits should be, or the end of the file."""
    text = str(exc).lower()
    return "premature end of data segment" in text or "premature end of jpeg file" in text


def decode_array(
    data: bytes | memoryview,
    name: str = "<bytes>",
    *,
    shrink: int = 1,
    fast: bool = False,
    strict: bool = False,
    size: tuple[int, int] | None = None,
) -> np.ndarray:
    """Decode bytes into an ``HxWx3`` uint8 RGB array, at ``1/shrink`` of the full size where
    the decoder can scale (JPEG: 2, 4 or 8, in the DCT domain).

    Args:
        data: the encoded image.
        name: what to call it in errors.
        shrink: a power of two; the result is at least ``1/shrink`` of each side.
        fast: libjpeg-turbo's fast integer IDCT and chroma upsampling.
        strict: a JPEG whose scan data is corrupt or ends early is an error.
        size: ``(height, width)`` as :func:`image_size` gave it for these bytes, when the
            caller has it already (the header is then not read twice).

    Raises:
        CorruptImageError: the bytes cannot be decoded, declare more pixels than the limit, or
            (``strict``) hold damaged scan data.
    """
    import numpy as np

    h, w = size if size is not None else image_size(data, name)
    if _simplejpeg is not None and _is_jpeg(data):
        try:
            return _turbo(data, (-(-h // shrink), -(-w // shrink)), shrink, fast, strict=strict)
        except (ValueError, RuntimeError) as exc:
            if strict and isinstance(exc, ValueError) and _corrupt_scan(exc):
                raise CorruptImageError(name, f"damaged JPEG data: {exc}") from None
            # JPEGs outside libjpeg-turbo's fast path: Pillow below
    img = _open(data, name)
    try:
        if shrink > 1 and img.format == "JPEG":
            img.draft("RGB", (-(-w // shrink), -(-h // shrink)))
        return np.array(img.convert("RGB"))  # a writable copy: torch takes it as it is
    except Exception as exc:
        raise CorruptImageError(name, f"cannot decode image: {exc}") from exc


def decode_top(
    data: bytes | memoryview,
    rows: int,
    *,
    shrink: int = 1,
    fast: bool = False,
    size: tuple[int, int],
    scan_end: int = -1,
) -> tuple[np.ndarray, int]:
    """Decode at least the first ``rows`` rows (counted at full size) of an image, leniently, at
    ``1/shrink`` of its size as :func:`decode_array` does; a JPEG whose scan can end early is
    decoded only that far (:func:`~fastdata.images.codec.first_rows`: the same pixels, for about
    that share of the time). ``size`` is ``(height, width)`` as :func:`image_size` gave it;
    ``scan_end``: where a JPEG's first scan ends as its record's header gives it (-1: searched).

    Returns:
        The pixels (the whole image, or only its top rows) and the height of the whole image
        decoded at that scale, so that a caller maps full-size rows to the array's as it would
        for the whole image.

    Raises:
        CorruptImageError: as :func:`decode_array`.
    """
    height, width = size
    cut = first_rows(data, rows, scan_end) if _simplejpeg is not None and width >= 8 else None
    if cut is not None:
        short, declared = cut
        want = (-(-declared // shrink), -(-width // shrink))
        try:  # (leniently: skipping the rest of the scan is a warning)
            img = _turbo(short, want, shrink, fast, strict=False)
        except (ValueError, RuntimeError):
            pass  # the whole image, below, says what is wrong
        else:
            # At the scale asked for (the only one that gives this width, the sides differing
            # by an eighth between scales), as the whole image would be decoded.
            if img.shape[:2] == want:
                return img, -(-height // shrink)
    img = decode_array(data, shrink=shrink, fast=fast, size=size)
    return img, img.shape[0]


def _turbo(
    data: bytes | memoryview, scaled: tuple[int, int], shrink: int, fast: bool, *, strict: bool
) -> np.ndarray:
    """libjpeg-turbo's decode at ``1/shrink`` (``scaled`` is the size that gives). Leniently,
    into zeros (as fast as into fresh memory, measured): a decoder that fails after a warning
    counts the failure as a warning too, and the rows it never wrote are then black, not
    whatever the memory held before (the pixels of another image, freed).

    Raises:
        ValueError, RuntimeError: as ``simplejpeg.decode_jpeg`` (strictly: at any warning).
    """
    import numpy as np

    return _simplejpeg.decode_jpeg(
        data,
        colorspace="RGB",
        fastdct=fast,
        fastupsample=fast,
        min_height=scaled[0] if shrink > 1 else 0,
        min_width=scaled[1] if shrink > 1 else 0,
        buffer=None if strict else np.zeros(scaled[0] * scaled[1] * 3, np.uint8),
        strict=strict,
    )


def turbo_scale(data: bytes | memoryview, shrink: int) -> bool:
    """Whether :func:`decode_array` decodes the JPEG ``data`` with libjpeg-turbo at exactly
    ``1/shrink`` (as libjpeg's ``scale_denom``), for a decoder of its own that must give the same
    pixels (:mod:`fastdata.images.window`). Not where simplejpeg is missing or refuses the header
    (sampling factors TurboJPEG has no subsampling for, such as 3x1 luma, or a warning in the
    headers): Pillow decodes those, with its own IDCT and upsampling. Nor where TurboJPEG decodes
    at another scale: it takes the largest of its n/8 factors that gives the size asked for,
    which for sides of a few pixels is not ``1/shrink`` (a 3 x 3 image at 1/2 is decoded at 3/4,
    the same 2 x 2 pixels). Costs a header read (about 2 us)."""
    if _simplejpeg is None:
        return False
    try:
        height, width, _, _ = _simplejpeg.decode_jpeg_header(data)
    except (ValueError, KeyError):  # (KeyError: a subsampling simplejpeg has no name for)
        return False
    if shrink == 1:
        return True
    larger = 8 // shrink + 1  # the next factor up, larger/8, must give a larger size
    return any(-(-side * larger // 8) > -(-side // shrink) for side in (int(height), int(width)))


def decode_pil(data: bytes | memoryview, name: str = "<bytes>") -> Image.Image:
    """Decode bytes into an RGB ``PIL.Image`` (grayscale, palette and CMYK are converted).

    Raises:
        CorruptImageError: the bytes cannot be decoded or declare more pixels than the limit;
            the message names ``name``.
    """
    img = _open(data, name)
    try:
        img.load()
    except Exception as exc:
        raise CorruptImageError(name, f"cannot decode image: {exc}") from exc
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def decode_numpy(data: bytes | memoryview, name: str = "<bytes>") -> np.ndarray:
    """Decode bytes into an ``HxWx3`` uint8 RGB array (leniently, as training wants).

    Raises:
        CorruptImageError: the bytes cannot be decoded; the message names ``name``.
    """
    return decode_array(data, name)


def decode_check(data: bytes | memoryview, name: str) -> None:
    """Decode fully and strictly, and discard the pixels.

    Without libjpeg-turbo, a JPEG is decoded twice (see :func:`check_repaired`): Pillow decodes
    scan data that ends early without a word.

    Raises:
        CorruptImageError: the image cannot be decoded, is over the pixel limit, or its scan data
            is corrupt or ends early (JPEGs).
    """
    pixels = decode_array(data, name, strict=True)
    if _simplejpeg is None and _is_jpeg(data) and _cut_short(data, name, pixels):
        raise CorruptImageError(name, "damaged JPEG data: its scan data ends early")


_FILLER = b"\xaa" * 256
"""Bits that a scan cut short decodes where its own are missing (no ``FF``: not a marker; their
first bit set, unlike the zeros a decoder puts in at the marker)."""


def check_scans(data: bytes | memoryview, name: str) -> None:
    """Check, from its scan headers alone, that a JPEG that lacked its end-of-image marker
    (``data``, the marker appended) was not cut between two of its scans: a progressive file
    must hold every bit of every coefficient of every component (a scan with Al 0 for each), a
    sequential or lossless one a scan for every component. A file cut there decodes without a
    word, from the scans it has (a progressive one blurred, its finer bits missing; another
    without the colour of the components missing), which no decode tells from a whole one.
    Costs a walk of the headers (:func:`~fastdata.images.scans.read_scans`); a file whose
    headers it cannot judge passes (the decode that follows judges it), unless they are too
    many to walk.

    Raises:
        CorruptImageError: ``truncated JPEG: progressive scans missing``, ``truncated JPEG:
            scans of some of its components missing``, ``truncated JPEG: ends inside a marker
            segment after its scan data``, or more marker segments than
            :data:`~fastdata.images.scans.MOST_SEGMENTS` (not judged, so not repaired).
    """
    scans = read_scans(data)
    why = scans.missing if scans is not None else None
    if why is not None:
        raise CorruptImageError(name, why)


def check_repaired(data: bytes, name: str) -> None:
    """Check that a JPEG that lacked its end-of-image marker (``data``, the marker appended)
    lacked nothing else. First its scan headers (:func:`check_scans`: a file cut between two
    scans), then a decode: a file missing only the marker decodes whole, every row of blocks
    present; a file cut inside a scan does not: libjpeg-turbo meets the marker where scan data
    should be and says so. Pillow does not, so there the image is decoded a second time with
    filler bits before the marker: a whole scan ends before them (the decoder skips them to the
    marker), a scan cut short decodes them into its missing blocks, and the pixels differ.
    Costs a decode (two without libjpeg-turbo); call it after :func:`image_size` (the pixel
    limit).

    Raises:
        CorruptImageError: scans missing (:func:`check_scans`), the scan data ends early
            (:data:`TRUNCATED`), or the image does not decode with the marker appended (a file
            cut inside the headers of a later scan).
    """
    check_scans(data, name)
    if _simplejpeg is not None:
        try:
            _simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
            return
        except ValueError as exc:
            if _ends_early(exc):
                raise CorruptImageError(name, TRUNCATED) from None
            if "extraneous bytes" in str(exc):
                return  # bytes after a whole scan, where the marker was missing: skipped
            raise CorruptImageError(
                name, f"does not decode with its end-of-image marker appended: {exc}"
            ) from None
        except (RuntimeError, KeyError):
            pass  # outside libjpeg-turbo's fast path: Pillow below
    if _cut_short(data, name):
        raise CorruptImageError(name, TRUNCATED)


def _cut_short(data: bytes | memoryview, name: str, pixels: np.ndarray | None = None) -> bool:
    """Whether Pillow decodes the JPEG ``data`` (which ends with its end-of-image marker) into
    other pixels with :data:`_FILLER` before the marker (``pixels``: its RGB pixels decoded
    already, if they were)."""
    import numpy as np

    raw = bytes(data)
    if not raw.endswith(EOI):
        return False
    whole = pixels if pixels is not None else _pillow_rgb(raw, name)
    try:
        filled = _pillow_rgb(raw[:-2] + _FILLER + EOI, name)
    except CorruptImageError:
        return True
    return not np.array_equal(whole, filled)


def _pillow_rgb(data: bytes, name: str) -> np.ndarray:
    import numpy as np

    img = _open(data, name)
    try:
        return np.asarray(img.convert("RGB"))
    except Exception as exc:
        raise CorruptImageError(name, f"cannot decode image: {exc}") from exc
