"""Zig-zag sequence layout for context parallelism.

The sequence is cut into 2N equal chunks; CP rank r holds chunks r and 2N-1-r, concatenated in that
order. Every rank then holds one early and one late chunk, so the causal work (the number of
(query, key) pairs with key <= query) is the same on every rank. All batch tensors (ids, labels,
RoPE positions, document ids, global indices) are sharded the same way along the sequence dim.
"""
from __future__ import annotations

import torch


def check_divisible(length: int, n: int) -> int:
    """Returns the chunk length L / 2N."""
    if n < 1:
        raise ValueError(f"cp={n} must be >= 1")
    if length % (2 * n):
        raise ValueError(f"sequence length {length} is not divisible by 2 x cp = {2 * n} (zig-zag cuts it into "
                         f"2 x cp chunks); use a length that is a multiple of {2 * n}")
    return length // (2 * n)


def rank_chunks(n: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices that CP rank `rank` of `n` holds, in local order."""
    return rank, 2 * n - 1 - rank


def zigzag_index(length: int, n: int, rank: int) -> torch.Tensor:
    """Global sequence positions held by `rank`, in local order: (L / N,) int64."""
    c = check_divisible(length, n)
    a, b = rank_chunks(n, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def shard(x: torch.Tensor, n: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of `x` along the sequence dim `dim` (a view-free copy)."""
    if n == 1:
        return x
    c = check_divisible(x.shape[dim], n)
    a, b = rank_chunks(n, rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: shards[r] is rank r's share; returns the full sequence."""
    n = len(shards)
    c = shards[0].shape[dim] // 2
    chunks: list = [None] * (2 * n)
    for r, s in enumerate(shards):
        a, b = rank_chunks(n, r)
        chunks[a], chunks[b] = s.narrow(dim, 0, c), s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def split(x: torch.Tensor, n: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Contiguous piece `rank` of `n` along `dim`: a Ulysses rank's part of its ring rank's share."""
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"sequence share of {x.shape[dim]} tokens does not split into {n} Ulysses pieces; "
                         f"use a sequence length that is a multiple of {n} x the ring's 2 x degree")
    c = x.shape[dim] // n
    return x.narrow(dim, rank * c, c)


def split_batch(batch: dict, n: int, rank: int) -> dict:
    return {k: split(v, n, rank, dim=1) for k, v in batch.items()}


def shard_batch(batch: dict, n: int, rank: int) -> dict:
    """Every (B, L) tensor of a PackedBatch, sharded along L."""
    return {k: shard(v, n, rank, dim=1) for k, v in batch.items()}
