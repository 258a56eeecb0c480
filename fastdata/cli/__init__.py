"""The ``fastdata`` command: a thin shell over the library. Only this module prints."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import click

from .. import __version__
from ..errors import FastdataError

__all__ = ["main"]


class _Group(click.Group):
    """Turns library errors into one line on stderr and their exit code, without a traceback.

    Exit codes: 0 success; 1 a failure (a damaged record, a server away, a full disk, another
    writer); 2 a usage mistake (a bad option, a store that exists or does not, nothing to resume);
    130 interrupted. A closed pipe (``fastdata info | head``) ends quietly.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _silence_stdout()
            ctx.exit(0)
        except FastdataError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except OSError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(1)


@contextmanager
def _progress(label: str, quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing a bar on stderr (None when quiet or stderr is not a tty)."""
    if quiet:
        yield None
        return
    bars: list[Any] = []
    seen = [0]

    def update(done: int, total: int) -> None:
        if not bars:
            bar = click.progressbar(
                length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True
            )
            bar.__enter__()
            bars.append(bar)
        bars[0].update(done - seen[0])
        seen[0] = done

    try:
        yield update
    finally:
        for bar in bars:
            bar.__exit__(None, None, None)


@contextmanager
def _writing(
    dst: str, label: str, quiet: bool, resume: bool, overwrite: bool
) -> Iterator[Callable[[int, int], None] | None]:
    """A command that writes the store ``dst``: its progress bar; on Ctrl-C, how to finish it
    (exit 130)."""
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other")
    try:
        with _progress(label, quiet) as progress:
            yield progress
    except KeyboardInterrupt:
        how = "with --resume in place of --overwrite" if overwrite else "with --resume"
        click.echo(
            f"\ninterrupted; what was committed is kept: run the same command {how} to finish "
            f"({dst})",
            err=True,
        )
        sys.exit(130)


def _listing(title: str, lines: Iterable[str]) -> None:
    """A title and its items, indented under it."""
    click.echo(title)
    for line in lines:
        click.echo(f"  {line}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _silence_stdout() -> None:
    """The reader of our output went away: send the rest nowhere, so that nothing complains."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _mongo(options: dict[str, Any]) -> dict[str, Any]:
    """The MongoDB options given on the command line (none when not given)."""
    timeout = options.pop("timeout", None)
    return {"timeout_s": timeout} if timeout is not None else {}


def _open(store: str, options: dict[str, Any]) -> Any:
    from ..stores import open_store

    return open_store(
        store,
        allow_pickle=options["allow_pickle"],
        collection=options["collection"],
        index_file=options["index_file"],
        **_mongo(options),
    )


_timeout = click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    help="Seconds to wait for a MongoDB server to answer (default 10).",
)


_allow_pickle = click.option(
    "--allow-pickle",
    is_flag=True,
    help="Read an LMDB store written by the pickle-based recipes (only stores you trust).",
)


