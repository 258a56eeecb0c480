"""Pure functions on image bytes: sniff the format, validate a JPEG, repair its end-of-image marker.

Nothing here touches a path or the source folder: functions take bytes and return bytes or a result.

A JPEG is a chain of marker segments starting with SOI (``FF D8``). The entropy-coded data after a
start-of-scan (SOS) segment never contains a bare ``FF D9`` (every ``FF`` byte in it is followed by
``00`` or a restart marker), so the first ``FF D9`` after the first scan is the end-of-image (EOI)
marker. Anything after it (padding, appended data) is legal and left alone. A file whose headers are
complete but whose scan data runs to the end without EOI is *repairable* when its scan data is
whole: appending ``FF D9`` makes decoders accept it. Whether it is whole (or the file was cut short,
its last blocks missing) only a decode tells: see ``decode.check_repaired``. A file cut inside its
headers, or one without SOI, is corrupt.
"""

from __future__ import annotations

import enum
import re

from ..errors import CorruptImageError

__all__ = [
    "EOI",
    "JpegState",
    "SOI",
    "first_rows",
    "inspect_jpeg",
    "is_jpeg",
    "repair_if_cut",
    "repair_jpeg",
    "sniff",
]

SOI = b"\xff\xd8"
EOI = b"\xff\xd9"
_SOS = 0xDA
# Markers that stand alone, without a length field: TEM, RST0-7, SOI, EOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8), 0xD8, 0xD9})
# Start-of-frame markers: C0 baseline and C1 extended sequential, Huffman-coded (the only ones
# whose scan can end early, see first_rows); C2 progressive, C3 lossless, C5-C7 differential,
# C9-CB and CD-CF arithmetic-coded (C4 DHT, C8 JPG and CC DAC are not frames).
_SEQUENTIAL = frozenset({0xC0, 0xC1})
_OTHER_FRAMES = frozenset({0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def sniff(data: bytes | memoryview) -> str | None:
    """Return the image format the bytes hold, judged by their signature, or None.

    The result is one of ``jpeg png gif bmp tiff webp ppm pgm pbm`` (lower case); the file name's
    extension plays no part.
    """
    head = bytes(data[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head.startswith(b"BM"):
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if len(head) >= 3 and head[0:1] == b"P" and head[2:3] in (b" ", b"\n", b"\r", b"\t"):
        kind = head[1:2]
        if kind in (b"3", b"6"):
            return "ppm"
        if kind in (b"2", b"5"):
            return "pgm"
        if kind in (b"1", b"4"):
            return "pbm"
    return None


class JpegState(enum.Enum):
    """What :func:`inspect_jpeg` found."""

    OK = "ok"
    """SOI, complete headers, scan data and EOI (possibly followed by trailing bytes)."""
    MISSING_EOI = "missing-eoi"
    """Complete headers, and the end-of-image marker missing: repairable if the scan data is
    whole (a decode tells: ``decode.check_repaired``), not if the file was cut short."""
    CORRUPT = "corrupt"
    """No SOI, cut inside the headers, or no scan at all: not repairable."""


def inspect_jpeg(data: bytes) -> tuple[JpegState, str]:
    """Walk a JPEG's marker segments and report whether it is whole.

    Args:
        data: the file's bytes.

    Returns:
        The state and, for anything but OK, a short human-readable reason.
    """
    n = len(data)
    if not data.startswith(SOI):
        return JpegState.CORRUPT, "not a JPEG (no start-of-image marker FF D8)"
    pos = 2
    while True:
        # Fill bytes (FF FF ...) may precede a marker.
        while pos < n and data[pos] == 0xFF and pos + 1 < n and data[pos + 1] == 0xFF:
            pos += 1
        if pos + 2 > n:
            return JpegState.CORRUPT, f"truncated in its headers at byte {pos} (no image data)"
        if data[pos] != 0xFF:
            found = f"{data[pos]:02X}"
            return JpegState.CORRUPT, f"bad marker at byte {pos} (expected FF, found {found})"
        marker = data[pos + 1]
        if marker == 0xD9:
            return JpegState.CORRUPT, f"end-of-image at byte {pos} before any image data"
        if marker in _STANDALONE:
            pos += 2
            continue
        if pos + 4 > n:
            return JpegState.CORRUPT, f"truncated in its headers at byte {pos} (no image data)"
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2:
            return JpegState.CORRUPT, f"bad segment length {length} at byte {pos}"
        end = pos + 2 + length
        if end > n:
            return JpegState.CORRUPT, f"truncated in its headers at byte {pos} (no image data)"
        if marker == _SOS:
            break
        pos = end
    # `end` is where the first scan's entropy-coded data starts. Searching from the back finds
    # the marker at once in the usual file that ends with it.
    if data.rfind(EOI, end) >= 0:
        return JpegState.OK, ""
    return JpegState.MISSING_EOI, "end-of-image marker FF D9 missing"


def first_rows(data: bytes | memoryview, rows: int) -> tuple[bytes, int] | None:
    """The JPEG ``data`` declaring only its first rows: a copy whose frame header gives a height
    of at least ``rows`` (whole rows of MCUs, plus one row of MCUs so that the chroma upsampling
    of the last rows wanted sees the rows below them). A decoder then decodes only those rows,
    with the same pixels as in the whole image, and skips the rest of the scan: decoding the
    top of an image costs about its share of the rows.

    Returns the copy and the height it declares; None where that does not hold, or might not,
    or saves nothing: not a JPEG, or not a sequential Huffman-coded one (progressive, lossless,
    arithmetic-coded: a decoder must read every scan of those whole), not one or three
    components, a first scan that does not hold every component, anything but the end-of-image
    marker after that scan (a decoder that reads the whole image might fail there), a height
    left to a DNL marker, sides over a decoder's 65,500, headers that do not parse or take more
    than :data:`_MOST_STEPS` steps to walk, or ``rows`` within the last row of MCUs.
    """
    if not isinstance(data, bytes):
        data = bytes(data)  # (indexed as bytes, whatever buffer it came in)
    n = len(data)
    if not data.startswith(SOI):
        return None
    pos = 2
    frame: tuple[int, int, int] | None = None  # (offset of the height, components, MCU rows)
    for _ in range(_MOST_STEPS):
        if pos + 4 > n or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            if marker in (0xD8, 0xD9):
                return None
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2 or pos + 2 + length > n:
            return None
        if marker in _SEQUENTIAL:
            count = data[pos + 9] if length >= 8 else 0
            if frame is not None or count not in (1, 3) or length != 8 + 3 * count:
                return None
            factors = [data[pos + 11 + 3 * i] & 0x0F for i in range(count)]
            width = (data[pos + 7] << 8) | data[pos + 8]
            if min(factors) < 1 or width > _MOST_SIDE:
                return None
            frame = (pos + 5, count, 8 * max(factors))
        elif marker in _OTHER_FRAMES:
            return None
        elif marker == _SOS:
            if frame is None or length < 3 or data[pos + 4] != frame[1]:
                return None
            at, _, mcu_rows = frame
            height = (data[at] << 8) | data[at + 1]
            declared = (-(-max(rows, 1) // mcu_rows) + 1) * mcu_rows
            if height == 0 or height > _MOST_SIDE or declared >= height:
                return None
            after = _MARKER_AFTER_SCAN.search(data, pos + 2 + length)
            if after is None or data[after.end() - 1] != 0xD9:
                return None
            view = memoryview(data)
            short = b"".join((view[:at], declared.to_bytes(2, "big"), view[at + 2 :]))
            return short, declared
        pos += 2 + length
    return None


_MOST_STEPS = 256
"""Segments and fill bytes :func:`first_rows` walks before the scan, at most (a JPEG has a few
dozen; past that, the whole image is decoded, which skips them at the decoder's speed)."""
_MOST_SIDE = 65500
"""The largest side libjpeg decodes."""
_MARKER_AFTER_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
"""The first marker after a scan's entropy-coded data (in which every ``FF`` is followed by
``00``, a restart marker or more ``FF`` fill)."""


def repair_jpeg(data: bytes) -> tuple[bytes, bool]:
    """Append the end-of-image marker to a JPEG that lacks it.

    Returns:
        The (possibly) repaired bytes and whether a repair was made. Whole JPEGs, including those
        with trailing bytes after EOI, come back unchanged.

    Raises:
        CorruptImageError: the bytes are not a repairable JPEG (named ``<bytes>``; callers that know
            the file name re-raise with it).
    """
    state, reason = inspect_jpeg(data)
    if state is JpegState.OK:
        return data, False
    if state is JpegState.MISSING_EOI:
        return data + EOI, True
    raise CorruptImageError("<bytes>", reason)


def is_jpeg(data: bytes | memoryview) -> bool:
    """Whether the bytes start with a JPEG's start-of-image marker."""
    return bytes(data[:2]) == SOI


def repair_if_cut(data: bytes) -> tuple[bytes, bool]:
    """A JPEG that lacks only its end-of-image marker gets it appended; anything else comes back
    as it is (for readers of stores that other tools wrote, which must not refuse what they
    cannot judge). Returns the bytes and whether they were repaired."""
    if is_jpeg(data) and inspect_jpeg(data)[0] is JpegState.MISSING_EOI:
        return data + EOI, True
    return data, False
