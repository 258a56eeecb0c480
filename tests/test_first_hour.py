"""What got in a new user's way in the first hour, each reproduced and now answered."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.ops.bench import measure_loader
from fastdata.errors import StoreError

from .conftest import jpeg_bytes
from .mongo_server import free_port
from .procs import REPO, cli, run_script

# -------------------------------------------------------------- install


def test_python_versions_agree(tmp_path: Path) -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["options"]["python_requires"] == ">=3.11"
    assert cfg["mypy"]["python_version"] == "3.11"
    assert 'target-version = "py311"' in (REPO / "ruff.toml").read_text()
    assert "Python 3.11 or newer" in (REPO / "README.md").read_text()
    # the scripts check the interpreter first, and say in one line what is needed
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.9.18'\nexit 1\n")
    old.chmod(0o755)
    result = subprocess.run(
        ["bash", "-c", "source scripts/_venv.sh && ensure_venv ."],
        cwd=REPO,
        env=dict(os.environ, PYTHON=str(old)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"fastdata needs Python 3.11 or newer; {old} is Python 3.9.18. "
        "Set PYTHON=/path/to/python3.11 and run again."
    )


def test_the_scripts_say_when_they_install(tmp_path: Path) -> None:
    """A first install takes about a minute: the scripts say so instead of showing nothing."""
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(
        '#!/bin/sh\n[ "$1" = -c ] && exit 1\necho "pip $*" >> pip.log\nexit 0\n'
    )  # fastdata not importable yet; pip "succeeds"
    (venv / "python").chmod(0o755)
    script = f"source {REPO}/scripts/_venv.sh && ensure_venv '.[turbo]'"
    result = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "installing fastdata and its dependencies into .venv (about a minute" in result.stderr
    assert "-c constraints.txt -e .[turbo]" in (tmp_path / "pip.log").read_text()


def test_every_pip_command_names_the_distribution() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    name = cfg["metadata"]["name"]
    assert name == "fastdata-images"
    texts = [p.read_text() for p in (REPO / "fastdata").rglob("*.py")]
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    # (docs/gpu.md installs NVIDIA's own packages by their names)
    texts += [page.read_text() for page in pages if page.name != "gpu.md"]
    for text in texts:
        for command in re.findall(r"pip install '?([\w.-]+)\[", text):
            assert command == name


# -------------------------------------------------------------- no silent no-ops


@pytest.fixture
def small_store(good_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "small.lmdb"
    convert(good_folder, dst)  # 12 images
    return dst


def test_a_store_smaller_than_a_batch_is_an_error_not_an_empty_epoch(small_store: Path) -> None:
    with pytest.raises(ValueError, match=r"12 samples .* no whole batch of 64.*drop_last=False"):
        create_loader(LMDBImageDataset(small_store), 64, num_workers=0, device="cpu")
    loader = create_loader(
        LMDBImageDataset(small_store), 64, num_workers=0, device="cpu", drop_last=False
    )
    assert [len(labels) for _, labels in loader] == [12]
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), str(small_store), "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 2 and "no whole batch of 64" in result.stderr
    assert "images/s" not in result.stdout


def test_an_unknown_scheme_is_a_usage_error(good_folder: Path, tmp_path: Path) -> None:
    result = cli("convert", str(good_folder), "mongo://host/db", "-q")
    assert result.returncode == 2
    assert "unknown scheme mongo:" in result.stderr and "mongodb://host:port/DB" in result.stderr
    assert not Path("mongo:").exists()


def test_options_that_do_not_fit_the_store_are_usage_errors(
    good_folder: Path, small_store: Path
) -> None:
    result = cli("convert", str(good_folder), str(small_store) + "2", "-c", "train", "-q")
    assert result.returncode == 2 and "--collection applies to mongodb://" in result.stderr
    result = cli("info", str(small_store), "--timeout", "3")
    assert result.returncode == 2 and "--timeout applies to mongodb://" in result.stderr
    result = cli("info", "mongodb://127.0.0.1:1/db", "-c", "x", "--allow-pickle")
    assert result.returncode == 2 and "--allow-pickle applies to LMDB" in result.stderr


def test_resume_with_nothing_to_resume_is_a_usage_error(good_folder: Path, tmp_path: Path) -> None:
    result = cli("convert", str(good_folder), str(tmp_path / "new.lmdb"), "--resume", "-q")
    assert result.returncode == 2
    assert "nothing to resume" in result.stderr and "without --resume" in result.stderr


# -------------------------------------------------------------- hints


def test_info_on_an_image_folder_says_to_convert_it(good_folder: Path) -> None:
    result = cli("info", str(good_folder))
    assert result.returncode == 2
    assert f"an image folder, not a store; convert it first: `fastdata convert {good_folder} " in (
        result.stderr
    )
    assert f"{good_folder}.lmdb`" in result.stderr


def test_messages_speak_the_clis_words() -> None:
    result = cli("info", "mongodb://127.0.0.1:1", "-c", "x")
    assert result.returncode != 0
    assert "put it in the URI: mongodb://host:port/DB" in result.stderr
    assert "database=" not in result.stderr


@pytest.mark.mongo
def test_the_outage_message_reports_the_time_it_measured() -> None:
    from fastdata import MongoImageDataset

    uri = f"mongodb://127.0.0.1:{free_port()}/db"
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        MongoImageDataset(uri, "c", timeout_s=1.0)
    elapsed = time.monotonic() - started
    reported = float(re.search(r"in ([\d.]+) s", str(info.value)).group(1))  # type: ignore[union-attr]
    assert abs(reported - elapsed) < 0.5
    for command in ("convert", "info", "verify", "export", "bench"):
        assert "--timeout" in cli(command, "--help").stdout


def test_a_closed_pipe_ends_quietly(small_store: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastdata", "info", str(small_store), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that read nothing and went away
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(60) == 0 and err == ""


def test_exit_codes(good_folder: Path, small_store: Path, tmp_path: Path) -> None:
    assert cli("convert", str(good_folder), str(small_store), "-q").returncode == 2  # exists
    assert cli("info", str(tmp_path / "missing.lmdb")).returncode == 2  # not found
    assert cli("convert", "--workers", "0", "a", "b").returncode == 2  # click's own check
    assert cli("info", "mongodb://127.0.0.1:1/db", "-c", "x", "--timeout", "0.5").returncode == 1


def test_a_store_of_another_tool_says_what_it_lacks(tmp_path: Path) -> None:
    import pickle

    import lmdb

    path = tmp_path / "legacy.lmdb"
    env = lmdb.open(str(path), subdir=False, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"0", pickle.dumps((jpeg_bytes(), 0)))
        txn.put(b"__keys__", pickle.dumps([b"0"]))
    env.close()
    info = cli("info", str(path), "--allow-pickle")
    assert "size:       not recorded (a store written by another tool)" in info.stdout
    verify = cli("verify", str(path), "--allow-pickle", "-q")
    assert verify.returncode == 0 and "the store has no checksums" in verify.stdout
    assert "OK (sizes, checksums" not in verify.stdout


# -------------------------------------------------------------- bench


def test_bench_does_not_time_the_batches_queued_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fastdata.loaders import tuning

    now = [0.0]  # a clock that moves only when a batch takes its 10 ms (no test waits on one)
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])

    class Queued:
        """A loader whose first batches were ready at once, then one every 10 ms."""

        prefetch_factor = 2

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i in range(10_000):
                if i >= 5:  # 1 + 2 workers x 2 queued
                    now[0] += 0.01
                yield None, [0] * 8

    rate = measure_loader(lambda w: Queued(), 2, seconds=0.3, batch_size=8)
    assert rate == pytest.approx(800)  # 8 images per 10 ms, not inflated by the queued ones


@pytest.mark.slow  # (measures for seconds, twice; its choice can flip on a loaded machine)
def test_bench_reports_the_spread_and_chooses_the_same_count(small_store: Path) -> None:
    import json

    chosen = set()
    for _ in range(2):
        result = cli("bench", str(small_store), "--batch-size", "4", "--seconds", "0.3", "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        for w, (low, high) in report["loader_spread"].items():
            assert low <= report["loader_per_s"][w] <= high
        chosen.add(report["chosen_workers"])
    assert len(chosen) == 1


# -------------------------------------------------------------- the recipes people come from


def test_samples_and_imgs_like_imagefolder(small_store: Path, good_folder: Path) -> None:
    ds = LMDBImageDataset(small_store)
    assert len(ds.samples) == 12 and ds.imgs[5] == ("dog/000.jpg", 1)
    assert ds.samples[0] == ("cat/000.jpg", 0) and ds.samples[-1] == ("eel/002.jpg", 2)
    assert [label for _, label in ds.samples] == list(ds.targets)
    assert ds.samples[10:] == [("eel/001.jpg", 2), ("eel/002.jpg", 2)]
    assert all((good_folder / name).is_file() for name, _ in ds.samples)
    with pytest.raises(AttributeError):
        ds.samples.append(("x", 0))  # type: ignore[attr-defined]


def test_the_apex_loop_ends_with_none(small_store: Path) -> None:
    result = run_script(
        """
        import sys
        from torch.utils.data import DataLoader
        from fastdata import LMDBImageDataset, fast_collate
        from fastdata.compat.apex import data_prefetcher
        from fastdata.images.pipelines import EvalPipeline

        ds = LMDBImageDataset(sys.argv[1], pipeline=EvalPipeline(32))
        prefetcher = data_prefetcher(DataLoader(ds, batch_size=5, collate_fn=fast_collate))
        input, target = prefetcher.next()
        shapes = []
        while input is not None:
            shapes.append(tuple(input.shape))
            input, target = prefetcher.next()
        print(shapes, prefetcher.next())
        """,
        small_store,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(5, 3, 32, 32), (5, 3, 32, 32), (2, 3, 32, 32)] (None, None)"


def test_timms_call_shape(small_store: Path) -> None:
    from fastdata.compat.timm import create_loader as timm_create_loader

    loader = timm_create_loader(
        LMDBImageDataset(small_store),
        (3, 32, 32),
        4,
        is_training=True,
        use_prefetcher=True,
        num_workers=0,
        re_prob=0.25,  # logged as not applied
    )
    images, targets = next(iter(loader))
    assert images.shape == (4, 3, 32, 32) and images.dtype.is_floating_point
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        timm_create_loader(LMDBImageDataset(small_store), 32, 4, not_a_timm_option=1)
    wide = timm_create_loader(LMDBImageDataset(small_store), (3, 32, 48), 4, num_workers=0)
    assert next(iter(wide))[0].shape == (4, 3, 32, 48)  # a pair, as timm takes it


def test_the_default_install_is_the_fast_path(small_store: Path) -> None:
    from fastdata import records
    from fastdata.images import decode

    assert decode.has_turbo() and records.CHECKSUM_IMPLEMENTATION == "ISA-L (isal)"
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    required = cfg["options"]["install_requires"]
    assert "simplejpeg" in required and "isal" in required  # not only in an extra
    info = cli("info", str(small_store))
    assert "decoder:    libjpeg-turbo (simplejpeg" in info.stdout and "CRC-32: ISA-L" in info.stdout


def test_without_the_fast_path_fastdata_falls_back_and_says_so() -> None:
    result = run_script(
        """
        import logging, sys, zlib
        sys.modules["simplejpeg"] = None  # as on a platform without the wheels
        sys.modules["isal"] = sys.modules["isal.isal_zlib"] = None
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        from fastdata import records as jpeg
        from fastdata.images import decode
        from tests.conftest import jpeg_bytes
        data = jpeg_bytes()
        assert decode.decode_numpy(data).shape == (48, 64, 3)  # Pillow decodes it
        assert jpeg.checksum(data) == zlib.crc32(data)
        print(decode.decoder_name(), "|", jpeg.CHECKSUM_IMPLEMENTATION)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Pillow (simplejpeg missing") and "| zlib" in result.stdout
    assert "JPEGs are decoded with Pillow" in result.stderr
    assert "CRC-32 through zlib" in result.stderr


def test_bench_blames_the_figure_out_of_line() -> None:
    from fastdata.ops.bench import BenchReport, _out_of_line

    def report(decode: tuple[float, float, float], loader: float) -> BenchReport:
        low, median_, high = decode
        r = BenchReport("s", 100, 64, 1000.0, median_, pipeline_spread=(low, high), cpus=2)
        r.loader_per_s = {2: loader}
        return r

    # the one-process figure swung (a busy machine): the loader fits its fastest round
    busy = _out_of_line(report((138, 176, 890), 1300))
    assert len(busy) == 1 and "decode+crop in one process varied from 138 to 890" in busy[0]
    # a steady one-process figure: the loader figure itself is suspect
    steady = _out_of_line(report((700, 720, 730), 2500))
    assert len(steady) == 1 and "the loader figure is cache-bound or too short" in steady[0]
    assert _out_of_line(report((700, 720, 730), 1400)) == []  # in line


@pytest.mark.slow  # (a bench run after the refused one: seconds of measuring)
def test_bench_checks_its_plot_dependency_before_measuring(
    small_store: Path, tmp_path: Path
) -> None:
    code = """
import sys, importlib.util, time
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "matplotlib" else real(name, *a)
from fastdata.cli import main
sys.argv = ["fastdata", "bench", sys.argv[1], "--seconds", "30", "--plot", "p.png"]
main()
"""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, str(small_store)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode != 0 and "--plot needs matplotlib" in result.stderr
    assert "nothing was measured" in result.stderr and time.monotonic() - started < 20
    quick = cli("bench", str(small_store), "-b", "4", "--seconds", "0.3", "-j", "0")
    assert quick.returncode == 0, quick.stderr
    assert "CRC-32:" in quick.stdout and "decode+crop:" in quick.stdout and "(" in quick.stdout


def test_the_convert_output_names_what_it_counts(good_folder: Path, tmp_path: Path) -> None:
    """The reader threads used (docs/cli.md: "the output says which it used"), on a short
    conversion too, and the non-image files by name, not just counted."""
    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        for i in range(3):
            (src / cls).mkdir(parents=True, exist_ok=True)
            (src / cls / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    (src / "cat" / "notes.txt").write_text("x")
    for i in range(25):
        (src / "dog" / f"label-{i:02d}.xml").write_text("x")
    result = cli("convert", str(src), str(tmp_path / "a.lmdb"))
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"^reader threads: \d+ \(the fastest of the counts measured; --workers N fixes it\)$",
        result.stdout,
        flags=re.M,
    ), result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("non-image files"))
    assert line.startswith("non-image files ignored: 26: cat/notes.txt, dog/label-00.xml")
    assert "and 23 more (`fastdata -v` before the command names 20)" in line
    verbose = cli("-v", "convert", str(src), str(tmp_path / "b.lmdb"))
    line = next(x for x in verbose.stdout.splitlines() if x.startswith("non-image files"))
    assert "dog/label-18.xml and 6 more" in line and "(`fastdata -v`" not in line
    fixed = cli("convert", str(src), str(tmp_path / "c.lmdb"), "-j", "1")
    assert "reader threads: 1\n" in fixed.stdout