def _store_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options every command that reads a store takes."""
    fn = _allow_pickle(fn)
    fn = click.option(
        "--index-file",
        type=click.Path(dir_okay=False, exists=True),
        help="JSON index of a Mongo collection in the img_name/bson_img layout.",
    )(fn)
    fn = _timeout(fn)
    return click.option(
        "--collection", "-c", help="The collection, when STORE is a mongodb:// URI."
    )(fn)


_quiet = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")


class WorkerCount(click.ParamType):
    """``auto`` or a whole number of worker processes."""

    name = "auto|N"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        if isinstance(value, int) or value == "auto":
            return value
        if str(value).isdigit():
            return int(value)
        self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)


class ByteSize(click.ParamType):
    """A size in bytes: ``123``, ``64K``, ``512M``, ``2G`` (powers of 1024)."""

    name = "size"
    _units: ClassVar[dict[str, int]] = {
        "": 1,
        "K": 1 << 10,
        "M": 1 << 20,
        "G": 1 << 30,
        "T": 1 << 40,
    }

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        number, unit = text.rstrip("KMGT"), text[len(text.rstrip("KMGT")) :]
        if unit in self._units and number.isdigit():
            return int(number) * self._units[unit]
        self.fail(f"{value!r} is not a size (e.g. 500M, 2G)", param, ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fastdata")
@click.option("--verbose", "-v", is_flag=True, help="Log what the library does.")
def cli(verbose: bool) -> None:
    """Pack image folders into LMDB and read them back fast in PyTorch.

    \b
    Example:
      fastdata convert ~/data/train train.lmdb
      fastdata info train.lmdb
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )


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
    "--collection", "-c", help="Mongo collection, when DST is a URI (default: SRC's name)."
)
@click.option(
    "--max-file-size",
    type=ByteSize(),
    help="Skip files larger than this (bytes, or with K, M, G; default 1G; a resume keeps the "
    "size it began with).",
)
@_timeout
@_quiet
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
    classes_file: str | None,
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

    \b
    Example:
      fastdata convert ~/data/imagenet/train train.lmdb --workers 8
      fastdata convert ~/data/imagenet/train mongodb://db1:27017/images -c train
      fastdata convert ~/data/imagenet/train train.lmdb --append
      fastdata convert ~/data/imagenet/val.csv val.lmdb --classes synsets.txt
    """
    from ..ops.convert import convert as run_convert
    from ..sources.manifest import read_class_list

    where = f"{dst} --collection {collection}" if collection else dst
    with _writing(where, "converting", quiet, resume, overwrite) as progress:
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
        )
    click.echo(
        f"{report.destination}: {report.count} images in {len(report.classes)} classes, "
        f"{_human(report.total_bytes)}"
    )
    if report.appended:
        added = report.converted + report.resumed_from - len(report.skipped)
        if report.converted + report.resumed_from == 0:
            click.echo(
                f"nothing to add: the store holds all {report.already_stored} usable images of "
                "the source; it is left exactly as it was"
            )
        else:
            click.echo(
                f"appended {max(0, added)} new images; {report.already_stored} of the source's "
                "were in the store already"
            )
        if report.skipped_unchanged:
            click.echo(
                f"{report.skipped_unchanged} file(s) skipped before and unchanged since: not "
                "read again (`fastdata info --skipped` lists them)"
            )
        if report.gone_count:
            more = report.gone_count - len(report.gone)
            _listing(
                f"{report.gone_count} image(s) of the store are no longer in the source (the "
                "store keeps them; convert with --overwrite to drop them):",
                [*report.gone, *([f"... and {more} more"] if more else [])],
            )
        if report.moved:
            _listing(
                "moved, it seems (same file name, another folder): stored again under the new "
                "path and label, the old record kept:",
                (f"{old} -> {new}" for old, new in report.moved),
            )
        if report.new_classes:
            click.echo(f"new classes, added at the end: {', '.join(report.new_classes)}")
        if report.class_order != "sorted":
            click.echo(
                "note: the class order is no longer ImageFolder's (sorted): labels already "
                "given keep their meaning, new classes come after them"
            )
        if report.changed:
            _listing(
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
    elif not report.appended and not report.converted:
        click.echo("the conversion is complete already; nothing to do")
    click.echo(
        f"{report.converted} files read in {report.seconds:.1f} s "
        f"({report.images_per_second:.0f} files/s)"
    )
    if report.compared:
        click.echo(
            f"{report.compared} stored file(s) read again to compare with their records "
            "(modified since they were stored)"
        )
    if report.reader_threads:
        counts = sorted(set(report.reader_threads))
        click.echo(f"reader threads: {'/'.join(map(str, counts))}")
    if report.appended:
        click.echo(f"repaired in this append (end-of-image marker appended): {report.repaired_now}")
    else:
        click.echo(f"repaired (end-of-image marker appended): {report.repaired}")
    if report.non_image_files:
        click.echo(f"non-image files ignored: {report.non_image_files}")
    if report.skipped:
        _listing(
            f"skipped {len(report.skipped)} unusable file(s):",
            (f"{s.name}: {s.reason}" for s in report.skipped),
        )


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
@_allow_pickle
@_timeout
@_quiet
def copy(
    src: str,
    dst: str,
    source_collection: str | None,
    collection: str | None,
    resume: bool,
    overwrite: bool,
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
    """
    from ..ops.copy import copy_store

    with _writing(dst, "copying", quiet, resume, overwrite) as progress:
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
        )
    click.echo(f"{report.destination}: {report.count} records, {_human(report.total_bytes)}")
    if report.resumed_from:
        click.echo(f"resumed after {report.resumed_from} records already copied")
    click.echo(
        f"{report.copied} records copied in {report.seconds:.1f} s "
        f"({report.records_per_second:.0f} records/s), every checksum checked"
    )


