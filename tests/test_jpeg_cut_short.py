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


# A JPEG of several scans (progressive, or one scan per component) cut between two of them
# decodes without a word, from the scans it has: only its scan headers tell that it was cut.

PROGRESSIVE_MISSING = "truncated JPEG: progressive scans missing"
COMPONENTS_MISSING = "truncated JPEG: scans of some of its components missing"


def progressive_jpeg(seed: int, mode: str = "RGB", subsampling: int = 2) -> bytes:
    import io

    from PIL import Image

    pixels = Image.open(io.BytesIO(jpeg_bytes(96, 72, seed=seed))).convert(mode)
    buf = io.BytesIO()
    pixels.save(buf, "JPEG", quality=90, progressive=True, subsampling=subsampling)
    return buf.getvalue()


def scan_per_component_jpeg(width: int, height: int, seed: int) -> bytes:
    """A sequential (baseline) JPEG whose three components each have a scan of their own, every
    block a DC value (random) and no AC coefficient: what Pillow cannot write."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = -(-width // 8) * -(-height // 8)

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    parts = [b"\xff\xd8", segment(0xDB, b"\x00" + bytes([8] * 64))]  # one quantisation table
    size = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    frame = bytes([8]) + size + bytes([3, 1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0])
    parts.append(segment(0xC0, frame))
    dc_counts = bytes([0, 0, 0, 12] + [0] * 12)  # DC categories 0-11: a 4-bit code each
    parts.append(segment(0xC4, b"\x00" + dc_counts + bytes(range(12))))
    parts.append(segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\x00"))  # AC: only EOB, "0"
    for component in (1, 2, 3):
        bits, previous = [], 0
        for value in rng.integers(-60, 60, blocks).tolist():
            diff, previous = value - previous, value
            category = abs(diff).bit_length()
            bits.append(f"{category:04b}")
            if category:
                bits.append(f"{diff if diff > 0 else diff - 1 + (1 << category):0{category}b}")
            bits.append("0")  # end of block
        text = "".join(bits)
        text += "1" * (-len(text) % 8)
        coded = int(text, 2).to_bytes(len(text) // 8, "big").replace(b"\xff", b"\xff\x00")
        parts.append(segment(0xDA, bytes([1, component, 0, 0, 63, 0])) + coded)
    return b"".join(parts) + b"\xff\xd9"


def scan_boundaries(data: bytes) -> list[int]:
    """Where ``data`` can be cut between two scans: before each scan header but the first, and
    before each Huffman table between scans (in scan data every ``FF`` is followed by ``00``)."""
    first = data.find(b"\xff\xda")
    return sorted(
        at
        for marker in (b"\xff\xda", b"\xff\xc4")
        for at in range(first + 1, len(data))
        if data.startswith(marker, at)
    )


def random_cuts(data: bytes, count: int, seed: int) -> list[int]:
    """``count`` lengths to cut ``data`` to, anywhere from its first scan header to the scan
    data's last byte (a copy that lost more than its end-of-image marker)."""
    import random

    return random.Random(seed).sample(range(data.find(b"\xff\xda"), len(data) - 2), count)


