"""A JPEG's frame and scan headers, walked segment by segment (:func:`read_scans`): whether a
file whose scans come one after the other (progressive, or one per component) holds them all,
or was cut between two of them, which decodes without a word (see ``codec`` and
``decode.check_repaired``)."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import (
    DHP,
    ONE_FRAME,
    OTHER_FRAMES,
    PROGRESSIVE,
    SOI,
    SOS,
    STANDALONE,
    marker_after,
)

__all__ = ["MOST_SEGMENTS", "JpegScans", "ScanHeader", "read_scans"]


@dataclass(frozen=True)
class ScanHeader:
    """One start-of-scan (SOS) segment's fields, by their names in ITU T.81 (B.2.3).

    Attributes:
        components: the component identifiers the scan holds (Cs1..CsNs).
        ss: the first coefficient of the spectral band, in zig-zag order (Ss; 0 is DC).
        se: the last coefficient of the band (Se).
        ah: the bit position of the previous scan of the band (Ah; 0 in its first scan).
        al: the bit position of this scan (Al): the band's coefficients are whole once a scan
            with ``al`` 0 has been read.
    """

    components: tuple[int, ...]
    ss: int
    se: int
    ah: int
    al: int


_ALL_COEFFICIENTS = (1 << 64) - 1


@dataclass(frozen=True)
class JpegScans:
    """A JPEG's frame and the scans that follow it, as :func:`read_scans` found them.

    Attributes:
        frame: the start-of-frame marker's second byte (``0xC0`` baseline, ``0xC2``
            progressive, ...).
        components: the frame's component identifiers (C1..CNf).
        scans: every scan header, in file order.
        cut: the data ends inside or right after a marker segment that follows a scan (not
            at an end-of-image marker, nor in a scan's entropy-coded data).
        stopped: the walk stopped after :data:`MOST_SEGMENTS` steps, before the data's end.
    """

    frame: int
    components: tuple[int, ...]
    scans: tuple[ScanHeader, ...]
    cut: bool
    stopped: bool = False

    @property
    def progressive(self) -> bool:
        return self.frame in PROGRESSIVE

    @property
    def missing(self) -> str | None:
        """Why the scans do not make a whole image (``truncated JPEG: ...``), or None where
        they lack nothing.

        Progressive: every coefficient (DC, and AC 1 to 63) of every component of the frame
        must have been read to its last bit, by a scan with ``al`` 0. Otherwise (sequential,
        lossless): every component must have a scan (each may have its own). Data :attr:`cut`
        in a segment after its scans lacks that segment's end. A walk :attr:`stopped` early
        judges nothing: it lacks what it did not read. (Whether a scan's own data is whole only
        a decode tells.)
        """
        if self.stopped:
            most = MOST_SEGMENTS
            return f"more than {most} marker segments: too many to tell whether scans are missing"
        if self.progressive:
            read = dict.fromkeys(self.components, 0)  # (coefficient bits, per component)
            for scan in self.scans:
                if scan.al == 0 and scan.ss <= scan.se <= 63:
                    band = ((1 << (scan.se + 1)) - 1) ^ ((1 << scan.ss) - 1)
                    for c in scan.components:
                        if c in read:
                            read[c] |= band
            if any(bits != _ALL_COEFFICIENTS for bits in read.values()):
                return "truncated JPEG: progressive scans missing"
        else:
            scanned = {c for scan in self.scans for c in scan.components}
            if not scanned.issuperset(self.components):
                return "truncated JPEG: scans of some of its components missing"
        if self.cut:
            return "truncated JPEG: ends inside a marker segment after its scan data"
        return None


def read_scans(data: bytes | memoryview) -> JpegScans | None:
    """Walk every marker segment of the JPEG ``data``, scan after scan, to its end-of-image
    marker (or to the end of the data), and gather its frame's components and its scan headers.
    Each scan's entropy-coded data is skipped to the next marker: an ``FF`` followed by anything
    but ``00`` (a stuffed byte), a restart marker (``D0``-``D7``) or more ``FF`` fill.

    The work is bounded whatever the bytes say: at most :data:`MOST_SEGMENTS` segments, fill
    bytes and scans are walked (one step each; the entropy-coded data is skipped in one pass,
    in C; a walk that takes more steps stops there, :attr:`JpegScans.stopped`), and nothing is
    allocated by a field's say-so (a segment's fields are read only within the bytes that are
    there).

    Returns:
        The frame and scans, or None where they cannot be judged: not a JPEG, no frame before
        the first scan, a second frame or a hierarchical image (a DHP segment, differential
        frames), a segment that does not parse, or headers cut before the first scan (see
        :func:`inspect_jpeg`) or that take more steps than :data:`MOST_SEGMENTS` to reach it.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    n = len(data)
    if not data.startswith(SOI):
        return None
    pos = 2
    frame: int | None = None
    components: tuple[int, ...] = ()
    scans: list[ScanHeader] = []

    def found(cut: bool, stopped: bool = False) -> JpegScans | None:
        if frame is None or not scans:
            return None
        return JpegScans(frame, components, tuple(scans), cut, stopped)

    for _ in range(MOST_SEGMENTS):
        if pos + 2 > n:  # (the data ends after a segment, or in its last byte)
            return found(cut=True)
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
            continue
        if marker == 0xD9:
            return found(cut=False)
        if marker in STANDALONE:
            if marker == 0xD8:
                return None
            pos += 2
            continue
        if pos + 4 > n:
            return found(cut=True)
        length = (data[pos + 2] << 8) | data[pos + 3]
        end = pos + 2 + length
        if end > n:
            return found(cut=True)
        if length < 2:
            return None
        if marker in ONE_FRAME or marker in PROGRESSIVE:
            count = data[pos + 9] if length >= 8 else 0
            if frame is not None or count == 0 or length != 8 + 3 * count:
                return None
            frame = marker
            components = tuple(data[pos + 10 + 3 * i] for i in range(count))
        elif marker in OTHER_FRAMES or marker == DHP:
            return None
        elif marker == SOS:
            count = data[pos + 4] if length >= 3 else 0
            if frame is None or count == 0 or length != 6 + 2 * count:
                return None
            at = pos + 5 + 2 * count  # Ss, Se, then Ah and Al in one byte
            scans.append(
                ScanHeader(
                    components=tuple(data[pos + 5 + 2 * i] for i in range(count)),
                    ss=data[at],
                    se=data[at + 1],
                    ah=data[at + 2] >> 4,
                    al=data[at + 2] & 0x0F,
                )
            )
            after = marker_after(data, end)
            if after is None:  # (the data ends in the scan: no marker after it)
                return found(cut=False)
            pos = after
            continue
        pos = end
    return found(cut=False, stopped=True)


MOST_SEGMENTS = 4096
"""Segments, fill bytes and scans that :func:`read_scans` walks, at most (a progressive JPEG
has a few dozen: a scan, and a Huffman table or two before it, per band of each component)."""
