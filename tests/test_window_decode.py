"""The crop window decoded alone (fastdata/images/_jpegwindow.c): bit for bit the same window of
the whole image's decode, at every scale, subsampling and IDCT; what it does not take left to
the other path; the pipelines' pixels unchanged; and no memory error on damaged files under
AddressSanitizer."""

from __future__ import annotations

import importlib
import io
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.images import decode, window
from fastdata.images.decode import decode_array, decoder_name
from fastdata.images.pipelines import EvalPipeline, TrainPipeline
from fastdata.images.synthetic import synthetic_jpeg

from .handmade_jpeg import handmade_jpeg
from .procs import run_script

SOURCE = Path(window.__file__).with_name("_jpegwindow.c")

built = pytest.mark.skipif(
    not window.available(),
    reason="fastdata's window decoder is not built here (a C compiler and libjpeg-turbo's headers)",
)


def photo(width: int, height: int, seed: int, **save: object) -> bytes:
    """A JPEG of smooth noise (detail at every scale), saved with Pillow's ``save`` options."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    if save.pop("grey", False):
        img = img.convert("L")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **save)  # type: ignore[arg-type]
    return buf.getvalue()


def corpus() -> list[bytes]:
    images = [synthetic_jpeg(500, 375, seed=1)]
    for subsampling in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
        for i, (w, h) in enumerate(((333, 250), (17, 9), (97, 203), (640, 481))):
            images.append(photo(w, h, seed=10 * subsampling + i, subsampling=subsampling))
    images.append(photo(300, 200, seed=7, grey=True))
    images.append(photo(250, 170, seed=8, restart_marker_rows=1))  # restart markers
    return images


@built
def test_a_window_is_the_same_window_of_the_whole_decode_bit_for_bit() -> None:
    rng = random.Random(5)
    checked = 0
    for data in corpus():
        for shrink in (1, 2, 4, 8):
            for fast in (False, True):
                whole = decode_array(data, shrink=shrink, fast=fast)
                rows, cols = whole.shape[:2]
                boxes = [(0, 0, rows, cols)]  # the whole image is a window too
                for _ in range(5):
                    y0, x0 = rng.randrange(rows), rng.randrange(cols)
                    boxes.append(
                        (y0, x0, rng.randrange(y0 + 1, rows + 1), rng.randrange(x0 + 1, cols + 1))
                    )
                for y0, x0, y1, x1 in boxes:
                    got = window.decode_window(data, shrink, (y0, x0, y1, x1), fast)
                    assert got is not None, (len(data), shrink, fast, (y0, x0, y1, x1))
                    assert np.array_equal(got, whole[y0:y1, x0:x1]), (
                        len(data),
                        shrink,
                        fast,
                        (y0, x0, y1, x1),
                    )
                    checked += 1
    assert checked == len(corpus()) * 4 * 2 * 6


@built
def test_what_it_does_not_take_is_left_to_the_other_path() -> None:
    data = synthetic_jpeg(200, 150, seed=2)
    progressive = photo(200, 150, seed=3, progressive=True)
    buf = io.BytesIO()
    Image.new("CMYK", (64, 48), (10, 20, 30, 40)).save(buf, "JPEG")
    for other in (progressive, buf.getvalue()):
        assert window.decode_window(other, 1, (0, 0, 10, 10), False) is None
    assert window.decode_window(data, 1, (0, 0, 151, 10), False) is None  # past the edge
    assert window.decode_window(data[: len(data) // 2], 1, (100, 0, 140, 10), False) is None
    assert window.decode_window(b"not a jpeg", 1, (0, 0, 1, 1), False) is None
    # what follows the scan decides whether the whole image decodes: a window is decoded
    # alone only where the end-of-image marker follows (fill bytes before it are the scan's)
    body = data[:-2]
    second_frame = body[body.index(b"\xff\xc0") : body.index(b"\xff\xc0") + 19]
    for extra in (second_frame, b"\xff\xd8", b"\xff\x05\x00\x04\xab\xcd"):
        assert window.decode_window(body + extra + b"\xff\xd9", 1, (0, 0, 10, 10), False) is None
    assert window.decode_window(body + b"\xff\xff\xd9", 1, (0, 0, 10, 10), False) is not None
    with pytest.raises(ValueError, match="out of range"):
        window._jpegwindow.decode(data, 3, 0, 0, 1, 1, False, 100)
    with pytest.raises(ValueError, match="over the limit"):
        window._jpegwindow.decode(data, 1, 0, 0, 100, 100, False, 99)


@built
def test_the_pipelines_give_the_pixels_they_gave_without_it() -> None:
    pipelines = [TrainPipeline(64), TrainPipeline(48, fast_decode=True, color_jitter=0.3)]
    pipelines += [EvalPipeline(64), EvalPipeline(32, crop_pct=1.1)]
    for data in corpus():
        for pipeline in pipelines:
            for seed in range(4):
                window.set_enabled(False)
                try:
                    want = pipeline(data, seed)
                finally:
                    window.set_enabled(True)
                assert np.array_equal(pipeline(data, seed), want), (len(data), pipeline, seed)


def test_info_and_bench_say_how_crops_are_decoded() -> None:
    name = decoder_name()
    assert "crops: " in name
    if window.available():
        assert "windows alone (fastdata.images._jpegwindow, libjpeg" in name
        before = window.set_enabled(False)
        try:
            assert "turned off" in decoder_name()
        finally:
            window.set_enabled(before)
    else:
        assert "not built here" in name


def test_info_names_the_module_it_uses_or_the_command_that_builds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if window.available():
        found = re.search(r"windows alone \(([\w.]+), ", decoder_name())
        assert found, decoder_name()
        importlib.import_module(found.group(1))  # the module info names is one that imports
    monkeypatch.setattr(window, "_jpegwindow", None)
    said = decoder_name()
    assert "not built here" in said
    # the headers a build needs (Python's too), and a command that runs as printed
    assert "headers of Python and libjpeg-turbo" in said
    assert "pip install -v -e . again in fastdata's checkout" in said


def smooth(width: int, height: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR))


def same_with_and_without(data: bytes, pipelines: list, seeds: range) -> None:
    for pipeline in pipelines:
        for seed in seeds:
            window.set_enabled(False)
            try:
                want = pipeline(data, seed)
            finally:
                window.set_enabled(True)
            assert np.array_equal(pipeline(data, seed), want), (pipeline, seed)


@built
def test_a_jpeg_libjpeg_turbo_does_not_decode_gets_the_pixels_it_got_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3x1 luma: simplejpeg refuses the header (no TurboJPEG subsampling has it), and the whole
    # image is decoded by Pillow, with its own IDCT and upsampling
    data = handmade_jpeg(smooth(160, 120, seed=1), [(3, 1), (1, 1), (1, 1)])
    whole = decode_array(data, fast=True)
    for box in ((0, 0, 120, 160), (30, 50, 90, 130)):
        got = window.decode_window(data, 1, box, True)
        assert got is None or np.array_equal(got, whole[box[0] : box[2], box[1] : box[3]])
    pipelines = [TrainPipeline(48, fast_decode=True), EvalPipeline(32, crop_pct=1.1)]
    same_with_and_without(data, pipelines, range(4))
    # and where simplejpeg is not installed, every JPEG is decoded by Pillow
    monkeypatch.setattr(decode, "_simplejpeg", None)
    same_with_and_without(photo(200, 150, seed=2), pipelines, range(2))


@built
def test_an_image_of_a_few_pixels_gets_the_scale_the_whole_decode_gets() -> None:
    # TurboJPEG decodes a 3 x 3 image asked for at 1/2 (2 x 2 pixels) at 3/4, not 1/2
    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (3, 3, 3), dtype=np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    for shrink in (2, 4, 8):
        for fast in (False, True):
            whole = decode_array(data, shrink=shrink, fast=fast)
            box = (0, 0, *whole.shape[:2])
            got = window.decode_window(data, shrink, box, fast)
            assert got is None or np.array_equal(got, whole), (shrink, fast)
    same_with_and_without(data, [EvalPipeline(1), TrainPipeline(1, fast_decode=True)], range(3))


@built
def test_no_window_holds_memory_libjpeg_never_wrote() -> None:
    # 2x4 luma at 1/2: libjpeg-turbo before 3.0 crops the chroma rows short
    # (jpeg_crop_scanline) and the colour conversion reads memory never written
    data = handmade_jpeg(smooth(160, 120, seed=4), [(2, 4), (1, 1), (1, 1)])
    for shrink in (2, 4):
        height, width = -(-120 // shrink), -(-160 // shrink)
        full = window._jpegwindow.decode(data, shrink, 0, 0, height, width, False, 1 << 30)
        for y0, x0, y1, x1 in ((5, width // 2, 20, width), (2, 10, height - 3, width // 2)):
            got = window._jpegwindow.decode(data, shrink, y0, x0, y1, x1, False, 1 << 30)
            if got is not None:
                assert full is not None
                rows = np.frombuffer(full, np.uint8).reshape(height, width, 3)[y0:y1, x0:x1]
                assert np.array_equal(np.frombuffer(got, np.uint8), rows.ravel()), shrink


MEMORY = """
import re, sys
from fastdata.images import window
data = open(sys.argv[1], "rb").read()
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size, from now
except OSError:
    sys.exit("no clear_refs")
