"""create_loader: the training loader in one call, tuned, deterministic, resumable."""

from __future__ import annotations

import contextlib
import logging
import random
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from ..errors import ResumeError, UsageError
from .collate import collate_encoded, collate_for
from .device import DecodedBatches, DeviceStep, pinned_device
from .device_workers import (
    DecodingCollate,
    Probed,
    decode_settings,
    refuse_fields,
    stop_workers,
    worker_start,
)
from .normalize import IMAGENET_MEAN, IMAGENET_STD
from .position import (
    RESTART,
    Position,
    change_note,
    dataset_identity,
    epoch_of,
    make_state,
    read_state,
    refuse_other,
    same_samples,
)
from .prefetch import PrefetchLoader
from .sampler import EpochSampler, ranks
from .tuning import pick_workers

__all__ = ["Loader", "create_loader"]

log = logging.getLogger(__name__)

Workers = Union[int, str]


def _worker_init(worker_id: int) -> None:
    from .malloc import tune_malloc

    # torch seeds each worker from the loader's generator; the other generators follow it, so a
    # user transform that draws from random or numpy is reproducible for a given worker count.
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    tune_malloc()


def _shut_down(dataloader: DataLoader[Any]) -> None:
    """Stop a DataLoader's persistent workers and drop the slot mappings of exited workers."""
    from .slots import drop_exited_workers

    iterator = getattr(dataloader, "_iterator", None)
    collate = dataloader.collate_fn
    if isinstance(collate, DecodingCollate) and collate.decoder.device.type == "cuda":
        stop_workers(iterator, collate.decoder.device)  # (what they shared let go first)
    elif iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    dataloader._iterator = None
    drop_exited_workers()


