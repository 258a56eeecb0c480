"""Image sizes as timm takes them (an int or a pair) and timm's colour jitter, without
torchvision: deterministic per sample, and the same arithmetic as torchvision's on uint8."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.compat.timm import create_loader as timm_create_loader
from fastdata.images.pipelines import (
    EvalPipeline,
    TrainPipeline,
    color_jitter,
    draw_jitter,
    jitter_strengths,
    output_shape,
)

from .conftest import jpeg_bytes, write


@pytest.fixture
def store(tmp_path: Path) -> Path:
    for i in range(12):  # photos of mixed sizes
        write(
            tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(60 + 7 * i, 40 + 5 * i, seed=i)
        )
    dst = tmp_path / "s.lmdb"
    convert(tmp_path / "src", dst)
    return dst


def test_sizes_are_an_int_or_a_pair(store: Path) -> None:
    data = jpeg_bytes(90, 70)
    assert TrainPipeline(32)(data, seed=1).shape == (32, 32, 3)
    assert TrainPipeline((24, 40))(data, seed=1).shape == (24, 40, 3)
    assert EvalPipeline((24, 40))(data).shape == (24, 40, 3)
    assert EvalPipeline([30, 30])(data).shape == (30, 30, 3)  # type: ignore[arg-type]
    for bad in (0, -3, (1, 2, 3), "224", 2.5, (24, 0), True):
        with pytest.raises(ValueError, match="image size"):
            TrainPipeline(bad)  # type: ignore[arg-type]
    assert output_shape(7) == (7, 7)
    loader = create_loader(
        LMDBImageDataset(store), 4, image_size=(16, 24), num_workers=0, device="cpu", mean=None
    )
    images, _ = next(iter(loader))
    assert images.shape == (4, 3, 16, 24)


def reference_jitter(image: np.ndarray, ops: list[tuple[int, float]]) -> np.ndarray:
    """torchvision's uint8 arithmetic, written out with torch (torchvision is not needed)."""
    x = torch.from_numpy(image).permute(2, 0, 1)

    def gray(t: torch.Tensor) -> torch.Tensor:
        r, g, b = t.unbind(0)
        return (0.2989 * r + 0.587 * g + 0.114 * b).to(t.dtype).unsqueeze(0)

    def blend(a: torch.Tensor, b: torch.Tensor | float, ratio: float) -> torch.Tensor:
        return (ratio * a + (1.0 - ratio) * b).clamp(0, 255).to(a.dtype)

    for op, factor in ops:
        if op == 0:
            x = blend(x, torch.zeros_like(x), factor)
        elif op == 1:
            x = blend(x, torch.mean(gray(x).to(torch.float32)), factor)
        else:
            x = blend(x, gray(x), factor)
    return x.permute(1, 2, 0).numpy()


def test_the_jitter_is_torchvisions_arithmetic() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    for seed in range(20):
        ops = draw_jitter(random.Random(seed), (0.4, 0.4, 0.4))
        assert sorted(op for op, _ in ops) == [0, 1, 2]
        assert all(0.6 <= f <= 1.4 for _, f in ops)
        ours, theirs = color_jitter(image, ops), reference_jitter(image, ops)
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1  # float rounding only
    assert draw_jitter(random.Random(0), (0.0, 0.5, 0.0))[0][0] == 1  # only what has a strength
    assert jitter_strengths(0.4) == (0.4, 0.4, 0.4)
    assert jitter_strengths((0.1, 0.2, 0.3, 0.0)) == (0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="hue"):
        jitter_strengths((0.1, 0.2, 0.3, 0.1))
    with pytest.raises(ValueError, match=">= 0"):
        jitter_strengths(-0.1)


def test_the_jitter_depends_on_the_seed_alone() -> None:
    data = jpeg_bytes(80, 60)
    plain, jittered = TrainPipeline(32), TrainPipeline(32, color_jitter=0.4)
    a, b = jittered(data, seed=5), jittered(data, seed=5)
    assert np.array_equal(a, b)  # any worker, any time
    assert not np.array_equal(a, plain(data, seed=5))  # same crop, jittered
    never = TrainPipeline(32, color_jitter=0.4, color_jitter_prob=0.0)
    assert np.array_equal(never(data, seed=5), plain(data, seed=5))


def test_timms_default_jitter_is_applied_and_the_rest_is_logged(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = LMDBImageDataset(store)
    kw = dict(is_training=True, use_prefetcher=False, num_workers=0)
    with caplog.at_level(logging.WARNING):
        loader = timm_create_loader(ds, 32, 4, **kw)
    assert loader.dataloader.dataset.pipeline.color_jitter == (
        0.4,
        0.4,
        0.4,
    )  # timm's default, applied
    assert "not applied" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        loader = timm_create_loader(ds, 32, 4, auto_augment="rand-m9-mstd0.5", re_prob=0.25, **kw)
    assert "auto_augment" in caplog.text and "re_prob" in caplog.text
    assert (
        loader.dataloader.dataset.pipeline.color_jitter is None
    )  # as timm: AutoAugment replaces the jitter
    evaluation = timm_create_loader(ds, 32, 4, num_workers=0, use_prefetcher=False)
    assert isinstance(evaluation.dataloader.dataset.pipeline, EvalPipeline)
