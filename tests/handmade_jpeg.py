"""A baseline JPEG written by hand, with what no encoder at hand writes: any sampling factors
(3x1 or 2x4 luma), a scan per component."""

from __future__ import annotations

import numpy as np

# the zigzag order of a block's 64 coefficients: by anti-diagonal, alternating direction
ZIGZAG = sorted(range(64), key=lambda i: (i // 8 + i % 8, (-1) ** (i // 8 + i % 8 + 1) * (i // 8)))
AC_SYMBOLS = [0x00, 0xF0] + [run << 4 | size for run in range(16) for size in range(1, 11)]


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def handmade_jpeg(
    rgb: np.ndarray, factors: list[tuple[int, int]], scans: list[list[int]] | None = None
) -> bytes:
    """A baseline JPEG of ``rgb`` (YCbCr) with any sampling factors ``factors`` (``(h, v)`` per
    component, the largest a multiple of each), which no encoder at hand writes: one flat
    quantisation table, and Huffman codes of one length per class (DC 4 bits, AC 8). ``scans``:
    the components of each scan (all in one by default)."""
    height, width = rgb.shape[:2]
    hmax, vmax = max(h for h, _ in factors), max(v for _, v in factors)
    mcu_w, mcu_h = 8 * hmax, 8 * vmax
    cols, rows = ceil(width, mcu_w), ceil(height, mcu_h)
    pad = ((0, rows * mcu_h - height), (0, cols * mcu_w - width), (0, 0))
    padded = np.pad(rgb.astype(np.float64), pad, "edge")
    r, g, b = padded[..., 0], padded[..., 1], padded[..., 2]
    planes = [
        0.299 * r + 0.587 * g + 0.114 * b,
        -0.168736 * r - 0.331264 * g + 0.5 * b + 128,
        0.5 * r - 0.418688 * g - 0.081312 * b + 128,
    ]
    n = np.arange(8)
    scale = np.sqrt(np.where(n == 0, 1 / 8, 2 / 8))[:, None]
    dct = scale * np.cos((2 * n + 1) * n[:, None] * np.pi / 16)
    coefs = []  # per component: (block rows, block cols, 64) quantised, zigzag order
    for plane, (h, v) in zip(planes, factors, strict=True):
        fy, fx = vmax // v, hmax // h
        small = plane.reshape(plane.shape[0] // fy, fy, plane.shape[1] // fx, fx).mean((1, 3))
        blocks = small.reshape(small.shape[0] // 8, 8, small.shape[1] // 8, 8).swapaxes(1, 2) - 128
        freq = np.einsum("ij,abjk,lk->abil", dct, blocks, dct)
        coefs.append(np.rint(freq.reshape(*freq.shape[:2], 64)[..., ZIGZAG] / 4).astype(int))
    bits: list[str] = []

    def put(value: int, size: int) -> None:
        if size:
            bits.append(format(value if value >= 0 else value + (1 << size) - 1, f"0{size}b"))

    def block(zz: np.ndarray, last: int) -> int:
        diff = int(zz[0]) - last
        size = abs(diff).bit_length()
        bits.append(format(size, "04b"))
        put(diff, size)
        run = 0
        for value in (int(x) for x in zz[1:]):
            if value == 0:
                run += 1
                continue
            while run > 15:
                bits.append(format(AC_SYMBOLS.index(0xF0), "08b"))
                run -= 16
            size = abs(value).bit_length()
            bits.append(format(AC_SYMBOLS.index(run << 4 | size), "08b"))
            put(value, size)
            run = 0
        if run:
            bits.append("00000000")  # EOB
        return int(zz[0])

    def entropy(scan: list[int]) -> bytes:
        bits.clear()
        last = [0] * len(factors)
        if len(scan) == 1:  # non-interleaved: the component's own blocks, row by row
            (c,) = scan
            h, v = factors[c]
            block_rows = ceil(ceil(height * v, vmax), 8)
            block_cols = ceil(ceil(width * h, hmax), 8)
            for y in range(block_rows):
                for x in range(block_cols):
                    last[c] = block(coefs[c][y, x], last[c])
        else:
            for my in range(rows):
                for mx in range(cols):
                    for c in scan:
                        h, v = factors[c]
                        for y in range(v):
                            for x in range(h):
                                last[c] = block(coefs[c][my * v + y, mx * h + x], last[c])
        text = "".join(bits)
        text += "1" * (-len(text) % 8)
        return bytes(int(text[i : i + 8], 2) for i in range(0, len(text), 8)).replace(
            b"\xff", b"\xff\x00"
        )

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    sof = bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes([len(factors)])
    for i, (h, v) in enumerate(factors):
        sof += bytes([i + 1, h << 4 | v, 0])
    dht = bytes([0x00]) + bytes([0, 0, 0, 12] + [0] * 12) + bytes(range(12))
    dht += bytes([0x10]) + bytes([0] * 7 + [len(AC_SYMBOLS)] + [0] * 8) + bytes(AC_SYMBOLS)
    out = b"\xff\xd8" + segment(0xDB, bytes([0]) + bytes([4] * 64)) + segment(0xC0, sof)
    out += segment(0xC4, dht)
    for scan in scans or [list(range(len(factors)))]:
        sos = bytes([len(scan)]) + b"".join(bytes([c + 1, 0]) for c in scan) + bytes([0, 63, 0])
        out += segment(0xDA, sos) + entropy(scan)
    return out + b"\xff\xd9"
