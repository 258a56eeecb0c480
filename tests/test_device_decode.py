"""Batched decode on the device (nvImageCodec's CPU backend here): the same crops as the CPU
pipeline, pixels within the decoders' rounding, the CPU fallback, and determinism across
worker counts."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.images import pipelines
from fastdata.images.decode import decode_array
from fastdata.images.device_backends import available_backends
from fastdata.images.device_decode import DeviceDecoder
from fastdata.images.pipelines import EvalPipeline, TrainPipeline
from fastdata.images.synthetic import synthetic_jpeg

from .conftest import jpeg_bytes, png_bytes, write

needs_nvimgcodec = pytest.mark.skipif(
    "nvimgcodec" not in available_backends("cpu"),
    reason="nvImageCodec is not installed (pip install nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12)",
)

JPEGS = [synthetic_jpeg(500, 375, seed=i) for i in range(6)] + [
    jpeg_bytes(333, 250, seed=7),
    jpeg_bytes(200, 300, mode="L", seed=8),  # greyscale: three channels come out
]


def cpu_batch(pipeline: TrainPipeline | EvalPipeline, datas: list[bytes], seeds: list[int]):  # type: ignore[no-untyped-def]
    return torch.stack(
        [torch.from_numpy(pipeline(d, s)).permute(2, 0, 1) for d, s in zip(datas, seeds)]
    )


@needs_nvimgcodec
def test_a_region_decode_is_the_window_of_the_full_decode() -> None:
    # the same boxes: nvImageCodec decodes only the plan's window, and that window is exactly
    # the pixels the full image has there
    decoder = DeviceDecoder("cpu", backend="nvimgcodec")
    pipeline = TrainPipeline(224, fast_decode=False)
    for seed, data in enumerate(JPEGS[:6]):
        plan = pipeline.plan(data, seed)
        (window,) = decoder._decode([data], [plan])
        y0, x0, y1, x1 = plan.pixels(*plan.full)
        full = decode_array(data)
        assert torch.equal(window.permute(1, 2, 0), torch.from_numpy(full[y0:y1, x0:x1]))


@needs_nvimgcodec
@pytest.mark.parametrize("size", [224, (160, 192), 64])
@pytest.mark.parametrize("jitter", [None, 0.4])
def test_the_device_path_gives_the_cpu_pipelines_crops(
    size: int | tuple[int, int], jitter: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = TrainPipeline(size, fast_decode=False, color_jitter=jitter)
    seeds = list(range(100, 100 + len(JPEGS)))
    plans = [pipeline.plan(d, s) for d, s in zip(JPEGS, seeds)]
    got = DeviceDecoder("cpu", backend="nvimgcodec")(JPEGS, plans)
    # as they run: where the crop is at least twice the output the CPU decodes at a reduced
    # size and the device averages blocks of the same size, which differ by a few levels; a
    # wrong box or a missed flip differs by tens
    as_run = cpu_batch(pipeline, JPEGS, seeds)
    assert got.dtype == torch.uint8 and got.shape == as_run.shape
    for image, want in zip(got, as_run):
        assert (image.int() - want.int()).abs().float().mean() < 8
        assert (image.int() - want.flip(2).int()).abs().float().mean() > 15
    # both at full size: the same to the rounding of the resize filters (uint8 fixed point
    # against float32)
    monkeypatch.setattr(pipelines, "shrink_for", lambda *args: 1)
    got = DeviceDecoder("cpu", backend="nvimgcodec")(JPEGS, plans)
    diff = (got.int() - cpu_batch(pipeline, JPEGS, seeds).int()).abs()
    assert diff.float().mean() < 0.5, diff.float().mean()
    assert (diff > 2).float().mean() < 0.01


@needs_nvimgcodec
def test_the_eval_pipeline_too() -> None:
    pipeline = EvalPipeline((192, 160))
    plans = [pipeline.plan(d) for d in JPEGS]
    got = DeviceDecoder("cpu", backend="nvimgcodec")(JPEGS, plans)
    want = cpu_batch(pipeline, JPEGS, [0] * len(JPEGS))
    assert (got.int() - want.int()).abs().float().mean() < 1.0


@needs_nvimgcodec
def test_records_that_are_not_jpegs_take_the_cpu_path_with_one_line_per_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline = TrainPipeline(48, fast_decode=False)
    datas = [JPEGS[0], png_bytes(90, 70, seed=1), JPEGS[1], png_bytes(80, 64, seed=2)]
    plans = [pipeline.plan(d, i) for i, d in enumerate(datas)]
    decoder = DeviceDecoder("cpu", backend="nvimgcodec")
    with caplog.at_level(logging.DEBUG, logger="fastdata.images.device_decode"):
        got = decoder(datas, plans)
        decoder(datas, plans)
    lines = [r for r in caplog.records if "CPU pipeline" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG]  # one per batch
    assert "2 of 4" in lines[0].getMessage()
    # the PNGs are exactly what the CPU pipeline makes of them
    for i in (1, 3):
        assert torch.equal(got[i], torch.from_numpy(pipeline(datas[i], i)).permute(2, 0, 1))


def test_the_install_hint_names_the_package_built_for_this_torchs_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a torch built for CUDA 13 needs nvImageCodec's cu13 build: the cu12 one would not load
    import fastdata.images.device_decode as dd

    monkeypatch.setattr(dd, "available_backends", lambda device="cpu": ["cpu"])
    for cuda, packages in (
        ("13.0", "nvidia-nvimgcodec-cu13 nvidia-nvjpeg "),
        ("12.8", "nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12 "),
        (None, "nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12 "),
    ):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        with pytest.raises(ValueError, match=f"pip install {packages}"):
            DeviceDecoder("cpu", backend="nvimgcodec")


def test_without_a_device_decoder_the_cpu_pipeline_decodes_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastdata.images.device_decode as dd

    monkeypatch.setattr(dd, "available_backends", lambda device="cpu": ["cpu"])
    with caplog.at_level(logging.WARNING, logger="fastdata.images.device_decode"):
        decoder = DeviceDecoder("cpu")
    assert decoder.backend == "cpu"
    assert "pip install nvidia-nvimgcodec-cu" in caplog.text
    pipeline = TrainPipeline(64, fast_decode=False)
    plans = [pipeline.plan(d, i) for i, d in enumerate(JPEGS)]
    want = cpu_batch(pipeline, JPEGS, list(range(len(JPEGS))))
    assert torch.equal(decoder(JPEGS, plans), want)  # exactly the CPU pipeline


def test_a_backend_that_cannot_run_here_is_refused_with_what_it_needs() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceDecoder("cpu", backend="torchvision")
    with pytest.raises(ValueError, match="choose one of"):
        DeviceDecoder("cpu", backend="nvjpeg")
    with pytest.raises(ValueError, match="one plan each"):
        DeviceDecoder("cpu", backend="cpu")(JPEGS[:2], [])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    for i in range(30):
        data = synthetic_jpeg(160, 120, seed=i) if i % 10 else png_bytes(100, 90, seed=i)
        write(root / f"c{i % 3}" / f"{i:03d}.{'jpg' if i % 10 else 'png'}", data)
    dst = tmp_path_factory.mktemp("store") / "s.lmdb"
    convert(root, dst)
    return dst


def epoch(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.mark.parametrize("backend", [pytest.param("nvimgcodec", marks=needs_nvimgcodec), "cpu"])
def test_create_loader_decodes_on_the_device_the_same_for_any_worker_count(
    store: Path, backend: str
) -> None:
    common = dict(image_size=48, device="cpu", seed=3, batch_size=8, mean=None, std=None)
    runs = []
    for workers in (0, 2):
        with create_loader(
            LMDBImageDataset(store),
            num_workers=workers,
            decode="device",
            decode_backend=backend,
            pipeline=TrainPipeline(48, fast_decode=False),
            **common,  # type: ignore[arg-type]
        ) as loader:
            runs.append(epoch(loader) + epoch(loader))  # two epochs: other crops, same on both
    for (x0, y0), (x1, y1) in zip(*runs, strict=True):
        assert x0.dtype == torch.uint8 and x0.shape == (8, 3, 48, 48)
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    with create_loader(
        LMDBImageDataset(store),
        num_workers=0,
        pipeline=TrainPipeline(48, fast_decode=False),
        **common,  # type: ignore[arg-type]
    ) as cpu_loader:
        on_cpu = epoch(cpu_loader)
    for (x, y), (cx, cy) in zip(runs[0], on_cpu):
        assert torch.equal(y, cy)
        assert (x.int() - cx.int()).abs().float().mean() < 4.0  # same crops, other decoder


def test_device_decode_normalises_like_the_cpu_path(store: Path) -> None:
    with create_loader(
        LMDBImageDataset(store),
        batch_size=8,
        image_size=32,
        device="cpu",
        num_workers=0,
        decode="device",
        decode_backend="cpu",
    ) as loader:
        x, y = next(iter(loader))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32) and y.dtype == torch.int64
    assert -3 < float(x.min()) < float(x.max()) < 3


def test_device_decode_refuses_what_it_cannot_follow(store: Path) -> None:
    with pytest.raises(ValueError, match="without a transform"):
        create_loader(
            LMDBImageDataset(store, transform=np.asarray),
            batch_size=4,
            device="cpu",
            num_workers=0,
            decode="device",
        )
    with pytest.raises(ValueError, match="'cpu' or 'device'"):
        create_loader(LMDBImageDataset(store), batch_size=4, device="cpu", decode="gpu")


def test_auto_workers_measure_the_decoded_batches(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real = DeviceDecoder.batch

    def counting(self: DeviceDecoder, encoded):  # type: ignore[no-untyped-def]
        images, labels = real(self, encoded)
        decoded.append(images.shape[0])
        return images, labels

    monkeypatch.setattr(DeviceDecoder, "batch", counting)
    with create_loader(
        LMDBImageDataset(store),
        batch_size=8,
        image_size=32,
        device="cpu",
        decode="device",
        decode_backend="cpu",
        num_workers="auto",
        auto_seconds=0.2,
    ) as loader:
        assert decoded, "the measurement never decoded a batch"
        assert loader.worker_rates


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nvimgcodec", "torchvision"])
def test_on_cuda_each_backend_gives_the_cpu_pipelines_pixels(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} cannot decode on this machine's CUDA device")
    monkeypatch.setattr(pipelines, "shrink_for", lambda *args: 1)
    pipeline = TrainPipeline(224, fast_decode=False, color_jitter=0.4)
    plans = [pipeline.plan(d, s) for s, d in enumerate(JPEGS)]
    got = DeviceDecoder("cuda", backend=backend)(JPEGS, plans)
    assert got.device.type == "cuda"
    want = cpu_batch(pipeline, JPEGS, list(range(len(JPEGS))))
    diff = (got.cpu().int() - want.int()).abs()
    # nvJPEG's IDCT and upsampling are not libjpeg-turbo's: a little more than rounding
    assert diff.float().mean() < 2.0, diff.float().mean()


@pytest.mark.gpu
def test_on_cuda_the_loader_is_deterministic_and_holds_its_memory(store: Path) -> None:
    common = dict(image_size=48, device="cuda", seed=3, batch_size=8, decode="device")
    runs = []
    for workers in (0, 2):
        with create_loader(LMDBImageDataset(store), num_workers=workers, **common) as loader:  # type: ignore[arg-type]
            epochs = [epoch(loader) for _ in range(4)]
            reserved = torch.cuda.memory_reserved()
            epochs.append(epoch(loader))
            assert torch.cuda.memory_reserved() == reserved  # steady across epochs
            runs.append(epochs)
    for a, b in zip(*runs, strict=True):
        for (x0, y0), (x1, y1) in zip(a, b, strict=True):
            assert x0.device.type == "cuda" and x0.dtype == torch.float32
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_one_decoder_serves_two_threads() -> None:
    decoder = DeviceDecoder("cpu")
    pipeline = TrainPipeline(32)
    plans = [pipeline.plan(d, i) for i, d in enumerate(JPEGS)]
    want = decoder(JPEGS, plans)
    results: list[torch.Tensor] = []

    def work() -> None:
        for _ in range(20):
            results.append(decoder(JPEGS, plans))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 40 and all(torch.equal(r, want) for r in results)


BOMB_RUN = """
import io, resource, sys
from PIL import Image
from fastdata.images.device_decode import DeviceDecoder
from fastdata.images.pipelines import EvalPipeline
buf = io.BytesIO()
Image.new("RGB", (9000, 9000), (90, 120, 150)).save(buf, "JPEG", quality=50)
data = buf.getvalue()
del buf
pipeline = EvalPipeline(224)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
images = DeviceDecoder("cpu", backend=sys.argv[1])([data] * 4, [pipeline.plan(data)] * 4)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(grown, int(images.float().mean()), file=sys.stderr)
"""


@pytest.mark.slow
@needs_nvimgcodec
def test_images_that_declare_many_pixels_cost_one_window_at_a_time() -> None:
    # four 81-million-pixel images (under the pixel limit): decoded at once and converted to
    # float whole they took 1.8 GB more; a group at a time, reduced in strips, about 0.8 (one
    # window decoded, and the decoder's own buffers)
    result = subprocess.run(
        [sys.executable, "-c", BOMB_RUN, "nvimgcodec"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    grown, mean = map(int, result.stderr.split()[-2:])
    assert grown < 1100, f"peak memory grew by {grown} MiB"
    assert 110 <= mean <= 130  # the image's colour, not garbage


def test_errors_name_the_record_and_nothing_alarming_reaches_stderr(tmp_path: Path) -> None:
    root = tmp_path / "src"
    good = synthetic_jpeg(160, 120, seed=1)
    write(root / "a" / "0.jpg", good)
    write(root / "a" / "1.jpg", good[: len(good) // 2])  # scan data cut: skipped at conversion
    write(root / "a" / "2.png", png_bytes(40, 30, seed=1))
    store = tmp_path / "s.lmdb"
    convert(root, store)
    with lmdb.open(str(store), subdir=True, lock=False) as env, env.begin(write=True) as txn:
        key = b"%010d" % 1  # the PNG's bytes cut short: no decoder can read it
        txn.put(key, bytes(txn.get(key))[:60])
    code = f"""
