"""The commands that write a store: ``convert`` (and ``--append``) and ``copy``."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

import click

from ..fields import check_name
from .app import (
    ByteSize,
    allow_pickle_option,
    cli,
    human_size,
    listing,
    parse_query,
    quiet_option,
    timeout_option,
    verbose_given,
    where_option,
    writing,
)

if TYPE_CHECKING:
    from ..ops.reports import ConvertReport


@cli.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=str)
@click.option(
    "--workers",
    "-j",
    type=click.IntRange(1, 256),
    help="Reader threads (default: the fastest of a few, measured as the conversion runs; "
    "1 reads in the writing thread).",
)
@click.option("--strict", is_flag=True, help="Stop at the first unusable image; don't skip.")
@click.option(
    "--verify-decode",
    is_flag=True,
    default=None,
    help="Also decode every image; skip undecodable (a resume keeps what the run began with).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted conversion into DST, with the options it began with.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing store at DST.")
@click.option(
    "--append",
    is_flag=True,
    help="Add the images of SRC that the store DST does not hold yet (by relative path).",
)
@click.option(
    "--drop-unlisted-classes",
    "drop_unlisted",
    is_flag=True,
    help="With --classes (or a manifest's own class list): leave out the rows of classes the "
    "list lacks, instead of refusing the list.",
)
@click.option(
    "--check-content",
    is_flag=True,
    help="With --append: compare every stored file's bytes with its record (checksum), not only "
    "its size and, for files modified since, its bytes.",
)
@click.option(
    "--classes",
    "classes_file",
    type=click.Path(dir_okay=False, exists=True),
    help="For a manifest SRC: the class order, one name a line (integer labels index it).",
)
@click.option(
    "--fields",
    help="Per-image fields beyond the class: for a CSV manifest the columns to keep ('*': all), "
    "for JSON Lines (every key is a field) or --sidecars the types of those named; "
    "NAME[:TYPE] separated by commas, TYPE str (default), int, float, bool or json, a list "
    "of numbers as float[4] or float[-1,4] (-1: any length), e.g. caption,boxes:float[-1,4].",
)
@click.option(
    "--sidecars",
    help="For an image folder: the files beside each image that give its fields, by extension "
    "(json,txt: x.json's keys and x.txt's text become fields of x.jpg).",
)
@click.option(
    "--collection", "-c", help="Mongo collection, when DST is a URI (default: SRC's name)."
)
@click.option(
    "--max-file-size",
    type=ByteSize(),
    help="Skip files larger than this (bytes, or with K, M, G; default 1G; a resume keeps the "
    "size it began with).",
)
@timeout_option
@quiet_option
def convert(
    src: str,
    dst: str,
    collection: str | None,
    workers: int | None,
    strict: bool,
    verify_decode: bool | None,
    resume: bool,
    overwrite: bool,
    append: bool,
    check_content: bool,
    drop_unlisted: bool,
    classes_file: str | None,
    fields: str | None,
    sidecars: str | None,
    max_file_size: int | None,
    timeout: float | None,
    quiet: bool,
) -> None:
    """Convert the image folder SRC (SRC/<class>/<image>), or the manifest SRC (a .csv with
    path and label columns, or a .jsonl with those keys), into the store DST.

    DST is an LMDB folder, or a MongoDB URI (mongodb://host:port/DB, credentials in the URI or
    in FASTDATA_MONGO_USER / FASTDATA_MONGO_PASSWORD). Every image is validated; JPEGs missing
    their end-of-image marker are repaired; unusable files are skipped and listed (or, with
    --strict, stop the run). SRC is only read.

    With --append, the images of SRC that DST does not hold yet (by relative path) are added
    as new records, in place: labels already given keep their meaning (new classes go at the end
    of the class list), readers that have DST open go on reading what they opened, and files
    that changed since they were stored are reported, not stored twice.

    Images may carry fields beyond their class (captions, multi-labels, boxes, any JSON): the
    keys of a JSON Lines row, the CSV columns --fields names, or sidecar files (--sidecars). A
    manifest without labels makes a store without classes (every target is -1).

    \b
    Example:
      fastdata convert ~/data/imagenet/train train.lmdb --workers 8
      fastdata convert ~/data/imagenet/train mongodb://db1:27017/images -c train
      fastdata convert ~/data/imagenet/train train.lmdb --append
      fastdata convert ~/data/imagenet/val.csv val.lmdb --classes synsets.txt
      fastdata convert captions.jsonl captions.lmdb
      fastdata convert boxes.csv boxes.lmdb --fields 'boxes:float[-1,4],source'
      fastdata convert ~/data/shards/train train.lmdb --sidecars json,txt
    """
    from ..ops.convert import convert as run_convert
    from ..sources.manifest import read_class_list

    with writing("converting", quiet, resume, overwrite) as progress:
        report = run_convert(
            src,
            dst,
            workers=workers,
            strict=strict,
            verify_decode=verify_decode,
            resume=resume,
            overwrite=overwrite,
            progress=progress,
            collection=collection,
            max_file_bytes=max_file_size,
            timeout_s=timeout,
            tune_allocator=True,  # this process is the conversion's alone
            append=append,
            classes=read_class_list(classes_file) if classes_file else None,
            check_content=check_content,
            drop_unlisted=drop_unlisted,
            fields=fields,
            sidecars=sidecars,
        )
    _render_convert(report, measured=workers is None)


@cli.command()
@click.argument("src")
@click.argument("dst")
@click.option(
    "--source-collection",
    help="SRC's collection, when both SRC and DST are mongodb:// URIs.",
)
@click.option(
    "--collection",
    "-c",
    help="The collection of the one side that is a mongodb:// URI; when both are, DST's "
    "(default: SRC's name).",
)
@click.option("--resume", is_flag=True, help="Continue an interrupted copy into DST.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store at DST.")
@where_option("Copy only the records a query selects")
@allow_pickle_option
@timeout_option
@quiet_option
def copy(
    src: str,
    dst: str,
    source_collection: str | None,
    collection: str | None,
    resume: bool,
    overwrite: bool,
    query: str | None,
    allow_pickle: bool,
    timeout: float | None,
    quiet: bool,
) -> None:
    """Copy the store SRC into DST: LMDB or MongoDB on either side.

    Every record's bytes, checksum and flags, the labels, the skipped list and the metadata are
    carried over as they are, each record checked against its checksum on the way; an LMDB copy
    is compacted. The same rules as convert: one writer at a time, --overwrite builds the new
    store aside, --resume continues after an interruption.

    \b
    Example:
      fastdata copy train.lmdb mongodb://db1:27017/images -c train
      fastdata copy mongodb://db1:27017/images -c train /local/train.lmdb
      fastdata copy train.lmdb crowded.lmdb --where '{"fields.boxes.3": {"$exists": true}}'
    """
    from ..ops.copy import copy_store

    where = parse_query(query)
    with writing("copying", quiet, resume, overwrite) as progress:
        report = copy_store(
            src,
            dst,
            source_collection=source_collection,
            collection=collection,
            resume=resume,
            overwrite=overwrite,
            allow_pickle=allow_pickle,
            progress=progress,
            timeout_s=timeout,
            where=where,
        )
    click.echo(f"{report.destination}: {report.count} records, {human_size(report.total_bytes)}")
    if report.resumed_from:
        click.echo(f"resumed after {report.resumed_from} records already copied")
    click.echo(
        f"{report.copied} records copied in {report.seconds:.1f} s "
        f"({report.records_per_second:.0f} records/s), every checksum checked"
    )


def _counted(what: str, count: int, names: list[str]) -> None:
    """``what: count``, naming the first few of them (20 with the group's ``-v``)."""
    shown = names[: 20 if verbose_given() else 3]
    line = f"{what}: {count}"
    if shown:
        line += f": {', '.join(shown)}"
    unnamed = count - len(shown)
    if shown and unnamed > 0:
        line += f" and {unnamed} more"
        if len(shown) < len(names):
            line += " (`fastdata -v` before the command names 20)"
    click.echo(line)


def _render_convert(report: ConvertReport, *, measured: bool) -> None:
    """What a conversion or an append did, as the CLI prints it."""
    n = len(report.classes)
    classes = f"{n} class{'es' * (n != 1)}" if report.labelled else "no classes (targets -1)"
    click.echo(
        f"{report.destination}: {report.count} images in {classes}, "
        f"{human_size(report.total_bytes)}"
    )
    if report.fields:
        click.echo(f"fields: {', '.join(report.fields)}")
    if report.appended:
        if report.converted + report.resumed_from == 0:
            click.echo(
                f"nothing to add: the store holds all {report.already_stored} usable images of "
                "the source; it is left exactly as it was"
            )
        else:
            click.echo(
                f"appended {report.added} new image(s); {report.already_stored} of the source's "
                "were in the store already"
            )
        if report.skipped_unchanged:
            click.echo(
                f"{report.skipped_unchanged} file(s) skipped before and unchanged since: not "
                f"read again (`fastdata info {report.destination_words} --skipped` lists them)"
            )
        if report.gone_count:
            more = report.gone_count - len(report.gone)
            listing(
                f"{report.gone_count} image(s) of the store are no longer in the source (the "
                "store keeps them; convert with --overwrite to drop them):",
                [*report.gone, *([f"... and {more} more"] if more else [])],
            )
        if report.moved:
            listing(
                "moved, it seems (same file name, another folder): stored again under the new "
                "path and label, the old record kept:",
                (f"{old} -> {new}" for old, new in report.moved),
            )
        added_classes = [c for c in report.new_classes if c in report.classes]
        if added_classes:
            click.echo(f"new classes, added at the end: {', '.join(added_classes)}")
        if report.class_order != "sorted":
            click.echo(
                "note: the class order is no longer ImageFolder's (sorted): labels already "
                "given keep their meaning, new classes come after them"
            )
        if report.changed:
            listing(
                f"{len(report.changed)} file(s) changed since they were stored (not stored "
                "again; convert with --overwrite to take the new versions):",
                (f"{c.name}: {c.reason}" for c in report.changed),
            )
    if report.discarded:
        click.echo(f"discarded {report.discarded}")
    if report.resumed_options or (report.resumed_from and report.converted):
        flags = " ".join(report.resumed_options)
        click.echo(
            f"resumed after {report.resumed_from} images already converted"
            + (f", with the options it began with: {flags}" if flags else "")
        )
    elif not report.appended and not report.converted and report.finished:
        click.echo(
            f"resumed after {report.resumed_from} images already converted: the store is "
            "complete now"
        )
    elif not report.appended and not report.converted:
        click.echo("the conversion is complete already; nothing to do")
    click.echo(
        f"{report.converted} files read in {report.seconds:.1f} s "
        f"({report.images_per_second:.0f} files/s)"
    )
    if report.compared:
        click.echo(
            f"{report.compared} stored file(s) read again to compare with their records "
            "(modified no earlier than their record was written: times are not precise enough "
            "to tell)"
        )
    if report.reader_threads:
        counts = sorted(set(report.reader_threads))
        how = " (the fastest of the counts measured; --workers N fixes it)" if measured else ""
        click.echo(f"reader threads: {'/'.join(map(str, counts))}{how}")
    repaired = report.repaired_now if report.appended else report.repaired
    title = "repaired in this append" if report.appended else "repaired"
    _counted(f"{title} (end-of-image marker appended)", repaired, report.repaired_names)
    if report.non_image_files:
        _counted("non-image files ignored", report.non_image_files, report.non_image_names)
    if report.sidecars_seen:
        exts = ",".join(report.sidecars_seen)
        click.echo(
            f"  (files named like the images, .{exts.replace(',', ' .')}: their fields? "
            f"--sidecars {exts} stores them with each image)"
        )
    if report.unused_columns:
        # (a column named twice cannot be one: --fields would be refused)
        once = [c for c in report.unused_columns if report.unused_columns.count(c) == 1]
        usable = [c for c in once if check_name(c, "") is None]
        names = ",".join([*report.fields, *usable])  # (the fields stored, and these)
        kept = f" (keep them with --fields {shlex.quote(names)}, a type each where not text)"
        click.echo(
            f"CSV columns not stored: {', '.join(report.unused_columns)}{kept if usable else ''}"
        )
    if report.skipped:
        listing(
            f"skipped {len(report.skipped)} unusable file(s):",
            (f"{s.name}: {s.reason}" for s in report.skipped),
        )
