"""Check that bytes hold a usable image: its real format sniffed, a JPEG's markers checked (and
its missing end-of-image marker repaired), its header read within the pixel limit, and, when
asked, the whole image decoded. Pure: bytes in, bytes out."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptImageError
from .codec import EOI, JpegState, inspect_scan, scan_end, sniff
from .decode import check_repaired, decode_check, image_size

__all__ = ["CheckedImage", "validate_image"]


@dataclass(frozen=True)
class CheckedImage:
    """Bytes that passed :func:`validate_image`.

    Attributes:
        data: the bytes to store: the original, with ``FF D9`` appended when ``repaired``.
        format: the format sniffed from the bytes (``jpeg``, ``png``, ...).
        repaired: whether the end-of-image marker was appended.
        scan_end: for a JPEG, where its first scan ends in ``data`` (the offset of the marker
            after it: :func:`~.codec.scan_end`), which its record's header keeps; -1 otherwise.
    """

    data: bytes
    format: str
    repaired: bool
    scan_end: int = -1


def validate_image(data: bytes, name: str, *, decode: bool = False) -> CheckedImage:
    """Check that bytes hold an image, repairing a JPEG's missing end-of-image marker.

    Only a JPEG that lacks nothing but its end-of-image marker is repaired: one cut short (its
    scan data ends before its last blocks) is refused as :data:`~.decode.TRUNCATED`, which
    costs a decode of each JPEG that lacks the marker.

    Args:
        data: the image file's bytes.
        name: what to call the image in errors (its relative path).
        decode: also decode the image fully and strictly (slower, catches damaged pixel data);
            without it only the header is read, for the image's size.

    Returns:
        The bytes to store, their format and whether they were repaired.

    Raises:
        CorruptImageError: empty bytes, an unknown format, a JPEG that cannot be repaired (cut
            inside its headers, or short of scan data), a header that cannot be read or
            declares more pixels than the limit, or (with ``decode``) bytes that cannot be
            decoded.
    """
    if not data:
        raise CorruptImageError(name, "empty file (0 bytes)")
    fmt = sniff(data)
    if fmt is None:
        raise CorruptImageError(name, "not a recognised image format")
    repaired, start = False, -1
    if fmt == "jpeg":
        state, reason, start = inspect_scan(data)
        if state is JpegState.CORRUPT:
            raise CorruptImageError(name, reason)
        if state is JpegState.MISSING_EOI:
            data, repaired = data + EOI, True
    if repaired or not decode:
        image_size(data, name)  # a readable header, within the pixel limit
    if repaired:
        check_repaired(data, name)
    if decode:
        decode_check(data, name)
    return CheckedImage(data, fmt, repaired, scan_end(data, start) if fmt == "jpeg" else -1)
