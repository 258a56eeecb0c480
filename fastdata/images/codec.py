"""Pure functions on image bytes: sniff the format, validate a JPEG, repair its end-of-image marker.

Nothing here touches a path or the source folder: functions take bytes and return bytes or a result.

A JPEG is a chain of marker segments starting with SOI (``FF D8``). The entropy-coded data after a
start-of-scan (SOS) segment never contains a bare ``FF D9`` (every ``FF`` byte in it is followed by
``00`` or a restart marker), so the first ``FF D9`` after the first scan is the end-of-image (EOI)
marker. Anything after it (padding, appended data) is legal and left alone. A file whose headers are
complete but whose scan data runs to the end without EOI is *repairable* when its scan data is
whole: appending ``FF D9`` makes decoders accept it. Whether it is whole (or the file was cut short)
takes two looks (see ``decode.check_repaired``): its scan headers (``scans.read_scans``: a
file of several scans, progressive or one scan per component, may be cut between two of them,
and then decodes without a word, from fewer scans), and a decode (a scan cut short, its last
blocks missing). A file cut inside its headers, or one without SOI, is corrupt.
"""

from __future__ import annotations

import enum
import re

from ..errors import CorruptImageError

try:  # fastdata's own compiled module, where it is built, finds markers (64 bytes at a time)
    from . import _jpegwindow  # type: ignore[attr-defined]

    if getattr(_jpegwindow, "ABI", 1) < 2:  # (built from an older source: pip install again)
        _jpegwindow = None
except ImportError:
    _jpegwindow = None

__all__ = [
    "EOI",
    "JpegState",
    "SOI",
    "first_rows",
    "inspect_jpeg",
    "inspect_scan",
    "is_jpeg",
    "repair_if_cut",
    "repair_jpeg",
    "scan_end",
    "sniff",
]

