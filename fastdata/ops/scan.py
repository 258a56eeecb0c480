"""A conversion's source and destination, before anything is written: the folder or manifest
scanned with the options that apply to it (:func:`scan_source`), scanned again with a store's
own fields for an append to it (:func:`scan_for_store`, :func:`stored_meta`), and a destination
refused where the store would hold what it converts (:func:`check_destination`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import Phrase, SourceError, UsageError, option
from ..fields import parse_field_specs
from ..records import StoreMeta
from ..sources.folder import scan_folder
from ..sources.manifest import is_manifest, listed_folders, scan_manifest
from ..sources.samples import FolderScan
from ..stores import StoreWriter

__all__ = [
    "STRICT_HINT",
    "check_destination",
    "scan_for_store",
    "scan_source",
    "stored_meta",
]

STRICT_HINT = (
    " (",
    option("strict"),
    " stops at the first unusable file; without it such files are skipped and listed)",
)


def check_destination(scan: FolderScan, writer: StoreWriter) -> None:
    """Refuse a store where it would hold what it converts, comparing paths with links
    resolved: inside the source folder, or, for a manifest (whose source is the files it lists,
    not the folder it sits in), at the manifest or at a folder that holds a listed file."""
    target = getattr(writer, "path", None)
    if not isinstance(target, str):
        return  # not on the file system
    dest = Path(os.path.realpath(target))
    if scan.layout == "manifest":
        manifest = Path(scan.source)
        if dest == manifest or dest in manifest.parents:
            raise SourceError(
                f"{target}: the store would be written over the manifest {scan.source}; "
                "choose another destination"
            )
        for folder in map(Path, listed_folders(scan)):
            if dest == folder or dest in folder.parents:
                raise SourceError(
                    f"{target}: the store would be written where the manifest's images are "
                    f"(links resolved, {folder} is {'it' if dest == folder else 'inside it'}); "
                    "choose a destination that holds none of them (the images are never "
                    "written to)"
                )
        return
    root = Path(os.path.realpath(scan.root))
    if dest == root or root in dest.parents:
        raise SourceError(
            f"{target}: the store would be written inside the source folder {scan.root} "
            f"(links resolved, it is {dest}); choose a destination outside it (the source "
            "folder is never written to)"
        )


def stored_meta(
    destination: str | os.PathLike[str],
    collection: str | None,
    source: str | os.PathLike[str],
    mongo: dict[str, Any],
) -> StoreMeta | None:
    """The metadata of the store an append goes to, or None where none can be read (the writer
    says why, under its lock)."""
    from ..errors import FastdataError
    from ..stores import open_store

    given = Path(source).expanduser()
    root = given.parent if is_manifest(source) else given
    try:
        if str(destination).startswith("mongodb"):
            reader = open_store(destination, collection=collection or root.resolve().name, **mongo)
        else:
            reader = open_store(destination)
    except (FastdataError, OSError, ValueError):
        return None
    try:
        return reader.meta
    except (FastdataError, OSError):
        return None
    finally:
        reader.close()


def scan_for_store(
    base: StoreMeta,
    source: str | os.PathLike[str],
    classes: Sequence[str] | None,
    strict: bool,
    drop_unlisted: bool,
    fields: str | Sequence[str] | None,
    sidecars: Sequence[str] | str | None,
) -> FolderScan:
    """For an append to a store with fields: the source scanned with the store's fields as its
    declared types (and its sidecars), which an append keeps; no other field is taken.
    Inferred from the new rows alone, a type could differ (ints where the store has floats, or
    the other way round) and values would be refused or changed.

    Raises:
        UsageError: ``--fields`` (of the store's, any) or ``--sidecars`` given, other than the
            store's.
    """
    if is_manifest(source) != (base.layout == "manifest"):
        # a folder against a manifest's store, or the other way round: refused by the plan,
        # which says so (the store's fields would not apply)
        return scan_source(source, classes, strict, drop_unlisted, fields, sidecars)
    schema = base.schema
    keep: list[str | Phrase] = [option("fields", schema.describe(","))] if schema else []
    if base.sidecars:
        keep[:0] = [
            option("sidecars", ",".join(base.sidecars)),
            *([Phrase(" ", ", ")] * bool(schema)),
        ]
    if fields is not None:
        declared, star = parse_field_specs(fields)
        if star or any(schema.get(f.name) != f for f in declared):  # (some of them, or all)
            raise UsageError(
                f"{source}: the store's fields are {schema.describe() or 'none'}; an append "
                "keeps them: leave ",
                option("fields", None),
                " out (or give ",
                *keep,
                ")",
            )
    given = [ext.strip().lstrip(".") for ext in sidecar_words(sidecars)]
    if given and given != list(base.sidecars):
        raise UsageError(
            f"{source}: the store's sidecars are {','.join(base.sidecars) or 'none'}; an append "
            "reads the same: leave ",
            option("sidecars", None),
            " out",
            *((" (or give ", *keep, ")") if base.sidecars else ()),
        )
    return scan_source(
        source,
        classes,
        strict,
        drop_unlisted,
        schema.describe(",") if schema else None,
        list(base.sidecars) or None,
        closed=True,
    )


def sidecar_words(sidecars: Sequence[str] | str | None) -> list[str]:
    """``--sidecars`` as extensions: ``"json,txt"`` or ``["json", "txt"]``."""
    items = [sidecars] if isinstance(sidecars, str) else list(sidecars or [])
    return [ext for item in items for ext in item.split(",") if ext.strip()]


def scan_source(
    source: str | os.PathLike[str],
    classes: Sequence[str] | None,
    strict: bool,
    drop_unlisted: bool = False,
    fields: str | Sequence[str] | None = None,
    sidecars: Sequence[str] | str | None = None,
    closed: bool = False,
) -> FolderScan:
    """The samples of a folder or a manifest; with ``strict``, none may be unusable;
    ``closed``: the declared fields are all there are (an append's)."""
    declared, star = parse_field_specs(fields) if fields is not None else ([], False)
    side = sidecar_words(sidecars)
    if is_manifest(source):
        if side:
            raise UsageError(
                f"{source}: ",
                option("sidecars", None),
                " reads files beside a folder's images; a manifest gives its fields in its own "
                "rows (JSON Lines keys, or CSV columns with ",
                option("fields", None),
                ")",
            )
        if star and not str(source).lower().endswith(".csv"):
            raise UsageError(
                f"{source}: ",
                option("fields", "*"),
                " picks CSV columns; in JSON Lines every key is a field",
            )
        scan = scan_manifest(
            source,
            classes,
            drop_unlisted=drop_unlisted,
            fields=declared,
            all_fields=star,
            closed=closed,
        )
    elif classes is not None:
        raise UsageError(f"{source}: a class list applies to manifests, not to image folders")
    else:
        if (declared or star) and not side:
            raise UsageError(
                f"{source}: ",
                option("fields", None),
                " types a manifest's fields or a folder's sidecar fields; give ",
                option("sidecars", "json,txt"),
                " (the files beside each image) for a folder",
            )
        if star:
            raise UsageError(
                f"{source}: ", option("fields", "*"), " picks CSV columns, not sidecar fields"
            )
        scan = scan_folder(source, sidecars=side, fields=declared, closed=closed)
    if strict and scan.unusable:
        first = scan.unusable[0]
        where = (
            f"{scan.source}: {first.name}"
            if scan.layout == "manifest"
            else str(scan.root / first.name)
        )
        raise SourceError(f"{where}: {first.reason}", *STRICT_HINT)
    return scan
