"""Resumable, data-parallel-sharded loading of packed sequences.

torchdata's StatefulDataLoader keeps the position inside an epoch (its state goes into every
checkpoint); `EpochLoader` adds the epoch counter and reshuffles per epoch. Each data-parallel rank
reads a disjoint share; context-parallel ranks of one group read the same sequences.
"""
from __future__ import annotations

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from longstride.data.batch import collate


class ShardSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch, rank r of n taking every n-th index; all ranks get the same
    count (the tail that does not divide is dropped for that epoch)."""

    def __init__(self, num_items: int, rank: int, world: int, seed: int):
        if num_items < world:
            raise ValueError(
                f"only {num_items} packed sequences for {world} data-parallel ranks; use more data or fewer ranks"
            )
        self.num_items, self.rank, self.world, self.seed, self.epoch = num_items, rank, world, seed, 0

    def __len__(self) -> int:
        return self.num_items // self.world

    def set_epoch(self, epoch: int) -> None:  # the HF Trainer calls it at each epoch
        self.epoch = epoch

    def __iter__(self):
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items)
        return iter(perm[self.rank: len(self) * self.world: self.world].tolist())


class EpochLoader:
    """Endless iterator over micro-batches; `state_dict()` resumes exactly where it stopped."""

    def __init__(self, dataset, micro_batch_size: int, rank: int, world: int, seed: int, num_workers: int = 0):
        self.sampler = ShardSampler(len(dataset), rank, world, seed)
        if len(self.sampler) < micro_batch_size:
            raise ValueError(
                f"each data rank has {len(self.sampler)} sequences, fewer than micro_batch_size={micro_batch_size}"
            )
        self.loader = StatefulDataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler, drop_last=True,
                                         collate_fn=collate, num_workers=num_workers)
        self._it = None

    def __next__(self) -> dict:
        while True:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.sampler.epoch += 1

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch = state["epoch"]
        self.loader.load_state_dict(state["loader"])
        self._it = None
