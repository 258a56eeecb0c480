"""What the verbs report: one typed report per run, built by the verb, rendered by the CLI.

The conversion's report lives here, apart from the conversion, so that the append plan (which
adds its part to it) and the conversion import it from below, not from each other; the export's
too, which its file writing (:mod:`.export_files`) counts into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import SkippedFile

__all__ = ["ConvertReport", "ExportReport"]


@dataclass
class ConvertReport:
    """What a conversion did.

    Attributes:
        destination: the store written.
        count: records in the store.
        repaired: records whose JPEG end-of-image marker was appended.
        skipped: files left out (unreadable or not decodable), with the reason.
        non_image_files: files below the class folders ignored for their extension.
        non_image_names: the first of them, by relative path.
        total_bytes: image bytes stored.
        seconds: wall time of this run.
        resumed_from: samples already handled by an earlier run (0 for a fresh one).
        converted: samples handled by this run.
        classes: the class names, in label order.
        labelled: whether the records have classes (a manifest without labels: no).
        fields: the store's fields, as ``--fields`` writes them (``boxes:float[-1,4]``).
        reader_threads: the reader-thread counts used: the one given, or each one the
            conversion chose by measurement (1: reading in the writing thread).
        appended: the run added to a store (``append``); then ``count`` is the store's new
            size, ``converted`` what this run handled, and:
        already_stored: samples of the source the store held already (not stored again).
        added: records the append added (the store's count before it, less its count now).
        new_classes: classes the store did not have, added at the end of its class list.
        class_order: ``"sorted"`` (ImageFolder's) or ``"appended"`` (new classes at the end).
        changed: files the store holds that changed since they were stored (reported, not
            stored again).
        gone: the first few images of the store that the source no longer has (the store keeps
            them); ``gone_count`` counts them all.
        moved: ``(stored name, new name)`` of images that look moved (another folder, same file
            name): stored again as new records, the old ones kept.
        skipped_unchanged: files the store lists as skipped, unchanged since: not read again.
        resumed_options: the options a resumed run continued with, as command-line flags.
        discarded: what an append discarded before it began (an interrupted append of another
            source), or "".
        repaired_now: records this run repaired (``repaired`` is the store's total).
        compared: files of the store an append read to compare with their records.
    """

    destination: str
    count: int
    repaired: int
    skipped: list[SkippedFile]
    non_image_files: int
    total_bytes: int
    seconds: float
    resumed_from: int = 0
    converted: int = 0
    finished: bool = False
    """This run completed the store (not a run that found it complete already)."""
    destination_words: str = ""
    """The store as command-line words (``DST`` or ``URI --collection C``, quoted), for the
    commands the report prints."""
    classes: list[str] = field(default_factory=list)
    labelled: bool = True
    fields: list[str] = field(default_factory=list)
    reader_threads: list[int] = field(default_factory=list)
    non_image_names: list[str] = field(default_factory=list)
    unused_columns: list[str] = field(default_factory=list)
    sidecars_seen: list[str] = field(default_factory=list)
    """Extensions of files beside images, named like them, that were not read (no
    ``--sidecars``): the images' fields, it may be."""
    """A CSV manifest's columns not stored (neither path, label nor named by ``--fields``)."""
    repaired_names: list[str] = field(default_factory=list)
    """The first images this run repaired, by name."""
    appended: bool = False
    already_stored: int = 0
    added: int = 0
    new_classes: list[str] = field(default_factory=list)
    class_order: str = "sorted"
    changed: list[SkippedFile] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    gone_count: int = 0
    moved: list[tuple[str, str]] = field(default_factory=list)
    skipped_unchanged: int = 0
    resumed_options: list[str] = field(default_factory=list)
    discarded: str = ""
    repaired_now: int = 0
    compared: int = 0

    @property
    def images_per_second(self) -> float:
        return self.converted / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ExportReport:
    """What :func:`~fastdata.ops.export.export_store` wrote."""

    outdir: str
    files: int = 0
    total_bytes: int = 0
    kept: int = 0
    """Files that existed with the right bytes (``resume``) and were left as they were."""
    damaged: list[str] = field(default_factory=list)
    """Records left out because they fail their checksum or fields check, or their name is
    one no conversion gives or an earlier record's (``skip_damaged``), each as ``record N
    (name)`` (``record N`` where its header cannot be read)."""
    undecodable: list[str] = field(default_factory=list)
    """Records left out because they do not decode (``decode`` and ``skip_damaged``), each as
    ``record N (name): why``."""
    repaired: bool = False
    manifest: str = ""
    """For a store converted from a manifest: the manifest written beside the images (JSON Lines,
    its first line the class list), which converts back to the same store."""
    sidecars: int = 0
    """Sidecar files written beside the images (a folder store's fields)."""
    convert_back: str = ""
    """The command that converts what was written back into a store like this one (the fields'
    types declared, so that they do not depend on what the values look like)."""
