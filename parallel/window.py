"""Sliding-window attention under context parallelism: a halo exchange instead of the ring.

A query at global position g with window W sees keys (g - W, g] of its own document. So a rank's chunk that
starts at g0 needs, besides its own tokens, only the halo [max(g0 - W + 1, start of the document holding g0),
g0): at most W - 1 tokens per chunk, wherever they are held. Every rank of a CP group knows the full batch's
documents and the chunk assignment, so each computes what every rank needs from every other, without asking;
one all-to-all (uneven splits) moves the halos of K and V (O(W) tokens per chunk, not the sequence), and the
backward sends the halo tokens' dK/dV back the same way. A rank then attends locally: for each of its chunks,
an extended key buffer [halo, chunk], with one causal windowed piece per document segment of the chunk, whose
queries are the suffix of its keys (parallel/varlen.py's windowed pieces; the dense kernels' banded form on CPU).

Chunked attention needs no exchange of its own: it is the ring over documents cut into chunks
(parallel/pattern.chunk_docs). `pattern_plan` picks the plan of each layer's pattern from the batch's ring plan,
once per batch, and ring_forward / ring_backward (parallel/ring.py) run it, so Ulysses, UPipe and hybrid (which
attend through them) apply windows and chunks on the sequence they gather.

    halo_forward(q, k, v, plan, kernel, scale, comm, softcap) -> (out, lse)
    halo_backward(dout, q, k, v, out, lse, plan, kernel, scale, comm, softcap) -> (dq, dk, dv)
q: (B, H, Lloc, D), k/v: (B, Hkv, Lloc, D), out like q, lse: (B, H, Lloc) fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from longstride.host_copy import as_device_tensor
from longstride.model.real import real
from longstride.parallel.blocks import Derived, RingPlan, ring_plan, run_starts
from longstride.parallel.collectives import all_to_all_single
from longstride.parallel.kernels import varlen_kernel
from longstride.parallel.pattern import Pattern, chunk_docs, doc_starts
from longstride.parallel.varlen import VarlenCall, flat
from longstride.parallel.zigzag import Assignment


@dataclass
class HaloPlan:
    """One rank's windowed attention for one batch. send_idx: the rank's flat (B * Lloc) token indices it sends,
    grouped by destination rank (send_splits tokens to each); recv_splits: tokens received from each rank;
    ext_src: for each token of the extended key buffer, its index in [local flat tokens, received tokens];
    call: the causal windowed pieces (queries: the local flat tokens, keys: the extended buffer)."""

    n: int
    rank: int
    window: int
    local: int
    send_idx: np.ndarray
    send_splits: list
    recv_splits: list
    ext_src: np.ndarray
    call: VarlenCall
    derived: Derived = field(default_factory=Derived, repr=False, compare=False)

    def index(self, name: str, device) -> torch.Tensor:
        key = (name, device)
        if key not in self.derived:  # copied to the device once per batch, not per layer
            with real():
                self.derived[key] = as_device_tensor(getattr(self, name), torch.long, device)
        return self.derived[key]


def pattern_plan(plan: RingPlan, pattern: Pattern):
    """The plan a layer with `pattern` runs, derived once per batch from the batch's ring plan: the plan itself
    for plain causal attention, a ring plan over (document, chunk) runs for chunked attention, a HaloPlan for a
    sliding window."""
    length = plan.local * plan.n
    pattern = pattern.within(length)
    if pattern.causal:
        return plan
    key = ("pattern", pattern.window, pattern.chunk)  # a soft-cap changes no geometry
    if key not in plan.derived:
        docs = chunk_docs(plan.docs, pattern.chunk, (plan.batch, length))
        if pattern.window is None:
            plan.derived[key] = ring_plan(docs, plan.batch, length, plan.n, plan.rank, plan.assignment)
        else:
            plan.derived[key] = halo_plan(docs, plan.batch, length, plan.rank, plan.assignment, pattern.window)
    return plan.derived[key]


def _owners(a: Assignment) -> dict:
    return {x: (r, i) for r, chunks in enumerate(a.chunks) for i, x in enumerate(chunks)}


def _halos(docs: Optional[np.ndarray], batch: int, length: int, a: Assignment, window: int) -> dict:
    """(row, global chunk) -> the global start of its halo (the halo ends where the chunk starts)."""
    c = a.chunk_len(length)
    starts = [doc_starts(docs[b]) if docs is not None else np.zeros(length, dtype=np.int64) for b in range(batch)]
    return {(b, x): max(x * c - (window - 1), int(starts[b][x * c])) for b in range(batch) for x in range(a.n * a.k)}


def halo_plan(docs: Optional[np.ndarray], batch: int, length: int, rank: int, a: Assignment,
              window: int) -> HaloPlan:
    """docs: (B, L) full-batch document ids (None: one document per row); a: the CP layout's chunk assignment."""
    c, n = a.chunk_len(length), a.n
    local = c * a.k
    owner = _owners(a)
    halo = _halos(docs, batch, length, a, window)

    def sources(d: int, b: int, x: int):
        """The halo of rank d's chunk x in row b, as (source rank, flat token indices on that rank) runs."""
        g = halo[b, x]
        while g < x * c:
            y = g // c
            end = min(x * c, (y + 1) * c)
            s, i = owner[y]
            yield s, b * local + i * c + np.arange(g - y * c, end - y * c)
            g = end

    need = {}  # (receiver, source) -> the source's flat indices, in the receiver's order
    for d in range(n):
        for b in range(batch):
            for x in a.chunks[d]:
                for s, idx in sources(d, b, x):
                    need.setdefault((d, s), []).append(idx)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
    got = {s: cat(need.get((rank, s), [])) for s in range(n) if s != rank}
    recv_splits = [0 if s == rank else len(got[s]) for s in range(n)]
    send = [np.zeros(0, dtype=np.int64) if d == rank else cat(need.get((d, rank), [])) for d in range(n)]
    ext_src, q_ranges, k_ranges = _extended(docs, a, rank, halo=halo, sources=sources, recv_splits=recv_splits,
                                            shape=(batch, c, local))
    return HaloPlan(n, rank, window, local, send_idx=cat(send), send_splits=[len(x) for x in send],
                    recv_splits=recv_splits, ext_src=ext_src, call=VarlenCall.of_ranges(q_ranges, k_ranges, window))