class Loader:
    """What :func:`create_loader` returns: iterate it for device batches, epoch after epoch.

    Every ``for`` loop over it is one epoch; the epoch number advances by itself (reshuffling,
    also across ranks) without a call to ``set_epoch``. Its position is global
    (:mod:`fastdata.loaders.position`): ``state_dict()`` taken by rank 0 between batches, given
    to ``load_state_dict()`` of a new loader on every rank, with any world size, worker count or
    batch size, makes its next iteration exactly the samples of the epoch not yet delivered by
    any rank, each once, split evenly over the new ranks (torchdata's ``StatefulDataLoader``
    protocol). A dataset that grew by an append since finishes the saved epoch over the samples
    it began with; the new ones join from the next.
    """

    def __init__(
        self,
        dataloader: DataLoader[Any],
        sampler: EpochSampler,
        device_loader: PrefetchLoader,
        *,
        seed: int,
        worker_rates: dict[int, float] | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.device_loader = device_loader
        self.seed = seed
        self.worker_rates = worker_rates or {}
        self.epoch = 0
        self._resume: Position | None = None  # where the next iteration begins, if not at 0
        self._iterating = False
        self._consumed = 0  # batches of this iteration handed out
        self._loaded: Position | None = None  # the position load_state_dict placed
        self._latest: object = None  # the iteration begun last
        self._current: object = None  # the iteration the position follows (None: between)
        self.resume_note = ""
        """What the last ``load_state_dict`` continues, said for a person (``resuming epoch 3
        on 2 ranks instead of 4: 61,440 samples left, 30,720 each``)."""
        self._finalizer = weakref.finalize(self, _shut_down, dataloader)
        self._batches: Callable[[], Any] = lambda: None  # the device loader's iterator now

    @property
    def worker_pids(self) -> list[int]:
        """The PIDs of the worker processes running now (none between epochs without
        persistent workers, and none with ``num_workers=0``)."""
        iterator = getattr(self.dataloader, "_iterator", None)
        workers = getattr(iterator, "_workers", None) or []
        return [w.pid for w in workers if w.pid is not None]

    def close(self) -> None:
        """Stop the worker processes and release their shared-memory batch slots (batches still
        referenced keep theirs until they go). Also done when the loader is garbage-collected."""
        iterating = self._batches()
        if iterating is not None:  # (a loop under way stops taking batches: see __iter__)
            with contextlib.suppress(ValueError):  # (running in another thread: it ends there)
                iterating.close()
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dataset(self) -> Any:
        return self.dataloader.dataset

    @property
    def batch_size(self) -> int:
        return int(self.dataloader.batch_size or 1)

    @property
    def num_workers(self) -> int:
        return self.dataloader.num_workers

    @property
    def device(self) -> torch.device:
        return self.device_loader.device

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (from its beginning); but right after
        ``load_state_dict``, the epoch it continues goes on from where it was saved (as a loop
        written for a ``DistributedSampler`` calls ``set_epoch(epoch)`` before every epoch,
        the resumed one too, and torchdata's stateful loader keeps the position then)."""
        loaded = self._resume is not None and self._resume is self._loaded
        if loaded and self._resume is not None and epoch == self._resume.epoch:
            return
        self.epoch, self._resume, self._consumed = epoch, None, 0
        self._current, self._iterating = None, False

    def _place(self) -> None:
        """The sampler where the next iteration begins."""
        if self._resume is None:
            self.sampler.set_epoch(self.epoch)
        else:
            saved = self._resume
            self.sampler.resume(saved.epoch, saved.position, saved.samples)

    def __len__(self) -> int:
        """Batches in the next (or current) iteration for this rank."""
        if not self._iterating:
            self._place()
        per_rank = self.sampler.per_rank()
        if self.dataloader.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        self._place()
        expected, open_before = len(self), self._finalizer.alive
        self._resume, self._consumed, self._iterating = None, 0, True
        mine = self._latest = self._current = object()
        finished = False
        try:
            batches = iter(self.device_loader)
            self._batches = weakref.ref(batches)
            # an iterator left behind when another began stops: the batches are the other's
            while self._latest is mine:
                try:
                    batch = next(batches)
                except StopIteration:
                    if open_before and not self._finalizer.alive and self._consumed < expected:
                        raise UsageError(
                            f"the loader was closed during epoch {self.sampler.epoch}, after "
                            f"{self._consumed} of its {expected} batches: iterate it again to "
                            "deliver the rest (its workers start again), or stop using it"
                        ) from None
                    finished = True
                    break
                if self._current is mine:
                    self._consumed += 1
                yield batch
        finally:
            # only the iteration the loader's position follows moves it (not one left behind,
            # nor one under way when load_state_dict or set_epoch placed the next elsewhere)
            if self._current is mine:
                if not finished:  # (left early: the next iteration goes on from here)
                    self._resume = self.position()
                self._iterating, self._current = False, None
                if finished:
                    self.epoch += 1
                    self._consumed = 0

    def position(self) -> Position:
        """Where the loader stands: the epoch, and the samples of its order that the ranks
        together have been handed (a batch counts once this loader has yielded it)."""
        if self._iterating:
            epoch, samples = self.sampler.epoch, self.sampler.samples
            at = self.sampler.delivered(self._consumed * self.batch_size)
        elif self._resume is not None:
            saved = self._resume
            epoch, at, samples = saved.epoch, saved.position, saved.samples
        else:
            epoch, at, samples = self.epoch, 0, len(self.dataset)
        return Position(
            epoch=epoch,
            position=at,
            samples=samples,
            seed=self.seed,
            shuffle=self.sampler.shuffle,
            world_size=self.sampler.world_size,
            batch_size=self.batch_size,
            dataset=dataset_identity(self.dataset),
        )

    def state_dict(self) -> dict[str, Any]:
        """The loader's position as plain JSON types (under a kilobyte, whatever the epoch's
        length): what ``load_state_dict`` of a loader of any shape continues from."""
        return make_state(self.position())

    def load_state_dict(self, state: dict[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue from ``state`` (rank 0's, given to every rank): the next iteration yields
        this rank's share of the rest of its epoch; with ``restart_epoch``, the saved epoch
        from its beginning (over the dataset as it is), whatever else differs.

        Raises:
            ResumeError: a state of another store, selection, seed or order, of a later
                fastdata, or edited or cut short: named, with the way out.
        """
        if restart_epoch:  # (from any state that names its epoch: the way out of a refusal)
            epoch = epoch_of(state)
            self._loaded = None
            self.set_epoch(epoch)
            self.resume_note = f"starting epoch {epoch} again from its beginning"
            return
        saved = read_state(state)
        mine = dataset_identity(self.dataset)
        same = (
            saved.dataset is None or mine is None or same_samples(saved.dataset, mine, self.dataset)
        )
        meta = getattr(getattr(self.dataset, "reader", None), "meta", None)
        lineage = {getattr(meta, "id", None), *getattr(meta, "appended_from", [])}
        refuse_other(saved, self.seed, self.sampler.shuffle, mine, same, lineage)
        if saved.samples > len(self.dataset):
            raise ResumeError(
                f"cannot resume: the saved epoch has {saved.samples:,} samples and this dataset "
                f"{len(self.dataset):,}; resume over the dataset it saved, or start the epoch "
                "again with ",
                RESTART,
            )
        self.epoch, self._resume, self._consumed = saved.epoch, saved, 0
        self._loaded = saved
        self._current, self._iterating = None, False
        if saved.position == 0:  # (an epoch not begun: over the dataset as it is now)
            self._resume = None
        self.resume_note = change_note(
            saved, self.sampler.world_size, self.batch_size, len(self.dataset)
        )

    def __repr__(self) -> str:
        return (
            f"Loader({len(self.dataset)} samples, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, device={str(self.device)!r}, epoch={self.epoch})"
        )


# Longer than the house's ~80 lines, for a reason: it is one flat sequence of option resolutions
# (device, workers, sampler, collate, prefetch), each a few lines that read the ones before; cut
# into helpers they would pass a dozen values back and forth and read worse.
def create_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    train: bool = True,
    image_size: int | tuple[int, int] = 224,
    num_workers: Workers = "auto",
    device: torch.device | str | None = None,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
    dtype: torch.dtype | None = None,
    channels_last: bool = False,
    seed: int = 0,
    drop_last: bool | None = None,
    distributed: bool | None = None,
    pipeline: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool = True,
    prefetch_factor: int | None = None,
    auto_seconds: float = 1.0,
    multiprocessing_context: str | None = None,
    decode: str = "cpu",
    decode_backend: str = "auto",
    decode_in: str = "main",
    decode_options: Mapping[str, Any] | None = None,
    pad_fields: bool = False,
) -> Loader:
    """A loader that yields ``(images, labels)`` batches on the device, normalised there.

    For a fastdata dataset without a ``transform`` of its own, images go through the built-in
    pipelines (``TrainPipeline`` when ``train``, else ``EvalPipeline``, at ``image_size``), with
    each sample's augmentation drawn from ``(seed, epoch, index)``: the same ``seed`` gives the
    same order and the same crops on every run, for any ``num_workers``. Any other dataset (or
    one with a ``transform``) is used as it is and collated with ``fast_collate``.

    Args:
        dataset: an ``LMDBImageDataset``/``MongoImageDataset``, or any map-style dataset of
            ``(image, label)`` with same-size uint8 images.
        batch_size: samples per batch (per rank).
        train: shuffle, augment and drop the last partial batch (unless ``drop_last`` says).
        image_size: output side of the built-in pipelines, or ``(height, width)`` (as timm's
            ``img_size`` takes it).
        num_workers: worker processes, or ``"auto"`` to measure a few counts briefly on this
            dataset and take the fewest within 10% of the best (logged).
        device: where batches go; None picks the current accelerator, else the CPU.
        mean, std: normalisation in 0-1 units (None for both: no normalisation, images become
            ``dtype`` scaled to 0-1 if a ``dtype`` is given, else stay uint8).
        dtype: image dtype on the device (float32 by default when normalising).
        channels_last: ``channels_last`` memory format on the device.
        seed: the seed of the order and the augmentation.
        drop_last: drop each rank's last partial batch (default: ``train``).
        distributed: shard across ``torch.distributed`` ranks; None detects an initialised
            process group.
        pipeline: a pipeline to use instead of the built-in ones.
        collate_fn: instead of ``fast_collate``.
        pad_fields: for a dataset read with ``fields=``: batch variable-length number fields
            as one zero-padded tensor with a ``<name>_mask``, not as a list of tensors.
        pin_memory: default: when batches go to an accelerator.
        persistent_workers: keep the workers between epochs.
        prefetch_factor: batches each worker prepares ahead (default: 4 for up to 2 workers,
            else 2).
        auto_seconds: how long ``"auto"`` measures each candidate count.
        multiprocessing_context: ``"fork"``, ``"spawn"``, ... for the workers.
        decode: ``"cpu"``: the workers decode, crop and resize; ``"device"``: the workers only
            read the bytes and draw each sample's crop (from its header), and the batch is
            decoded, cropped, resized and flipped on ``device`` (see
            :mod:`fastdata.images.device_decode`), with the same crops as on the CPU. Needs a
            fastdata dataset without a ``transform``.
        decode_backend: for ``decode="device"``: ``"auto"``, ``"nvimgcodec"``,
            ``"torchvision"`` or ``"cpu"``.
        decode_in: for ``decode="device"``: ``"main"``, a thread of this process decodes each
            batch on the device; ``"workers"``, each worker process decodes its batches on the
            device and hands them over through CUDA IPC (the workers start with ``spawn`` on
            CUDA; :mod:`fastdata.loaders.device_workers`), which leaves this process's host
            core and interpreter lock to the training loop.
        decode_options: for ``decode="device"``: options of the
            :class:`~fastdata.images.device_decode.DeviceDecoder` (``hardware``, ``regions``,
            ``threads``, ``batched``).

    Returns:
        A :class:`Loader`.
    """
    from ..datasets import ImageStoreDataset
    from ..images.pipelines import EvalPipeline, TrainPipeline

    options = decode_settings(decode, decode_in, decode_options)
    with_seeds = False
    decoder = None
    target = pinned_device(device)  # (the decoding thread's device is this thread's)
    if isinstance(dataset, ImageStoreDataset) and dataset.transform is None:
        chosen = pipeline or (TrainPipeline(image_size) if train else EvalPipeline(image_size))
        if decode == "device":
            from ..images.device_decode import DeviceDecoder
            from ..images.pipelines import Planned

            if collate_fn is not None:
                raise ValueError("decode='device' batches the encoded images itself: no collate_fn")
            refuse_fields(dataset)
            fast = bool(getattr(chosen, "fast_decode", False))
            decoder = DeviceDecoder(target, backend=decode_backend, fast=fast, **options)
            chosen, collate_fn = Planned(chosen), collate_encoded
        dataset = dataset.with_pipeline(chosen)
        if decoder is not None and decode_in == "workers":
            collate_fn = DecodingCollate(decoder, dataset)
        with_seeds = True
    elif decode == "device":
        raise ValueError(
            "decode='device' needs an LMDBImageDataset or MongoImageDataset without a "
            "transform: the device follows the built-in pipelines' crops"
        )
    if len(dataset) == 0:  # type: ignore[arg-type]
        where = getattr(getattr(dataset, "reader", None), "location", "the dataset")
        raise UsageError(
            f"{where}: the dataset is empty (a selection that matched no record?): the loader "
            "would yield nothing, an epoch that looks like success; check its where=, classes= "
            "or indices="
        )
    rank, world = ranks(distributed)
    drop = train if drop_last is None else drop_last
    sampler = EpochSampler(
        len(dataset),  # type: ignore[arg-type]
        shuffle=train,
        seed=seed,
        rank=rank,
        world_size=world,
        with_seeds=with_seeds,
    )
    if drop and sampler.per_rank() < batch_size:
        raise ValueError(
            f"the dataset's {len(dataset)} samples ({sampler.per_rank()} per rank) make no "  # type: ignore[arg-type]
            f"whole batch of {batch_size}, and the last partial batch is dropped (train=True): "
            "the loader would yield nothing; lower batch_size, or pass drop_last=False to keep "
            "the partial batch"
        )
    in_workers = decoder is not None and decode_in == "workers" and target.type == "cuda"
    context = worker_start(in_workers, pin_memory, multiprocessing_context)
    step = None if decoder is None or decode_in == "workers" else DeviceStep(decoder, dataset)
    pin = target.type == "cuda" and not in_workers if pin_memory is None else pin_memory
    collate = collate_fn or collate_for(dataset, pad_fields)

    def build(workers: int, batch_sampler_source: Any, persistent: bool) -> DataLoader[Any]:
        extra: dict[str, Any] = {}
        if workers > 0:
            extra["prefetch_factor"] = prefetch_factor or (4 if workers <= 2 else 2)
            extra["persistent_workers"] = persistent
            extra["worker_init_fn"] = _worker_init
            if context:
                extra["multiprocessing_context"] = context
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=batch_sampler_source,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=pin,
            drop_last=drop,
            generator=torch.Generator().manual_seed(seed),
            **extra,
        )

    rates: dict[int, float] = {}
    if num_workers == "auto":
        probe = RandomSampler(dataset, replacement=True, num_samples=1 << 30)  # type: ignore[arg-type]

        def probe_loader(w: int) -> Any:
            loader = build(w, probe, persistent=False)
            if in_workers:  # (measurement stops mid-epoch: what the workers share let go)
                return Probed(loader)
            # with the device decoding, the rate is the decoded batches', not the bytes'
            return loader if step is None else DecodedBatches(loader, step)

        workers, rates = pick_workers(
            probe_loader,
            batch_size=batch_size,
            seconds=auto_seconds,
        )
    elif isinstance(num_workers, int) and num_workers >= 0:
        workers = num_workers
    else:
        raise ValueError(f"num_workers must be 'auto' or an integer >= 0, got {num_workers!r}")
    dataloader = build(workers, sampler, persistent=persistent_workers)
    normalizing = mean is not None or std is not None
    device_loader = PrefetchLoader(
        dataloader,
        target,
        mean=mean if normalizing else None,
        std=std if normalizing else None,
        dtype=dtype,
        channels_last=channels_last,
        decode=step,
        on_device=in_workers,
    )
    log.info(
        "loader: %d samples, batch %d, %d worker%s, rank %d of %d, device %s, decoded by %s",
        len(dataset),  # type: ignore[arg-type]
        batch_size,
        workers,
        "" if workers == 1 else "s",
        rank,
        world,
        target,
        "the workers" if decoder is None else f"{decoder} in {decode_in}",
    )
    return Loader(dataloader, sampler, device_loader, seed=seed, worker_rates=rates)
