"""What selective activation checkpointing keeps: the policy torch's selective-checkpoint contexts ask, op by op,
during a checkpointed layer's forward (model/checkpointing.py switches it on).

Kept: the matmuls' outputs (KEPT: the q/k/v, output and MLP or experts' projections) and, where no ring splits the
sequence (one device, Ulysses, UPipe), attention's kernel output and log-sum-exp (ATTENTION_OPS). Everything else
(norms, RoPE, residual adds, activations, autocast's casts: cheap elementwise ops) is recomputed from them in
backward: no matmul and no attention kernel runs again (a Ulysses exchange does). Attention's forward is recomputed
under a ring (its kernels run once per block, and keeping those outputs would hold a block's output per ring step)
and with the math kernel (its softmax is ops of its own; CUDA's sdpa kernel runs it for windowed or sink layers).

Light on purpose (torch only): parallel/kernels.py and parallel/ring.py mark the attention whose kernel outputs are
kept with keep_attention_output.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import CheckpointPolicy

_aten = torch.ops.aten
# the matmuls whose outputs selective checkpointing keeps (a linear layer is one of them under a view; experts are
# grouped matmuls). _unsafe_view (matmul's reshape of its mm) aliases a kept output without sharing its version
# counter: kept too (no new memory), so that an op changing it in place is caught by the cache's mutation check
# instead of handing backward a changed value. (A reshape that must copy also ends in one, and its copy would be
# kept: none of the nine architectures tests/test_memory_estimate.py measures does one in a layer.)
KEPT = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._unsafe_view.default,
        *([_aten._grouped_mm.default] if hasattr(_aten, "_grouped_mm") else [])}

# attention kernels whose outputs (out, lse and a kernel's small extras) are kept: where torch's SDPA runs under
# autograd, or inside attention's autograd.Function where it says so (keep_attention_output). By name, so that the
# flash-attn package's custom ops match without importing it.
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward",
                 "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_cudnn_attention", "aten::_efficient_attention_forward",
                 "flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_forward"}

_attention = threading.local()  # torch asks the policy in the forward only, in the thread that runs the model


@contextmanager
def keep_attention_output():
    """Around attention's kernel calls on one device or in a ring of one, inside its autograd.Function (which runs
    without grad): their outputs are kept, so that backward's recompute of the layer skips attention's kernels.
    Each document's kernel output covers its own rows, so what is kept is one output and one log-sum-exp."""
    _attention.depth = getattr(_attention, "depth", 0) + 1
    try:
        yield
    finally:
        _attention.depth -= 1


def keeps_attention(ring: int, kernel: str) -> bool:
    """Whether a stage's attention output is kept: where no ring splits the sequence (`ring`, its ring degree: 1 on
    one device and under Ulysses or UPipe, whose ranks attend over the whole sequence with the heads they hold) and
    the kernel is not math (the explicit reference computes its softmax in ops of its own)."""
    return ring == 1 and kernel != "math"


def policy(ctx, op, *args, **kwargs):
    # A keep-list rather than a recompute-list: buffers that attention fills in place (ring and Ulysses outputs,
    # receive buffers) must never be kept, and a keep-list never names them. Nothing that runs without grad is kept
    # either, attention's kernels marked above aside: the forward of an autograd.Function (a tiled op, which keeps only
    # its input and recomputes its tiles itself; ring and Ulysses attention) saves what it needs on its own.
    if op in KEPT:
        keep = torch.is_grad_enabled()
    else:
        keep = op.name() in ATTENTION_OPS and (torch.is_grad_enabled() or getattr(_attention, "depth", 0) > 0)
    return CheckpointPolicy.PREFER_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