@cli.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option(
    "--skipped", "list_skipped", is_flag=True, help="Also list the files the conversion left out."
)
@_store_options
def info(store: str, as_json: bool, list_skipped: bool, **options: Any) -> None:
    """Show a store's count, classes, sizes, repairs and format version.

    STORE is an LMDB path or a mongodb:// URI with --collection.

    \b
    Example:
      fastdata info train.lmdb
      fastdata info mongodb://db1:27017/images --collection train
    """
    from ..ops.info import store_info

    facts = store_info(_open(store, options), list_skipped=list_skipped)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    click.echo(f"store:      {facts['location']}")
    click.echo(f"format:     {facts['format']} v{facts['version']}")
    click.echo(f"images:     {facts['count']}")
    if facts["format"] == "fastdata":
        total, mean = _human(facts["total_bytes"]), _human(facts["mean_bytes"])
        click.echo(f"size:       {total} (mean {mean})")
    else:
        click.echo("size:       not recorded (a store written by another tool)")
    click.echo(f"repaired:   {facts['repaired']}")
    click.echo(f"skipped:    {facts['skipped']}")
    if facts["source"]:
        kind = " (a manifest)" if facts.get("layout") == "manifest" else ""
        click.echo(f"source:     {facts['source']}{kind}")
    if facts.get("copied_from"):
        click.echo(f"copied from the store {facts['copied_from']}")
    if facts["created"]:
        click.echo(f"created:    {facts['created']}")
    if facts["id"]:
        click.echo(f"id:         {facts['id']}")
    click.echo(f"decoder:    {facts['decoder']}; CRC-32: {facts['checksum_implementation']}")
    counts = facts["images_per_class"]
    click.echo(f"classes:    {facts['classes']}")
    if facts.get("class_order") == "appended":
        click.echo("            (in the order they were added, not sorted: --append added some)")
    if facts.get("appends"):
        click.echo(f"appends:    {facts['appends']} (readers of earlier versions read on)")
    shown = list(counts.items())
    for name, n in shown[:20]:
        click.echo(f"  {n:>8}  {name}")
    if len(shown) > 20:
        click.echo(f"  ... and {len(shown) - 20} more")
    for note in facts.get("interrupted", []):
        click.echo(f"note:       {note}")
    if list_skipped:
        items = [f"{i['name']}: {i['reason']}" for i in facts["skipped_files"]]
        _listing("skipped files:", items or ["(none)"])
    elif facts["skipped"]:
        click.echo("(list the skipped files with --skipped)")


@cli.command()
@click.argument("store")
@click.option("--decode", is_flag=True, help="Also decode every image.")
@_store_options
@_quiet
def verify(store: str, decode: bool, quiet: bool, **options: Any) -> None:
    """Check every record's checksum (and with --decode, that it decodes).

    Exits with code 1 and lists the failures when any record fails. STORE is an LMDB path or a
    mongodb:// URI with --collection.

    \b
    Example:
      fastdata verify train.lmdb --decode
    """
    from ..errors import (
        IncompleteStoreError,
        PickleNotAllowedError,
        StoreError,
        StoreNotFoundError,
    )
    from ..ops.verify import check_file, verify_store

    try:
        reader = _open(store, options)
    except (IncompleteStoreError, PickleNotAllowedError, StoreNotFoundError):
        raise
    except StoreError as exc:
        # too damaged to open: say which pages are, when it is an LMDB file
        from ..stores.mongo.connection import is_mongo_uri

        pages = [] if is_mongo_uri(store) else check_file(store)
        click.echo(f"Error: {exc}", err=True)
        for page in pages:
            click.echo(f"  damaged {page}", err=True)
        sys.exit(1)
    with _progress("verifying", quiet) as progress:
        report = verify_store(reader, decode=decode, progress=progress)
    if report.ok:
        if report.checksums:
            what = "checksums and decoding" if decode else "checksums"
        else:
            what = "read" + (" and decoded" if decode else "") + "; the store has no checksums"
        click.echo(f"{report.location}: {report.checked} records OK ({what})")
        return
    if report.broken:
        _listing(f"{report.location}: the store breaks its invariants:", report.broken[:20])
    if report.damaged_pages:
        click.echo(f"{report.location}: {len(report.damaged_pages)} damaged page(s):")
        for page in report.damaged_pages:
            click.echo(f"  {page}")
    if report.failures or report.damaged_pages:
        click.echo(
            f"{report.location}: {len(report.failures)} of {len(reader)} records failed "
            f"({report.checked} read):"
        )
        for f in report.failures:
            click.echo(f"  {f.index} {f.name}: {f.reason}")
    sys.exit(1)