before = peak()
window.decode_window(data, 1, (0, 0, 16, 16), False)
print((peak() - before) // 1024)
"""


@built
def test_a_window_costs_no_memory_for_what_a_file_declares(tmp_path: Path) -> None:
    # A frame of 8000 x 8000 whose first scan holds one component: libjpeg reads every scan
    # into coefficients of the whole image before the first row (128 MB for the luma alone)
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs here (Linux's peak resident size)")
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    data = bytearray(handmade_jpeg(pixels, [(1, 1)] * 3, scans=[[0]]))
    at = data.index(b"\xff\xc0") + 5
    data[at : at + 4] = (8000).to_bytes(2, "big") * 2
    path = tmp_path / "declares.jpg"
    path.write_bytes(data)
    result = run_script(MEMORY, path)
    if "no clear_refs" in result.stderr:
        pytest.skip("/proc/self/clear_refs cannot be written here")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 32, f"{result.stdout.strip()} MB for a window of 16 x 16"


@built
def test_a_window_larger_than_any_jpeg_is_not_taken() -> None:
    # its size times 3 bytes overflowed, and Python refused the allocation with SystemError
    side = 2**31 - 1
    data = synthetic_jpeg(64, 48, seed=1)
    assert window._jpegwindow.decode(data, 1, 0, 0, side, side, False, 1 << 62) is None


HARNESS = """
import ctypes, random, sys
import _jpegwindow
rng = random.Random(int(sys.argv[2]))
count = searched = 0
for path in sys.argv[3:]:
    raw = open(path, "rb").read()
    data = ctypes.create_string_buffer(raw, len(raw))  # (exactly its bytes: no slack to read)
    for _ in range(int(sys.argv[1])):
        shrink = rng.choice((1, 2, 4, 8))
        y0, x0 = rng.randrange(0, 400), rng.randrange(0, 400)
        y1, x1 = y0 + rng.randrange(1, 300), x0 + rng.randrange(1, 300)
        end = rng.choice((-1, -1, len(raw) - 2, len(raw) - 1, len(raw), rng.randrange(len(raw))))
        try:
            _jpegwindow.decode(data, shrink, y0, x0, y1, x1, rng.random() < 0.5, 1 << 26, end)
        except ValueError:
            pass
        count += 1
    for start in (0, 1, rng.randrange(len(raw)), len(raw) - 65, len(raw) - 1, len(raw)):
        found = _jpegwindow.marker_after(data, start)
        assert found == -1 or start <= found < len(raw) - 1, (path, start, found)
        searched += 1
print("decoded", count, "searched", searched)
"""


def damaged(seed: int, count: int) -> list[bytes]:
    """JPEGs cut short, bit-flipped, with bytes inserted and with frames that declare other
    sizes: what a damaged store or a hostile file holds."""
    rng = random.Random(seed)
    sources = corpus()
    out = []
    for i in range(count):
        data = bytearray(rng.choice(sources))
        kind = i % 4
        if kind == 0:
            data = data[: rng.randrange(2, len(data))]
        elif kind == 1:
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(2, len(data))] ^= 1 << rng.randrange(8)
        elif kind == 2:
            at = rng.randrange(2, len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        else:
            sof = data.find(b"\xff\xc0")
            if sof > 0:  # declared height and width: tiny, huge, zero
                data[sof + 5 : sof + 9] = rng.choice(
                    (
                        b"\x00\x01\x00\x01",
                        b"\xff\xdc\xff\xdc",
                        b"\x00\x00\x01\x00",
                        b"\x10\x00\x00\x08",
                    )
                )
        out.append(bytes(data))
    return out


def run_under_asan(tmp_path: Path, count: int, windows: int) -> None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here")
    runtime = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not runtime or not Path(runtime).exists():
        pytest.skip("no AddressSanitizer runtime here")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    module = tmp_path / f"_jpegwindow{suffix}"
    build = subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-g",
            "-O1",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE),
            "-ljpeg",
            "-o",
            str(module),
        ],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        pytest.skip(f"cannot build the window decoder here: {build.stderr[-300:]}")
    files = []
    for i, data in enumerate(damaged(seed=count, count=count)):
        files.append(tmp_path / f"{i}.jpg")
        files[-1].write_bytes(data)
    result = subprocess.run(
        [sys.executable, "-c", HARNESS, str(windows), "3", *map(str, files)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            "LD_PRELOAD": runtime,
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
            "PYTHONPATH": str(tmp_path),
            "PATH": "/usr/bin:/bin",
        },
        timeout=600,
    )
    assert result.returncode == 0 and "AddressSanitizer" not in result.stderr, result.stderr[-3000:]
    assert f"decoded {count * windows} searched {count * 6}" in result.stdout


def test_damaged_files_under_address_sanitizer(tmp_path: Path) -> None:
    run_under_asan(tmp_path, count=1000, windows=4)


@pytest.mark.slow
def test_many_damaged_files_under_address_sanitizer(tmp_path: Path) -> None:
    run_under_asan(tmp_path, count=10000, windows=6)


@built
def test_a_window_decoder_that_rounds_otherwise_than_simplejpeg_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the module links the system's libjpeg-turbo, simplejpeg its own: a version that decodes
    # otherwise must not change a crop's pixels (checked once a process, said once)
    real = window._jpegwindow

    class OffByOne:
        __name__ = real.__name__

        @staticmethod
        def version() -> str:
            return "libjpeg-turbo 9.9.9"

        @staticmethod
        def decode(*args: object) -> bytearray | None:
            raw = real.decode(*args)
            if raw is not None and len(raw) > 7:
                raw[7] ^= 1
            return raw

    data = synthetic_jpeg(200, 150, seed=4)
    pipeline = TrainPipeline(64)
    window.set_enabled(False)
    try:
        want = pipeline(data, 3)
    finally:
        window.set_enabled(True)
    monkeypatch.setattr(window, "_jpegwindow", OffByOne)
    monkeypatch.setattr(window, "_agrees", [])
    with caplog.at_level("WARNING", logger="fastdata.images.window"):
        assert not window.available() and not window.available()
        assert window.decode_window(data, 1, (0, 0, 10, 10), False) is None
        assert np.array_equal(pipeline(data, 3), want)
    assert sum("does not give the pixels" in r.getMessage() for r in caplog.records) == 1
    assert "does not give simplejpeg's pixels here" in window.describe()
