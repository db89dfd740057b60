"""Ulysses context parallelism, its headwise-staged form UPipe, and Ulysses inside a ring (hybrid).

Each rank of a Ulysses group of N holds a contiguous 1/N of its sequence (the whole sequence, or
its ring rank's zig-zag share) for all heads. An all-to-all turns (L/N tokens, H heads) into
(L tokens, H/N heads); attention runs over the full sequence with the ring machinery (a one-rank
"ring" when there is no ring: one varlen-causal call per document layout, parallel/blocks.py); a
second all-to-all brings the output back to sequence shards.

UPipe runs the query heads in stages of U (parallel/upipe.py): each stage's all-to-alls and
attention reuse the previous stage's buffers, and K/V are exchanged once and kept. Only the local
inputs, the local output and each stage's log-sum-exp are saved for backward; backward exchanges
(q, out, dout) per stage again and runs the attention backward stage by stage, so its buffers are
per stage too. Plain Ulysses is the one-stage case.

    ulysses_attention(q, k, v, plan, kernel, scale, ring, heads, stage_heads) -> out, differentiable
q: (B, H, Lloc, D), k/v: (B, Hkv, Lloc, D) with Lloc the rank's share; out like q.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel.blocks import RingPlan
from parallel.ring import RingComm, ring_backward, ring_forward
from parallel.upipe import HeadSchedule, head_schedule


class HeadComm:
    """All-to-all between sequence shards and head shards over one Ulysses process group (None: one
    process, the exchanges are identities; used to test the stage logic without a group)."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    @staticmethod
    def _buf(bufs: Optional[dict], name: str, shape, like: torch.Tensor) -> torch.Tensor:
        b = bufs.get(name) if bufs is not None else None
        if b is None or b.shape != shape or b.dtype != like.dtype:
            b = torch.empty(shape, dtype=like.dtype, device=like.device)
            if bufs is not None:
                bufs[name] = b
        return b

    def to_heads(self, x: torch.Tensor, bufs: Optional[dict] = None, name: str = "") -> torch.Tensor:
        """(M, h, Lloc, D) -> (M, h/N, N*Lloc, D): head chunk i goes to rank i, whose sequence is the
        ranks' pieces in rank order. bufs: reused buffers (the result is one of them)."""
        N = self.size
        if N == 1:
            return x
        M, h, Ll, D = x.shape
        send = self._buf(bufs, name + ".send", (N, M, h // N, Ll, D), x)
        send.copy_(x.view(M, N, h // N, Ll, D).transpose(0, 1))
        recv = self._buf(bufs, name + ".recv", send.shape, x)
        dist.all_to_all_single(recv, send, group=self.group)
        full = self._buf(bufs, name + ".full", (M, h // N, N * Ll, D), x)
        full.view(M, h // N, N, Ll, D).copy_(recv.permute(1, 2, 0, 3, 4))
        return full

    def to_seq(self, y: torch.Tensor, bufs: Optional[dict] = None, name: str = "") -> torch.Tensor:
        """Inverse of to_heads: (M, h/N, N*Lloc, D) -> (M, h, Lloc, D) (may be a view of a buffer)."""
        N = self.size
        if N == 1:
            return y
        M, hl, L, D = y.shape
        send = self._buf(bufs, name + ".send", (N, M, hl, L // N, D), y)
        send.copy_(y.view(M, hl, N, L // N, D).permute(2, 0, 1, 3, 4))
        recv = self._buf(bufs, name + ".recv", send.shape, y)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.transpose(0, 1).reshape(M, N * hl, L // N, D)


def _kv_to_heads(k, v, sched: HeadSchedule, heads: HeadComm) -> torch.Tensor:
    """K and V (replicated where the schedule says) in one all-to-all -> kept (2, B, Kr, L, D)."""
    kv = torch.stack([k, v])
    if sched.kv_rep > 1:
        kv = kv.repeat_interleave(sched.kv_rep, dim=2)
    two, B, Hkv, Ll, D = kv.shape
    return heads.to_heads(kv.reshape(2 * B, Hkv, Ll, D)).view(2, B, Hkv // heads.size, Ll * heads.size, D)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, kernel, scale, ring, heads, stage_heads):
        sched = head_schedule(q.shape[1], k.shape[1], heads.size, stage_heads)
        kv = _kv_to_heads(k, v, sched, heads)
        out, lses, bufs = torch.empty_like(q), [], {}
        for st in sched.stages:
            qf = heads.to_heads(q.index_select(1, st.send), bufs, "q")
            o, lse = ring_forward(qf, st.pick(kv[0]), st.pick(kv[1]), plan, kernel, scale, ring)
            out.index_copy_(1, st.send, heads.to_seq(o, bufs, "o"))
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.args = (plan, kernel, scale, ring, heads, sched)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *lses = ctx.saved_tensors
        plan, kernel, scale, ring, heads, sched = ctx.args
        kv = _kv_to_heads(k, v, sched, heads)
        dkv = torch.zeros(kv.shape, dtype=torch.promote_types(k.dtype, torch.float32), device=k.device)
        dq, bufs = torch.empty_like(q), {}
        B, U = q.shape[0], len(sched.stages[0].send)
        for st, lse in zip(sched.stages, lses):
            x = torch.stack([t.index_select(1, st.send) for t in (q, out, dout)])  # (3, B, U, Lloc, D)
            f = heads.to_heads(x.view(3 * B, U, *x.shape[3:]), bufs, "qod").view(3, B, U // heads.size, -1, x.shape[-1])
            gq, gk, gv = ring_backward(f[2], f[0], st.pick(kv[0]), st.pick(kv[1]), f[1], lse, plan, kernel, scale,
                                       ring)
            st.add(dkv[0], gk)
            st.add(dkv[1], gv)
            dq.index_copy_(1, st.send, heads.to_seq(gq, bufs, "dq"))
        two, _, kr, L, D = dkv.shape
        back = heads.to_seq(dkv.to(k.dtype).view(2 * B, kr, L, D)).reshape(2, B, -1, L // heads.size, D)
        if sched.kv_rep > 1:  # the replicas' gradients sum into their K/V head
            back = back.view(2, B, sched.kv_heads, sched.kv_rep, L // heads.size, D).sum(3)
        return dq, back[0], back[1], None, None, None, None, None, None


def ulysses_attention(q, k, v, plan: RingPlan, kernel: str, scale: float, ring: Optional[RingComm],
                      heads: HeadComm, stage_heads: int = 0) -> torch.Tensor:
    """plan: the ring plan over the Ulysses group's (ring-local) sequence, n = 1 without a ring."""
    return _UlyssesAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, kernel, scale, ring,
                                   heads, stage_heads)
