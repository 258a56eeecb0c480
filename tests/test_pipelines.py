import io
import random

import numpy as np
import pytest
from PIL import Image

from fastdata import LMDBImageDataset, convert
from fastdata.images.pipelines import EvalPipeline, TrainPipeline, sample_crop

from .conftest import jpeg_bytes, png_bytes, write


def coordinate_png(height: int, width: int) -> bytes:
    """A lossless image whose pixels encode their own position."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([y % 256, x % 256, (y // 256) * 16 + (x // 256)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("height, width", [(375, 500), (500, 375), (64, 48), (1000, 90), (30, 30)])
def test_crops_stay_inside_the_image(height: int, width: int) -> None:
    for seed in range(300):
        rng = random.Random(seed)
        top, left, h, w = sample_crop(rng, height, width, (0.08, 1.0), (3 / 4, 4 / 3))
        assert top >= 0 and left >= 0 and h > 0 and w > 0
        assert top + h <= height and left + w <= width


def test_crop_area_and_ratio_follow_the_ranges() -> None:
    areas, ratios = [], []
    for seed in range(500):
        _, _, h, w = sample_crop(random.Random(seed), 400, 400, (0.25, 0.5), (0.5, 2))
        areas.append(h * w / 160000)
        ratios.append(w / h)
    assert min(areas) >= 0.24 and max(areas) <= 0.51
    assert min(ratios) >= 0.49 and max(ratios) <= 2.05


@pytest.mark.parametrize(
    "data",
    [
        jpeg_bytes(500, 375),
        jpeg_bytes(1200, 900),
        jpeg_bytes(40, 30),
        png_bytes(100, 80),
        jpeg_bytes(300, 200, mode="CMYK"),
        jpeg_bytes(300, 200, mode="L"),
    ],
    ids=["jpeg", "large-jpeg-reduced-decode", "tiny-upscaled", "png", "cmyk", "gray"],
)
def test_shapes_and_dtypes(data: bytes) -> None:
    for pipeline in (TrainPipeline(96), EvalPipeline(96)):
        out = pipeline(data, 7)
        assert out.shape == (96, 96, 3) and out.dtype == np.uint8 and out.flags.c_contiguous


def test_same_seed_same_crop_different_seed_different_crop() -> None:
    data = jpeg_bytes(500, 375)
    p = TrainPipeline(64)
    assert np.array_equal(p(data, 1), p(data, 1))
    assert not all(np.array_equal(p(data, 1), p(data, s)) for s in range(2, 6))


def test_eval_takes_the_center() -> None:
    data = coordinate_png(300, 400)
    out = EvalPipeline(size=100, crop_pct=1.0)(data)  # short side 300 -> 100: central 300x300
    # the middle output pixel comes from the middle of the source
    y, x = int(out[50, 50, 0]), int(out[50, 50, 1]) + 256 * (int(out[50, 50, 2]) % 16)
    assert abs(y - 150) <= 3 and abs(x - 200) <= 3
    # the left edge of the output is the left edge of the central square (x = 50)
    assert abs(int(out[50, 0, 1]) - 50) <= 3


def test_train_crop_content_comes_from_inside_the_crop() -> None:
    data = coordinate_png(200, 240)
    p = TrainPipeline(size=50, scale=(0.2, 0.3), hflip=0.0)
    for seed in range(20):
        out = p(data, seed)
        top, left, h, w = sample_crop(random.Random(seed), 200, 240, p.scale, p.ratio)
        ys, xs = out[:, :, 0].astype(int), out[:, :, 1].astype(int)  # width 240 < 256
        assert top - 2 <= ys.min() and ys.max() <= top + h + 2
        assert left - 2 <= xs.min() and xs.max() <= left + w + 2


def test_flip_mirrors() -> None:
    data = coordinate_png(100, 100)
    unflipped = TrainPipeline(size=40, scale=(1, 1), ratio=(1, 1), hflip=0.0)(data, 3)
    flipped = TrainPipeline(size=40, scale=(1, 1), ratio=(1, 1), hflip=1.0)(data, 3)
    assert np.array_equal(flipped, unflipped[:, ::-1])


def smooth_jpeg(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_reduced_decode_matches_full_decode_closely() -> None:
    data = smooth_jpeg(1600, 1200)
    reduced = EvalPipeline(size=100, crop_pct=1.0)(data)  # decoded at 1/8 of 1600x1200
    # reference: full decode, short side to 100, central 100x100
    full = np.asarray(
        Image.open(io.BytesIO(data)).convert("RGB").resize((133, 100), Image.BILINEAR)
    )[:, 16:116]
    assert np.abs(reduced.astype(int) - full.astype(int)).mean() < 3


def test_dataset_uses_pipeline_unless_a_transform_is_given(good_folder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    convert(good_folder, tmp_path / "s.lmdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", pipeline=TrainPipeline(32))
    img, label = ds[(3, 99)]
    assert img.shape == (32, 32, 3) and label == 0
    assert np.array_equal(ds[(3, 99)][0], img)
    own = LMDBImageDataset(
        tmp_path / "s.lmdb", transform=lambda im: im.size, pipeline=TrainPipeline(32)
    )
    assert own[3][0] == (64, 48)  # the user's transform wins, on a PIL image


def test_corrupt_record_error_names_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write(tmp_path / "src" / "c" / "a.jpg", jpeg_bytes()[:-2])  # repaired on the way in
    convert(tmp_path / "src", tmp_path / "s.lmdb")
    ds = LMDBImageDataset(tmp_path / "s.lmdb", pipeline=EvalPipeline(16))
    assert ds[0][0].shape == (16, 16, 3)
