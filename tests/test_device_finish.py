"""The batched crop-reduce-resize of device decoding against the one-image operations it stands
for (torch's antialiased bilinear interpolation, a block average, a flip, the jitter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdata.images.device_finish import axis_weights, finish_batch, jitter_batch
from fastdata.images.device_finish import finish_one
from fastdata.images.pipelines import CropPlan, color_jitter


@pytest.mark.parametrize(("size", "out"), [(375, 224), (224, 224), (100, 224), (901, 224), (7, 3)])
def test_one_axis_is_torchs_antialiased_interpolation(size: int, out: int) -> None:
    x = torch.rand(1, 1, size, 5, dtype=torch.float64) * 255
    want = F.interpolate(x, size=(out, 5), mode="bilinear", antialias=True, align_corners=False)
    one = torch.tensor([1])
    w = axis_weights(torch.tensor([0]), torch.tensor([size]), one, out, size).double()
    got = w[0] @ x[0, 0]
    assert torch.allclose(got, want[0, 0], atol=0.01)  # a hundredth of a level


def test_the_window_and_the_block_average_are_in_the_weights() -> None:
    x = torch.rand(40, 3, dtype=torch.float64)
    # window rows 3..38 of 40, averaged over blocks of 4 (the last holds 3), then 9 -> 5 rows
    w = axis_weights(torch.tensor([3]), torch.tensor([38]), torch.tensor([4]), 5, 40).double()
    blocks = F.avg_pool1d(x[3:38].T.unsqueeze(0), 4, ceil_mode=True)[0]  # 3 x 9
    wide = blocks[None, :, :, None].expand(-1, -1, -1, 2)
    want = F.interpolate(wide, size=(5, 2), mode="bilinear", antialias=True)[0, :, :, 0].T
    assert torch.allclose(w[0] @ x, want, atol=1e-6)
    flipped = axis_weights(
        torch.tensor([3]), torch.tensor([38]), torch.tensor([4]), 5, 40, torch.tensor([True])
    ).double()
    assert torch.allclose(flipped[0] @ x, want.flip(0), atol=1e-6)


def _windows(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [(int(h), int(w)) for h, w in torch.randint(30, 700, (n, 2), generator=g)]
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def test_a_batch_is_each_image_finished_alone() -> None:
    from fastdata.images.pipelines import shrink_for

    out = (224, 224)
    windows = _windows(1, 12)
    rng = np.random.default_rng(3)
    flips = [bool(f) for f in rng.integers(0, 2, len(windows))]
    jitter = [
        tuple((int(op), float(f)) for op, f in zip(rng.permutation(3), rng.uniform(0.6, 1.4, 3)))
        if i % 3
        else ()
        for i in range(len(windows))
    ]
    boxes = [(0, 0, int(w.shape[1]), int(w.shape[2])) for w in windows]
    shrink = [shrink_for(b[2], b[3], *out) for b in boxes]
    got = finish_batch(windows, boxes, shrink, out, flips, jitter)
    assert got.shape == (len(windows), 3, *out) and got.dtype == torch.uint8
    for i, window in enumerate(windows):
        plan = CropPlan(tuple(window.shape[1:]), (0, 0, 1, 1), out, flips[i], jitter[i])
        want = finish_one(window, plan)
        diff = (got[i].int() - want.int()).abs()
        # the one-image path truncates a block average that needs no resize; rounding apart,
        # the two agree
        assert float(diff.float().mean()) < 0.6, (i, window.shape, float(diff.float().mean()))
        assert int(diff.max()) <= (255 if jitter[i] else 1), (i, window.shape)


def test_the_jitter_of_a_batch_is_each_images_own() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    ops = [((0, 1.3), (1, 0.7), (2, 0.5)), (), ((2, 1.4), (0, 0.8)), ((1, 1.2),)]
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float()
    got = jitter_batch(x, ops).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i in range(4):
        want = color_jitter(images[i], ops[i]) if ops[i] else images[i]
        assert np.abs(got[i].astype(int) - want.astype(int)).max() <= 1


def test_the_same_batch_gives_the_same_bits() -> None:
    windows = _windows(7, 6)
    boxes = [(0, 0, int(w.shape[1]), int(w.shape[2])) for w in windows]
    args = (windows, boxes, [1, 2, 1, 2, 1, 1], (64, 48), [True] * 6, [()] * 6)
    assert torch.equal(finish_batch(*args), finish_batch(*args))