@cli.command()
@click.argument("store")
@click.argument("outdir", type=click.Path(file_okay=False, path_type=str))
@click.option("--repaired", is_flag=True, help="Write the repaired bytes, not the original ones.")
@click.option("--overwrite", is_flag=True, help="Replace files that exist in OUTDIR.")
@click.option(
    "--resume", is_flag=True, help="Keep files in OUTDIR that already hold the right bytes."
)
@click.option(
    "--skip-damaged", is_flag=True, help="Leave out records that fail their checksum (exit 1)."
)
@_store_options
@_quiet
def export(
    store: str,
    outdir: str,
    repaired: bool,
    overwrite: bool,
    resume: bool,
    skip_damaged: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Write the store back out as the folder tree it came from, byte for byte.

    Every record's checksum is checked before it is written; each file is written under a
    temporary name and renamed, so no file is left partial. Nothing is written outside OUTDIR,
    whatever names the store holds. STORE is an LMDB path or a mongodb:// URI with --collection.

    \b
    Example:
      fastdata export train.lmdb restored/
    """
    from ..ops.export import export_store

    reader = _open(store, options)
    with _progress("exporting", quiet) as progress:
        report = export_store(
            reader,
            outdir,
            repaired=repaired,
            overwrite=overwrite,
            resume=resume,
            skip_damaged=skip_damaged,
            progress=progress,
        )
    click.echo(f"{outdir}: wrote {report.files} files, {_human(report.total_bytes)}")
    if report.manifest:
        click.echo(f"manifest: {report.manifest} (converts back to the same store)")
    if report.kept:
        click.echo(f"kept {report.kept} files that were already complete")
    if report.damaged:
        _listing(
            f"left out {len(report.damaged)} damaged record(s) (checksum mismatch):",
            report.damaged,
        )
        sys.exit(1)


@cli.command()
@click.argument("store")
@click.option("--batch-size", "-b", type=click.IntRange(1), default=64, show_default=True)
@click.option(
    "--workers",
    "-j",
    type=WorkerCount(),
    default="auto",
    show_default=True,
    help="'auto' to choose among the measured counts, or a count to mark.",
)
@click.option("--step-ms", type=click.FloatRange(0, min_open=True), help="Training step time.")
@click.option("--seconds", type=click.FloatRange(0.1), default=1.0, show_default=True)
@click.option("--image-size", type=click.IntRange(8), default=224, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw images/s per worker count.")
@_store_options
def bench(
    store: str,
    batch_size: int,
    workers: int | str,
    step_ms: float | None,
    seconds: float,
    image_size: int,
    as_json: bool,
    plot: str | None,
    **options: Any,
) -> None:
    """Measure whether training on STORE would wait for data on this machine.

    Prints raw record reads/s, decode+pipeline images/s in one process, loader images/s for
    several worker counts (the chosen one marked) and, given --step-ms, whether a training step
    of that length would wait for data and for what share of its time.

    \b
    Example:
      fastdata bench train.lmdb --batch-size 256 --step-ms 120
    """
    from ..ops.bench import bench_store, plot_report

    report = bench_store(
        store,
        batch_size=batch_size,
        workers=workers,
        step_ms=step_ms,
        seconds=seconds,
        image_size=image_size,
        **_mongo(options),
        **{k: v for k, v in options.items() if v is not None and v is not False},
    )
    if plot:
        plot_report(report, plot)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"store:          {report.store} ({report.records} records)")
    click.echo(f"raw reads:      {report.reads_per_s:10.0f} records/s")
    click.echo(f"decode+crop:    {report.pipeline_per_s:10.0f} images/s in one process")
    click.echo(f"                ({report.decoder}, {image_size} px train pipeline)")
    click.echo(f"loader, batch {report.batch_size}:")
    for w, rate in sorted(report.loader_per_s.items()):
        low, high = report.loader_spread.get(w, (rate, rate))
        mark = "  <- chosen" if w == report.chosen_workers else ""
        click.echo(f"  {w:>3} workers {rate:10.0f} images/s  ({low:.0f}-{high:.0f}){mark}")
    click.echo(f"                (median of the rounds, slowest-fastest; {report.cpus} CPUs)")
    for note in report.notes:
        click.echo(f"note: {note}")
    if report.verdict is not None:
        v = report.verdict
        if v["wait_ms"] > 0:
            click.echo(
                f"input-bound: a batch takes {v['data_ms']:.1f} ms to load, the step "
                f"{report.step_ms:g} ms; training would wait {v['wait_fraction']:.0%} of the time"
            )
        else:
            click.echo(
                f"keeps up: a batch takes {v['data_ms']:.1f} ms to load, the step "
                f"{report.step_ms:g} ms; training would not wait for data"
            )
    if plot:
        click.echo(f"plot: {plot}")


def main() -> None:
    """Console-script entry point."""
    try:
        cli()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()


if __name__ == "__main__":  # pragma: no cover
    main()
