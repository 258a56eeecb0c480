"""A loader's position, saved and read back: the epoch, how many samples of its order the ranks
together have delivered, and what the samples are (the seed, the dataset's identity). Plain
JSON types, under a kilobyte whatever the epoch's length, covered by a digest so that a state
edited by hand or cut short is refused rather than resumed somewhere else.

The position is global (:class:`~fastdata.loaders.sampler.EpochSampler`): the state rank 0
saves at a step continues the job on any world size, worker count or batch size with exactly
the samples not yet delivered.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..errors import Phrase, ResumeError

__all__ = ["Position", "epoch_of", "make_state", "read_state"]

KEY = "fastdata_loader"
VERSION = 1
RESTART = Phrase("--restart-epoch", "load_state_dict(state, restart_epoch=True)")
"""The way out of a state that cannot be resumed: the saved epoch, from its beginning."""
FRESH = Phrase(
    "without --resume", "without load_state_dict (or pick the epoch: loader.set_epoch(EPOCH))"
)
"""The way out of a state that names no epoch: not to resume at all."""


@dataclass(frozen=True)
class Position:
    """A saved position: epoch ``epoch`` of ``samples`` samples, of which the ranks together
    delivered the first ``position`` of its order; the loader that saved it (its seed, order,
    ranks and batch size) and its dataset's identity (``StoreReader.identity``, or None)."""

    epoch: int
    position: int
    samples: int
    seed: int
    shuffle: bool | None
    world_size: int
    batch_size: int
    dataset: dict[str, Any] | None


def make_state(where: Position) -> dict[str, Any]:
    """The state ``Loader.state_dict`` gives: JSON types, and the digest of them all."""
    body: dict[str, Any] = {
        KEY: VERSION,
        "epoch": where.epoch,
        "position": where.position,
        "samples": where.samples,
        "seed": where.seed,
        "shuffle": where.shuffle,
        "world_size": where.world_size,
        "batch_size": where.batch_size,
    }
    if where.dataset is not None:
        body["dataset"] = where.dataset
    body["check"] = _digest(body)
    return body


def _digest(body: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in body.items() if k != "check"}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_state(state: Any) -> Position:
    """A state as ``make_state`` made it (or an earlier fastdata's), every value checked.

    Raises:
        ResumeError: not a loader's state, one cut short or edited (its digest), or one of a
            later fastdata; the message names what, and the way out.
    """
    if not isinstance(state, dict):
        raise _damaged(f"it is a {type(state).__name__}, not a loader's state (a dict)")
    version = state.get(KEY)
    if version is None and "batches" in state:
        return _earlier(state)
    if version is None:
        raise _damaged(f"it has no {KEY!r} key: not a state that Loader.state_dict() gave")
    if type(version) is not int or version < 1:
        raise _damaged(f"its {KEY!r} is {version!r}, not a version of the loader's state")
    if version > VERSION:
        raise ResumeError(
            f"cannot resume: the state was saved by a later fastdata (loader state version "
            f"{version!r}; this one reads {VERSION}): upgrade fastdata, or start the epoch again "
            "with ",
            RESTART,
        )
    try:
        digest = _digest(state)
    except (TypeError, ValueError, RecursionError) as exc:  # a tensor, bytes, a cycle, ...
        raise _damaged(f"it holds a value that is not plain JSON ({exc})") from None
    if state.get("check") != digest:
        raise _damaged("its digest does not match its values: it was edited or cut short")
    out = Position(
        epoch=_whole(state, "epoch"),
        position=_whole(state, "position"),
        samples=_whole(state, "samples"),
        seed=_whole(state, "seed", signed=True),
        shuffle=_flag(state, "shuffle"),
        world_size=max(1, _whole(state, "world_size")),
        batch_size=max(1, _whole(state, "batch_size")),
        dataset=_identity(state.get("dataset")),
    )
    if out.position > out.samples:
        raise _damaged(f"position {out.position} is past the epoch's {out.samples} samples")
    return out


def epoch_of(state: Any) -> int:
    """The epoch a state was saved in, all that starting that epoch again needs: read from a
    state however damaged, edited or later, as long as it names one.

    Raises:
        ResumeError: a state that names no epoch; the message says how to start anew.
    """
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if type(epoch) is not int or epoch < 0:
        what = (
            f"its 'epoch' is {epoch!r}, not an epoch"
            if isinstance(state, dict)
            else f"it is a {type(state).__name__}, not a loader's state"
        )
        raise ResumeError(f"cannot start the saved epoch again: {what}; start anew ", FRESH)
    return epoch


def _earlier(state: dict[str, Any]) -> Position:
    """The state of a fastdata before positions were global: its rank layout's batches, which
    deliver the same prefix of the order."""
    batches, batch_size = _whole(state, "batches"), max(1, _whole(state, "batch_size"))
    world = max(1, _whole(state, "world_size")) if "world_size" in state else 1
    samples = _whole(state, "samples")
    return Position(
        epoch=_whole(state, "epoch"),
        position=min(samples, batches * batch_size * world),
        samples=samples,
        seed=_whole(state, "seed", signed=True),
        shuffle=state["shuffle"] if type(state.get("shuffle")) is bool else None,  # (unsaved)
        world_size=world,
        batch_size=batch_size,
        dataset=_identity(state.get("dataset")),
    )


