"""Resumable, data-parallel-sharded loading of packed sequences.

torchdata's StatefulDataLoader keeps the position inside an epoch (its state goes into every
checkpoint); `EpochLoader` adds the epoch counter and reshuffles per epoch. Each data-parallel rank
reads a disjoint share; context-parallel ranks of one group read the same sequences.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from longstride.data.batch import collate


def stateful_loader(dataset, **kwargs) -> StatefulDataLoader:
    """torchdata's StatefulDataLoader, without the deprecation warning its constructor raises under newer torch
    (it calls torch.set_vital, which such builds deprecate): noise in every stage's log that no user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(dataset, **kwargs)


class ShardSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch (shuffle=False: the items in order), rank r of n taking every n-th index
    from `start` (0, or where a run on another number of ranks stopped in this epoch); all ranks get the same
    count (the tail that does not divide is dropped for that epoch)."""

    def __init__(self, num_items: int, rank: int, world: int, seed: int, shuffle: bool = True):
        if num_items < world:
            raise ValueError(
                f"only {num_items} packed sequences for {world} data-parallel ranks; use more data or fewer ranks"
            )
        self.num_items, self.rank, self.world, self.seed, self.epoch, self.start = num_items, rank, world, seed, 0, 0
        self.shuffle = shuffle

    def __len__(self) -> int:
        return (self.num_items - self.start) // self.world

    def set_epoch(self, epoch: int) -> None:  # the HF Trainer calls it at each epoch
        self.epoch, self.start = epoch, 0

    def __iter__(self):
        perm = (np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items) if self.shuffle
                else np.arange(self.num_items))
        return iter(perm[self.start + self.rank: self.start + len(self) * self.world: self.world].tolist())


class EpochLoader:
    """Endless iterator over micro-batches; `state_dict()` resumes exactly where it stopped."""

    def __init__(self, dataset, micro_batch_size: int, rank: int, world: int, seed: int, num_workers: int = 0):
        self.sampler = ShardSampler(len(dataset), rank, world, seed)
        if len(self.sampler) < micro_batch_size:
            raise ValueError(
                f"each data rank has {len(self.sampler)} sequences, fewer than micro_batch_size={micro_batch_size}"
            )
        self.loader = stateful_loader(dataset, batch_size=micro_batch_size, sampler=self.sampler, drop_last=True,
                                      collate_fn=collate, num_workers=num_workers)
        self._it = None

        self.micro_batch_size, self.consumed = micro_batch_size, 0  # sequences this rank read in this epoch

    def __next__(self) -> dict:
        while True:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
                self.consumed += self.micro_batch_size
                return batch
            except StopIteration:
                self._it = None
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self.consumed = 0

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        s = self.sampler
        return {"epoch": s.epoch, "loader": self.loader.state_dict(), "world": s.world, "start": s.start,
                "consumed": self.consumed, "items": s.num_items}

    def load_state_dict(self, state: dict) -> None:
        """Resumes where `state` stopped. A state written with another number of data-parallel ranks is
        re-split: every rank had read `consumed` sequences of this epoch's order, so the next unread one is
        start + consumed x world, and this run's ranks share the rest of the epoch from there. A state written over
        another number of packed sequences is refused: the stage's data changed, so its position would name other
        sequences. (A recipe's resume compares the data's fingerprint first: recipes/run/stage_state.py.)"""
        s = self.sampler
        if state.get("items", s.num_items) != s.num_items:
            raise ValueError(f"the checkpoint's data position is in an epoch of {state['items']} packed sequences, "
                             f"but this stage now packs {s.num_items}: its data changed since (an edited source, "
                             "another data config or longstride version); resume with the data it was written with, "
                             "keep the checkpoint's weights and start its data afresh (in a recipe: "
                             "train.resume_data=false), or start the stage over")
        s.epoch = state["epoch"]
        if state.get("world", s.world) == s.world:
            s.start, self.consumed = state.get("start", 0), state.get("consumed", 0)
            self.loader.load_state_dict(state["loader"])
        else:
            s.start, self.consumed = state["start"] + state["consumed"] * state["world"], 0
            if len(s) < self.micro_batch_size:  # too little left of this epoch for one micro-batch each
                s.set_epoch(s.epoch + 1)
        self._it = None
