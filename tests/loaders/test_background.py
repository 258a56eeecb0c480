import gc
import threading
import time
import traceback

import pytest
import torch

from fastdata.loaders import BackgroundGenerator, background


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fastdata-background")]


def wait_no_producers(timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while producer_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not producer_threads()


@pytest.fixture(autouse=True)
def no_leftover_threads():  # type: ignore[no-untyped-def]
    yield
    gc.collect()
    assert wait_no_producers(), f"threads left: {producer_threads()}"


def test_every_item_once_in_order() -> None:
    assert list(BackgroundGenerator(range(1000), max_prefetch=3)) == list(range(1000))


def test_empty_and_exhausted() -> None:
    g = BackgroundGenerator([])
    assert list(g) == []
    assert list(g) == []  # exhausted stays exhausted, no deadlock
    assert wait_no_producers()


def test_producer_exception_reraised_with_original_traceback() -> None:
    def failing():  # type: ignore[no-untyped-def]
        yield 1
        yield 2
        raise KeyError("record 17 missing")

    g = BackgroundGenerator(failing())
    assert next(g) == 1 and next(g) == 2
    with pytest.raises(KeyError, match="record 17 missing") as info:
        next(g)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing" in frames  # the producer's own frame is in the traceback
    with pytest.raises(StopIteration):
        next(g)


def test_break_early_and_drop_leaves_no_thread() -> None:
    def endless():  # type: ignore[no-untyped-def]
        i = 0
        while True:
            yield i
            i += 1

    for item in BackgroundGenerator(endless(), max_prefetch=2):
        if item == 5:
            break
    gc.collect()
    assert wait_no_producers()


def test_close_and_context_manager_stop_thread() -> None:
    finished = threading.Event()

    def source():  # type: ignore[no-untyped-def]
        try:
            yield from range(10**9)
        finally:
            finished.set()

    with BackgroundGenerator(source()) as g:
        assert next(g) == 0
    assert not g.alive
    assert finished.wait(5)  # the source generator was closed, in its thread
    with pytest.raises(StopIteration):
        next(g)
    g2 = BackgroundGenerator(range(10**9))
    next(g2)
    g2.close()
    assert not g2.alive


def test_garbage_collection_stops_thread() -> None:
    g = BackgroundGenerator(iter(range(10**9)), max_prefetch=1)
    next(g)
    del g
    gc.collect()
    assert wait_no_producers()


def test_slow_consumer_fast_producer_bounded_queue() -> None:
    produced = []

    def source():  # type: ignore[no-untyped-def]
        for i in range(20):
            produced.append(i)
            yield i

    g = BackgroundGenerator(source(), max_prefetch=3)
    out = []
    for item in g:
        time.sleep(0.01)
        # the producer never runs more than the queue bound (+1 in hand) ahead
        assert len(produced) - len(out) <= 3 + 2
        out.append(item)
    assert out == list(range(20))


def test_fast_consumer_slow_producer() -> None:
    def source():  # type: ignore[no-untyped-def]
        for i in range(10):
            time.sleep(0.01)
            yield i

    assert list(BackgroundGenerator(source())) == list(range(10))


def test_producer_runs_ahead_while_consumer_works() -> None:
    produced = [threading.Event() for _ in range(3)]

    def source():  # type: ignore[no-untyped-def]
        for i in range(3):
            produced[i].set()
            yield i

    g = BackgroundGenerator(source(), max_prefetch=2)
    assert next(g) == 0
    # while the consumer holds item 0, the producer makes the next ones on its own
    assert produced[1].wait(5) and produced[2].wait(5)
    assert list(g) == [1, 2]


def test_decorator() -> None:
    @background(max_prefetch=4)
    def squares(n: int):  # type: ignore[no-untyped-def]
        for i in range(n):
            yield i * i

    g = squares(5)
    assert isinstance(g, BackgroundGenerator)
    assert list(g) == [0, 1, 4, 9, 16]


def test_moves_batches_to_device_in_thread() -> None:
    batches = [{"x": torch.ones(2, 2) * i, "name": f"b{i}"} for i in range(3)]
    out = list(BackgroundGenerator(batches, device="cpu"))
    assert [b["name"] for b in out] == ["b0", "b1", "b2"]
    assert all(b["x"].device.type == "cpu" for b in out)


def test_rejects_bad_prefetch() -> None:
    with pytest.raises(ValueError, match="max_prefetch"):
        BackgroundGenerator([], max_prefetch=0)
