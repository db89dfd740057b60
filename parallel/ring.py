"""Zig-zag ring attention: exact causal, document-masked attention over a sequence split across CP ranks.

Each rank holds its zig-zag share of Q, K, V (parallel/zigzag.py). Forward: for n steps, the rank
computes its queries against the K/V block it holds while the next block travels (batch_isend_irecv
to the next rank, from the previous one); block outputs are merged with their log-sum-exp in fp32.
Backward: K/V go round again; each block's dK/dV accumulate in fp32 in a buffer that follows the
block round the ring and arrives back at its owner after the last step; dQ accumulates locally.
Which blocks a step computes comes from parallel/blocks.py. K/V keep their own (fewer) GQA heads
on the wire; the kernels resolve GQA inside the call. A layer's pattern (parallel/pattern.py) picks its plan:
chunked attention is the ring over (document, chunk) runs, a sliding window a halo exchange instead of the
ring (parallel/window.py); sinks join the merged output through its log-sum-exp.

    ring_forward(q, k, v, plan, kernel, scale, comm, pattern, sinks) -> (out, lse)
    ring_backward(dout, q, k, v, out, lse, plan, kernel, scale, comm, pattern) -> (dq, dk, dv)
    ring_attention(q, k, v, plan, kernel, scale, comm, pattern, sinks) -> out, differentiable
q: (B, H, Lloc, D), k/v: (B, Hkv, Lloc, D), out: like q, lse: (B, H, Lloc) fp32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from longstride.parallel.balance import balanced_assignment
from longstride.parallel.blocks import RingPlan, ring_plan
from longstride.parallel.collectives import CopyIn, host_staged
from longstride.parallel.config import CPDegrees
from longstride.parallel.attention_call import CallAttention
from longstride.parallel.dense import seq_major
from longstride.parallel.kernels import step_backward, step_forward
from longstride.parallel.pattern import CAUSAL, Pattern, fold_sinks
from longstride.parallel.varlen import dense_last
from longstride.parallel.window import HaloPlan, halo_backward, halo_forward, pattern_plan
from longstride.parallel.zigzag import shard_batch, zigzag

KV_TAG, DKV_TAG = 0, 1


class RingComm:
    """Point-to-point exchange with the ring neighbours of one CP process group."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, sends, tag: int) -> tuple[list, list]:
        """Starts sending each (B, H, L, D) tensor of `sends` to the next rank and receiving the previous
        rank's into a new buffer; returns (the received tensors, the requests to wait on). The two ranks may
        hold a tensor in different memory layouts (a dK/dV block's layout depends on the kernel path that
        made it, which depends on that rank's documents), so no message follows either rank's layout: every
        message is the tensor's (B, L, H, D)-contiguous bytes (see `to_wire`), and what is received is a
        (B, H, L, D) view of such a buffer. Shapes and dtypes are the same on every rank of a ring."""
        ops, recvs, copies = [], [], []
        for i, x in enumerate(sends):
            wire = to_wire(x)
            buf = torch.empty(wire.shape, dtype=wire.dtype, device=wire.device)
            recvs.append(buf.transpose(1, 2))
            if host_staged(self.group, wire):  # gloo: through host buffers, copied in once received
                wire, host = wire.cpu(), torch.empty(wire.shape, dtype=wire.dtype)
                copies.append(CopyIn(buf, host))
                buf = host
            ops += [dist.P2POp(dist.isend, wire, self.next, self.group, 8 * tag + i),
                    dist.P2POp(dist.irecv, buf, self.prev, self.group, 8 * tag + i)]
        return recvs, dist.batch_isend_irecv(ops) + copies


def to_wire(x: torch.Tensor) -> torch.Tensor:
    """x: (B, H, L, D) -> its (B, L, H, D)-contiguous form, the one layout ring messages travel in. No copy
    when x already lies over such a buffer (transformers' q/k/v, the ring's accumulators, what the ring
    received); a copy otherwise."""
    seq = x.transpose(1, 2)
    return seq if seq.is_contiguous() else seq.contiguous()


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-weighted combination of the two partial results, in fp32."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


def _check(q, k, v, plan: RingPlan, comm: Optional[RingComm]) -> None:
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]} "
                         f"(k {tuple(k.shape)}, v {tuple(v.shape)})")
    assert q.shape[2] == plan.local, (q.shape, plan.local)
    assert plan.n == (comm.size if comm is not None else 1), "plan and process group disagree on the CP degree"


def _accumulator(like: torch.Tensor) -> torch.Tensor:
    """fp32 (or wider) zeros in transformers' (B, L, H, D) layout."""
    return seq_major(like, _acc_dtype(like), torch.zeros)


