"""A JPEG that lacks only its end-of-image marker is repaired; one cut short (scan data missing)
is not: it is named for what it is, at conversion and by verify, with libjpeg-turbo or
without it (Pillow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdata import convert, open_store, verify_store
from fastdata.errors import CorruptImageError
from fastdata.images import validate
from fastdata.images.decode import has_turbo
from fastdata.images.validate import validate_image

from .conftest import jpeg_bytes, write
from .procs import cli, run_script

TRUNCATED = "truncated JPEG: scan data ends early"


def cut(data: bytes, share: float) -> bytes:
    """``data`` cut after ``share`` of its scan data (a file copied in part)."""
    start = data.find(b"\xff\xda")
    end = start + int((len(data) - start) * share)
    return data[: end - 1 if data[end - 1] == 0xFF else end]


def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write(root / "c" / "whole.jpg", jpeg_bytes(256, 192, seed=1))
    write(root / "c" / "no-eoi.jpg", jpeg_bytes(256, 192, seed=2)[:-2])
    write(root / "c" / "half.jpg", cut(jpeg_bytes(256, 192, seed=3), 0.5))
    return root


def skipped(report_or_stdout: object) -> dict[str, str]:
    return {s.name: s.reason for s in report_or_stdout.skipped}  # type: ignore[attr-defined]


@pytest.mark.parametrize("verify_decode", [False, True])
def test_only_a_jpeg_missing_nothing_but_its_end_marker_is_repaired(
    tmp_path: Path, verify_decode: bool
) -> None:
    report = convert(source(tmp_path), tmp_path / "s.lmdb", verify_decode=verify_decode)
    assert skipped(report) == {"c/half.jpg": TRUNCATED}
    assert report.repaired == 1 and report.repaired_names == ["c/no-eoi.jpg"]
    assert report.count == 2
    assert verify_store(open_store(tmp_path / "s.lmdb"), decode=True).ok


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_cut_anywhere_in_its_scan_is_not_repaired(share: float, progressive: bool) -> None:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 255, (120, 160, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, progressive=progressive)
    whole = buf.getvalue()
    assert validate_image(whole[:-2], "x.jpg").repaired  # only its marker missing: repaired
    with pytest.raises(CorruptImageError, match="truncated JPEG|does not decode"):
        validate_image(cut(whole, share), "x.jpg")


BLOCK_TURBO = """
import sys
sys.modules["simplejpeg"] = None  # libjpeg-turbo cannot be imported: Pillow decodes
from fastdata.images.decode import has_turbo
assert not has_turbo()
from fastdata.cli import main
sys.argv = ["fastdata", *sys.argv[1:]]
main()
"""


def test_without_libjpeg_turbo_a_jpeg_cut_short_is_refused_too(tmp_path: Path) -> None:
    src = source(tmp_path)
    for flags in ([], ["--verify-decode"]):
        dst = tmp_path / f"s{len(flags)}.lmdb"
        done = run_script(BLOCK_TURBO, "convert", src, dst, "-q", *flags)
        assert done.returncode == 0, done.stderr
        assert f"c/half.jpg: {TRUNCATED}" in done.stdout  # skipped, said so without -v
        assert "repaired (end-of-image marker appended): 1: c/no-eoi.jpg" in done.stdout


def repaired_as_before(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store converted as fastdata did before it told a JPEG cut short from one that lacks
    only its end marker: both repaired."""
    with monkeypatch.context() as patched:
        patched.setattr(validate, "check_repaired", lambda data, name: None, raising=False)
        assert convert(src, dst).repaired == 2


def test_verify_names_a_jpeg_cut_short_that_an_earlier_conversion_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    repaired_as_before(source(tmp_path), dst, monkeypatch)
    for decode in (False, True):  # (a repaired record is decoded: it may have been cut)
        failures = verify_store(open_store(dst), decode=decode).failures
        assert [(f.name, f.reason) for f in failures] == [("c/half.jpg", TRUNCATED)]
    found = cli("verify", str(dst), "-q")
    assert found.returncode == 1 and f"c/half.jpg: {TRUNCATED}" in found.stdout
    assert "--skip-damaged --decode`" in found.stdout  # the export that leaves it out


def test_verify_without_libjpeg_turbo_names_it_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "s.lmdb"
    repaired_as_before(source(tmp_path), dst, monkeypatch)
    for flags in ([], ["--decode"]):
        found = run_script(BLOCK_TURBO, "verify", dst, "-q", *flags)
        assert found.returncode == 1, found.stdout + found.stderr
        assert f"c/half.jpg: {TRUNCATED}" in found.stdout


@pytest.mark.skipif(not has_turbo(), reason="needs libjpeg-turbo (simplejpeg)")
def test_checking_a_repair_costs_one_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a JPEG that lacks its marker is decoded at conversion (without --verify-decode),
    once."""
    from fastdata.images import decode

    calls: list[int] = []
    real = decode._simplejpeg.decode_jpeg
    monkeypatch.setattr(
        decode._simplejpeg, "decode_jpeg", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    validate_image(jpeg_bytes(seed=4), "whole.jpg")
    assert calls == []
    validate_image(jpeg_bytes(seed=4)[:-2], "no-eoi.jpg")
    assert calls == [1]
