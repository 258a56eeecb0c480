from pathlib import Path

import pytest

from fastdata.errors import SourceError
from fastdata.sources.folder import scan_folder
from fastdata.sources.samples import Sample

from .conftest import jpeg_bytes, write


def test_classes_sorted_and_samples_deterministic(mixed_folder: Path) -> None:
    scan = scan_folder(mixed_folder)
    assert scan.classes == ["a_class", "b_class"]  # .cache is hidden
    assert scan.class_to_idx == {"a_class": 0, "b_class": 1}
    names = [s.name for s in scan.samples]
    assert "b_class/.hidden.jpg" not in names
    assert "a_class/nested/deep.jpeg" in names
    assert "a_class/gray.JPG" in names  # extensions match case-insensitively
    assert [s.label for s in scan.samples] == sorted(s.label for s in scan.samples)
    assert scan.skipped_files == 1  # notes.txt
    assert scan_folder(mixed_folder).samples == scan.samples


def test_order_matches_imagefolder(tmp_path: Path) -> None:
    # ImageFolder sorts the walked directories by path string: x, x/a, x/a b, x/a/z
    # (a top-down walk would give x/a/z before x/a b)
    for rel in ("x/a/1.jpg", "x/a b/2.jpg", "x/0.jpg", "x/a/z/3.jpg"):
        write(tmp_path / rel, jpeg_bytes())
    names = [s.name for s in scan_folder(tmp_path).samples]
    assert names == ["x/0.jpg", "x/a/1.jpg", "x/a b/2.jpg", "x/a/z/3.jpg"]


def test_missing_root_names_path(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="nope: no such folder"):
        scan_folder(tmp_path / "nope")


def test_root_without_class_folders(tmp_path: Path) -> None:
    write(tmp_path / "loose.jpg", jpeg_bytes())
    with pytest.raises(SourceError, match="no class folders"):
        scan_folder(tmp_path)


def test_class_folders_without_images(tmp_path: Path) -> None:
    write(tmp_path / "cls" / "readme.md", b"hi")
    with pytest.raises(SourceError, match="no images found"):
        scan_folder(tmp_path)


def test_fingerprint_changes_with_content(good_folder: Path) -> None:
    before = scan_folder(good_folder).fingerprint()
    write(good_folder / "cat" / "new.jpg", jpeg_bytes())
    assert scan_folder(good_folder).fingerprint() != before


def test_a_scan_holds_its_samples_packed(tmp_path: Path) -> None:
    """Nothing per image is a Python object: memory is about the name plus 12 bytes."""
    for c in range(3):
        folder = tmp_path / f"class{c}"
        folder.mkdir()
        for i in range(2000):
            (folder / f"img_{i:06d}.jpg").touch()
    scan = scan_folder(tmp_path)
    n = len(scan.samples)
    assert n == 6000
    name_bytes = sum(len(s.name) for s in scan.samples)
    assert scan.samples.nbytes <= name_bytes + 12 * n + 8 < 64 * n
    assert scan.samples[2000] == Sample("class1/img_000000.jpg", 1)
    assert scan.samples[-1] == Sample("class2/img_001999.jpg", 2)
    tail = scan.samples[5998:]
    assert [s.name for s in tail] == ["class2/img_001998.jpg", "class2/img_001999.jpg"]
    assert list(scan.samples.labels[1999:2001]) == [0, 1]