def pixels(data: bytes):  # type: ignore[no-untyped-def]
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def several_scans_source(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder of JPEGs of several scans cut between two of them (each with the reason it is
    skipped for), and of the same JPEGs without only their end-of-image marker."""
    root = tmp_path / "src"
    cuts: dict[str, str] = {}
    files = {
        "rgb": (progressive_jpeg(1), PROGRESSIVE_MISSING),
        "rgb444": (progressive_jpeg(2, subsampling=0), PROGRESSIVE_MISSING),
        "grey": (progressive_jpeg(3, mode="L"), PROGRESSIVE_MISSING),
        "planes": (scan_per_component_jpeg(40, 24, seed=4), COMPONENTS_MISSING),
    }
    for stem, (whole, reason) in files.items():
        write(root / "c" / f"{stem}-no-eoi.jpg", whole[:-2])
        for at in scan_boundaries(whole):
            write(root / "c" / f"{stem}-{at}.jpg", whole[:at])
            cuts[f"c/{stem}-{at}.jpg"] = reason
    return root, cuts


@pytest.mark.parametrize("verify_decode", [False, True])
def test_a_jpeg_cut_between_two_of_its_scans_is_skipped_as_truncated(
    tmp_path: Path, verify_decode: bool
) -> None:
    src, cuts = several_scans_source(tmp_path)
    assert len(cuts) > 30  # (every boundary of every file: 9 of a progressive JPEG's 10 scans)
    report = convert(src, tmp_path / "s.lmdb", verify_decode=verify_decode)
    assert skipped(report) == cuts
    repaired = [f"c/{stem}-no-eoi.jpg" for stem in ("grey", "planes", "rgb", "rgb444")]
    assert report.repaired_names == repaired and report.count == 4
    store = open_store(tmp_path / "s.lmdb")
    assert verify_store(store, decode=True).ok
    from fastdata import LMDBImageDataset

    stored = LMDBImageDataset(tmp_path / "s.lmdb", output="numpy")
    for i, name in enumerate(repaired):  # (the store's order is the folder's, sorted)
        whole = (src / name).read_bytes() + b"\xff\xd9"
        assert (stored[i][0] == pixels(whole)).all()  # the whole image, its marker appended


def test_without_libjpeg_turbo_a_jpeg_cut_between_its_scans_is_skipped_too(
    tmp_path: Path,
) -> None:
    src, cuts = several_scans_source(tmp_path)
    for flags in ([], ["--verify-decode"]):
        done = run_script(BLOCK_TURBO, "convert", src, tmp_path / f"s{len(flags)}.lmdb", *flags)
        assert done.returncode == 0, done.stderr
        for name, reason in cuts.items():
            assert f"{name}: {reason}" in done.stdout
        assert "repaired (end-of-image marker appended): 4: " in done.stdout


@pytest.mark.parametrize("decode", [False, True])
def test_a_jpeg_of_several_scans_cut_anywhere_is_not_repaired(decode: bool) -> None:
    for whole in (progressive_jpeg(5), progressive_jpeg(6, mode="L")):
        assert validate_image(whole[:-2], "x.jpg", decode=decode).repaired
        for at in random_cuts(whole, 60, seed=len(whole)):
            with pytest.raises(CorruptImageError) as refused:
                validate_image(whole[:at], "x.jpg", decode=decode)
            assert refused.value.reason.startswith("truncated")
    whole = scan_per_component_jpeg(64, 48, seed=7)
    assert (pixels(validate_image(whole[:-2], "x.jpg").data) == pixels(whole)).all()
    for at in random_cuts(whole, 60, seed=7):
        with pytest.raises(CorruptImageError) as refused:
            validate_image(whole[:at], "x.jpg", decode=decode)
        assert refused.value.reason.startswith("truncated")


def test_without_libjpeg_turbo_a_jpeg_of_several_scans_cut_anywhere_is_skipped(
    tmp_path: Path,
) -> None:
    whole = progressive_jpeg(8)
    cuts = random_cuts(whole, 40, seed=8)
    for at in cuts:
        write(tmp_path / "src" / "c" / f"{at}.jpg", whole[:at])
    write(tmp_path / "src" / "c" / "whole.jpg", whole)
    done = run_script(BLOCK_TURBO, "convert", tmp_path / "src", tmp_path / "s.lmdb", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    for at in cuts:
        assert f"c/{at}.jpg: truncated" in done.stdout
    assert "repaired (end-of-image marker appended): 0" in done.stdout


def test_a_jpeg_with_too_many_segments_to_walk_is_not_repaired() -> None:
    """The headers are walked so far and no further: a JPEG cut between two scans, which
    thousands of empty comments keep from its next scan header, is not repaired unjudged."""
    from fastdata.images.scans import MOST_SEGMENTS

    whole = progressive_jpeg(11)
    first, second = scan_boundaries(whole)[:2]
    padded = whole[:first] + b"\xff\xfe\x00\x02" * MOST_SEGMENTS + whole[first:second]
    with pytest.raises(CorruptImageError) as refused:
        validate_image(padded, "x.jpg")
    assert refused.value.reason == (
        f"more than {MOST_SEGMENTS} marker segments: too many to tell whether scans are missing"
    )


def test_verify_names_a_progressive_jpeg_cut_between_scans_and_its_export_leaves_it_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shlex

    whole = progressive_jpeg(9)
    src = tmp_path / "src"
    write(src / "c" / "whole.jpg", whole)
    write(src / "c" / "cut.jpg", whole[: scan_boundaries(whole)[2]])
    write(src / "c" / "no-eoi.jpg", progressive_jpeg(10)[:-2])
    dst = tmp_path / "s.lmdb"
    repaired_as_before(src, dst, monkeypatch)
    for decode in (False, True):
        failures = verify_store(open_store(dst), decode=decode).failures
        assert [(f.name, f.reason) for f in failures] == [("c/cut.jpg", PROGRESSIVE_MISSING)]
    found = cli("verify", str(dst), "-q")
    assert found.returncode == 1 and f"c/cut.jpg: {PROGRESSIVE_MISSING}" in found.stdout
    advised = next(c for c in found.stdout.split("`") if c.startswith("fastdata export"))
    exported = cli(*shlex.split(advised)[1:])
    assert exported.returncode == 1, exported.stdout + exported.stderr
    assert f"(c/cut.jpg): {PROGRESSIVE_MISSING}" in exported.stdout  # left out, and said so
    out = Path(shlex.split(advised)[3])
    assert sorted(p.name for p in out.rglob("*.jpg")) == ["no-eoi.jpg", "whole.jpg"]
