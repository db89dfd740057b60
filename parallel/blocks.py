"""Which (query, key) blocks a ring-attention rank computes at each step, under document masking.

Documents are contiguous runs of the sequence. Take a query chunk i and a key chunk j (global chunk
indices of the zig-zag layout):
  j > i   nothing: every key is in the future of every query;
  j == i  causal within each document of the chunk (varlen-causal, the chunk's document segments);
  j < i   every key precedes every query, so a query and a key share a document only if that document
          runs from the key through the gap to the query. At most one document does (the one holding
          the last key of chunk j), and the pairs are one dense rectangle: the queries of that document
          (a prefix of chunk i) by its keys (a suffix of chunk j), or nothing at all.
So every block is skipped, one dense rectangle, or varlen-causal: no L x L mask, no document length
constraint, and empty blocks cost nothing. At step 0 (a rank's own K/V) the local order [chunk r,
chunk 2N-1-r] is itself causal-consistent: every key of chunk r precedes every query of chunk
2N-1-r, and a document spanning the two is contiguous in local order. So step 0 is one
varlen-causal call over the local sequence, as large as the kernel can get. The same holds for any
assignment of chunks to ranks (parallel/zigzag.Assignment) whose local order is increasing. The plan depends only
on the full batch's document ids, which every rank of a CP group has, so it is computed once per
batch, without communication, and serves every layer's forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from longstride.parallel.zigzag import Assignment, zigzag


@dataclass(frozen=True)
class Block:
    """Local query rows [q0, q1) against key columns [k0, k1) of the K/V block held at this step.
    segments=None: dense; else varlen-causal segments (s, e) relative to q0 (== k0, square block)."""

    q0: int
    q1: int
    k0: int
    k1: int
    segments: Optional[tuple] = None

    @property
    def pairs(self) -> int:
        """Attention scores computed (the block's work)."""
        if self.segments is None:
            return (self.q1 - self.q0) * (self.k1 - self.k0)
        return sum((e - s) * (e - s + 1) // 2 for s, e in self.segments)


class Derived:
    """What a plan derives once per batch and every layer reuses (key -> value: a kernel's packed calls, another
    pattern's plan, device copies of its indices). A plain object, not a dict, so that a copy of the plan
    (dataclasses.replace, or torch.distributed.utils._apply_to_tensors, which rebuilds dataclasses and dicts) shares
    it instead of starting empty and building every call again. The layout that carries the plan reaches each layer
    uncopied (parallel/cp.DocLayout)."""

    __slots__ = ("_items",)

    def __init__(self):
        self._items: dict = {}

    def __contains__(self, key) -> bool:
        return key in self._items

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value


@dataclass
class RingPlan:
    """steps[t] = [(rows, blocks), ...]: batch rows (a slice) sharing one list of blocks at ring step t,
    when this rank holds the K/V of CP rank (rank - t) mod n. chunk: the layout's chunk length; local: the
    rank's tokens per row; docs: the full batch's (B, L) document ids it was made from (None: plain causal),
    from which the plans of other attention patterns are derived (parallel/window.pattern_plan)."""

    n: int
    rank: int
    chunk: int
    steps: list
    assignment: Assignment
    docs: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    batch: int = 0
    # what the kernels derive from the plan once per batch and reuse in every layer's forward and backward
    # (parallel/kernels.py: a varlen kernel's packed calls per step)
    derived: Derived = field(default_factory=Derived, repr=False, compare=False)

    @property
    def local(self) -> int:
        return self.chunk * self.assignment.k

    def pairs(self) -> int:
        return sum((rows.stop - rows.start) * sum(b.pairs for b in blocks)
                   for step in self.steps for rows, blocks in step)


def run_starts(row: np.ndarray) -> np.ndarray:
    """row: (L,) document ids -> the start index of each run of equal ids (the first is 0)."""
    return np.flatnonzero(np.r_[True, row[1:] != row[:-1]])


def doc_segments(doc: np.ndarray, lo: int, hi: int) -> tuple:
    """(start, end) of each document run in doc[lo:hi], relative to lo."""
    edges = [*run_starts(doc[lo:hi]).tolist(), hi - lo]
    return tuple(zip(edges[:-1], edges[1:]))


def _pair(doc: Optional[np.ndarray], qc: int, kc: int, c: int, q_off: int, k_off: int) -> Optional[Block]:
    """The block for global query chunk qc against key chunk kc, at local offsets q_off / k_off."""
    # kc == qc happens only at step 0 (a rank's own chunks), which step_blocks plans as one block
    if kc > qc:
        return None
    if doc is None:
        return Block(q_off, q_off + c, k_off, k_off + c)
    spanning = doc[(kc + 1) * c - 1]
    if doc[qc * c] != spanning:
        return None
    nq = int(np.count_nonzero(doc[qc * c:(qc + 1) * c] == spanning))
    nk = int(np.count_nonzero(doc[kc * c:(kc + 1) * c] == spanning))
    return Block(q_off, q_off + nq, k_off + c - nk, k_off + c)


def _fuse(blocks: list[Block]) -> list[Block]:
    """Merges dense rectangles that share their rows and touch in columns, or vice versa: fewer,
    larger kernel calls (with no document masking a ring step is then one call)."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.segments is not None or b.segments is not None:
                    continue
                if (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    fused = Block(a.q0, a.q1, a.k0, b.k1)
                elif (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    fused = Block(a.q0, b.q1, a.k0, a.k1)
                else:
                    continue
                blocks = [x for t, x in enumerate(blocks) if t not in (i, j)] + [fused]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda b: (b.q0, b.k0))


def step_blocks(doc: Optional[np.ndarray], length: int, n: int, rank: int, step: int,
                assignment: Optional[Assignment] = None) -> list[Block]:
    """Blocks of one batch row at ring step `step`. doc: (L,) document ids of the full row, or None
    for plain causal attention; assignment: the chunks each rank holds (zig-zag when None)."""
    a = assignment or zigzag(n)
    c = a.chunk_len(length)
    own = a.chunks[rank]
    if step == 0:  # the rank's own chunks in increasing order: one varlen-causal block
        m = len(own) * c
        if doc is None:
            return [Block(0, m, 0, m, ((0, m),))]
        local = np.concatenate([doc[j * c:(j + 1) * c] for j in own])
        return [Block(0, m, 0, m, doc_segments(local, 0, m))]
    src = (rank - step) % n
    blocks = []
    for qi, qc in enumerate(own):
        for ki, kc in enumerate(a.chunks[src]):
            blk = _pair(doc, qc, kc, c, qi * c, ki * c)
            if blk is not None:
                blocks.append(blk)
    return _fuse(blocks)


def check_doc_runs(docs: np.ndarray) -> None:
    """docs: (B, L) document ids. Each document must be one contiguous run of its row (ids need not be
    sorted): the block geometry above, and the per-run kernels of one device, read a document as a run."""
    for b, row in enumerate(docs):
        starts = run_starts(row)
        ids, counts = np.unique(row[starts], return_counts=True)
        if (counts > 1).any():
            bad = ids[counts > 1][0]
            at = starts[row[starts] == bad][:2].tolist()
            raise ValueError(f"doc_ids row {b}: document id {bad} appears in separate runs (starting at positions "
                             f"{at[0]} and {at[1]}); each document must be one contiguous run of the packed "
                             f"sequence, as data.batch.packed_item makes them: give every run its own id")


def ring_plan(doc_ids: Optional[torch.Tensor | np.ndarray], batch: int, length: int, n: int, rank: int,
              assignment: Optional[Assignment] = None) -> RingPlan:
    """doc_ids: (B, L) full-sequence document ids (each document one contiguous run; a tensor or the numpy
    array a caller already has), or None for plain causal; assignment: the chunks each rank holds (zig-zag
    when None; parallel/balance.py)."""
    a = assignment or zigzag(n)
    if a.n != n:
        raise ValueError(f"the chunk assignment is for {a.n} ranks, the ring has {n}")
    c = a.chunk_len(length)
    steps = []
    docs = doc_ids.cpu().numpy() if isinstance(doc_ids, torch.Tensor) else doc_ids
    if docs is not None:
        check_doc_runs(docs)
    for t in range(n):
        if docs is None:
            steps.append([(slice(0, batch), step_blocks(None, length, n, rank, t, a))])
        else:
            steps.append([(slice(b, b + 1), step_blocks(docs[b], length, n, rank, t, a)) for b in range(batch)])
    return RingPlan(n, rank, c, steps, a, docs=docs, batch=batch)
