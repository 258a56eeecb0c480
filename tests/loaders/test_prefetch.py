from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastdata.loaders import IMAGENET_MEAN, IMAGENET_STD, PrefetchLoader

Pair = namedtuple("Pair", "images targets")


def image_batches(
    n: int = 5, batch: int = 4, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, 3, 8, 6), dtype=torch.uint8, generator=g),
            torch.arange(i * batch, (i + 1) * batch),
        )
        for i in range(n)
    ]


def reference(x: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:  # type: ignore[no-untyped-def]
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x.double() / 255 - m.double()) / s.double()


def test_every_batch_once_in_order_last_included() -> None:
    batches = image_batches(n=7)
    out = list(PrefetchLoader(batches, device="cpu"))
    assert len(out) == 7
    for (x, y), (ox, oy) in zip(batches, out, strict=True):
        assert torch.equal(x, ox) and torch.equal(y, oy)  # no dtype asked: moved only


def test_normalization_matches_reference_for_each_dtype() -> None:
    batches = image_batches()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        loader = PrefetchLoader(batches, device="cpu", dtype=dtype, normalize=True)
        for (x, y), (ox, oy) in zip(batches, loader, strict=True):
            assert ox.dtype == dtype and oy.dtype == torch.int64
            err = (ox.double() - reference(x)).abs() / reference(x).abs().clamp(min=1)
            assert err.max().item() < tol, dtype
            assert torch.equal(oy, y)  # targets only moved


def test_custom_mean_std_and_plain_scaling() -> None:
    ((x, _),) = image_batches(n=1)
    ((ox, _),) = PrefetchLoader([(x, 0)], device="cpu", mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    torch.testing.assert_close(ox.double(), reference(x, (0.5,) * 3, (0.25, 0.5, 1.0)))
    ((oz, _),) = PrefetchLoader([(x, 0)], device="cpu", dtype=torch.float32)
    torch.testing.assert_close(oz, x.float() / 255)


def test_channels_last_on_device() -> None:
    ((x, _),) = image_batches(n=1)
    ((ox, _),) = PrefetchLoader([(x, 0)], device="cpu", normalize=True, channels_last=True)
    assert ox.is_contiguous(memory_format=torch.channels_last)


def test_nested_structures_and_non_tensor_leaves() -> None:
    ((x, y),) = image_batches(n=1)
    batch = {
        "pair": Pair(x, y),
        "meta": OrderedDict(names=["a", "b"], count=2, missing=None),
        "list": [x[:1], "text", (y, 3.5)],
        "mask": torch.ones(4, 8, 6, dtype=torch.uint8),  # uint8 but 3-D: not an image batch
    }
    (out,) = PrefetchLoader([batch], device="cpu", normalize=True)
    assert isinstance(out["pair"], Pair) and out["pair"].images.dtype == torch.float32
    assert torch.equal(out["pair"].targets, y)
    assert isinstance(out["meta"], OrderedDict) and out["meta"]["names"] == ["a", "b"]
    assert out["meta"]["count"] == 2 and out["meta"]["missing"] is None
    assert out["list"][1] == "text" and out["list"][2][1] == 3.5
    assert out["list"][0].dtype == torch.float32
    assert out["mask"].dtype == torch.uint8


def test_empty_loader_yields_nothing() -> None:
    assert list(PrefetchLoader([], device="cpu", normalize=True)) == []


def test_passes_through_loader_attributes_and_epochs() -> None:
    ds = TensorDataset(torch.zeros(10, 3, 2, 2, dtype=torch.uint8), torch.arange(10))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=0)
    dl = DataLoader(ds, batch_size=3, sampler=sampler)
    pl = PrefetchLoader(dl, device="cpu", normalize=True)
    assert len(pl) == len(dl) == 2
    assert pl.dataset is ds and pl.sampler is sampler and pl.batch_size == 3
    pl.set_epoch(1)
    assert sampler.epoch == 1
    first = [y.tolist() for _, y in pl]
    second = [y.tolist() for _, y in pl]  # iterating again starts a new epoch
    assert first == second and sum(len(b) for b in first) == 5
    with pytest.raises(AttributeError):
        PrefetchLoader([], device="cpu").set_epoch(0)


def test_loader_exception_reaches_caller_unchanged_after_earlier_batches() -> None:
    class Boom(RuntimeError):
        pass

    def gen():  # type: ignore[no-untyped-def]
        yield image_batches(n=1)[0]
        raise Boom("disk on fire")

    seen = []
    with pytest.raises(Boom, match="disk on fire"):
        for batch in PrefetchLoader(gen(), device="cpu", normalize=True):
            seen.append(batch)
    assert len(seen) == 1


