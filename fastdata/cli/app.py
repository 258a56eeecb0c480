"""The command group, the one error funnel and the options and helpers the commands share."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import click

from .. import __version__
from ..errors import FastdataError, WriteFailedError

__all__ = ["EXIT_CODE", "cli"]

EXIT_CODE = "fastdata.exit_code"
"""``ctx.meta`` key: the code a command that is printing a failure exits with, kept when the
reader of its output goes away (``fastdata verify STORE | head``)."""


class _Group(click.Group):
    """Turns library errors into one line on stderr and their exit code, without a traceback.

    Exit codes (docs/cli.md's table): 0 success; 1 a failure (a damaged record, a server away, a
    full disk, another writer); 2 a usage mistake (a bad option, a store that exists or does not,
    nothing to resume); 130 interrupted (Ctrl-C), whatever the command. A closed pipe
    (``fastdata info | head``) ends quietly, with the code of the failure being printed if any.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # (commands that write say how to finish, and exit 130)
            click.echo("\ninterrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:  # (`fastdata verify STORE | head`): the exit code stays
            silence_stdout()
            ctx.exit(ctx.meta.get(EXIT_CODE, 0))
        except WriteFailedError as exc:  # (what its store holds now, and what finishes it)
            click.echo(f"Error: {_failed(exc)}", err=True)
            ctx.exit(exc.exit_code)
        except FastdataError as exc:  # (its advice in the command line's words)
            click.echo(f"Error: {exc.render(cli=True)}", err=True)
            ctx.exit(exc.exit_code)
        except OSError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(1)


@contextmanager
def progress_bar(label: str, quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing a bar on stderr (None when quiet or stderr is not a tty)."""
    if quiet or not sys.stderr.isatty():  # (a bar's label alone, where no bar is drawn)
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
def writing(
    label: str, quiet: bool, resume: bool, overwrite: bool
) -> Iterator[Callable[[int, int], None] | None]:
    """A command that writes a store: its progress bar; on Ctrl-C, the command that finishes it
    (exit 130)."""
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other")
    try:
        with progress_bar(label, quiet) as progress:
            yield progress
    except KeyboardInterrupt as exc:
        try:
            said = _left(exc)
        except (KeyboardInterrupt, Exception):  # (a second Ctrl-C, a server away)
            said = f"what was committed is kept: finish it with `{_resumed()}`"
        click.echo(f"\ninterrupted; {said}", err=True)
        sys.exit(130)


def _left(exc: KeyboardInterrupt) -> str:
    """What an interrupted write left, as the store it was writing says: nothing (it was
    stopped before it wrote), an interrupted run and the command that finishes it, or a store
    that reads as before with what is unfinished in it."""
    from ..errors import Interrupted

    if not isinstance(exc, Interrupted):  # (stopped before it opened the store to write)
        return "nothing was written: run the same command again"
    return _held(
        exc.target,
        exc.collection,
        nothing="it was stopped before it wrote a record: nothing was kept; run the same "
        "command again",
        finished="nothing of this run is left unfinished",
    )


def _failed(exc: WriteFailedError) -> str:
    """A write that failed part-way, and what its store holds now, as it says (the class's
    advice, a resume, may not apply: nothing to resume, or a resume beside --overwrite)."""
    if exc.target is None:  # (no writer named its store)
        return exc.render(cli=True)
    try:
        said = _held(
            exc.target,
            exc.collection,
            nothing="nothing was kept; run the same command again",
            finished="it reads as before; nothing of this run was kept: run the same command again",
        )
    except Exception:  # (a server away, the disk still failing: the class's advice)
        return exc.render(cli=True)
    return f"{exc.without_hint(cli=True)}. Free space (or fix the disk); then, {said}"


def _held(target: str, collection: str | None, *, nothing: str, finished: str) -> str:
    """What the store a write stopped in holds now: ``nothing`` where there is no store, an
    interrupted run and the command that finishes it, or a store that reads as before with
    what is unfinished in it (``finished`` where nothing is)."""
    from ..errors import IncompleteStoreError, StoreNotFoundError
    from ..stores import open_store

    try:
        reader = open_store(target, collection=collection)
    except StoreNotFoundError:
        return nothing
    except IncompleteStoreError as found:
        return f"what was committed is kept: {found.render(cli=True)}"
    try:
        unfinished = reader.interrupted()
        held = f"{reader.location} holds a complete store of {len(reader)} records"
    finally:
        reader.close()
    if unfinished:
        return f"{held}, read as before; " + "; ".join(unfinished)
    return f"{held}; {finished}"


def _resumed() -> str:
    """The command being run, with --resume in place of --overwrite: its paths made absolute
    (and so never read as an option), a password in a URI masked, every option as
    ``--name=value``, its words quoted for the shell."""
    from ..stores.uri import mask_uri

    ctx = click.get_current_context()
    words = [
        "fastdata",
        *(["-v"] if verbose_given() else []),
        ctx.info_name or ctx.command.name or "",
    ]
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param, click.Argument):
            text = str(value)
            words.append(mask_uri(text) if "://" in text else os.path.abspath(text))
        elif not isinstance(param, click.Option) or param.name in ("overwrite", "resume"):
            continue
        elif param.is_flag:
            words += [max(param.opts, key=len)] if value else []
        elif value is not None and value != param.default:
            text = str(value)
            if isinstance(param.type, click.Path):
                text = os.path.abspath(text)
            words.append(f"{max(param.opts, key=len)}={text}")
    return shlex.join([*words, "--resume"])


def verbose_given() -> bool:
    """Whether the command was given the group's ``-v``."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.find_root().params.get("verbose"))


def listing(title: str, lines: Iterable[str]) -> None:
    """A title and its items, indented under it."""
    click.echo(title)
    for line in lines:
        click.echo(f"  {line}")


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def silence_stdout() -> None:
    """The reader of our output went away: send the rest nowhere, so that nothing complains."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def mongo_options(options: dict[str, Any]) -> dict[str, Any]:
    """The MongoDB options given on the command line (none when not given), as the library
    takes them; ``options`` is left as it is."""
    timeout = options.get("timeout")
    return {"timeout_s": timeout} if timeout is not None else {}


def open_given(store: str, options: dict[str, Any]) -> Any:
    from ..stores import open_store

    return open_store(
        store,
        allow_pickle=options["allow_pickle"],
        collection=options["collection"],
        index_file=options["index_file"],
        **mongo_options(options),
    )


timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    help="Seconds to wait for a MongoDB server to answer (default 10).",
)


allow_pickle_option = click.option(
    "--allow-pickle",
    is_flag=True,
    help="Read an LMDB store written by the pickle-based recipes (only stores you trust).",
)


def store_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options every command that reads a store takes."""
    fn = allow_pickle_option(fn)
    fn = click.option(
        "--index-file",
        type=click.Path(dir_okay=False, exists=True),
        help="JSON index of a Mongo collection in the img_name/bson_img layout.",
    )(fn)
    fn = timeout_option(fn)
    return click.option(
        "--collection", "-c", help="The collection, when STORE is a mongodb:// URI."
    )(fn)


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")


def where_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--where QUERY``: a query document as JSON (``what``: what it does to the command)."""
    return click.option(
        "--where",
        "query",
        metavar="QUERY",
        help=f"{what}: a MongoDB query document as JSON, the same on every store "
        """(docs/fields.md), e.g. '{"fields.boxes.3": {"$exists": true}}'.""",
    )


def parse_query(text: str | None) -> Any:
    """``--where``'s JSON, parsed (None: not given); the query itself is checked against the
    store's fields where it is run."""
    import json

    from ..errors import QueryError

    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError:
        raise QueryError(
            f"--where: the query is nested too deep ({len(text)} characters)"
        ) from None
    except ValueError as exc:
        raise QueryError(
            f"--where {text!r} is not JSON ({exc}); give a query document, quoted for the "
            """shell: --where '{"fields.score": {"$gt": 0.5}}'"""
        ) from None


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
    """Pack image folders into LMDB or MongoDB and read them back fast in PyTorch.

    \b
    Example:
      fastdata convert ~/data/train train.lmdb
      fastdata info train.lmdb
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )
