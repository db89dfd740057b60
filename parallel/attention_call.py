"""The autograd Function behind longstride's attention on one device (parallel/kernels._DocCall) and in a ring
(parallel/ring.RingCall), and the op its forward runs as (Ulysses' Function, parallel/ulysses.py, runs its whole
forward through it too: the all-to-alls with the ring call of each stage).

A call object holds everything but the tensors: call.forward(q, k, v, sinks) -> (out, lse) with the sinks folded in,
call.backward(dout, q, k, v, out, lse) -> (dq, dk, dv). The Function saves q, k, v, out, lse and the sinks only.
(The op passes on whatever tensors a call's forward returns: Ulysses' returns what its backward reads.)

Its forward runs as one dispatcher op, `longstride::attention_forward` (selective.ATTENTION_OP), so that selective
activation checkpointing (model/selective.py) sees a layer's whole attention as one op: it keeps the op's
outputs, and backward's recompute of the layer takes them from its cache instead of running the kernels again,
and under a ring or Ulysses instead of sending K/V round it or exchanging heads again too (no rank communicates in
that recompute, so none waits for another). The call object reaches the op through a registry entry that lives for
the op's call only (an op takes tensors and numbers). A dispatch mode sees the op, not what runs inside it: one that
must see the kernels and buffers inside (the memory trace, the flash kernels' contract check) runs it with
`run_inside`.
Not for torch.compile or export, which would take the call's key for a constant: the attention function that makes
the call for training is registered outside compiled graphs (parallel/attention.py); nothing compiles eval's.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstride.model.selective import ATTENTION_OP
from longstride.parallel.pattern import sink_grad

_calls: dict = {}
_keys = itertools.count()


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                       call: int) -> list[torch.Tensor]:
    return list(_calls[call].forward(q, k, v, sinks))


@_attention_forward.register_fake
def _(q, k, v, sinks, call):  # under FakeTensorMode the call runs on fake tensors as it runs on real ones
    return list(_calls[call].forward(q, k, v, sinks))


def is_attention_op(func) -> bool:
    return func is torch.ops.longstride.attention_forward.default


def run_inside(mode: TorchDispatchMode, args, kwargs):
    """Inside `mode`'s __torch_dispatch__ for the attention op (is_attention_op): the op's outputs, computed with
    `mode` active again, so that it sees each op of the call (a mode is inactive while it handles an op)."""
    q, k, v, sinks, key = (*args, *(kwargs or {}).values())  # the schema's order
    TorchDispatchMode.__enter__(mode)  # the base class's: a mode's own __enter__ may do more than activate it
    try:
        return list(_calls[key].forward(q, k, v, sinks))
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)


def attention_forward(q, k, v, sinks, call) -> tuple[torch.Tensor, ...]:
    """call.forward(q, k, v, sinks) run as longstride::attention_forward: (out, lse), or what the call returns."""
    key = next(_keys)
    _calls[key] = call
    try:
        return tuple(_attention_forward(q, k, v, sinks, key))
    finally:
        del _calls[key]


class CallAttention(torch.autograd.Function):
    """Attention through a call object (see the module's docstring); apply(q, k, v, sinks, call) -> out."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        out, lse = attention_forward(q, k, v, sinks, call)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(dout, q, k, v, out, lse)
        return dq, dk, dv, sink_grad(dout, out, lse, sinks), None