import sys
from fastdata import LMDBImageDataset, create_loader
from fastdata.errors import CorruptImageError, RecordError
loader = create_loader(LMDBImageDataset({str(store)!r}, indices=[0, 0]), batch_size=2,
                       device="cpu", num_workers=0, decode="device", train=False)
print(tuple(next(iter(loader))[0].shape))
bad = create_loader(LMDBImageDataset({str(store)!r}), batch_size=2,
                    device="cpu", num_workers=0, decode="device", train=False)
try:
    next(iter(bad))
except (CorruptImageError, RecordError) as exc:  # the bytes cut short fail their checksum first
    print("error:", exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "(2, 3, 224, 224)" in result.stdout
    assert "record 1 (a/2.png)" in result.stdout and "s.lmdb" in result.stdout
    assert "ERROR" not in result.stderr and "nvimgcodec" not in result.stderr.lower()


@needs_nvimgcodec
def test_a_header_the_device_decoder_refuses_goes_through_the_cpu_pipeline() -> None:
    data = JPEGS[0]
    sof = data.index(b"\xff\xc0")
    odd = data[:sof] + b"\x00\x00" + data[sof:]  # two stray bytes before the frame header
    pipeline = TrainPipeline(48, fast_decode=False)
    plans = [pipeline.plan(odd, 1)]
    got = DeviceDecoder("cpu", backend="nvimgcodec")([odd], plans)
    assert torch.equal(got[0], torch.from_numpy(pipeline(odd, 1)).permute(2, 0, 1))


def test_what_the_device_cannot_follow_is_refused_before_any_batch(store: Path) -> None:
    class Grey(TrainPipeline):
        def __call__(self, data: bytes, seed: int | None = None) -> np.ndarray:
            return super().__call__(data, seed).mean(2, keepdims=True).repeat(3, 2)

    with pytest.raises(ValueError, match="plan"):
        create_loader(
            LMDBImageDataset(store),
            batch_size=4,
            device="cpu",
            num_workers=0,
            decode="device",
            pipeline=Grey(32),
        )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            DeviceDecoder("cuda")


def test_an_eval_crop_wider_than_the_image_keeps_the_whole_image() -> None:
    data = jpeg_bytes(200, 300, seed=3)  # 200 wide, 300 high
    plan = EvalPipeline(64, crop_pct=1.15).plan(data)
    y0, x0, y1, x1 = plan.pixels(*plan.full)
    assert 0 <= y0 < y1 <= 300 and (x0, x1) == (0, 200)
    got = DeviceDecoder("cpu", backend="cpu")([data], [plan])
    assert torch.equal(
        got[0], torch.from_numpy(EvalPipeline(64, crop_pct=1.15)(data)).permute(2, 0, 1)
    )


@needs_nvimgcodec
def test_a_decoder_that_takes_no_windows_gets_whole_images_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # nvJPEG's hardware decoder refuses every crop window (seen on an H100 and an H200): the
    # decoder then decodes whole images and cuts the windows out, and says so once
    pipeline = TrainPipeline(64, fast_decode=False)
    plans = [pipeline.plan(d, s) for s, d in enumerate(JPEGS)]
    want = DeviceDecoder("cpu", backend="nvimgcodec", regions=False)(JPEGS, plans)
    decoder = DeviceDecoder("cpu", backend="nvimgcodec")
    decoder(JPEGS[:2], plans[:2])  # the codec is made on first use
    real = decoder._codec

    class Refusing:
        def decode(self, streams, **kwargs):  # type: ignore[no-untyped-def]
            if decoder.regions:
                return [None] * len(streams)
            return real.decode(streams, **kwargs)

    decoder._codec = Refusing()
    with caplog.at_level(logging.WARNING, logger="fastdata.images.device_decode"):
        got = decoder(JPEGS, plans)
        again = decoder(JPEGS, plans)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert decoder.regions is False
    lines = [r.getMessage() for r in caplog.records]
    assert sum("decoding whole images" in line for line in lines) == 1, lines
    assert not any("CPU pipeline" in line for line in lines), lines


def test_device_decoder_options_are_checked() -> None:
    with pytest.raises(ValueError, match="hardware=1.5"):
        DeviceDecoder("cpu", hardware=1.5)
    with pytest.raises(ValueError, match="threads=-1"):
        DeviceDecoder("cpu", threads=-1)
    assert "hardware=0.6" in repr(DeviceDecoder("cpu", backend="cpu", hardware=0.6))
