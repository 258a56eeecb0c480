"""A batch of decoded windows of different sizes cropped, reduced, resized, flipped and jittered
with a handful of batched tensor operations, whatever the number of images.

Resizing one image at a time costs about ten small device operations per image (a float copy,
a block average, an antialiased interpolation, rounding, a flip, the jitter): at 256 images a
batch that is thousands of kernel launches, each a few microseconds of Python in the process
that also runs the training loop. Here the whole batch is two matrix products:

- each axis of each image becomes one ``out x padded`` matrix ``W`` that does, in one linear
  map, what :mod:`fastdata.images.device_decode` did in steps: keep the window, average ``k``
  pixels (the reduction the CPU path gets from decoding at 1/k, ``k`` by the CPU path's rule),
  and resample with the triangle filter of ``torch.nn.functional.interpolate(mode="bilinear",
  antialias=True)`` (PIL's ``ImagingResample``), its rows reversed for a flip;
- the images are copied once into one zero-offset padded ``N x 3 x H x W`` buffer, and the
  batch is ``Wy @ X @ Wx^T``;
- the colour jitter runs over the batch, each image's ops drawn in its own order.

Pixels agree with the one-image path to float rounding (a level, rarely, where a value lies at
.5); the same batch gives the same bits every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import pipelines

if TYPE_CHECKING:
    import torch

    from .pipelines import CropPlan

__all__ = [
    "PAD",
    "STRIP_ROWS",
    "axis_weights",
    "chunks",
    "finish_batch",
    "finish_one",
    "jitter_batch",
    "reduce_window",
]

STRIP_ROWS = 32
"""Output rows of a window reduced at a time before its resize (see :func:`reduce_window`)."""
PAD = 64
"""The padded batch's sides are multiples of this."""