def _extended(docs, a: Assignment, rank: int, halo: dict, sources, recv_splits: list, shape: tuple):
    """This rank's extended key buffer (for each row and own chunk: its halo, then the chunk) as indices into
    [local flat tokens, received tokens], and the pieces: one per document segment of each own chunk.
    shape: (rows, chunk length, local tokens per row)."""
    batch, c, local = shape
    offset = {s: sum(recv_splits[:s]) for s in range(a.n)}  # where each source's tokens start in the received ones
    ext, q_ranges, k_ranges, size = [], [], [], 0
    for b in range(batch):
        for i, x in enumerate(a.chunks[rank]):
            start = size
            for s, idx in sources(rank, b, x):
                if s == rank:
                    ext.append(idx)
                else:
                    ext.append(batch * local + offset[s] + np.arange(len(idx)))
                    offset[s] += len(idx)
            hl = x * c - halo[b, x]
            q0 = b * local + i * c
            ext.append(q0 + np.arange(c))
            size += hl + c
            row = docs[b, x * c:(x + 1) * c] if docs is not None else np.zeros(c, dtype=np.int64)
            edges = [*run_starts(row).tolist(), c]
            for s0, e0 in zip(edges[:-1], edges[1:]):
                q_ranges.append((q0 + s0, q0 + e0))
                k_ranges.append((start if s0 == 0 else start + hl + s0, start + hl + e0))
    return np.concatenate(ext), q_ranges, k_ranges


def _exchange(x: torch.Tensor, send_splits: list, recv_splits: list, comm) -> torch.Tensor:
    """x: (S, ...) tokens grouped by destination -> (R, ...) tokens grouped by source (one all-to-all)."""
    recv = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if comm is not None:  # one rank: nothing travels
        all_to_all_single(recv, x.contiguous(), comm.group, recv_splits, send_splits)
    return recv


def _extended_kv(k, v, plan: HaloPlan, comm):
    """Keys and values of the extended buffer (the local tokens and the received halos), each (1, Hkv, E, D)."""
    kv = torch.cat([flat(k), flat(v)], dim=1)  # (B * Lloc, 2 * Hkv, D): K and V in one message
    halo = _exchange(kv.index_select(0, plan.index("send_idx", kv.device)), plan.send_splits, plan.recv_splits,
                     comm)
    ext = torch.cat([kv, halo]).index_select(0, plan.index("ext_src", kv.device))
    hkv = k.shape[1]
    return _as_bhld(ext[:, :hkv], 1), _as_bhld(ext[:, hkv:], 1)


def _as_bhld(x: torch.Tensor, batch: int) -> torch.Tensor:
    # packed (B * L, H, D) -> (B, H, L, D) over it
    return x.view(batch, -1, *x.shape[1:]).transpose(1, 2)


def halo_forward(q, k, v, plan: HaloPlan, kernel: str, scale: float, comm, softcap=None):
    B, H, L, D = q.shape
    ek, ev = _extended_kv(k, v, plan, comm)
    out, lse = plan.call.forward(varlen_kernel(kernel), q, ek, ev, scale, softcap)
    return _as_bhld(out, B), lse.view(H, B, L).transpose(0, 1)


def halo_backward(dout, q, k, v, out, lse, plan: HaloPlan, kernel: str, scale: float, comm, softcap=None):
    """K/V's halos are exchanged again (as the ring sends K/V round again), and their dK/dV sent back."""
    B, hkv = q.shape[0], k.shape[1]
    ek, ev = _extended_kv(k, v, plan, comm)
    dq, dk, dv = plan.call.backward(varlen_kernel(kernel), dout, q, ek, ev, out=out, lse=lse, scale=scale,
                                    softcap=softcap)
    del ek, ev
    acc_dtype = torch.promote_types(k.dtype, torch.float32)
    dext = torch.cat([dk, dv], dim=1).to(acc_dtype)
    acc = dext.new_zeros((B * plan.local + sum(plan.recv_splits), *dext.shape[1:]))
    acc.index_add_(0, plan.index("ext_src", acc.device), dext)
    mine, theirs = acc[:B * plan.local], acc[B * plan.local:]
    back = _exchange(theirs, plan.recv_splits, plan.send_splits, comm)  # each halo's gradient to its owner
    mine.index_add_(0, plan.index("send_idx", acc.device), back)
    dk, dv = (_as_bhld(g, B).to(k.dtype) for g in (mine[:, :hkv], mine[:, hkv:]))
    return _as_bhld(dq, B), dk, dv
