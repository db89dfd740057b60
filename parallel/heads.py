"""UPipe's head schedule: which query heads go through the all-to-all and attention together.

Ulysses degree N, H query heads, U query heads per stage (N | U | H): every stage sends U/N query
heads to each rank of the Ulysses group, so the attention stage holds U heads' worth of full-sequence
buffers instead of H. Plain Ulysses is the one-stage schedule U = H.

K/V heads travel once, before the first stage, and stay for the later ones. When Hkv does not divide
by N, each K/V head is replicated lcm(Hkv, N) / Hkv times first (lcm(Hkv, N) heads travel, which
divides H since both N and Hkv do) and the replicas' gradients are summed. Rank i of the group then
owns K/V heads [i*Kr, (i+1)*Kr), Kr = lcm(Hkv, N) / N, and the query heads that read them.

GQA order (as in the UPipe paper): a rank takes its query heads member-major, member m of each of its
K/V groups before member m + 1; with U = Hkv, stage s is query head s of every K/V group. Within a
stage the heads are sorted by K/V head, so the kernel sees contiguous GQA groups and reads a slice
of the kept K/V (a gather only when U/N and Kr do not divide one another).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import torch

from longstride.model.real import real


@dataclass(frozen=True)
class Stage:
    send: torch.Tensor  # (U,) local query head indices in send order: rank 0's U/N heads, then rank 1's, ...
    kv: Union[slice, torch.Tensor]  # the kept K/V heads the received U/N query heads read, in GQA order
    groups: int  # query heads per K/V head in the kernel call (1 when kv is a gather index)

    def pick(self, kv: torch.Tensor) -> torch.Tensor:
        # kv: (B, Kr, L, D) kept K or V -> this stage's heads
        return kv[:, self.kv] if isinstance(self.kv, slice) else kv.index_select(1, self.kv)

    def add(self, acc: torch.Tensor, grad: torch.Tensor) -> None:
        # acc: (B, Kr, L, D) fp32 dK or dV of the kept heads, grad: this stage's part
        if isinstance(self.kv, slice):
            acc[:, self.kv] += grad
        else:
            acc.index_add_(1, self.kv, grad.to(acc.dtype))


@dataclass(frozen=True)
class HeadSchedule:
    heads: int
    kv_heads: int
    n: int
    kv_rep: int  # each K/V head travels as kv_rep replicas
    stages: tuple

    @property
    def kv_travel(self) -> int:
        return self.kv_heads * self.kv_rep

    @property
    def kv_per_rank(self) -> int:
        return self.kv_travel // self.n


@lru_cache(maxsize=64)
def head_schedule(heads: int, kv_heads: int, n: int, stage_heads: int = 0, device=None) -> HeadSchedule:
    """The stages of one attention call; stage_heads = U, 0 for all heads at once (plain Ulysses). Its index
    tensors live on `device` (the attention's: index_copy_ and index_select take no index from another
    device), made once per device; always real tensors, even when first asked for inside a fake-tensor trace
    (recipes/memory/trace.py), since the cache outlives it."""
    with real():
        return _schedule(heads, kv_heads, n, stage_heads, torch.device(device or "cpu"))


def _schedule(heads: int, kv_heads: int, n: int, stage_heads: int, device: torch.device) -> HeadSchedule:
    U = stage_heads or heads
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
    if heads % n or U % n or heads % U:
        raise ValueError(f"Ulysses degree {n} and heads per stage {U} must satisfy {n} | {U} | {heads} (query heads)")
    travel = math.lcm(kv_heads, n)
    g, kr, per = heads // travel, travel // n, U // n  # queries per travelling K/V head, K/V per rank, queries per rank
    own = [[(j, m) for m in range(g) for j in range(i * kr, (i + 1) * kr)] for i in range(n)]
    stages = []
    for s in range(heads // U):
        take = [sorted(own[i][s * per:(s + 1) * per]) for i in range(n)]
        send = torch.tensor([j * g + m for part in take for j, m in part], device=device)
        local = [j for j, _ in take[0]]  # kept K/V heads read, in rank 0's numbering (the same on every rank)
        first, count = local[0], len(set(local))
        reps = per // count
        if local == [first + t // reps for t in range(per)] and per == count * reps:
            stages.append(Stage(send, slice(first, first + count), reps))
        else:
            stages.append(Stage(send, torch.tensor(local, device=device), 1))
    return HeadSchedule(heads, kv_heads, n, travel // kv_heads, tuple(stages))
