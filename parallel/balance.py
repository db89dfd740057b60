"""Document-aware load balancing for ring attention: a chunk assignment per batch that gives every CP
rank the same number of tokens and as equal a share of the attention work as the documents allow.

Zig-zag balances plain causal attention exactly, but under document masking a rank's work is the
number of (query, key) pairs inside each document that its queries see: a query at position p of its
document attends p + 1 keys, whichever rank holds them (the ring brings every key round). So the work
of a chunk is the sum of its tokens' in-document positions + 1, and the work of a rank is the sum over
its chunks: a number every rank computes from the full batch's document ids, without communication.
A model whose layers differ (parallel/pattern.py: sliding windows, chunks) is weighed by what each layer
type computes, summed over its layers: min(p + 1, window) keys for a windowed layer, (p mod chunk) + 1
for a chunked one, as one layout serves every layer.

`balanced_assignment` cuts the sequence into N x k equal chunks for k = 2, 4, 8, ... (as far as the
length divides and `max_chunks` allows), deals the chunks to ranks by longest-processing-time (the
most expensive chunk first, to the least loaded rank that still has room for one, so every rank gets
k chunks) and keeps the assignment whose slowest rank is closest to the mean, zig-zag included. Zig-zag
is returned as it is when it is already within `tolerance`. Everything is deterministic (stable sorts,
ties to the lower rank), so every rank computes the same assignment. No padding, no divisibility
requirement on documents: parallel/blocks.py plans any assignment.

    token_work(doc_ids) -> (L,) int64;  rank_work(work, assignment) -> (N,);  imbalance(work) -> max / mean
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from longstride.parallel.pattern import Pattern, doc_starts
from longstride.parallel.zigzag import Assignment, zigzag


def token_work(docs: np.ndarray, patterns: tuple = ()) -> np.ndarray:
    """docs: (B, L) document ids (contiguous runs) -> (L,) per position, summed over rows, the keys that
    position's query attends: its position inside its document + 1 (causal layers), summed over the model's
    layers by pattern when `patterns` ((Pattern, layers), ...: pattern.model_patterns) is given."""
    docs = np.atleast_2d(docs)
    B, L = docs.shape
    idx = np.arange(L)
    work = np.zeros(L, dtype=np.int64)
    for row in docs:
        pos = idx - doc_starts(row)  # position inside the document
        for p, layers in patterns or ((Pattern(), 1),):
            keys = pos % p.chunk + 1 if p.chunk else pos + 1
            work += layers * (np.minimum(keys, p.window) if p.window else keys)
    return work


def rank_work(work: np.ndarray, a: Assignment) -> np.ndarray:
    """(N,) the attention work of each rank's queries under assignment `a`."""
    per_chunk = work.reshape(a.n * a.k, -1).sum(1)
    return np.array([per_chunk[list(c)].sum() for c in a.chunks])


def imbalance(per_rank: np.ndarray) -> float:
    """Slowest rank's work over the mean (1.0 is perfect)."""
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def lpt(chunk_work: np.ndarray, n: int) -> Assignment:
    """Longest-processing-time dealing of n x k chunks to n ranks, k each: the most expensive chunk first,
    to the least loaded rank with room (ties to the lower rank)."""
    k = len(chunk_work) // n
    load, held = np.zeros(n, dtype=np.int64), [[] for _ in range(n)]
    for j in np.argsort(-chunk_work, kind="stable"):
        open_ranks = [r for r in range(n) if len(held[r]) < k]
        r = min(open_ranks, key=lambda x: (load[x], x))
        held[r].append(int(j))
        load[r] += chunk_work[j]
    return Assignment(tuple(tuple(sorted(h)) for h in held))


def balanced_assignment(doc_ids: Optional[np.ndarray], n: int, max_chunks: int = 8,
                        tolerance: float = 1.01, patterns: tuple = ()) -> Assignment:
    """The chunk assignment for one batch (see the module docstring). doc_ids: (B, L) or None (plain causal:
    zig-zag is exact); max_chunks: the most chunks per rank tried (more chunks balance finer, at more and
    smaller kernel calls per ring step); patterns: the model's layer patterns, weighed by their work."""
    z = zigzag(n)
    if doc_ids is None or n == 1:
        return z
    docs = np.asarray(doc_ids)
    z.chunk_len(docs.shape[-1])  # the length must at least divide into zig-zag's 2N chunks
    work = token_work(docs, patterns)
    best, best_score = z, imbalance(rank_work(work, z))
    if best_score <= tolerance:
        return z
    length, k = docs.shape[-1], 2
    while k <= max_chunks and length % (n * k) == 0:
        a = lpt(work.reshape(n * k, -1).sum(1), n)
        score = imbalance(rank_work(work, a))
        if score < best_score - 1e-9:
            best, best_score = a, score
        if best_score <= tolerance:
            break
        k *= 2
    return best