def test_default_device_on_cpu_machine_makes_no_cuda_call(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    def forbidden(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("CUDA call on a CPU-only machine")

    monkeypatch.setattr(torch.cuda, "Stream", forbidden)
    monkeypatch.setattr(torch.cuda, "current_stream", forbidden)
    pl = PrefetchLoader(image_batches(), normalize=True)
    assert pl.device.type == "cpu"
    assert len(list(pl)) == 5
    assert not torch.cuda.is_initialized()


def test_mismatched_channels_is_a_clear_error() -> None:
    gray = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="3 channels but the image batch has 1"):
        list(PrefetchLoader([gray], device="cpu", normalize=True))


def test_with_dataloader_workers() -> None:
    ds = TensorDataset(torch.randint(0, 255, (20, 3, 4, 4), dtype=torch.uint8), torch.arange(20))
    dl = DataLoader(ds, batch_size=6, num_workers=2)
    got = torch.cat([y for _, y in PrefetchLoader(dl, device="cpu", normalize=True)])
    assert got.tolist() == list(range(20))


def test_a_decoding_loader_decodes_the_next_batch_while_the_caller_trains() -> None:
    # a device decode takes about as long as a training step: batch k+1 is decoded while the
    # caller still works on batch k, not after it asks for k+1
    import threading

    started = [threading.Event() for _ in range(4)]

    def decode(batch):  # type: ignore[no-untyped-def]
        x, y = batch
        started[int(y[0]) // 4].set()
        return x.flip(-1), y

    data = image_batches(n=4)
    got = []
    for i, (x, y) in enumerate(PrefetchLoader(data, device="cpu", decode=decode)):
        if i + 1 < len(data):
            assert started[i + 1].wait(10), f"batch {i + 1} was not decoded ahead"
        got.append((x, y))
    assert all(
        torch.equal(x, d.flip(-1)) and torch.equal(y, t)
        for (x, y), (d, t) in zip(got, data, strict=True)
    )


def test_a_decoding_loader_stops_its_thread_and_reports_errors() -> None:
    import threading

    class Boom(RuntimeError):
        pass

    def decode(batch):  # type: ignore[no-untyped-def]
        if int(batch[1][0]) == 8:
            raise Boom("record 8 is not an image")
        return batch

    before = threading.active_count()
    seen = []
    with pytest.raises(Boom, match="record 8"):
        for batch in PrefetchLoader(image_batches(n=5), device="cpu", decode=decode):
            seen.append(batch)
    assert len(seen) == 2  # the batches before the bad one, then its error

    it = iter(PrefetchLoader(image_batches(n=50), device="cpu", decode=lambda b: b))
    next(it)
    it.close()  # a caller breaking out of its loop
    for _ in range(100):
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.05)
    assert threading.active_count() <= before


def test_a_decode_that_raises_stopiteration_is_an_error_not_the_end_of_the_epoch() -> None:
    def decode(batch):  # type: ignore[no-untyped-def]
        if int(batch[1][0]) == 8:
            next(iter([]))  # a bug in the decode: StopIteration escapes it
        return batch

    seen = []
    with pytest.raises(RuntimeError, match="StopIteration"):
        for batch in PrefetchLoader(image_batches(n=5), device="cpu", decode=decode):
            seen.append(batch)
    assert len(seen) == 2


class WithWorkers(list):  # type: ignore[type-arg]
    """Batches, as from a loader with ``num_workers`` worker processes."""

    num_workers = 0


def test_batches_are_converted_on_the_cores_the_workers_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU, a loader with workers has its batches converted on the cores its workers
    leave, at least one thread (torch's threads spin between operations, on the cores the
    workers decode on: NOTE [ Threads beside the workers ]); the caller's own thread count is
    as it was between batches, and without workers the conversion keeps it."""
    from fastdata.loaders.normalize import Normalizer

    seen: list[int] = []
    apply = Normalizer.apply

    def counted(self, t, constants):  # type: ignore[no-untyped-def]
        if t.dtype == torch.uint8 and t.dim() == 4:
            seen.append(torch.get_num_threads())
        return apply(self, t, constants)

    monkeypatch.setattr(Normalizer, "apply", counted)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        batches = WithWorkers(image_batches(n=3))
        for workers, wanted in ((3, 1), (8, 1), (2, 2), (0, 4)):
            batches.num_workers = workers
            seen.clear()
            out = []
            for x, _ in PrefetchLoader(batches, device="cpu", normalize=True):
                assert torch.get_num_threads() == 4  # (the caller's, between batches)
                out.append(x)
            assert seen == [wanted] * 3, (workers, seen)
            for (x, _), got in zip(batches, out, strict=True):
                assert torch.allclose(got.double(), reference(x), atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_a_loader_whose_worker_count_cannot_be_read_is_wrapped_and_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loader's ``num_workers`` that raises (a wrapper's property that cannot answer before
    it starts) is no reason to refuse the loader: PrefetchLoader had raised its error when
    built, where it never asked before; a count of numpy's integer type counts."""
    import numpy as np

    from fastdata.loaders.device import threads_beside_workers

    class Unready(list):  # type: ignore[type-arg]
        @property
        def num_workers(self) -> int:
            raise RuntimeError("not started yet")

    batches = Unready(image_batches(n=2))
    out = [x for x, _ in PrefetchLoader(batches, device="cpu", normalize=True)]
    for (x, _), got in zip(batches, out, strict=True):
        assert torch.allclose(got.double(), reference(x), atol=1e-5)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    counted = WithWorkers(image_batches(n=1))
    counted.num_workers = np.int64(3)
    assert threads_beside_workers(counted) == 1
