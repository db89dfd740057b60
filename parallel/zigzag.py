"""Sequence layouts for context parallelism: which chunks of a sequence each CP rank holds.

An `Assignment` cuts the sequence into N x k equal chunks; rank r holds k of them, concatenated in
increasing global order (so a rank's local order is causal-consistent: parallel/blocks.py). Zig-zag
is k = 2, rank r holding chunks r and 2N-1-r: every rank then holds one early and one late chunk, so
plain causal work (the (query, key) pairs with key <= query) is the same on every rank. With
documents, parallel/balance.py picks other assignments. All batch tensors (ids, labels, RoPE
positions, document ids, global indices) are sharded the same way along the sequence dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch


@dataclass(frozen=True)
class Assignment:
    """chunks[r]: the global chunk indices rank r holds, increasing; every rank holds k chunks."""

    chunks: tuple

    @property
    def n(self) -> int:
        return len(self.chunks)

    @property
    def k(self) -> int:
        return len(self.chunks[0])

    def chunk_len(self, length: int) -> int:
        """The chunk length of a sequence of `length` tokens; a clear error when it does not divide."""
        parts = self.n * self.k
        if length % parts:
            raise ValueError(f"sequence length {length} is not divisible by {self.k} x cp = {parts} (the CP layout cuts "
                             f"it into {self.k} chunks per rank); use a length that is a multiple of {parts}")
        return length // parts

    def validate(self) -> None:
        flat = sorted(j for c in self.chunks for j in c)
        if flat != list(range(self.n * self.k)) or any(len(c) != self.k or list(c) != sorted(c) for c in self.chunks):
            raise ValueError(f"not a chunk assignment: every rank must hold {self.k} increasing chunk indices and "
                             f"together all of 0..{self.n * self.k - 1} once: {self.chunks}")


@lru_cache(maxsize=64)
def zigzag(n: int) -> Assignment:
    if n < 1:
        raise ValueError(f"cp={n} must be >= 1")
    return Assignment(tuple(rank_chunks(n, r) for r in range(n)))


def rank_chunks(n: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices that CP rank `rank` of `n` holds under zig-zag, in local order."""
    return rank, 2 * n - 1 - rank


def shard(x: torch.Tensor, n: int, rank: int, dim: int = 1, assignment: Optional[Assignment] = None) -> torch.Tensor:
    """This rank's share of `x` along the sequence dim `dim` (a copy); zig-zag unless `assignment` says."""
    if n == 1:
        return x
    a = assignment or zigzag(n)
    c = a.chunk_len(x.shape[dim])
    return torch.cat([x.narrow(dim, j * c, c) for j in a.chunks[rank]], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int = 1, assignment: Optional[Assignment] = None) -> torch.Tensor:
    """Inverse of `shard`: shards[r] is rank r's share; returns the full sequence."""
    a = assignment or zigzag(len(shards))
    c = shards[0].shape[dim] // a.k
    chunks: list = [None] * (a.n * a.k)
    for r, s in enumerate(shards):
        for i, j in enumerate(a.chunks[r]):
            chunks[j] = s.narrow(dim, i * c, c)
    return torch.cat(chunks, dim=dim)


def split(x: torch.Tensor, n: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Contiguous piece `rank` of `n` along `dim`: a Ulysses rank's part of its ring rank's share."""
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"sequence share of {x.shape[dim]} tokens does not split into {n} Ulysses pieces; "
                         f"use a sequence length that is a multiple of {n} x the ring's chunks")
    c = x.shape[dim] // n
    return x.narrow(dim, rank * c, c)


def split_batch(batch: dict, n: int, rank: int) -> dict:
    return {k: split(v, n, rank, dim=1) for k, v in batch.items()}


def shard_batch(batch: dict, n: int, rank: int, assignment: Optional[Assignment] = None) -> dict:
    """Every (B, L) tensor of a PackedBatch, sharded along L."""
    return {k: shard(v, n, rank, dim=1, assignment=assignment) for k, v in batch.items()}
