import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from fastdata import LMDBImageDataset, convert, create_loader, fast_collate
from fastdata.ops.bench import worker_candidates
from fastdata.loaders import EpochSampler

from ..conftest import jpeg_bytes, write


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    for i in range(40):
        write(root / f"c{i % 4}" / f"{i:03d}.jpg", jpeg_bytes(120, 90, seed=i))
    dst = tmp_path_factory.mktemp("store") / "s.lmdb"
    convert(root, dst)
    return dst


def epoch(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [(x.clone(), y.clone()) for x, y in loader]


def same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)
    )


def make(store: Path, **kw):  # type: ignore[no-untyped-def]
    options = dict(image_size=32, device="cpu", seed=7, num_workers=0)
    options.update(kw)
    return create_loader(LMDBImageDataset(store), 6, **options)


def test_batches_are_normalised_device_tensors(store: Path) -> None:
    x, y = next(iter(make(store)))
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert -3 < x.min() < 0 < x.max() < 3  # ImageNet-normalised
    x, _ = next(iter(make(store, mean=None, std=None)))
    assert x.dtype == torch.uint8  # left as uint8 when not normalising


def test_same_seed_same_batches_for_any_worker_count(store: Path) -> None:
    reference = epoch(make(store, num_workers=0))
    assert len(reference) == 40 // 6  # train drops the last partial batch
    for workers in (1, 2):
        assert same(epoch(make(store, num_workers=workers)), reference), workers
    assert not same(epoch(make(store, seed=8)), reference)


def test_epochs_reshuffle_on_their_own(store: Path) -> None:
    loader = make(store)
    first, second = epoch(loader), epoch(loader)
    assert loader.epoch == 2
    assert not same(first, second)
    assert len(second) == len(first)


def test_eval_loader_is_ordered_and_complete(store: Path) -> None:
    loader = make(store, train=False)
    labels = torch.cat([y for _, y in loader]).tolist()
    assert labels == list(LMDBImageDataset(store).targets) and len(loader) == 7


def test_resume_yields_exactly_the_unseen_rest(store: Path) -> None:
    full = make(store, num_workers=2)
    epoch0, epoch1 = epoch(full), epoch(full)

    interrupted = make(store, num_workers=2)
    seen = []
    for batch in interrupted:
        seen.append(batch)
        if len(seen) == 3:
            break
    state = interrupted.state_dict()
    assert state["epoch"] == 0 and state["position"] == 3 * 6

    resumed = make(store, num_workers=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint file
    assert len(resumed) == len(epoch0) - 3
    rest = epoch(resumed)
    assert same(seen, epoch0[:3]) and same(rest, epoch0[3:])
    assert same(epoch(resumed), epoch1)  # and the following epoch is the usual one


def test_resume_refuses_other_settings(store: Path) -> None:
    state = make(store).state_dict()
    with pytest.raises(ValueError, match="seed=7"):
        make(store, seed=1).load_state_dict(state)


def test_auto_picks_a_count_within_its_time_bound(store: Path) -> None:
    start = time.perf_counter()
    loader = make(store, num_workers="auto", auto_seconds=0.3)
    elapsed = time.perf_counter() - start
    candidates = worker_candidates()
    assert loader.num_workers in candidates
    assert sorted(loader.worker_rates) == candidates
    assert all(r > 0 for r in loader.worker_rates.values())
    assert elapsed < len(candidates) * (0.3 + 5.0)
    assert len(epoch(loader)) == 40 // 6


def test_rejects_bad_worker_count(store: Path) -> None:
    with pytest.raises(ValueError, match="num_workers"):
        make(store, num_workers="many")


class IndexDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 2, 2), i % 256, dtype=torch.uint8), i


def test_any_dataset_of_uint8_images() -> None:
    loader = create_loader(IndexDataset(10), 4, train=False, num_workers=0, device="cpu")
    got = [y.tolist() for _, y in loader]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _rank_main(rank: int, init: str, out: str, drop_last: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        loader = create_loader(
            IndexDataset(50), 4, num_workers=0, device="cpu", seed=3, drop_last=drop_last
        )
        epochs = [[y.tolist() for _, y in loader] for _ in range(2)]
        Path(out).write_text(json.dumps(epochs))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("drop_last", [False, True])
def test_two_ranks_share_the_data(tmp_path: Path, drop_last: bool) -> None:
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, init, outs[r], drop_last)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    r0, r1 = (json.loads(Path(o).read_text()) for o in outs)
    for e in range(2):
        a = [i for b in r0[e] for i in b]
        b = [i for b in r1[e] for i in b]
        assert len(r0[e]) == len(r1[e])  # equal batch counts
        assert not set(a) & set(b)  # disjoint
        if not drop_last:
            assert sorted(a + b) == list(range(50))  # together the whole epoch
    assert r0[0] != r0[1]  # reshuffled without set_epoch


def test_sampler_pads_ranks_to_equal_length() -> None:
    shares = [EpochSampler(11, rank=r, world_size=3, seed=1).indices() for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]
    assert set().union(*shares) == set(range(11))


def test_fast_collate_keeps_uint8_and_checks_sizes() -> None:
    import numpy as np

    x, y = fast_collate([(np.zeros((4, 5, 3), np.uint8), 1), (np.ones((4, 5, 3), np.uint8), 2)])
    assert x.shape == (2, 3, 4, 5) and x.dtype == torch.uint8 and y.tolist() == [1, 2]
    assert x[1].sum() == 60
    with pytest.raises(ValueError, match="one size"):
        fast_collate([(np.zeros((4, 5, 3), np.uint8), 1), (np.zeros((5, 5, 3), np.uint8), 2)])


def test_the_epoch_order_is_one_compact_array() -> None:
    """4 bytes a sample, the same order as before it was compact (torch.randperm, int64)."""
    sampler = EpochSampler(1_000_003, seed=3)
    import numpy as np
    import torch

    from fastdata.loaders.sampler import sample_seed

    sampler.set_epoch(2)
    order = sampler.indices()
    assert order.nbytes <= 4 * 1_000_003
    assert np.array_equal(np.sort(order), np.arange(1_000_003))
    g = torch.Generator().manual_seed(sample_seed(3, 2, -1) & 0xFFFFFFFFFFFF)
    assert np.array_equal(order, torch.randperm(1_000_003, generator=g).numpy())
