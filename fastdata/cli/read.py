"""The commands that read a store: ``info``, ``verify``, ``export`` and ``bench``."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

import click

from .app import (
    EXIT_CODE,
    WorkerCount,
    cli,
    human_size,
    listing,
    mongo_options,
    open_given,
    parse_query,
    progress_bar,
    quiet_option,
    store_options,
    where_option,
)


@cli.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option(
    "--skipped", "list_skipped", is_flag=True, help="Also list the files the conversion left out."
)
@where_option("Also count the records a query selects")
@store_options
def info(store: str, as_json: bool, list_skipped: bool, query: str | None, **options: Any) -> None:
    """Show a store's count, classes, sizes, repairs and format version.

    STORE is an LMDB path or a mongodb:// URI with --collection.

    \b
    Example:
      fastdata info train.lmdb
      fastdata info mongodb://db1:27017/images --collection train
      fastdata info train.lmdb --where '{"fields.score": {"$gt": 0.5}}'
    """
    from ..ops.info import store_info

    where = parse_query(query)
    facts = store_info(open_given(store, options), list_skipped=list_skipped, where=where)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    click.echo(f"store:      {facts['location']}")
    click.echo(f"format:     {facts['format']} v{facts['version']}")
    click.echo(f"images:     {facts['count']}")
    if facts["format"] == "fastdata":
        total, mean = human_size(facts["total_bytes"]), human_size(facts["mean_bytes"])
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
    if facts.get("fields"):
        from ..fields import Schema

        schema = Schema.from_list(facts["fields"], facts["location"])
        where = " (in MongoDB: fields.<name> of each document)" if "://" in store else ""
        click.echo(f"fields:     {len(schema)}{where}")
        for f in schema.fields:
            click.echo(f"  {f.name:<16} {f.spec.split(':', 1)[1]}")
        cover = facts.get("columns")
        if cover is not None and cover == facts["count"]:
            click.echo("columns:    every field (queries and batches of fields read them)")
        elif cover is not None:
            target = shlex.quote(os.path.abspath(store))
            over = f"over {cover:,} of {facts['count']:,} records" if cover else "none"
            click.echo(
                f"columns:    {over}: queries and fields read each record's header; build "
                f"them with `fastdata columns {target}`"
            )
    if not facts.get("labelled", True):
        click.echo("classes:    none (the manifest gave no labels: every target is -1)")
        counts = {}
    else:
        click.echo(f"classes:    {facts['classes']}")
    if facts.get("class_order") == "appended":
        click.echo("            (in the order they were added, not sorted: --append added some)")
    shown = list(counts.items())
    for name, n in shown[:20]:
        click.echo(f"  {n:>8}  {name}")
    if len(shown) > 20:
        click.echo(f"  ... and {len(shown) - 20} more")
    if facts.get("appends"):
        click.echo(f"appends:    {facts['appends']} (readers of earlier versions read on)")
    for note in facts.get("interrupted", []):
        click.echo(f"note:       {note}")
    if "where" in facts:
        chosen = facts["where"]
        click.echo(f"where:      {json.dumps(chosen['query'])}")
        click.echo(f"selected:   {chosen['count']} of {facts['count']}")
        for name, n in [kv for kv in chosen["images_per_class"].items() if kv[1]][:20]:
            click.echo(f"  {n:>8}  {name}")
    if list_skipped:
        items = [f"{i['name']}: {i['reason']}" for i in facts["skipped_files"]]
        listing("skipped files:", items or ["(none)"])
    elif facts["skipped"]:
        click.echo("(list the skipped files with --skipped)")


@cli.command()
@click.argument("store")
@click.argument("key")
@store_options
def index(store: str, key: str, **options: Any) -> None:
    """Have a MongoDB store's server index KEY, so that queries on it (--where, where=) read
    only what they select.

    KEY is a key a query names: fields.NAME for a field, or label, name, size, format.

    \b
    Example:
      fastdata index mongodb://db1:27017/images -c train fields.score
    """
    reader = open_given(store, options)
    name = reader.create_index(key)
    click.echo(f"{reader.location}: {key} is indexed ({name})")


@cli.command()
@click.argument("store")
def columns(store: str) -> None:
    """Build an LMDB STORE's columns and index of names again from its records, in place,
    while readers read on.

    A store keeps each field's values as columns beside its records (queries and batches of
    fields read them), and the names of its records as one index (appends and the names a
    dataset lists read it); convert, append and copy write them. Run this for a store written
    before fastdata kept them, or where verify finds them damaged.

    \b
    Example:
      fastdata columns /data/train.lmdb
    """
    from ..ops.columns import build_columns

    report = build_columns(store)
    if not report.fields:
        click.echo(
            f"{report.location}: index of names of {report.count:,} records built and read "
            f"back in {report.seconds:.1f} s (no fields, so no columns to build)"
        )
        return
    size = sum(report.fields.values())
    click.echo(
        f"{report.location}: columns of {len(report.fields)} fields and the index of names over "
        f"{report.count:,} records built and read back ({size / 2**20:.1f} MiB) in "
        f"{report.seconds:.1f} s"
    )


@cli.command()
@click.argument("store")
@click.option("--decode", is_flag=True, help="Also decode every image.")
@click.option(
    "--workers",
    "-j",
    type=click.IntRange(1, 256),
    help="Processes that check parts of an LMDB store side by side, on Linux (default: one per "
    "CPU, at most 8, for 20,000 records or more; at most one per 64 records; 1 checks in this "
    "process). MongoDB stores are checked in one.",
)
@store_options
@quiet_option
def verify(store: str, decode: bool, workers: int | None, quiet: bool, **options: Any) -> None:
    """Check every page, record and invariant of a store (and with --decode, every image).

    Every page of an LMDB store's B-tree, every record's size and checksum (and fields), and the
    invariants of a finished store are checked. Exits with code 1 and lists what failed when
    anything does. STORE is an LMDB path or a mongodb:// URI with --collection.

    \b
    Example:
      fastdata verify train.lmdb --decode
    """
    from ..errors import (
        IncompleteStoreError,
        PickleNotAllowedError,
        StoreDamagedError,
        StoreError,
        StoreNotFoundError,
    )
    from ..ops.verify import check_file, verify_store
    from ..stores.uri import is_mongo_uri
    from .advice import repairs

    try:
        reader = open_given(store, options)
    except (IncompleteStoreError, PickleNotAllowedError, StoreNotFoundError):
        raise
    except StoreError as exc:
        # too damaged to open: say which pages are, when it is an LMDB file (the one error
        # funnel prints the message and exits with its code)
        try:
            pages = [] if is_mongo_uri(store) else check_file(store)
        except StoreError:  # (the file's header: the error said it already)
            pages = []
        said = exc.without_hint(cli=True)  # (its hint would advise the command running)
        if isinstance(exc, StoreDamagedError):
            said += "; convert it again from its source (or copy it again, if it was a copy)"
        raise StoreError("\n".join([said, *(f"  damaged {page}" for page in pages)])) from None
    with progress_bar("verifying", quiet) as progress:
        report = verify_store(reader, decode=decode, progress=progress, workers=workers)
    if report.foreign:  # (not damage: nothing to repair, and nothing advised)
        listing(
            f"{report.location}: content fastdata did not write (not damage; left as it is):",
            report.foreign[:20],
        )
    if report.ok:
        if report.checksums:
            what = "sizes, checksums, fields and scan ends" + (", decoding" if decode else "")
        else:
            what = "read" + (" and decoded" if decode else "") + "; the store has no checksums"
        click.echo(f"{report.location}: {report.checked} records OK ({what})")
        return
    click.get_current_context().meta[EXIT_CODE] = 1
    if report.broken:
        listing(f"{report.location}: the store breaks its invariants:", report.broken[:20])
    if report.columns:
        listing(
            f"{report.location}: what it keeps beside its records (fields kept as columns for "
            "queries, the index of names):",
            report.columns[:20],
        )
        if not (report.broken or report.damaged_pages or report.failures):
            target = shlex.quote(os.path.abspath(store))
            click.echo(
                f"{report.location}: every record is sound; build what it keeps beside them "
                f"again from them with `fastdata columns {target}`"
            )
            sys.exit(1)
    if report.damaged_pages:
        listing(
            f"{report.location}: {len(report.damaged_pages)} damaged page(s):",
            report.damaged_pages[:100],
        )
        if len(report.damaged_pages) > 100:
            click.echo(f"  ... and {len(report.damaged_pages) - 100} more")
    if report.failures:
        click.echo(
            f"{report.location}: {len(report.failures)} of {len(reader)} records failed "
            f"({report.checked} read):"
        )
        for f in report.failures:
            click.echo(f"  {f.index} {f.name}: {f.reason}")
    elif report.damaged_pages:
        click.echo(
            f"{report.location}: all {report.checked} records read and sound; the damage lies "
            "in pages of the store's own"
        )
    collection = options["collection"] if is_mongo_uri(store) else None
    meta = reader.meta if reader.has_checksums else None
    decoding = any(f.decoding for f in report.failures)
    click.echo(f"{report.location}: {repairs(store, collection, meta, decode=decoding)}")
    sys.exit(1)


@cli.command()
@click.argument("store")
@click.argument("outdir", type=click.Path(file_okay=False, path_type=str))
@click.option("--repaired", is_flag=True, help="Write the repaired bytes, not the original ones.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace files that exist in OUTDIR (a manifest.jsonl there too).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Keep files in OUTDIR that already hold the right bytes; a manifest.jsonl there is "
    "replaced only if an export fastdata started there wrote it.",
)
@click.option(
    "--skip-damaged",
    is_flag=True,
    help="Leave out damaged records (a checksum or fields check that fails, a header that is "
    "not one, a name no conversion gives or an earlier record's) and export the rest (exit 1).",
)
@click.option(
    "--decode",
    is_flag=True,
    help="Also decode every image, as verify --decode does: one that does not decode is damaged "
    "(with --skip-damaged, left out).",
)
@where_option("Export only the records a query selects")
@store_options
@quiet_option
def export(
    store: str,
    outdir: str,
    repaired: bool,
    overwrite: bool,
    resume: bool,
    skip_damaged: bool,
    decode: bool,
    query: str | None,
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
      fastdata export train.lmdb crowded/ --where '{"fields.boxes.3": {"$exists": true}}'
    """
    from ..ops.export import export_store
    from ..stores.view import StoreView

    where = parse_query(query)
    reader = open_given(store, options)
    if where is not None:
        reader = StoreView(reader, where=where)
    try:
        with progress_bar("exporting", quiet) as progress:
            report = export_store(
                reader,
                outdir,
                repaired=repaired,
                overwrite=overwrite,
                resume=resume,
                skip_damaged=skip_damaged,
                decode=decode,
                progress=progress,
            )
    except KeyboardInterrupt:
        flags = {
            "--repaired": repaired,
            "--overwrite": overwrite,
            "--skip-damaged": skip_damaged,
            "--decode": decode,
        }
        given = [f for f, on in flags.items() if on]
        if query is not None:
            given += ["--where", query]
        again = _export_again(store, outdir, given, options)
        click.echo(
            f"\ninterrupted; every file written so far is whole: run `{again}` to finish",
            err=True,
        )
        sys.exit(130)
    sidecars = f" (and {report.sidecars} sidecar files)" if report.sidecars else ""
    click.echo(f"{outdir}: wrote {report.files} files, {human_size(report.total_bytes)}{sidecars}")
    if report.manifest:
        click.echo(f"manifest: {report.manifest}")
    click.echo(f"convert back with: {report.convert_back}")
    if reader.meta.class_order != "sorted" and not report.manifest:
        click.echo(
            "note: converted back, the classes are numbered in sorted order (ImageFolder's), not "
            "in this store's order (appends added some at the end): its labels would change"
        )
    elif where is not None and not report.manifest:
        present = len(set(reader.labels.tolist()))
        if present < len(reader.meta.classes):
            click.echo(
                f"note: the selection holds {present} of the store's {len(reader.meta.classes)} "
                "classes; converted back, its labels are numbered among those alone"
            )
    if report.kept:
        click.echo(f"kept {report.kept} files that were already complete")
    if report.damaged:
        listing(
            f"left out {len(report.damaged)} damaged record(s) (their bytes, fields, names or "
            "pages; "
            f"`fastdata verify {reader.command_target}` says which):",
            report.damaged,
        )
    if report.undecodable:
        listing(
            f"left out {len(report.undecodable)} record(s) that do not decode:",
            report.undecodable,
        )
    if report.damaged or report.undecodable:
        sys.exit(1)


