"""Elastic, exact resume: the state rank 0 saves continues the job on any world size, worker count
or batch size with exactly the samples of the epoch not yet delivered; a store that grew finishes
the epoch over the samples it began with; a state of another store, selection, seed or a later
fastdata, or one edited or cut short, is refused by name with the way out."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fastdata import LMDBImageDataset, ResumeError, convert, create_loader
from fastdata.loaders import EpochSampler

from ..conftest import jpeg_bytes, write
from ..procs import REPO


def deliver(sampler: EpochSampler, world: int, batch: int, steps: int | None) -> list[int]:
    """What ``world`` ranks (samplers alike but for the rank) deliver in ``steps`` steps of
    ``batch`` each (None: to the end), as they would in data-parallel training."""
    shares = []
    for rank in range(world):
        s = EpochSampler(sampler.n, seed=sampler.seed, rank=rank, world_size=world)
        s.resume(sampler.epoch, sampler.position, sampler.samples)
        shares.append([int(i) for i in s])
    per_rank = len(shares[0])
    upto = per_rank if steps is None else min(per_rank, steps * batch)
    return [i for share in shares for i in share[:upto]]


def test_any_sequence_of_shapes_delivers_every_sample_once() -> None:
    """Over random reshapes (world size, batch size), the ranks' deliveries are the epoch's
    order, each sample once, but for the padding of the last step (stated: the start of the
    rest it split, at most world_size - 1)."""
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 200)
        sampler = EpochSampler(n, seed=trial)
        sampler.set_epoch(rng.randint(0, 5))
        got: list[int] = []
        while True:
            world, batch = rng.randint(1, 6), rng.randint(1, 9)
            rest = sampler.rest()
            steps = rng.randint(0, 5) if rng.random() < 0.8 else None
            got += deliver(sampler, world, batch, steps)
            per_rank = -(-rest // world)
            done = per_rank if steps is None else min(per_rank, steps * batch)
            position = min(sampler.samples, sampler.position + done * world)
            if position == sampler.samples:
                padding = per_rank * world - rest if done == per_rank else 0
                break
            sampler.resume(sampler.epoch, position, sampler.samples)
        counts = Counter(got)
        assert set(counts) == set(range(n)), trial
        assert sum(counts.values()) - n == padding < world, trial


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    for i in range(40):
        write(root / f"c{i:03d}" / "0.jpg", jpeg_bytes(16, 12, seed=i))
    dst = tmp_path_factory.mktemp("store") / "s.lmdb"
    convert(root, dst)
    return dst


def loader(store: Path, batch: int, workers: int = 0, **kw: object):  # type: ignore[no-untyped-def]
    options: dict[str, object] = dict(
        image_size=8, device="cpu", seed=5, num_workers=workers, drop_last=False
    )
    options.update(kw)
    return create_loader(LMDBImageDataset(store), batch, **options)  # type: ignore[arg-type]


def labels(batches) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(x) for _, y in batches for x in y]


def test_a_resume_with_another_batch_size_and_workers_continues_the_same_order(
    store: Path,
) -> None:
    whole = labels(loader(store, 6))
    first = loader(store, 6, workers=2)
    seen = []
    for images, y in first:
        seen.append((images, y))
        if len(seen) == 3:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert state["position"] == 18 and len(json.dumps(state)) < 1024
    second = loader(store, 4, workers=1)
    second.load_state_dict(state)
    assert (
        second.resume_note
        == "resuming epoch 0 with batches of 4 instead of 6: 22 samples left"
    )
    rest = labels(second)
    assert labels(seen) + rest == whole  # the same order, each sample once
    assert second.epoch == 1 and sorted(labels(second)) == list(range(40))  # then a whole epoch


def test_a_store_that_grew_finishes_the_epoch_it_began_with(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(30):
        write(root / f"c{i:03d}" / "0.jpg", jpeg_bytes(16, 12, seed=i))
    store = tmp_path / "s.lmdb"
    convert(root, store)
    first = loader(store, 4)
    seen = []
    for batch in first:
        seen.append(batch)
        if len(seen) == 2:
            break
    state = first.state_dict()
    first.close()
    first.dataset.close()
    for i in range(30, 37):
        write(root / f"c{i:03d}" / "0.jpg", jpeg_bytes(16, 12, seed=i))
    convert(root, store, append=True)
    second = loader(store, 5)
    second.load_state_dict(state)
    assert "the 7 records added since join from epoch 1" in second.resume_note
    epoch0 = labels(seen) + labels(second)
    assert sorted(epoch0) == list(range(30))  # the 30 it began with, each once
    assert sorted(labels(second)) == list(range(37))  # the next epoch takes the new ones


def test_states_that_cannot_continue_are_refused_by_name(store: Path, tmp_path: Path) -> None:
    first = loader(store, 6)
    next(iter(first))
    state = first.state_dict()

    edited = dict(state, position=state["position"] + 6)
    with pytest.raises(ResumeError, match="digest does not match.*restart_epoch=True"):
        loader(store, 6).load_state_dict(edited)
    cut = {k: v for k, v in state.items() if k != "seed"}
    with pytest.raises(ResumeError, match="digest|'seed'"):
        loader(store, 6).load_state_dict(cut)
    later = dict(state, fastdata_loader=2)
    with pytest.raises(ResumeError, match="later fastdata.*version 2"):
        loader(store, 6).load_state_dict(later)
    for junk in ([], "state", None, {"epoch": 1}):
        with pytest.raises(ResumeError, match="cannot resume"):
            loader(store, 6).load_state_dict(junk)  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="seed=5, this one has seed=9"):
        loader(store, 6, seed=9).load_state_dict(state)

    other_root = tmp_path / "other"
    for i in range(40):
        write(other_root / f"c{i:03d}" / "0.jpg", jpeg_bytes(16, 12, seed=i))
    other = tmp_path / "other.lmdb"
    convert(other_root, other)
    with pytest.raises(ResumeError, match="read store .* this one reads store .*restart_epoch"):
        loader(other, 6).load_state_dict(state)
    restarted = loader(other, 6)
    restarted.load_state_dict(state, restart_epoch=True)  # the way out the message names
    assert restarted.epoch == 0 and sorted(labels(restarted)) == list(range(40))


def test_a_state_holding_values_that_are_not_json_is_refused_by_name(store: Path) -> None:
    """A checkpoint may hold a tensor where the state had an int (or bytes, a set, a cycle, a
    nesting deeper than Python recurses): refused as a damaged state, not a TypeError of json."""
    first = loader(store, 6)
    next(iter(first))
    state = first.state_dict()
    cycle: dict[str, object] = dict(state)
    cycle["me"] = cycle
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    for bad in (
        dict(state, epoch=torch.tensor(0)),
        dict(state, position=b"6"),
        dict(state, junk={1, 2}),
        {**state, 1: "a key that is not a string"},
        cycle,
        dict(state, junk=deep),
    ):
        with pytest.raises(ResumeError, match="not plain JSON.*restart_epoch=True"):
            loader(store, 6).load_state_dict(bad)
    for version in (0, -1, True, 1.0, "1"):
        with pytest.raises(ResumeError, match="not a version of the loader's state"):
            loader(store, 6).load_state_dict(dict(state, fastdata_loader=version))


def test_restart_epoch_is_a_way_out_of_every_state_that_names_its_epoch(store: Path) -> None:
    """The refusals of an edited, cut-short or later state name restart_epoch=True as the way
    out: it starts that epoch again (all it needs of the state is its epoch); a state that names
    no epoch says to start anew."""
    first = loader(store, 6)
    labels(first)  # epoch 0 done
    batches = iter(first)
    next(batches)
    state = first.state_dict()
    del batches
    assert state["epoch"] == 1
    edited = dict(state, position=state["position"] + 6)
    cut = {k: v for k, v in state.items() if k not in ("check", "samples")}
    later = dict(state, fastdata_loader=99, position="somewhere a later fastdata says")
    junk = dict(state, samples=torch.tensor(40))
    for bad in (edited, cut, later, junk):
        with pytest.raises(ResumeError, match="restart_epoch=True"):
            loader(store, 6).load_state_dict(bad)
        again = loader(store, 6)
        again.load_state_dict(bad, restart_epoch=True)
        assert again.resume_note == "starting epoch 1 again from its beginning"
        assert again.epoch == 1 and sorted(labels(again)) == list(range(40))
    for nameless in (dict(state, epoch=-1), dict(state, epoch=True), [], None):
        with pytest.raises(ResumeError, match="; start anew without load_state_dict"):
            loader(store, 6).load_state_dict(nameless, restart_epoch=True)  # type: ignore[arg-type]


def test_a_selection_of_a_selection_is_told_from_another(tmp_path: Path) -> None:
    """The first records of one class and the first of another (a view of a view, as
    ``.subset`` of a dataset with ``classes=`` makes) are other samples: a state of one is
    refused over the other; the same samples however selected resume."""
    root = tmp_path / "src"
    for i in range(24):
        write(root / f"c{i % 3}" / f"{i:03d}.jpg", jpeg_bytes(16, 12, seed=i))
    store = tmp_path / "s.lmdb"
    convert(root, store)

    def picked(cls: str) -> LMDBImageDataset:
        return LMDBImageDataset(store, classes=[cls]).subset(indices=[0, 1, 2, 3, 4, 5])

    first = create_loader(picked("c0"), 2, image_size=8, device="cpu", num_workers=0)
    next(iter(first))
    state = first.state_dict()
    other = create_loader(picked("c1"), 2, image_size=8, device="cpu", num_workers=0)
    with pytest.raises(ResumeError, match="the selection .* this one reads .*the selection"):
        other.load_state_dict(state)
    c0 = LMDBImageDataset(store).reader.labels.tolist().index(0)  # (a class's records in a run)
    by_index = LMDBImageDataset(store, classes=["c0"], indices=range(c0, c0 + 6))
    same = create_loader(by_index, 3, image_size=8, device="cpu", num_workers=0)
    same.load_state_dict(state)  # the same six records, labelled the same
    assert (
        same.resume_note
        == "resuming epoch 0 with batches of 3 instead of 2: 4 samples left"
    )


class Numbered(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` samples whose label is their index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros((3, 2, 2), dtype=torch.uint8), i


def numbered(n: int, batch: int, workers: int = 0):  # type: ignore[no-untyped-def]
    return create_loader(
        Numbered(n), batch, device="cpu", seed=3, num_workers=workers, drop_last=False
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_left_behind_does_not_move_the_position(workers: int) -> None:
    """An iterator taken to look at a batch and kept (``peek = iter(loader)``) while the loop
    runs a whole epoch: when it goes, the position stays the loop's, and the next epoch is
    whole; taken up again, it stops rather than take the loop's batches. A state loaded while
    it lives is not overwritten when it goes."""
    loader = numbered(40, 4, workers)
    peek = iter(loader)
    next(peek)
    seen: list[int] = []
    for step, (_, y) in enumerate(loader):
        seen += y.tolist()
        if step == 3:
            assert next(peek, None) is None  # (it stops: the batches are the loop's)
            del peek
        if step == 5:
            assert loader.state_dict()["position"] == 24
    assert sorted(seen) == list(range(40))
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (1, 0)
    assert sorted(labels(loader)) == list(range(40)) and loader.epoch == 2

    saver = numbered(40, 4, workers)
    batches = iter(saver)
    next(batches), next(batches)
    state = saver.state_dict()
    del batches
    other = numbered(40, 4, workers)
    left = iter(other)
    next(left)
    other.load_state_dict(state)
    del left
    assert other.state_dict() == state
    assert labels(other) == labels(saver)  # the rest of the epoch, from where it was saved


def test_set_epoch_of_the_resumed_epoch_keeps_the_position() -> None:
    """A loop written for a DistributedSampler calls ``set_epoch(epoch)`` before every epoch,
    the resumed one too: right after ``load_state_dict`` that continues the saved epoch (each
    sample once), as torchdata's stateful loader does; another epoch, or a later call, starts
    from the beginning."""
    first = numbered(40, 4)
    batches = iter(first)
    seen = [i for _ in range(3) for i in next(batches)[1].tolist()]
    state = first.state_dict()
    del batches
    second = numbered(40, 4)
    second.load_state_dict(state)
    delivered = {}
    for epoch in range(state["epoch"], 2):
        second.set_epoch(epoch)
        assert len(second) == (7 if epoch == 0 else 10)
        delivered[epoch] = labels(second)
    assert sorted(seen + delivered[0]) == list(range(40))  # each once
    assert sorted(delivered[1]) == list(range(40))
    second.set_epoch(1)  # (no load before it: the epoch from its beginning)
    assert sorted(labels(second)) == list(range(40))

    third = numbered(40, 4)
    third.load_state_dict(state)
    third.set_epoch(1)  # another epoch than the saved one: from its beginning
    assert sorted(labels(third)) == list(range(40)) and third.epoch == 2
    fourth = numbered(40, 4)
    fourth.load_state_dict(state)
    fourth.load_state_dict(state, restart_epoch=True)
    fourth.set_epoch(0)
    assert sorted(labels(fourth)) == list(range(40))


def test_a_state_of_ten_million_samples_is_small_and_plain() -> None:
    class Many(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 10_000_000

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.zeros((3, 2, 2), dtype=torch.uint8), i

    many = create_loader(Many(), 256, num_workers=0, device="cpu")
    next(iter(many))
    state = many.state_dict()
    assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 1024
    assert state["position"] == 256 and state["samples"] == 10_000_000


def run_cycles(tmp_path: Path, *args: str, timeout: int) -> list[dict[str, object]]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.elastic", str(tmp_path / "jobs"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_kills_restarts_reshapes_and_appends_lose_and_repeat_nothing(tmp_path: Path) -> None:
    """Data-parallel jobs (torch.distributed over gloo, 1 to 4 ranks, 0 to 4 workers each, random
    batch sizes) SIGKILLed at random points and restarted in another shape, some times after an
    append: every sample of every epoch delivered once (tests/elastic.py says how it is
    counted). A bounded number of cycles here; the long run is the slow test below."""
    found = run_cycles(tmp_path, "--cycles", "40", "--seconds", "30", "--seed", "1", timeout=170)
    summary = found[-1]
    assert summary["kills"] >= 8 and summary["jobs"] >= 2, summary


@pytest.mark.slow
def test_a_thousand_kill_restart_cycles_lose_and_repeat_nothing(tmp_path: Path) -> None:
    found = run_cycles(tmp_path, "--cycles", "1000", "--seed", "7", timeout=6 * 3600)
    assert found[-1]["kills"] == 1000, found[-1]


def test_a_selection_an_append_changed_is_refused_as_such(tmp_path: Path) -> None:
    """A selection by class over a store that grew since (an append added records of the class):
    the same store, another selection; the refusal says so, and restarting the epoch works."""
    root = tmp_path / "src"
    for i in range(24):
        write(root / f"c{i % 3}" / f"{i:03d}.jpg", jpeg_bytes(16, 12, seed=i))
    store = tmp_path / "s.lmdb"
    convert(root, store)

    def chosen():  # type: ignore[no-untyped-def]
        dataset = LMDBImageDataset(store, classes=["c0", "c1"])
        options = dict(image_size=8, device="cpu", seed=5, num_workers=0, drop_last=False)
        return create_loader(dataset, 4, **options)  # type: ignore[arg-type]

    first = chosen()
    next(iter(first))
    state = first.state_dict()
    first.close()
    first.dataset.close()
    for i in range(24, 30):
        write(root / f"c{i % 3}" / f"{i:03d}.jpg", jpeg_bytes(16, 12, seed=i))
    convert(root, store, append=True)
    with pytest.raises(ResumeError, match="the store grew by an append since.*restart_epoch"):
        chosen().load_state_dict(state)
    again = chosen()
    again.load_state_dict(state, restart_epoch=True)
    assert len(labels(again)) == 20  # (16 of c0 and c1, and the 4 the append added)


def test_a_state_of_the_earlier_format_resumes_where_it_stood(store: Path) -> None:
    """A state saved before positions were global (batches of one rank layout, no shuffle
    saved): its position is the same prefix of the order, for a loader in order too."""
    earlier = {"epoch": 0, "seed": 5, "world_size": 1, "rank": 0, "samples": 40}
    whole = labels(loader(store, 6, train=False))
    resumed = loader(store, 4, train=False)
    resumed.load_state_dict({**earlier, "batches": 2, "batch_size": 6})
    assert labels(resumed) == whole[12:]
