"""Throughput measurement behind ``fastdata bench`` and the scripts: raw record reads,
decode+pipeline per process, and whole loaders per worker count (see ``loaders/tuning.py``)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..loaders.tuning import (
    choose_workers,
    cpu_count,
    measure_loader,
    measure_workers,
    median,
    timed_loop,
    worker_candidates,
)

__all__ = [
    "BenchReport",
    "bench_store",
    "choose_workers",
    "input_bound",
    "measure_loader",
    "measure_pipeline",
    "measure_reads",
    "measure_workers",
    "plot_report",
    "require_plotting",
    "worker_candidates",
]

log = logging.getLogger(__name__)


def _random_batches(n: int, batch_size: int, seed: int = 0) -> Iterable[list[int]]:
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(n) for _ in range(batch_size)]


def measure_reads(reader: Any, *, batch_size: int = 64, seconds: float = 1.0) -> float:
    """Raw record reads per second: random batches of encoded bytes, no decoding."""
    batches = iter(_random_batches(len(reader), batch_size))
    return timed_loop(lambda: len(reader.read_samples(next(batches))), seconds)


def measure_pipeline(dataset: Any, *, seconds: float = 1.0) -> float:
    """Decode+pipeline images per second in this one process (the per-worker ceiling), with
    one torch thread, as a ``DataLoader`` worker runs it: with the process's pool of threads,
    each image's few small resize ops woke threads that spun on the cores the decoder needed
    (measured on a busy 2-CPU machine: 83 against 933 images/s, and swinging from run to
    run)."""
    import torch

    batches = iter(_random_batches(len(dataset), 16, seed=1))

    def step() -> int:
        return len(dataset.__getitems__([(i, i) for i in next(batches)]))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()  # warm caches
        return timed_loop(step, seconds)
    finally:
        torch.set_num_threads(threads)


def input_bound(images_per_s: float, batch_size: int, step_ms: float) -> dict[str, float]:
    """Whether a training step of ``step_ms`` would wait for data, and for what share of time.

    Returns:
        ``data_ms`` (time to produce one batch), ``wait_ms`` per step, and ``wait_fraction`` of
        the step's wall time spent waiting (0 when the loader keeps up).
    """
    data_ms = batch_size / images_per_s * 1000 if images_per_s > 0 else float("inf")
    wait_ms = max(0.0, data_ms - step_ms)
    wall = max(data_ms, step_ms)
    return {
        "data_ms": data_ms,
        "wait_ms": wait_ms,
        "wait_fraction": wait_ms / wall if wall else 0.0,
    }


@dataclass
class BenchReport:
    """What ``fastdata bench`` measured."""

    store: str
    records: int
    batch_size: int
    reads_per_s: float
    pipeline_per_s: float
    """The median of the rounds (as every figure here)."""
    reads_spread: tuple[float, float] = (0.0, 0.0)
    pipeline_spread: tuple[float, float] = (0.0, 0.0)
    """The slowest and fastest round."""
    loader_per_s: dict[int, float] = field(default_factory=dict)
    """The median of the rounds, per worker count."""
    loader_spread: dict[int, tuple[float, float]] = field(default_factory=dict)
    """The slowest and fastest round, per worker count."""
    chosen_workers: int = 0
    cpus: int = 1
    notes: list[str] = field(default_factory=list)
    """Figures that deserve a second look (e.g. more than the CPUs can give)."""
    step_ms: float | None = None
    verdict: dict[str, float] | None = None
    decoder: str = ""
    checksum: str = ""
    """The CRC-32 implementation in use."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loader_per_s"] = {str(k): v for k, v in self.loader_per_s.items()}
        d["loader_spread"] = {str(k): list(v) for k, v in self.loader_spread.items()}
        return d