def _add(acc, idx, g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """acc[idx] += g; when nothing is accumulated yet and g covers the whole tensor, g itself is the sum (kept
    only when it already is in the accumulators' dtype and (B, L, H, D) layout, so that dK/dV go on the wire
    without a copy; else copied into one)."""
    if acc is None:
        if g.shape == like.shape:
            if g.dtype == _acc_dtype(like) and g.transpose(1, 2).is_contiguous():
                return g
            return _accumulator(like).copy_(g)
        acc = _accumulator(like)
    acc[idx] += g
    return acc


def ring_forward(q, k, v, plan: RingPlan, kernel: str, scale: float, comm: Optional[RingComm],
                 pattern: Pattern = CAUSAL, sinks: Optional[torch.Tensor] = None):
    """sinks: (H,) sink logits of q's heads, or None; the returned (out, lse) include them."""
    _check(q, k, v, plan, comm)
    plan = pattern_plan(plan, pattern)
    if isinstance(plan, HaloPlan):
        out, lse = halo_forward(q, k, v, plan, kernel=kernel, scale=scale, comm=comm, softcap=pattern.softcap)
        out, lse = fold_sinks(out, lse, sinks)
        return out.to(q.dtype), lse
    n = plan.n
    out = _accumulator(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)
    kv = (k, v)  # two messages per step, sent from the tensors themselves: no stacked copy
    for t in range(n):
        if t + 1 < n:
            nxt, reqs = comm.exchange(kv, KV_TAG)
        for rows, b, o, l in step_forward(kernel, q, kv[0], kv[1], plan, t=t, scale=scale, softcap=pattern.softcap):
            merge(out[rows, :, b.q0:b.q1], lse[rows, :, b.q0:b.q1], o, l.to(out.dtype))
        if t + 1 < n:
            _wait(reqs)
            kv = nxt
    out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, kernel: str, scale: float, comm: Optional[RingComm],
                  pattern: Pattern = CAUSAL):
    """out, lse: what ring_forward returned (sinks included); the sinks' own gradient is pattern.sink_grad's."""
    plan = pattern_plan(plan, pattern)
    if isinstance(plan, HaloPlan):
        return halo_backward(dout, q, k, v, out, lse, plan=plan, kernel=kernel, scale=scale, comm=comm,
                             softcap=pattern.softcap)
    n = plan.n
    dq = None
    kv = (k, v)
    dkv_reqs, dkv_in = [], None
    for t in range(n):
        if t + 1 < n:
            nxt, reqs = comm.exchange(kv, KV_TAG)
        dk = dv = None  # this step's dK/dV of the block held, fp32
        steps = step_backward(kernel, dout, q, kv[0], kv[1], out=out, lse=lse, plan=plan, t=t, scale=scale,
                              softcap=pattern.softcap)
        for rows, b, gq, gk, gv in steps:
            r, c = (rows, slice(None), slice(b.q0, b.q1)), (rows, slice(None), slice(b.k0, b.k1))
            dq = _add(dq, r, gq, q)
            dk, dv = _add(dk, c, gk, k), _add(dv, c, gv, v)
        if dk is None:  # no block of this step reaches this rank's queries
            dk, dv = _accumulator(k), _accumulator(v)
        if t > 0:  # the block's dK/dV accumulated by the ranks that held it before
            _wait(dkv_reqs)
            dk += dkv_in[0]
            dv += dkv_in[1]
        if n > 1:  # pass it on; after the last step it reaches the block's owner
            dkv_in, dkv_reqs = comm.exchange((dk, dv), DKV_TAG)
        if t + 1 < n:
            _wait(reqs)
            kv = nxt
    if n > 1:
        _wait(dkv_reqs)
        dk, dv = dkv_in
    if dq is None:
        dq = _accumulator(q)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingCall(NamedTuple):
    """Everything but the tensors of one ring attention call."""

    plan: RingPlan
    kernel: str
    scale: float
    comm: Optional[RingComm]
    pattern: Pattern = CAUSAL

    def forward(self, q, k, v, sinks=None):
        return ring_forward(q, k, v, self.plan, kernel=self.kernel, scale=self.scale, comm=self.comm,
                            pattern=self.pattern, sinks=sinks)

    def backward(self, dout, q, k, v, out, lse):
        return ring_backward(dout, q, k, v, out, lse, plan=self.plan, kernel=self.kernel, scale=self.scale,
                             comm=self.comm, pattern=self.pattern)


def ring_attention(q, k, v, plan: RingPlan, kernel: str, scale: float, comm: Optional[RingComm],
                   pattern: Pattern = CAUSAL, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    call = RingCall(plan, kernel, scale, comm, pattern)
    return CallAttention.apply(dense_last(q), dense_last(k), dense_last(v), sinks, call)


# The "ring" context-parallel method (parallel/cp.py): all of cp is the ring.

def degrees(cfg, cp: int, heads: int, where: str, world: int = 0) -> CPDegrees:
    for name, value, reader in (("ulysses", cfg.ulysses, "hybrid"), ("upipe_heads", cfg.upipe_heads, "upipe or hybrid")):
        if value:
            raise ValueError(f"parallel.{name}={value} is read by cp_impl={reader}, and this run is cp_impl=ring; "
                             f"drop parallel.{name} or choose that method")
    return CPDegrees(ring=cp)


def shard(batch: dict, docs: Optional[torch.Tensor], cp) -> tuple[dict, RingPlan]:
    """This ring rank's chunks of every (B, L) tensor of a PackedBatch, and the plan of its attention blocks.
    docs: (B, L) document ids, None for plain causal; cp: the stage's CPContext. The chunk assignment is
    zig-zag, or with cp.balance=docs the batch's own (parallel/balance.py)."""
    B, L = batch["input_ids"].shape
    docs = None if docs is None else docs.cpu().numpy()  # once, for the balancer and the plan
    n = cp.degrees.ring
    assignment = zigzag(n)
    if cp.balance == "docs" and docs is not None:
        assignment = balanced_assignment(docs, n, cp.balance_chunks, patterns=cp.patterns)
    return shard_batch(batch, n, cp.ring_rank, assignment), ring_plan(docs, B, L, n, cp.ring_rank, assignment)


def attention(q, k, v, layout, scale: float, pattern: Pattern = CAUSAL, sinks=None) -> torch.Tensor:
    """layout: the batch's DocLayout (parallel/cp.py); pattern, sinks: the layer's (parallel/pattern.py)."""
    return ring_attention(q, k, v, layout.plan, kernel=layout.cp.kernel, scale=scale, comm=layout.cp.ring_comm,
                          pattern=pattern, sinks=sinks)
