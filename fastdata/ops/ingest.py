"""What a conversion's workers do to each sample: read its file, validate (and repair) the
image, and checksum it and its field values into the header of the record it becomes
(:func:`sample_loader`). Workers never write; the conversion stores what they give back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CorruptImageError
from ..images.validate import validate_image
from ..records import RecordHeader, SkippedFile, checksum
from ..sources.reading import read_file
from ..sources.samples import FolderScan, Sample

__all__ = ["Loaded", "sample_loader"]


@dataclass(frozen=True)
class Loaded:
    """A sample read and validated by a worker, ready to be stored."""

    header: RecordHeader
    data: bytes


_decode_json = json.JSONDecoder().decode


def sample_loader(
    scan: FolderScan, verify_decode: bool, max_file_bytes: int
) -> Callable[[list[Sample]], list[tuple[Sample, Loaded | SkippedFile]]]:
    """The workers' job: read, validate and checksum a chunk of samples (never writes)."""

    def skip(sample: Sample, path: str, reason: str) -> SkippedFile:
        # the file as it was, so that an append reads it again only once it changed
        try:
            st = os.stat(path)
        except OSError:
            return SkippedFile(sample.name, reason)
        return SkippedFile(sample.name, reason, st.st_size, st.st_mtime_ns)

    def load_one(sample: Sample) -> Loaded | SkippedFile:
        path = scan.file_path(sample.name)
        data = read_file(path, max_file_bytes)
        if isinstance(data, str):
            return skip(sample, path, data)
        try:
            checked = validate_image(data, sample.name, decode=verify_decode)
        except CorruptImageError as exc:
            return skip(sample, path, exc.reason)
        encoded = sample.fields
        header = RecordHeader(
            name=sample.name,
            label=sample.label,
            size=len(checked.data),
            crc32=checksum(checked.data),
            format=checked.format,
            repaired=checked.repaired,
            scan_end=checked.scan_end,
            fields=None if encoded is None else _decode_json(encoded.decode("utf-8")),
            fields_crc32=-1 if encoded is None else checksum(encoded),
            encoded_fields=encoded,
        )
        return Loaded(header, checked.data)

    def load(chunk: list[Sample]) -> list[tuple[Sample, Loaded | SkippedFile]]:
        return [(sample, load_one(sample)) for sample in chunk]

    return load
