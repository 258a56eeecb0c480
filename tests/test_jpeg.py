import pytest

from fastdata.errors import CorruptImageError
from fastdata.images.codec import JpegState, inspect_jpeg, repair_jpeg, sniff
from fastdata.images.validate import validate_image

from .conftest import jpeg_bytes, png_bytes


def test_sniff_uses_bytes_not_names() -> None:
    assert sniff(jpeg_bytes()) == "jpeg"
    assert sniff(png_bytes()) == "png"
    assert sniff(b"GIF89a....") == "gif"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "webp"
    assert sniff(b"P6\n3 3\n255\n") == "ppm"
    assert sniff(b"II*\x00....") == "tiff"
    assert sniff(b"hello world") is None
    assert sniff(b"") is None


def test_whole_jpeg_is_ok() -> None:
    assert inspect_jpeg(jpeg_bytes())[0] is JpegState.OK


def test_missing_eoi_is_repaired_by_appending_marker() -> None:
    good = jpeg_bytes(seed=3)
    damaged = good[:-2]
    assert inspect_jpeg(damaged)[0] is JpegState.MISSING_EOI
    fixed, repaired = repair_jpeg(damaged)
    assert repaired and fixed == good


def test_trailing_bytes_after_eoi_are_not_damage() -> None:
    data = jpeg_bytes() + b"\x00" * 100 + b"\xff\xd8 appended"
    fixed, repaired = repair_jpeg(data)
    assert not repaired and fixed == data


def test_thumbnail_eoi_in_header_does_not_hide_missing_eoi() -> None:
    # An APP segment holding FF D9 (as an EXIF thumbnail does) must be skipped by length.
    good = jpeg_bytes()
    payload = b"Exif\x00\x00" + b"\xff\xd8\xff\xd9"
    app1 = b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload
    with_thumb = good[:2] + app1 + good[2:]
    assert inspect_jpeg(with_thumb)[0] is JpegState.OK
    assert inspect_jpeg(with_thumb[:-2])[0] is JpegState.MISSING_EOI


def test_cut_inside_headers_is_corrupt() -> None:
    state, reason = inspect_jpeg(jpeg_bytes()[:100])
    assert state is JpegState.CORRUPT and "truncated" in reason
    with pytest.raises(CorruptImageError):
        repair_jpeg(jpeg_bytes()[:100])


def test_validate_rejects_empty_and_unknown_with_name() -> None:
    with pytest.raises(CorruptImageError, match=r"x/empty.jpg: empty file"):
        validate_image(b"", "x/empty.jpg")
    with pytest.raises(CorruptImageError, match=r"x/t.jpg: not a recognised image format"):
        validate_image(b"just text", "x/t.jpg")


def test_validate_returns_real_format_and_repair_flag() -> None:
    checked = validate_image(png_bytes(), "p.jpg")
    assert checked.format == "png" and not checked.repaired
    checked = validate_image(jpeg_bytes()[:-2], "j.jpg")
    assert checked.format == "jpeg" and checked.repaired and checked.data.endswith(b"\xff\xd9")


def test_validate_decode_rejects_what_pillow_cannot_decode() -> None:
    cut_png = png_bytes()[:60]
    validate_image(cut_png, "b.png")  # the signature alone passes
    with pytest.raises(CorruptImageError, match=r"b\.png: cannot decode"):
        validate_image(cut_png, "b.png", decode=True)


def test_the_marker_after_a_scan_is_found_where_the_pattern_finds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search for the marker after a scan's data (in the compiled module, where it is
    built: 64 bytes at a time; otherwise long data compared as an array) finds what the pattern
    finds (stuffed bytes, restart markers, fill, a lone FF at the end, none), across the pieces
    it compares at once."""
    import random

    from fastdata.images import codec

    module = codec._jpegwindow
    monkeypatch.setattr(codec, "_jpegwindow", None)  # (the paths in Python, below)
    rng = random.Random(3)
    pieces = [b"\xff\x00", b"\xff\xd3", b"\xff\xff", b"\xff\xd9", b"\xff\xc4", b"\x12", b"\xff"]
    weights = [30, 3, 1, 0.05, 0.05, 200, 0.02]
    monkeypatch.setattr(codec, "_SEARCH_CHUNK", 97)  # (pieces end inside pairs)
    for size in (10, 300, 5000, 40000):
        for _ in range(40):
            data = b"".join(rng.choices(pieces, weights, k=size)) + rng.choice([b"", b"\xff"])
            n = len(data)
            for start in {max(0, s) for s in (0, 1, 63, n // 3, n - 65, n - 1, n)}:
                found = codec._MARKER_AFTER_SCAN.search(data, start)
                want = None if found is None else found.start()
                if module is not None:
                    assert module.marker_after(data, start) == (-1 if want is None else want)
                monkeypatch.setattr(codec, "_SEARCH_AS_ARRAY", 0)
                assert codec.marker_after(data, start) == want
                assert codec.marker_after(memoryview(data), start) == want
                monkeypatch.setattr(codec, "_SEARCH_AS_ARRAY", 16 << 10)
                assert codec.marker_after(data, start) == want