def axis_weights(
    lo: torch.Tensor,
    hi: torch.Tensor,
    k: torch.Tensor,
    out: int,
    size: int,
    flip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per image, the ``out x size`` matrix that maps a padded axis of ``size`` pixels to the
    ``out`` pixels of the output: the window ``[lo, hi)`` averaged over blocks of ``k`` pixels
    (the last block holds what is left), then resampled as an antialiased bilinear
    interpolation does; reversed where ``flip``.

    Args:
        lo, hi, k: int64 tensors of ``N`` values on one device (``0 <= lo < hi <= size``,
            ``k >= 1``).
        out: the output's side.
        size: the padded axis' length.
        flip: bool tensor of ``N`` values, or None.

    Returns:
        float32 ``N x out x size``.
    """
    import torch

    device = lo.device
    length = hi - lo
    reduced = (length + k - 1) // k  # as avg_pool2d(ceil_mode=True) leaves it
    # (every temporary is N x out x size: sizes the padding keeps few, whatever the windows)
    most = size
    # the triangle filter over the reduced axis, as upsample_bilinear2d_aa computes it
    scale = reduced.to(torch.float32) / out
    support = torch.where(scale >= 1, scale, torch.ones_like(scale))
    inverse = 1 / support
    centre = scale[:, None] * (torch.arange(out, device=device, dtype=torch.float32) + 0.5)
    r = torch.arange(most, device=device, dtype=torch.float32)
    x = (r[None, None, :] + 0.5 - centre[:, :, None]) * inverse[:, None, None]
    a = (1 - x.abs()).clamp_(min=0)
    a *= r[None, None, :] < reduced[:, None, None]
    a /= a.sum(dim=2, keepdim=True)
    # composed with the block average: input pixel j is in block (j - lo) // k of the window
    j = torch.arange(size, device=device)
    block = (j[None, :] - lo[:, None]).div(k[:, None], rounding_mode="floor")
    inside = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    counts = (length[:, None] - block * k[:, None]).clamp(max=k[:, None]).clamp(min=1)
    block = block.clamp(0, most - 1)
    w = a.gather(2, block[:, None, :].expand(-1, out, -1))
    w *= (inside / counts)[:, None, :]
    if flip is not None:
        w = torch.where(flip[:, None, None], w.flip(1), w)
    return w


def jitter_batch(x: torch.Tensor, ops: Sequence[Sequence[tuple[int, float]]]) -> torch.Tensor:
    """``x`` (float32 ``N x 3 x H x W``, whole numbers 0-255) with each image's colour jitter
    ops applied in its own order, as :func:`fastdata.images.pipelines.color_jitter` applies
    them to one image (blend, clamp, truncate after each)."""
    import torch

    steps = max((len(o) for o in ops), default=0)
    if not steps:
        return x
    n = x.shape[0]
    kind = torch.zeros((steps, n), dtype=torch.int64)
    factor = torch.ones((steps, n), dtype=torch.float32)
    rest = torch.zeros((steps, n), dtype=torch.float32)  # 1 - factor, rounded once as there
    for i, image_ops in enumerate(ops):
        for s, (op, f) in enumerate(image_ops):
            kind[s, i], factor[s, i], rest[s, i] = op, f, 1 - f
    kind, factor, rest = (t.to(x.device, non_blocking=True) for t in (kind, factor, rest))
    shape = (n, 1, 1, 1)
    for s in range(steps):
        gray = (x[:, 0] * 0.2989 + x[:, 1] * 0.587 + x[:, 2] * 0.114).floor_().unsqueeze(1)
        mean = gray.mean(dim=(2, 3), keepdim=True)
        which = kind[s].view(shape)
        other = torch.where(
            which.eq(0), torch.zeros_like(gray), torch.where(which.eq(1), mean, gray)
        )
        x = (factor[s].view(shape) * x + rest[s].view(shape) * other).clamp_(0, 255).floor_()
    return x


def finish_batch(
    windows: Sequence[torch.Tensor],
    boxes: Sequence[tuple[int, int, int, int]],
    shrink: Sequence[int],
    out: tuple[int, int],
    flips: Sequence[bool],
    jitter: Sequence[Sequence[tuple[int, float]]],
) -> torch.Tensor:
    """Windows of decoded images resized to ``out`` together: ``N x 3 x H x W`` uint8.

    Args:
        windows: per image a ``3 x h x w`` uint8 tensor (a view is fine), on one device.
        boxes: per image ``(y0, x0, y1, x1)``: the part of its tensor kept (the whole tensor
            where the decoder cut the window already).
        shrink: per image the block size ``k`` of the reduction before the resize.
        out: ``(height, width)`` of the output.
        flips: per image, flip horizontally.
        jitter: per image its colour jitter ops (empty for none).
    """
    import torch

    device = windows[0].device
    n = len(windows)
    # padded to a multiple of PAD: batch after batch the buffers have few sizes, which the
    # device's caching allocator reuses instead of reserving more
    rows = -(-max(y1 - y0 for y0, _, y1, _ in boxes) // PAD) * PAD
    cols = -(-max(x1 - x0 for _, x0, _, x1 in boxes) // PAD) * PAD
    padded = torch.empty((n, 3, rows, cols), dtype=torch.uint8, device=device)
    for i, (window, (y0, x0, y1, x1)) in enumerate(zip(windows, boxes, strict=True)):
        padded[i, :, : y1 - y0, : x1 - x0].copy_(window[:, y0:y1, x0:x1])
    heights = torch.tensor([b[2] - b[0] for b in boxes], dtype=torch.int64)
    widths = torch.tensor([b[3] - b[1] for b in boxes], dtype=torch.int64)
    ks = torch.tensor(list(shrink), dtype=torch.int64)
    flip = torch.tensor(list(flips), dtype=torch.bool)
    heights, widths, ks, flip = (
        t.to(device, non_blocking=True) for t in (heights, widths, ks, flip)
    )
    zero = torch.zeros_like(heights)
    wy = axis_weights(zero, heights, ks, out[0], rows)
    wx = axis_weights(zero, widths, ks, out[1], cols, flip)
    # padding is never read: its weights are zero, and uint8 holds no NaN
    x = torch.matmul(wy[:, None], padded.to(torch.float32))
    x = torch.matmul(x, wx.transpose(1, 2)[:, None])
    x = x.round_().clamp_(0, 255)
    x = jitter_batch(x, jitter)
    return x.to(torch.uint8)


def finish_one(region: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """A decoded window (``3 x h x w`` uint8) resized to the plan's output, flipped and
    jittered: ``3 x H x W`` uint8."""
    import torch
    import torch.nn.functional as F

    x = reduce_window(region, plan.out).unsqueeze(0)
    if tuple(x.shape[2:]) != plan.out:
        x = F.interpolate(x, size=plan.out, mode="bilinear", antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255)
    x = x[0]
    if plan.flip:
        x = x.flip(2)
    for op, factor in plan.jitter:  # as pipelines.color_jitter, on the device
        if op == 0:
            other: torch.Tensor | float = 0.0
        else:
            gray = (x[0] * 0.2989 + x[1] * 0.587 + x[2] * 0.114).floor_()
            other = gray.mean() if op == 1 else gray.unsqueeze(0)
        x = (factor * x + (1 - factor) * other).clamp_(0, 255).floor_()
    return x.to(torch.uint8)


def reduce_window(region: torch.Tensor, out: tuple[int, int]) -> torch.Tensor:
    """``region`` (``3 x h x w`` uint8) as float32, averaged over ``k x k`` blocks first where it
    is at least twice the output (as the CPU path decodes such a crop at 1/k of its size), a
    strip of rows at a time: the float copy of a large window is never made whole."""
    import torch
    import torch.nn.functional as F

    _, h, w = region.shape
    k = pipelines.shrink_for(h, w, *out)  # the CPU path's rule
    if k == 1:
        return region.to(torch.float32)
    rows = STRIP_ROWS * k
    strips = [
        F.avg_pool2d(region[:, y : y + rows].to(torch.float32).unsqueeze(0), k, ceil_mode=True)[0]
        for y in range(0, h, rows)
    ]
    return torch.cat(strips, dim=1)


def chunks(items: list[tuple[int, Any]], budget: int) -> list[list[tuple[int, Any]]]:
    """``(position, 3 x h x w window)`` items cut into runs whose padded size (count x largest
    height x largest width) stays within ``budget`` pixels, taken in order of size so that
    windows padded together are alike."""
    ordered = sorted(items, key=lambda item: int(item[1].shape[1]) * int(item[1].shape[2]))
    chunks: list[list[tuple[int, Any]]] = []
    rows = cols = 0
    for item in ordered:
        h, w = int(item[1].shape[1]), int(item[1].shape[2])
        grown_rows, grown_cols = max(rows, h), max(cols, w)
        if chunks and (len(chunks[-1]) + 1) * grown_rows * grown_cols <= budget:
            chunks[-1].append(item)
            rows, cols = grown_rows, grown_cols
        else:
            chunks.append([item])
            rows, cols = h, w
    for chunk in chunks:  # back in batch order: contiguous places are written as one slice
        chunk.sort(key=lambda item: item[0])
    return chunks