SOI = b"\xff\xd8"
EOI = b"\xff\xd9"
SOS = 0xDA
# Markers that stand alone, without a length field: TEM, RST0-7, SOI, EOI.
STANDALONE = frozenset({0x01, *range(0xD0, 0xD8), 0xD8, 0xD9})
# Start-of-frame markers: C0 baseline and C1 extended sequential, Huffman-coded (the only ones
# whose scan can end early, see first_rows); C2 progressive, C3 lossless, C5-C7 differential,
# C9-CB and CD-CF arithmetic-coded (C4 DHT, C8 JPG and CC DAC are not frames).
_SEQUENTIAL = frozenset({0xC0, 0xC1})
OTHER_FRAMES = frozenset({0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
# The frames of one image (not hierarchical): sequential (Huffman or arithmetic-coded), lossless,
# and progressive ones; C5-C7 and CD-CF are the differential frames of a hierarchical image, after
# a DHP (DE) segment, which libjpeg does not decode.
ONE_FRAME = frozenset({0xC0, 0xC1, 0xC3, 0xC9, 0xCB})
PROGRESSIVE = frozenset({0xC2, 0xCA})
DHP = 0xDE


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
    state, reason, _ = inspect_scan(data)
    return state, reason


def inspect_scan(data: bytes) -> tuple[JpegState, str, int]:
    """:func:`inspect_jpeg`, and where the first scan's entropy-coded data starts (-1 where
    the state is CORRUPT), which :func:`scan_end` takes instead of walking the headers again."""
    start, reason = _first_scan(data)
    if start < 0:
        return JpegState.CORRUPT, reason, -1
    # Searching from the back finds the marker at once in the usual file that ends with it.
    if data.rfind(EOI, start) >= 0:
        return JpegState.OK, "", start
    return JpegState.MISSING_EOI, "end-of-image marker FF D9 missing", start


def _first_scan(data: bytes | memoryview) -> tuple[int, str]:
    """Where the first scan's entropy-coded data starts in the JPEG ``data`` (after its
    start-of-scan segment), and ""; or -1 and why there is none (not a JPEG, cut or damaged in
    its headers)."""
    n = len(data)
    if data[:2] != SOI:
        return -1, "not a JPEG (no start-of-image marker FF D8)"
    pos = 2
    while True:
        # Fill bytes (FF FF ...) may precede a marker.
        while pos < n and data[pos] == 0xFF and pos + 1 < n and data[pos + 1] == 0xFF:
            pos += 1
        if pos + 2 > n:
            return -1, f"truncated in its headers at byte {pos} (no image data)"
        if data[pos] != 0xFF:
            return -1, f"bad marker at byte {pos} (expected FF, found {data[pos]:02X})"
        marker = data[pos + 1]
        if marker == 0xD9:
            return -1, f"end-of-image at byte {pos} before any image data"
        if marker in STANDALONE:
            pos += 2
            continue
        if pos + 4 > n:
            return -1, f"truncated in its headers at byte {pos} (no image data)"
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2:
            return -1, f"bad segment length {length} at byte {pos}"
        end = pos + 2 + length
        if end > n:
            return -1, f"truncated in its headers at byte {pos} (no image data)"
        if marker == SOS:
            return end, ""
        pos = end


def scan_end(data: bytes | memoryview, start: int = -1) -> int:
    """Where the first scan's entropy-coded data ends in the JPEG ``data``: the offset of the
    marker after it (NOTE [ Scan ends ]); -1 where there is none (not a JPEG, no scan, or data
    that ends inside it). A conversion, an append and a copy record it in each JPEG record's
    header, so that a read that decodes only part of the image looks at two bytes, not the
    whole scan. ``start``: where that scan's data starts, where a walk of the headers found it
    already (:func:`inspect_scan`); -1: walked here. (About 4 us for a 100 kB JPEG just read,
    with the compiled module, and 1 us once its bytes are in the cache.)"""
    if start < 0:
        start, _ = _first_scan(data)
    if start < 0:
        return -1
    found = marker_after(data, start)
    return -1 if found is None else found


# NOTE [ Scan ends ]
# A read that decodes only the top rows (first_rows) or a window (fastdata.images.window) of a
# sequential JPEG must know that the marker after its first scan is the end of the image: a
# decoder that read the whole image could fail on anything else there, and the part decoded
# must get what the whole decode gets. Finding that marker means searching the scan's data, all
# the image's bytes. Every JPEG is read whole when it is stored anyway, so the conversion (and
# an append, and a copy from a store written before) records the marker's offset in the record's
# header as "scan_end" (records.RecordHeader); a read then looks at the two bytes there, which
# must be FF D9 and lie past the scan's start, or it decodes as without it. Records without it
# (stores written before, other tools' stores) are searched as before. `fastdata verify` checks
# each recorded offset against the bytes. With it, what a read does beside the decode depends
# on the headers' size, not the image's, except the CRC-32 that checks every read's bytes
# (scripts/bench_pipeline.py prints both).


def first_rows(data: bytes | memoryview, rows: int, scan_end: int = -1) -> tuple[bytes, int] | None:
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

    ``scan_end``: where the first scan ends as the record's header gives it (NOTE [ Scan ends ]);
    -1: searched.
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
        if marker in STANDALONE:
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
        elif marker in OTHER_FRAMES:
            return None
        elif marker == SOS:
            if frame is None or length < 3 or data[pos + 4] != frame[1]:
                return None
            at, _, mcu_rows = frame
            height = (data[at] << 8) | data[at + 1]
            declared = (-(-max(rows, 1) // mcu_rows) + 1) * mcu_rows
            if height == 0 or height > _MOST_SIDE or declared >= height:
                return None
            start = pos + 2 + length
            if scan_end < 0:
                after = marker_after(data, start)
                if after is None or data[after + 1] != 0xD9:
                    return None
            elif not (start <= scan_end < n - 1 and data[scan_end : scan_end + 2] == EOI):
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
_SEARCH_AS_ARRAY = 16 << 10
"""From this many bytes to search, :func:`marker_after` compares them as an array (2x the
pattern's speed on a 500x375 JPEG's 115 kB: 34 against 69 us; slower on a few kB)."""
_SEARCH_CHUNK = 256 << 10
"""Bytes compared at once (the comparison's memory: about 20x this at most, for a run of ``FF``)."""


def marker_after(data: bytes | memoryview, start: int) -> int | None:
    """Where the first marker at or after ``start`` begins (its ``FF``: an ``FF`` followed by
    anything but ``00``, a restart marker's ``D0``-``D7`` or more ``FF``), as the pattern
    :data:`_MARKER_AFTER_SCAN` finds it; None where there is none."""
    n = len(data)
    if _jpegwindow is not None:  # (in C: about 1 us for 100 kB in the cache)
        found_at: int = _jpegwindow.marker_after(data, start)
        return None if found_at < 0 else found_at
    if n - start < _SEARCH_AS_ARRAY:
        found = _MARKER_AFTER_SCAN.search(data, start)
        return None if found is None else found.start()
    import numpy as np

    a = np.frombuffer(data, np.uint8)
    for at in range(start, n - 1, _SEARCH_CHUNK):
        ff = np.flatnonzero(a[at : min(at + _SEARCH_CHUNK, n - 1)] == 0xFF)  # (each with a
        if len(ff):  # byte after it)
            after = a[ff + at + 1]
            marker = ff[(after != 0) & (after != 0xFF) & ((after < 0xD0) | (after > 0xD7))]
            if len(marker):
                return int(marker[0]) + at
    return None


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
