"""Batches that fast_collate sends from workers through reused shared-memory slots."""

import gc
import os
import multiprocessing
import warnings
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastdata import fast_collate
from fastdata.loaders import slots


class Pixels(Dataset):  # type: ignore[type-arg]
    """Sample i is an 8x8 RGB image filled with i % 251, labelled i."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 8, 8), i % 251, dtype=torch.uint8), i


def loader(workers: int = 2, **kw) -> DataLoader:  # type: ignore[no-untyped-def, type-arg]
    return DataLoader(Pixels(), batch_size=4, num_workers=workers, collate_fn=fast_collate, **kw)


def intact(batch: tuple[torch.Tensor, torch.Tensor]) -> bool:
    images, labels = batch
    expected = (labels % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(images)
    return images.shape == (len(labels), 3, 8, 8) and torch.equal(images, expected)


def mapped_slots() -> int:
    """Shared-memory batch slots this process has mapped, as the kernel lists them."""
    gc.collect()  # batches no one holds any more let go of their slot
    with open("/proc/self/maps") as maps:
        return sum("memfd:fastdata-batch" in line for line in maps)


def test_batches_kept_by_the_caller_are_never_overwritten() -> None:
    # 60 batches kept at once: far more than the slots, so most take PyTorch's own path
    kept = list(loader())
    assert len(kept) == 60 and all(intact(b) for b in kept)
    assert sorted(int(i) for _, y in kept for i in y) == list(range(240))


def test_slots_are_reused_across_batches_and_epochs() -> None:
    persistent = loader(persistent_workers=True)
    for _ in range(3):
        for batch in persistent:
            assert intact(batch)
    # 180 batches went through a handful of slots per worker
    assert 2 <= mapped_slots() <= 2 * slots.SLOTS_PER_WORKER


def test_mappings_of_exited_workers_are_dropped() -> None:
    it = iter(loader())
    assert all(intact(b) for b in it)
    first = mapped_slots()
    assert first >= 1
    del it  # its workers exit
    it = iter(loader())
    assert all(intact(b) for b in it)  # the next workers' first slots sweep the old ones
    assert mapped_slots() <= 2 * slots.SLOTS_PER_WORKER
    del it
    slots.drop_exited_workers()
    assert mapped_slots() == 0


def _drop_inherited_batches() -> None:
    # what happens when a forked child lets go of the batches it inherited; walking every object
    # touches torch's deprecated `reduce_op` alias, whose FutureWarning is not ours
    warnings.simplefilter("ignore", FutureWarning)

    def is_finalizer(o: object) -> bool:
        try:
            return isinstance(o, weakref.finalize)
        except ReferenceError:  # a dead weakref.proxy left by another test
            return False

    for finalizer in [o for o in gc.get_objects() if is_finalizer(o)]:
        found = finalizer.peek()
        if found is not None and found[1] is slots._release:
            finalizer()


def test_a_forked_child_dropping_a_batch_does_not_free_its_slot() -> None:
    it = iter(loader(workers=1, persistent_workers=True))
    held = next(it)
    snapshot = held[0].clone()
    child = multiprocessing.get_context("fork").Process(target=_drop_inherited_batches)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    for batch in it:  # the worker cycles through its slots; the held one must stay out
        assert intact(batch)
    assert torch.equal(held[0], snapshot)


@pytest.mark.slow
def test_spawned_workers_send_through_slots() -> None:
    spawned = loader(multiprocessing_context="spawn", persistent_workers=True)
    for _ in range(2):
        assert sum(intact(b) for b in spawned) == 60


def test_in_the_main_process_batches_are_plain_tensors() -> None:
    images, labels = fast_collate([(torch.zeros((3, 2, 2), dtype=torch.uint8), 5)])
    assert type(images) is torch.Tensor and labels.tolist() == [5]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a child that ended and was reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def device_loader():  # type: ignore[no-untyped-def]
    from fastdata import create_loader

    return create_loader(Pixels(), 4, train=False, num_workers=2, device="cpu", mean=None, std=None)


def test_a_closed_loader_releases_its_workers_and_slots() -> None:
    made = device_loader()
    assert sum(intact(b) for b in made) == 60
    workers = made.worker_pids
    assert len(workers) == 2 and mapped_slots() >= 1
    made.close()
    assert not any(_alive(pid) for pid in workers)
    assert mapped_slots() == 0


def test_a_collected_loader_releases_its_workers_and_slots() -> None:
    made = device_loader()
    assert sum(intact(b) for b in made) == 60
    workers = made.worker_pids
    assert len(workers) == 2
    del made
    gc.collect()
    assert not any(_alive(pid) for pid in workers)
    assert mapped_slots() == 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_process_that_exits_leaves_nothing_in_dev_shm() -> None:
    from ..procs import run_script

    before = set(os.listdir("/dev/shm"))
    result = run_script(
        """
        import torch
        from fastdata import create_loader, fast_collate
        class Pixels(torch.utils.data.Dataset):
            def __len__(self):
                return 400
            def __getitem__(self, i):
                return torch.full((3, 64, 64), i % 251, dtype=torch.uint8), i
        loader = create_loader(Pixels(), 8, train=True, num_workers=2, device="cpu")
        kept = [batch for _, batch in zip(range(30), loader)]  # some batches still held at exit
        print(len(kept))
        """
    )
    assert result.returncode == 0, result.stderr
    left = {
        name
        for name in set(os.listdir("/dev/shm")) - before
        if "torch" in name or "fastdata" in name
    }
    assert not left