def _whole(state: dict[str, Any], key: str, *, signed: bool = False) -> int:
    value = state.get(key)
    if type(value) is not int or (value < 0 and not signed):
        raise _damaged(f"its {key!r} is {value!r}, not a whole number")
    return value


def _flag(state: dict[str, Any], key: str) -> bool:
    value = state.get(key)
    if type(value) is not bool:
        raise _damaged(f"its {key!r} is {value!r}, not true or false")
    return value


def _identity(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("store"), str):
        raise _damaged("its 'dataset' is not a dataset's identity")
    return value


def _damaged(why: str) -> ResumeError:
    return ResumeError(
        f"cannot resume from this loader state: {why}; give the state the loader saved, or "
        "start the epoch again with ",
        RESTART,
    )


def refuse_other(
    saved: Position, seed: int, shuffle: bool, identity: Any, same: bool, lineage: Any = ()
) -> None:
    """Refuse a position that another loader's samples would continue elsewhere: another seed
    or order, or another dataset (``same``: the dataset is the saved one, or a store it grew
    into; ``lineage``: the ids of the store this one is and grew from), naming both and the way
    out.

    Raises:
        ResumeError: what differs.
    """
    if saved.seed != seed:
        _refuse(f"the saved loader had seed={saved.seed}, this one has seed={seed}")
    if saved.shuffle is not None and saved.shuffle != shuffle:
        _refuse(f"the saved loader had shuffle={saved.shuffle}, this one has shuffle={shuffle}")
    if saved.dataset is not None and identity is not None and not same:
        if saved.dataset.get("store") in lineage and "view" in saved.dataset:
            _refuse(  # (the same store, grown by an append: its selection is another now)
                f"the saved loader read {said(saved.dataset)}, this one reads {said(identity)}: "
                "the store grew by an append since, and the selection now holds other "
                "records, so the rest of the saved epoch is not in it; resume over the store "
                "as it was (a copy made before the append), or"
            )
        _refuse(
            f"the saved loader read {said(saved.dataset)}, this one reads {said(identity)}; "
            "resume over the same store and the same selection, or"
        )


def _refuse(what: str) -> None:
    head = what if what.endswith(", or") else f"{what}; create the loader the same way, or"
    raise ResumeError(f"cannot resume: {head} start the epoch again with ", RESTART)


def said(identity: dict[str, Any]) -> str:
    """A dataset's identity in words: ``store 1f2e... (5,000 records), view 9ab... (120)``."""
    words = f"store {identity.get('store')} ({identity.get('records')} records)"
    if "view" in identity:
        words += f", the selection {identity['view']} ({identity.get('selected')} records)"
    return words


def change_note(saved: Position, world_size: int, batch_size: int, samples: int) -> str:
    """What a resume continues, said for a person: ``resuming on 2 ranks instead of 4: 61,440
    samples left, 30,720 each`` (``samples``: the new dataset's length)."""
    begun = saved.position > 0  # (an epoch not begun takes the dataset as it is now)
    left = saved.samples - saved.position if begun else samples
    each = -(-left // world_size)
    changes = []
    if world_size != saved.world_size:
        changes.append(
            f"on {world_size} rank{'s' * (world_size != 1)} instead of {saved.world_size}"
        )
    if batch_size != saved.batch_size:
        changes.append(f"with batches of {batch_size} instead of {saved.batch_size}")
    grown = ""
    if samples > saved.samples and begun:
        grown = (
            f"; the {samples - saved.samples:,} records added since join from epoch "
            f"{saved.epoch + 1}"
        )
    how = f" {' and '.join(changes)}" if changes else ""
    share = f", {each:,} each" if world_size > 1 else ""
    return f"resuming epoch {saved.epoch}{how}: {left:,} samples left{share}{grown}"


def dataset_identity(dataset: Any) -> dict[str, Any] | None:
    """A store dataset's :meth:`~fastdata.stores.reader.StoreReader.identity` (None for
    another dataset)."""
    reader = getattr(dataset, "reader", None)
    identity = getattr(reader, "identity", None)
    return identity() if callable(identity) else None


def same_samples(saved: dict[str, Any], mine: dict[str, Any], dataset: Any) -> bool:
    """Whether a loader that saved ``saved`` reads the samples this one does: the same store
    (or one it grew into by appends: its first records are still those), and the same
    selection of it (a view's digest)."""
    meta = getattr(getattr(dataset, "reader", None), "meta", None)
    lineage = {mine.get("store"), *getattr(meta, "appended_from", [])}
    return saved.get("store") in lineage and saved.get("view") == mine.get("view")