def bench_store(
    store: str,
    *,
    batch_size: int = 64,
    workers: int | str = "auto",
    step_ms: float | None = None,
    seconds: float = 1.0,
    image_size: int = 224,
    rounds: int = 3,
    **open_options: Any,
) -> BenchReport:
    """Measure a store on this machine: raw reads, decode+pipeline per process, and the loader
    for several worker counts; with ``step_ms``, say whether training would wait for data.

    Args:
        store: an LMDB path or a Mongo URI (``collection=...`` among ``open_options``).
        batch_size: loader batch size.
        workers: ``"auto"`` to choose among the measured counts, or a count to mark as chosen
            (it is measured too).
        step_ms: the training step time, for the verdict.
        seconds: measuring time of each figure (each loader round).
        image_size: output side of the train pipeline.
        rounds: rounds of every figure (the median is reported, with the spread).
    """
    from ..datasets import ImageStoreDataset
    from ..images.decode import decoder_name
    from ..images.pipelines import TrainPipeline
    from ..loaders import create_loader
    from ..records import CHECKSUM_IMPLEMENTATION
    from ..stores import open_store

    reader = open_store(store, **open_options)
    dataset = ImageStoreDataset(reader, pipeline=TrainPipeline(image_size))
    reads, decodes = [], []
    for _ in range(max(1, rounds)):  # interleaved, so a busy stretch hits both
        reads.append(measure_reads(reader, batch_size=batch_size, seconds=seconds / rounds))
        decodes.append(measure_pipeline(dataset, seconds=seconds / rounds))
    report = BenchReport(
        store=reader.location,
        records=len(reader),
        batch_size=batch_size,
        reads_per_s=median(reads),
        pipeline_per_s=median(decodes),
        reads_spread=(min(reads), max(reads)),
        pipeline_spread=(min(decodes), max(decodes)),
        step_ms=step_ms,
        decoder=decoder_name(),
        checksum=CHECKSUM_IMPLEMENTATION,
    )
    report.cpus = cpu_count()
    candidates = worker_candidates(report.cpus)
    if isinstance(workers, int):
        candidates = sorted({*candidates, workers})

    def make_loader(w: int) -> Iterable[Any]:
        # uint8 batches on the CPU: the device copy and normalisation are the GPU's work
        return create_loader(
            dataset,
            batch_size,
            num_workers=w,
            device="cpu",
            mean=None,
            std=None,
            persistent_workers=False,
            drop_last=False,
        )

    rounds_per_s = measure_workers(
        make_loader, candidates, batch_size=batch_size, seconds=seconds, rounds=rounds
    )
    report.loader_per_s = {w: median(r) for w, r in rounds_per_s.items()}
    report.loader_spread = {w: (min(r), max(r)) for w, r in rounds_per_s.items()}
    report.notes.extend(_out_of_line(report))
    report.chosen_workers = (
        workers if isinstance(workers, int) else choose_workers(report.loader_per_s)
    )
    if step_ms is not None:
        rate = report.loader_per_s[report.chosen_workers]
        report.verdict = input_bound(rate, batch_size, step_ms)
    reader.close()
    return report


def _out_of_line(report: BenchReport) -> list[str]:
    """Figures that disagree, each blamed on the one that is out of line: a loader faster than
    its CPUs could decode at the one-process rate is explained by that rate when the rate
    varied and its best round accounts for the loader (a busy machine slowed the one-process
    figure), else it is the loader figure that is suspect."""
    notes = []
    low, high = report.pipeline_spread
    for w, rate in sorted(report.loader_per_s.items()):
        cpus = max(1, min(w, report.cpus))
        if rate <= 1.2 * report.pipeline_per_s * cpus:
            continue
        if rate <= 1.2 * high * cpus and high > 1.3 * low:
            notes.append(
                f"decode+crop in one process varied from {low:.0f} to {high:.0f} images/s "
                f"over the rounds: the machine was busy while it ran (the loader's {w} workers "
                f"at {rate:.0f} images/s fit its fastest round); run again on a quiet machine"
            )
            break  # one note says it for every count
        notes.append(
            f"{w} workers measured {rate:.0f} images/s, more than {cpus} CPU(s) at "
            f"{report.pipeline_per_s:.0f} images/s each can decode (at most {high:.0f} in any "
            "round): the loader figure is cache-bound or too short; measure longer (--seconds)"
        )
    return notes


def require_plotting() -> None:
    """Check that a plot can be drawn, before anything is measured.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            "--plot needs matplotlib: pip install 'fastdata-images[plot]' (nothing was measured)"
        )


def plot_report(report: BenchReport, path: str) -> None:
    """Draw loader throughput against worker count into ``path`` (PNG, ...).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            "--plot needs matplotlib: pip install 'fastdata-images[plot]'"
        ) from exc
    workers = sorted(report.loader_per_s)
    rates = [report.loader_per_s[w] for w in workers]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(workers, rates, marker="o", label="loader")
    ax.axhline(report.pipeline_per_s, linestyle=":", color="gray", label="one process, decode")
    chosen = report.chosen_workers
    ax.plot([chosen], [report.loader_per_s[chosen]], "r*", markersize=14, label="chosen")
    if report.step_ms:
        needed = report.batch_size / report.step_ms * 1000
        ax.axhline(needed, linestyle="--", color="green", label="needed by training")
    ax.set_xlabel("worker processes")
    ax.set_ylabel("images / s")
    ax.set_title(report.store, fontsize=8)
    ax.set_xticks(workers)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
