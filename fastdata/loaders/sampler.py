"""The order of an epoch: shuffled from a seed, sharded across ranks, resumable mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["EpochSampler", "ranks", "sample_seed"]

_MASK = (1 << 63) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample in one epoch (a fixed hash of the three numbers)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
    ) & _MASK
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 32)


def ranks(distributed: bool | None) -> tuple[int, int]:
    """This process's rank and the world size: ``(0, 1)`` unless ``distributed`` (None: where a
    ``torch.distributed`` process group is initialised)."""
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed is None:
        distributed = available
    if not distributed:
        return 0, 1
    if not available:
        raise RuntimeError(
            "distributed=True but no torch.distributed process group is initialised; call "
            "torch.distributed.init_process_group first"
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


class EpochSampler(Sampler[Any]):
    """Every rank's share of one epoch, in an order fixed by ``seed`` and the epoch, from a
    global position in it.

    All ranks draw the same permutation of the epoch's samples (``0 .. samples-1``: the dataset's
    length when the epoch began). Of its rest (from ``position``, the samples the ranks together
    have delivered), rank ``r`` takes every ``world_size``-th from ``r``: after ``k`` batches of
    ``b`` on every rank, the ranks together have delivered exactly the next ``k * b *
    world_size`` of the order, whatever the world size, batch size or worker count, so a
    position saved on one shape of job continues on any other. The rest is padded by repeating
    its start until it divides evenly by ``world_size`` (each rank the same number of steps; at
    most ``world_size - 1`` samples of the epoch's last step come twice), or cut with
    ``drop_last`` (at most ``world_size - 1`` left out).

    Args:
        n: dataset length.
        shuffle: shuffle (else index order).
        seed: the base seed; epoch ``e`` uses a permutation drawn from ``(seed, e)``.
        rank: this process's rank.
        world_size: number of ranks.
        drop_last: cut the tail that does not divide evenly instead of padding.
        with_seeds: yield ``(index, augmentation seed)`` pairs instead of indices.
    """

    def __init__(
        self,
        n: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        with_seeds: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.n = n
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.with_seeds = with_seeds
        self.epoch = 0
        self.position = 0
        """Samples of this epoch's order the ranks together delivered before this iteration."""
        self.epoch_samples: int | None = None
        """The length of the epoch being resumed, where the dataset grew since it began (None:
        the dataset's)."""

    @property
    def samples(self) -> int:
        """The samples of the current epoch (the dataset's length when it began)."""
        return self.n if self.epoch_samples is None else self.epoch_samples

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, over the dataset as it is."""
        self.epoch, self.position, self.epoch_samples = epoch, 0, None

    def resume(self, epoch: int, position: int, samples: int) -> None:
        """Continue epoch ``epoch`` of ``samples`` samples from global ``position``."""
        if not 0 <= position <= samples <= self.n:
            raise ValueError(f"position {position} of {samples} samples, of a dataset of {self.n}")
        self.epoch, self.position = epoch, position
        self.epoch_samples = None if samples == self.n else samples

    def rest(self) -> int:
        """Samples of the epoch not delivered yet, by all ranks."""
        return self.samples - self.position

    def per_rank(self) -> int:
        if self.drop_last:
            return self.rest() // self.world_size
        return -(-self.rest() // self.world_size)

    def order(self) -> np.ndarray:
        """The epoch's whole order, as one array: 4 bytes a sample (8 past 2**31 samples), not a
        list of Python ints."""
        n = self.samples
        wide = n >= 1 << 31
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(sample_seed(self.seed, self.epoch, -1) & 0xFFFFFFFFFFFF)
            # the same order whatever the index type; int32 is built twice as fast
            kind = torch.int64 if wide else torch.int32
            return torch.randperm(n, generator=g, dtype=kind).numpy()
        return np.arange(n, dtype=np.int64 if wide else np.int32)

    def indices(self) -> np.ndarray:
        """This rank's indices for the rest of the current epoch, as one array."""
        rest = self.order()[self.position :]
        total = self.per_rank() * self.world_size
        if total > len(rest):
            rest = np.tile(rest, -(-total // max(1, len(rest))))
        return rest[:total][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[Any]:
        mine = self.indices()
        if not self.with_seeds:
            return (int(i) for i in mine)
        seed, epoch = self.seed, self.epoch
        # each sample's augmentation seed is derived where it is used, not held for the epoch
        return ((int(i), sample_seed(seed, epoch, int(i))) for i in mine)

    def __len__(self) -> int:
        return max(0, self.per_rank())

    def delivered(self, per_rank: int) -> int:
        """The global position once every rank has delivered ``per_rank`` more samples of this
        iteration (the padding of the last step not counted)."""
        return min(self.samples, self.position + per_rank * self.world_size)
