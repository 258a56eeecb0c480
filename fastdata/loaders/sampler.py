"""The order of an epoch: shuffled from a seed, sharded across ranks, resumable mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["EpochSampler", "sample_seed"]

_MASK = (1 << 63) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample in one epoch (a fixed hash of the three numbers)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
    ) & _MASK
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 32)


class EpochSampler(Sampler[Any]):
    """Every rank's share of one epoch, in an order fixed by ``seed`` and the epoch.

    All ranks draw the same permutation of ``0 .. n-1``; it is padded by repeating its start until
    it divides evenly by ``world_size`` (or cut, with ``drop_last``), and rank ``r`` takes every
    ``world_size``-th index from ``r``. Ranks therefore see disjoint samples that together cover
    the epoch, the same number each.

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
        self.start = 0  # samples of this rank's share to skip (a resumed epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def per_rank(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return -(-self.n // self.world_size)

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, all of them (ignoring ``start``), as one
        array: 4 bytes a sample (8 past 2**31 samples), not a list of Python ints."""
        wide = self.n >= 1 << 31
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(sample_seed(self.seed, self.epoch, -1) & 0xFFFFFFFFFFFF)
            # the same order whatever the index type; int32 is built twice as fast
            kind = torch.int64 if wide else torch.int32
            order = torch.randperm(self.n, generator=g, dtype=kind).numpy()
        else:
            order = np.arange(self.n, dtype=np.int64 if wide else np.int32)
        total = self.per_rank() * self.world_size
        if total > len(order):
            order = np.tile(order, -(-total // max(1, len(order))))
        return order[:total][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[Any]:
        mine = self.indices()[self.start :]
        if not self.with_seeds:
            return (int(i) for i in mine)
        seed, epoch = self.seed, self.epoch
        # each sample's augmentation seed is derived where it is used, not held for the epoch
        return ((int(i), sample_seed(seed, epoch, int(i))) for i in mine)

    def __len__(self) -> int:
        return max(0, self.per_rank() - self.start)

    # -- resuming

    def state_dict(self) -> dict[str, Any]:
        """What fixes the order: the epoch, the seed, the rank layout and the dataset length."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "world_size": self.world_size,
            "rank": self.rank,
            "samples": self.n,
        }

    def load_state_dict(self, state: dict[str, Any], *, start: int = 0) -> None:
        """Continue the epoch of ``state`` from this rank's sample ``start``.

        Raises:
            ValueError: ``state`` has another seed, rank layout or dataset length: the rest of
                its epoch would be other samples.
        """
        mine = self.state_dict()
        for key in ("seed", "world_size", "rank", "samples"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume: the saved loader had {key}={state[key]}, this one has "
                    f"{mine[key]}; create the loader with the same settings"
                )
        self.epoch = int(state["epoch"])
        self.start = start
