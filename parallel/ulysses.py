"""Ulysses context parallelism, its headwise-staged form UPipe, and Ulysses inside a ring (hybrid).

Each rank of a Ulysses group of N holds a contiguous 1/N of its sequence (the whole sequence, or
its ring rank's zig-zag share) for all heads. An all-to-all turns (L/N tokens, H heads) into
(L tokens, H/N heads); attention runs over the full sequence with the ring machinery (a one-rank
"ring" when there is no ring: one varlen-causal call per document layout, parallel/blocks.py); a
second all-to-all brings the output back to sequence shards.

UPipe runs the query heads in stages of U (head schedule: parallel/heads.py): each stage's all-to-alls and
attention reuse the previous stage's buffers, and K/V are exchanged once and kept. Only the local
inputs, the local output and each stage's log-sum-exp are saved for backward; backward exchanges
(q, out, dout) per stage again and runs the attention backward stage by stage, so its buffers are
per stage too. Plain Ulysses is the one-stage case, except that it keeps the head-layout q and K/V (the
same bytes as the local q, k, v; K/V lcm(Hkv, N) / Hkv times more where replicated) and its backward
exchanges only (out, dout): one all-to-all fewer per backward and no third copy of q, out, dout in flight
at once (bench_peers measured the re-exchange at 1.16x DeepSpeed Ulysses' time and 2x its memory on 8:2 x
128 heads at 8K). The whole forward, all-to-alls included, is one call of parallel/attention_call's op:
selective checkpointing keeps its outputs (plain Ulysses': the local output, the head-layout q and K/V and
the lse; UPipe's: the local output and the lses), and backward's recompute of a layer exchanges nothing.

    ulysses_attention(q, k, v, plan, kernel, scale, ring, heads, stage_heads, pattern, sinks) -> out,
    differentiable
q: (B, H, Lloc, D), k/v: (B, Hkv, Lloc, D) with Lloc the rank's share; out like q. A layer's window or chunk
(parallel/pattern.py) applies on the gathered sequence through the ring functions; its sinks (H,) are sliced to
the heads each rank attends for.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from longstride.parallel import ring as ring_method
from longstride.parallel.attention_call import attention_forward
from longstride.parallel.blocks import RingPlan
from longstride.parallel.collectives import all_to_all_single
from longstride.parallel.config import CPDegrees, check_ulysses
from longstride.parallel.dense import seq_major
from longstride.parallel.ring import RingCall, RingComm
from longstride.parallel.heads import HeadSchedule, head_schedule
from longstride.parallel.pattern import CAUSAL, Pattern, sink_grad
from longstride.parallel.zigzag import split_batch


class HeadComm:
    """All-to-all between sequence shards and head shards over one Ulysses process group (None: one
    process, the exchanges are identities; used to test the stage logic without a group)."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def my_heads(self, order: torch.Tensor) -> torch.Tensor:
        """order: the heads in the order they were sent -> the ones this rank holds after to_heads."""
        per = order.numel() // self.size
        return order[self.rank * per:(self.rank + 1) * per]

    @staticmethod
    def _buf(bufs: Optional[dict], name: str, shape, like: torch.Tensor) -> torch.Tensor:
        b = bufs.get(name) if bufs is not None else None
        if b is None or b.shape != shape or b.dtype != like.dtype:
            b = torch.empty(shape, dtype=like.dtype, device=like.device)
            if bufs is not None:
                bufs[name] = b
        return b

    def to_heads(self, xs, bufs: Optional[dict] = None, name: str = "") -> torch.Tensor:
        """xs: one (M, h, Lloc, D) tensor or a list of them, exchanged in one all-to-all ->
        (P*M, h/N, N*Lloc, D), P the list length: head chunk i goes to rank i, whose sequence is the ranks'
        pieces in rank order. bufs: buffers reused across calls (the result is a view of one of them)."""
        xs = list(xs) if isinstance(xs, (list, tuple)) else [xs]
        N, P = self.size, len(xs)
        M, h, Ll, D = xs[0].shape
        if N == 1:
            return xs[0] if P == 1 else torch.cat(xs)
        send = self._buf(bufs, name + ".send", (N, P * M, h // N, Ll, D), xs[0])
        parts = send.view(N, P, M, h // N, Ll, D)
        for i, x in enumerate(xs):  # straight into the send buffer, no stacked copy
            parts[:, i].copy_(x.unflatten(1, (N, h // N)).transpose(0, 1))  # a view whatever x's strides
        recv = self._buf(bufs, name + ".recv", send.shape, xs[0])
        all_to_all_single(recv, send, self.group)
        del send, parts  # without kept buffers the send buffer goes before the layout copy's buffer comes
        # (P*M, N*Lloc, h/N, D) buffer, returned as its (P*M, h/N, N*Lloc, D) view: the layout a ring over the
        # Ulysses groups sends without a copy (parallel/ring.to_wire)
        full = self._buf(bufs, name + ".full", (P * M, N, Ll, h // N, D), xs[0])
        full.copy_(recv.permute(1, 0, 3, 2, 4))
        return full.view(P * M, N * Ll, h // N, D).transpose(1, 2)

    def to_seq(self, y: torch.Tensor, bufs: Optional[dict] = None, name: str = "") -> torch.Tensor:
        """Inverse of to_heads: (M, h/N, N*Lloc, D) -> (M, h, Lloc, D) (may be a view of a buffer)."""
        N = self.size
        if N == 1:
            return y
        M, hl, L, D = y.shape
        send = self._buf(bufs, name + ".send", (N, M, hl, L // N, D), y)
        send.copy_(y.view(M, hl, N, L // N, D).permute(2, 0, 1, 3, 4))
        recv = self._buf(bufs, name + ".recv", send.shape, y)
        all_to_all_single(recv, send, self.group)
        return recv.transpose(0, 1).flatten(1, 2)  # a view of recv when M == 1


def _kv_to_heads(k, v, sched: HeadSchedule, heads: HeadComm) -> torch.Tensor:
    """K and V (replicated where the schedule says) in one all-to-all -> kept (2, B, Kr, L, D)."""
    if sched.kv_rep > 1:
        k, v = (x.repeat_interleave(sched.kv_rep, dim=1) for x in (k, v))
    B, Hkv, Ll, D = k.shape
    return heads.to_heads([k, v]).view(2, B, Hkv // heads.size, Ll * heads.size, D)


def _sinks_of(sinks: Optional[torch.Tensor], heads_held: torch.Tensor) -> Optional[torch.Tensor]:
    return None if sinks is None else sinks.index_select(0, heads_held)


class UlyssesCall(NamedTuple):
    """Everything but the tensors of one Ulysses call: the ring call over the gathered sequence, the Ulysses
    group and UPipe's heads per stage (0: all at once)."""

    ring: RingCall
    heads: HeadComm
    stage_heads: int = 0


class _Exchange(NamedTuple):
    """Ulysses' whole forward as one attention call (parallel/attention_call): the all-to-alls and each stage's ring
    call run inside longstride's attention op, so that selective checkpointing keeps its outputs and backward's
    recompute neither attends nor exchanges again. forward -> plain Ulysses: (out, head-layout q, K/V, lse), what
    its backward reads; UPipe: (out, each stage's lse)."""

    call: UlyssesCall
    sched: HeadSchedule

    def forward(self, q, k, v, sinks):
        call, sched, heads = self.call, self.sched, self.call.heads
        kv = _kv_to_heads(k, v, sched, heads)
        # the output token-major (seq_major), as the ring's: transformers' out.transpose(1, 2) is then a view, not a
        # copy that the output projection would keep
        if len(sched.stages) == 1:  # plain Ulysses: all heads in head order, no buffers to keep for reuse
            qf = heads.to_heads(q)
            qf = qf.clone() if qf is q else qf  # one process (no group): an op's output may not be its input
            held = heads.my_heads(torch.arange(q.shape[1], device=q.device))
            o, lse = call.ring.forward(qf, kv[0], kv[1], _sinks_of(sinks, held))
            return seq_major(q).copy_(heads.to_seq(o)), qf, kv, lse
        out, lses, bufs = seq_major(q), [], {}
        for st in sched.stages:
            qf = heads.to_heads(q.index_select(1, st.send), bufs, "q")
            o, lse = call.ring.forward(qf, st.pick(kv[0]), st.pick(kv[1]), _sinks_of(sinks, heads.my_heads(st.send)))
            out.index_copy_(1, st.send, heads.to_seq(o, bufs, "o"))
            lses.append(lse)
        return out, *lses


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, call: UlyssesCall):
        sched = head_schedule(q.shape[1], k.shape[1], call.heads.size, call.stage_heads, q.device)
        ctx.call, ctx.sched = call, sched
        out, *kept = attention_forward(q, k, v, sinks, _Exchange(call, sched))
        if len(sched.stages) == 1:
            # the head-layout q and K/V hold the same bytes as the local q, k, v (L/N tokens x H heads = L tokens x
            # H/N heads; K/V more where replicated): kept instead of them, the backward does not exchange them again
            qf, kv, lse = kept
            ctx.save_for_backward(qf, kv, out, lse, sinks)
        else:  # UPipe: the local inputs, exchanged again stage by stage in backward
            ctx.save_for_backward(q, k, v, out, sinks, *kept)
        return out

    @staticmethod
    def backward(ctx, dout):
        call, sched, heads = ctx.call, ctx.sched, ctx.call.heads
        if len(sched.stages) == 1:
            *saved, sinks = ctx.saved_tensors
            return (*_one_stage_backward(dout, *saved, sinks=sinks, call=call, sched=sched), None)
        q, k, v, out, sinks, *lses = ctx.saved_tensors
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        kv = _kv_to_heads(k, v, sched, heads)
        dkv = torch.zeros(kv.shape, dtype=torch.promote_types(k.dtype, torch.float32), device=k.device)
        dq, bufs = torch.empty_like(q), ({} if len(sched.stages) > 1 else None)  # buffers reused by stages
        B = q.shape[0]
        for st, lse in zip(sched.stages, lses):
            pick = (lambda t: t) if bufs is None else (lambda t: t.index_select(1, st.send))  # noqa: E731
            f = heads.to_heads([pick(t) for t in (q, out, dout)], bufs, "qod")  # (3B, U/N, L, D)
            f = f.view(3, B, *f.shape[1:])
            gq, gk, gv = call.ring.backward(f[2], f[0], st.pick(kv[0]), st.pick(kv[1]), f[1], lse)
            if sinks is not None:
                held = heads.my_heads(st.send)
                dsinks.index_add_(0, held, sink_grad(f[2], f[1], lse, sinks.index_select(0, held)))
            st.add(dkv[0], gk)
            st.add(dkv[1], gv)
            dq.index_copy_(1, st.send, heads.to_seq(gq, bufs, "dq"))
        del kv, bufs
        dk, dv = (heads.to_seq(g.to(k.dtype)) for g in dkv)  # one at a time: each exchange's buffers are half
        if sched.kv_rep > 1:  # the replicas' gradients sum into their K/V head
            dk, dv = (g.unflatten(1, (sched.kv_heads, sched.kv_rep)).sum(2) for g in (dk, dv))
        return dq, dk, dv, dsinks, None


def _one_stage_backward(dout, qf, kv, out, lse, sinks, call: UlyssesCall, sched: HeadSchedule):
    """Plain Ulysses' backward from the kept head-layout q (B, H/N, L, D) and K/V (2, B, Kr, L, D): only the
    output and its gradient are exchanged (one all-to-all), then dQ and dK/dV go back to sequence shards."""
    B, heads = dout.shape[0], call.heads
    f = heads.to_heads([out, dout])  # (2B, H/N, L, D)
    f = f.view(2, B, *f.shape[1:])
    gq, gk, gv = call.ring.backward(f[1], qf, kv[0], kv[1], f[0], lse)
    dsinks = None
    if sinks is not None:  # this rank's heads' sink gradients; the other heads' come from their ranks
        held = heads.my_heads(torch.arange(sinks.numel(), device=sinks.device))
        dsinks = torch.zeros_like(sinks).index_add_(0, held, sink_grad(f[1], f[0], lse, sinks.index_select(0, held)))
    del f
    dq = heads.to_seq(gq)
    dk, dv = (heads.to_seq(g) for g in (gk, gv))
    if sched.kv_rep > 1:  # the replicas' gradients sum into their K/V head
        dk, dv = (g.unflatten(1, (sched.kv_heads, sched.kv_rep)).sum(2) for g in (dk, dv))
    return dq, dk, dv, dsinks


def ulysses_attention(q, k, v, plan: RingPlan, kernel: str, scale: float, ring: Optional[RingComm],
                      heads: HeadComm, stage_heads: int = 0, pattern: Pattern = CAUSAL,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """plan: the ring plan over the Ulysses group's (ring-local) sequence, n = 1 without a ring."""
    call = UlyssesCall(RingCall(plan, kernel, scale, ring, pattern), heads, stage_heads)
    return _UlyssesAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, call)


# The "ulysses" context-parallel method (parallel/cp.py): all of cp is the Ulysses group, all heads at once.
# UPipe and hybrid (parallel/upipe.py, parallel/hybrid.py) shard and attend the same way.

def degrees(cfg, cp: int, heads: int, where: str, world: int = 0) -> CPDegrees:
    check_ulysses(cp, cp, heads, where, within=world)
    if cfg.ulysses:
        raise ValueError(f"parallel.ulysses={cfg.ulysses} is read by cp_impl=hybrid (the Ulysses degree inside each "
                         "ring rank); cp_impl=ulysses splits heads over all cp ranks: drop parallel.ulysses")
    if cfg.upipe_heads:
        raise ValueError(f"parallel.upipe_heads={cfg.upipe_heads} is read by cp_impl=upipe or hybrid; "
                         "use parallel.cp_impl=upipe for headwise stages")
    return CPDegrees(1, cp, 0)


def shard(batch: dict, docs: Optional[torch.Tensor], cp) -> tuple[dict, RingPlan]:
    """The ring rank's share (the whole sequence without a ring), then this Ulysses rank's contiguous piece of
    it; the plan covers the ring-local sequence, which attention sees whole after the all-to-all."""
    local, plan = ring_method.shard(batch, docs, cp)
    return split_batch(local, cp.degrees.ulysses, cp.ulysses_rank), plan


def attention(q, k, v, layout, scale: float, pattern: Pattern = CAUSAL, sinks=None) -> torch.Tensor:
    cp = layout.cp
    return ulysses_attention(q, k, v, layout.plan, kernel=cp.kernel, scale=scale, ring=cp.ring_comm, heads=cp.head_comm,
                             stage_heads=cp.degrees.stage_heads, pattern=pattern, sinks=sinks)
