"""Generate a synthetic image folder, for the quick start, the benchmarks and ``fastdata bench``.

The images are JPEGs of smooth shapes with some texture, so their size and decode cost resemble
photographs (about 115 kB at 500x375 and quality 90) rather than flat colour or pure noise.
"""

from __future__ import annotations

import colorsys
import io
import os
from pathlib import Path

import numpy as np

__all__ = ["make_image_folder", "synthetic_jpeg"]


def synthetic_jpeg(
    width: int = 500,
    height: int = 375,
    *,
    seed: int = 0,
    quality: int = 90,
    hue: float | None = None,
) -> bytes:
    """One photograph-like JPEG (deterministic for a seed).

    With ``hue`` (0-1), its shapes take colours near that hue, which makes classes learnable.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / rng.uniform(20, 90) + rng.uniform(0, 6)),
            128 + 100 * np.cos(y / rng.uniform(20, 90) + rng.uniform(0, 6)),
            128 + 100 * np.sin((x + y) / rng.uniform(30, 120)),
        ],
        axis=-1,
    )
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(10, width // 2)), y0 + int(rng.integers(10, height // 2))
        if hue is None:
            fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        else:
            r, g, b = colorsys.hsv_to_rgb((hue + rng.normal(0, 0.02)) % 1.0, 0.9, 0.9)
            fill = (int(r * 255), int(g * 255), int(b * 255))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
    noise = rng.integers(-48, 49, (height, width, 3), dtype=np.int16)
    arr = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_image_folder(
    root: str | os.PathLike[str],
    *,
    classes: int = 10,
    per_class: int = 30,
    width: int = 500,
    height: int = 375,
    seed: int = 0,
) -> Path:
    """Write ``root/class_XX/img_XXXXX.jpg``, each class with shapes of its own hue; files already
    there are kept (the call is cheap the second time).

    Returns:
        The root folder.
    """
    out = Path(root)
    n = 0
    for c in range(classes):
        folder = out / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = folder / f"img_{i:05d}.jpg"
            if not path.exists():
                image = synthetic_jpeg(
                    width, height, seed=seed * 1_000_003 + n, hue=c / max(1, classes)
                )
                path.write_bytes(image)
            n += 1
    return out
