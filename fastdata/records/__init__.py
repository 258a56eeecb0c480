"""The schema both backends share: one record per image, and the store's metadata.

A record is the same thing in LMDB and MongoDB; the backends differ only in where the bytes live.
Image bytes are stored as they are; everything else is plain JSON or little-endian integers, so any
LMDB or Mongo client can read a store without fastdata (``docs/format.md`` writes the format down).
Nothing is pickled.

- ``header``: a record, its header, checksums, and the checks of a record's bytes and fields;
- ``progress``: a run's saved progress and the skipped list;
- ``meta``: a complete store's metadata and its labels.
"""

from .header import (
    CHECKSUM_IMPLEMENTATION,
    DAMAGED_SCAN_END,
    Record,
    RecordHeader,
    bytes_problem,
    checksum,
    checksums,
    decode_json,
    fields_problem,
    first_mismatch,
    name_bytes,
    plain_headers,
)
from .meta import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LABEL_DTYPE,
    MAX_CLASSES,
    StoreMeta,
    check_labels,
    class_count,
    new_store_id,
)
from .progress import Progress, SkippedFile, skipped_file

__all__ = [
    "CHECKSUM_IMPLEMENTATION",
    "DAMAGED_SCAN_END",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LABEL_DTYPE",
    "MAX_CLASSES",
    "Progress",
    "Record",
    "RecordHeader",
    "SkippedFile",
    "StoreMeta",
    "bytes_problem",
    "check_labels",
    "checksum",
    "checksums",
    "class_count",
    "decode_json",
    "fields_problem",
    "first_mismatch",
    "name_bytes",
    "new_store_id",
    "plain_headers",
    "skipped_file",
]
