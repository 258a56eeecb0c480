import io
import random

import numpy as np
import pytest
from PIL import Image

from fastdata import LMDBImageDataset, convert
from fastdata.errors import CorruptImageError
from fastdata.images.codec import first_rows
from fastdata.images.decode import decode_array, image_size
from fastdata.images.pipelines import (
    CropPlan,
    EvalPipeline,
    TrainPipeline,
    _resize,
    shrink_for,
    render,
    sample_crop,
)

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


def photo_jpeg(width: int, height: int, seed: int = 0, **save: object) -> bytes:
    """A noisy image (every block differs, so rows decoded wrongly would show)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], -1)
    arr = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGB")
    mode = save.pop("mode", "RGB")
    if mode != "RGB":
        img = img.convert(str(mode))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


def whole_image_render(data: bytes, plan: CropPlan, fast: bool) -> np.ndarray:
    """What the pipelines do with every row of the image decoded."""
    shrink = shrink_for(plan.box[2], plan.box[3], *plan.out)
    img = decode_array(data, shrink=shrink, fast=fast, size=plan.full)
    y0, x0, y1, x1 = plan.pixels(img.shape[0], img.shape[1])
    return _resize(img[y0:y1, x0:x1], *plan.out, plan.flip)


# (width, height, Pillow's save options): 4:4:4, 4:2:2, 4:2:0 (MCUs of 8 and 16 rows), sizes
# that are not whole MCUs, grayscale, a sequential extended-Huffman frame is not made by Pillow
SEQUENTIAL = [
    (333, 500, {"subsampling": 0}),
    (500, 375, {"subsampling": 1}),
    (501, 377, {"subsampling": 2}),
    (1200, 900, {"subsampling": 2}),  # reduced by the decoder (1/2, 1/4) for small outputs
    (300, 257, {"mode": "L"}),
]


@pytest.mark.parametrize(("width", "height", "save"), SEQUENTIAL)
@pytest.mark.parametrize("fast", [True, False])
def test_decoding_down_to_the_crop_gives_the_pixels_of_the_whole_image(
    width: int, height: int, save: dict[str, object], fast: bool
) -> None:
    """A train crop decodes only the rows down to its bottom edge: the output is the same, pixel
    for pixel, as from the whole image decoded, in both decoder modes and at every scale."""
    data = photo_jpeg(width, height, **dict(save))
    assert first_rows(data, 1) is not None  # the short path is taken
    for size in (224, 96, 56):
        pipe = TrainPipeline(size, fast_decode=fast)
        for seed in range(40):
            plan = pipe.plan(data, seed)
            assert np.array_equal(render(data, plan, fast), whole_image_render(data, plan, fast))
    pipe2 = EvalPipeline(64, crop_pct=0.5, fast_decode=fast)
    plan = pipe2.plan(data)
    assert np.array_equal(pipe2(data), whole_image_render(data, plan, fast))


def test_only_the_rows_asked_for_are_declared() -> None:
    data = photo_jpeg(500, 375, subsampling=2)  # MCUs of 16 rows
    for rows in (16, 1, 17, 100, 352):
        cut = first_rows(data, rows)
        assert cut is not None
        short, declared = cut
        assert len(short) == len(data) and short != data
        top = decode_array(short)  # (the exact decoder mode, whose chroma needs the rows below)
        assert top.shape == (declared, 500, 3)
        assert np.array_equal(top[:rows], decode_array(data)[:rows])
        # whole MCU rows past the rows asked for, and one more (the upsampling's context)
        assert declared % 16 == 0 and rows + 16 <= declared < rows + 32
    assert first_rows(data, 352) is not None and first_rows(data, 353) is None  # no MCU row saved
    assert first_rows(memoryview(data), 100) == first_rows(data, 100)  # any buffer
    plan = TrainPipeline(64).plan(data, 3)
    assert np.array_equal(render(memoryview(data), plan, True), render(data, plan, True))  # type: ignore[arg-type]
    assert first_rows(data, 10_000) is None


def test_jpegs_whose_scan_cannot_end_early_are_decoded_whole() -> None:
    progressive = photo_jpeg(400, 300, progressive=True)
    cmyk = photo_jpeg(400, 300, mode="CMYK")
    sequential = photo_jpeg(400, 300)
    sof = sequential.index(b"\xff\xc0")
    sos = sequential.index(b"\xff\xda")
    # a height left to a DNL marker; a first scan that holds one of the three components
    dnl = sequential[: sof + 5] + b"\x00\x00" + sequential[sof + 7 :]
    one_of_three = sequential[: sos + 4] + b"\x01" + sequential[sos + 5 :]
    for data in (progressive, cmyk, dnl, one_of_three, png_bytes(), b"", b"\xff\xd8"):
        assert first_rows(data, 10) is None
    for data in (progressive, cmyk):
        pipe = TrainPipeline(64)
        for seed in range(5):
            plan = pipe.plan(data, seed)
            assert np.array_equal(render(data, plan, True), whole_image_render(data, plan, True))


def test_damaged_headers_never_make_a_short_decode_fail_otherwise() -> None:
    """Bytes flipped in the headers or the image cut anywhere: ``first_rows`` answers (a copy or
    None) without raising, and the pipeline gives what decoding the whole image gives: pixels,
    or a CorruptImageError naming the image."""
    data = photo_jpeg(200, 150, subsampling=2)
    head = data.index(b"\xff\xda") + 14
    rng = random.Random(7)
    plan = TrainPipeline(32).plan(data, 1)
    for _ in range(400):
        bad = bytearray(data[: rng.randint(2, len(data))])
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(2, min(head, len(bad)))
            bad[at] = rng.randrange(256)
        damaged = bytes(bad)
        cut = first_rows(damaged, rng.randint(0, 200))
        assert cut is None or len(cut[0]) == len(damaged)
        try:
            whole = whole_image_render(damaged, plan, True)
        except CorruptImageError:
            with pytest.raises(CorruptImageError):
                render(damaged, plan, True)
            continue
        except Exception:  # the whole-image path's own failures are not at stake here
            continue
        try:
            short = render(damaged, plan, True)
        except CorruptImageError:
            continue  # this damage shows only in the rows the short decode reads
        assert short.shape == whole.shape


def test_a_jpeg_whose_whole_decode_fails_after_the_scan_is_decoded_whole() -> None:
    """What follows the scan decides whether the whole image decodes (a second frame or scan, a
    second image's start, a marker libjpeg refuses): a crop gets what the whole image gets, for
    every seed, never pixels in one epoch and an error in the next."""
    data = photo_jpeg(320, 240, subsampling=2)
    body = data[:-2]
    for extra in (
        body[body.index(b"\xff\xc0") : body.index(b"\xff\xc0") + 19],  # a second SOF
        b"\xff\xd8",  # a second image's start (one whose end-of-image was cut off)
        b"\xff\x05\x00\x04\xab\xcd",  # a marker no JPEG has
        b"\xff\xc8\x00\x04\xab\xcd",
    ):
        bad = body + extra + b"\xff\xd9"
        assert first_rows(bad, 10) is None
        pipe = TrainPipeline(64)
        for seed in range(12):
            plan = pipe.plan(bad, seed)
            try:
                whole = whole_image_render(bad, plan, True)
            except CorruptImageError:
                with pytest.raises(CorruptImageError):
                    render(bad, plan, True)
            else:
                assert np.array_equal(render(bad, plan, True), whole)
    # restart markers and fill bytes before the end are a scan's own: the short path holds
    assert first_rows(body + b"\xff\xff\xd9", 10) is not None


def test_a_side_over_what_a_decoder_takes_is_decoded_whole() -> None:
    data = bytearray(photo_jpeg(64, 48))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 7] = (65535).to_bytes(2, "big")  # libjpeg refuses over 65,500
    assert first_rows(bytes(data), 10) is None


def test_headers_are_walked_within_a_bound_and_as_bytes_whatever_the_buffer() -> None:
    data = photo_jpeg(200, 150)
    sos = data.index(b"\xff\xda")
    fill = data[:sos] + b"\xff" * 100_000 + data[sos:]  # fill bytes before the scan
    assert first_rows(fill, 10) is None  # not walked one by one: decoded whole
    com = b"\xff\xfe" + (254).to_bytes(2, "big") + b"c" * 252  # a comment of 254 bytes first
    commented = data[:2] + com + data[2:]
    expected = first_rows(commented, 40)
    assert expected is not None
    as_array = np.frombuffer(commented, np.uint8)  # numpy's scalars would overflow as bytes
    assert first_rows(as_array, 40) == expected  # type: ignore[arg-type]


def test_a_subsampling_without_a_name_is_read_not_a_crash() -> None:
    """libjpeg-turbo's header reader names subsamplings; one it has no name for (luma 1x4,
    chroma 1x1) is still a JPEG: its size is read, and a pipeline decodes it or names it."""
    data = bytearray(photo_jpeg(64, 48, subsampling=0))
    sof = data.index(b"\xff\xc0")
    data[sof + 11] = 0x14  # the first component sampled 1x4 (its scan no longer fits: damaged)
    assert image_size(bytes(data)) == (48, 64)
    try:
        out = TrainPipeline(32)(bytes(data), 1)
    except CorruptImageError:
        pass
    else:
        assert out.shape == (32, 32, 3)


def test_a_decoder_failing_after_a_warning_leaves_no_memory_of_before_in_the_pixels() -> None:
    """libjpeg-turbo counts a failure after a warning as a warning, and a lenient decode then
    hands back rows it never wrote: they must be the same every time (black), never whatever
    the memory held (another image's pixels, freed)."""
    data = bytearray(photo_jpeg(96, 80))
    sos = data.index(b"\xff\xda")
    assert data[sos + 4] == 3
    data[sos + 6] = 0x68  # the first component's tables: none defined (a failure)
    data[sos + 12] = 0x12  # the scan's end of spectral selection, out of range (a warning)
    bad = bytes(data)
    plan = TrainPipeline(32).plan(bad, 5)
    outcomes = []
    for fill in (0x00, 0xAB, 0x55, 0xFF):
        np.full(96 * 80 * 3, fill, np.uint8)  # memory freed just before, holding something
        for run in (lambda: decode_array(bad), lambda: render(bad, plan, True)):
            try:
                outcomes.append(run().tobytes())
            except CorruptImageError:
                outcomes.append(b"refused")
    assert outcomes[0::2] == [outcomes[0]] * 4 and outcomes[1::2] == [outcomes[1]] * 4