def _export_again(store: str, outdir: str, flags: list[str], options: dict[str, Any]) -> str:
    """The export command as given, with ``--resume``: what finishes an interrupted export.
    Paths are made absolute (it may be run from another folder), a URI's password is masked (as
    in every message) and each word is quoted for the shell."""
    from ..stores.uri import is_mongo_uri, mask_uri

    source = mask_uri(store) if is_mongo_uri(store) else os.path.abspath(store)
    words = ["fastdata", "export", source, os.path.abspath(outdir), *flags]
    if options.get("collection") is not None:
        words.append(f"--collection={options['collection']}")
    if options.get("timeout") is not None:
        words.append(f"--timeout={options['timeout']}")
    if options.get("index_file") is not None:
        words.append(f"--index-file={os.path.abspath(options['index_file'])}")
    if options.get("allow_pickle"):
        words.append("--allow-pickle")
    words.append("--resume")
    return " ".join(shlex.quote(word) for word in words)


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
@store_options
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
    from ..ops.bench import bench_store, plot_report, require_plotting

    if plot:
        require_plotting()
    report = bench_store(
        store,
        batch_size=batch_size,
        workers=workers,
        step_ms=step_ms,
        seconds=seconds,
        image_size=image_size,
        **mongo_options(options),
        **{k: v for k, v in options.items() if k != "timeout" and v is not None and v is not False},
    )
    if plot:
        plot_report(report, plot)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"store:          {report.store} ({report.records} records)")
    low, high = report.reads_spread
    click.echo(f"raw reads:      {report.reads_per_s:10.0f} records/s  ({low:.0f}-{high:.0f})")
    low, high = report.pipeline_spread
    click.echo(
        f"decode+crop:    {report.pipeline_per_s:10.0f} images/s in one process  "
        f"({low:.0f}-{high:.0f})"
    )
    click.echo(f"                ({report.decoder}, {image_size} px train pipeline)")
    click.echo(f"CRC-32:         {report.checksum}")
    click.echo(f"loader, batch {report.batch_size}:")
    for w, rate in sorted(report.loader_per_s.items()):
        low, high = report.loader_spread.get(w, (rate, rate))
        mark = "  <- chosen" if w == report.chosen_workers else ""
        workers = f"{w:>3} worker{'s' if w != 1 else ' '}"
        click.echo(f"  {workers} {rate:10.0f} images/s  ({low:.0f}-{high:.0f}){mark}")
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
