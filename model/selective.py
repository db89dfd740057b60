"""What selective activation checkpointing keeps: the policy torch's selective-checkpoint contexts ask, op by op,
during a checkpointed layer's forward (model/checkpointing.py switches it on).

Kept: the matmuls' outputs (KEPT: the q/k/v, output and MLP or experts' projections) and attention's output and
log-sum-exp (ATTENTION_OPS: longstride's attention, one op however it runs: on one device, in a ring, under Ulysses
or UPipe (parallel/attention_call.py); torch's SDPA kernels where SDPA runs under autograd). Everything else (norms,
RoPE, residual adds, activations, autocast's casts: cheap elementwise ops) is recomputed from them in backward: no
matmul and no attention kernel runs again, no ring sends K/V again and no Ulysses group exchanges heads again (its
all-to-alls run inside the op; plain Ulysses' op also returns, so keeps, the head-layout q and K/V its backward
reads). Where CUDA's SDPA falls back to its math kernel (fp64, or a shape no fused kernel takes) the kept matmuls
include its L x L scores, as no checkpointing keeps them.

Light on purpose (torch only): parallel/ imports it and it imports nothing of longstride.
"""
from __future__ import annotations

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

# attention: longstride's op (registered by parallel/attention_call.py; it runs inside an autograd.Function, without
# grad) and torch's SDPA kernels (kept where they run under grad: nowhere else calls them in a layer).
ATTENTION_OP = "longstride::attention_forward"
ATTENTION_OPS = {ATTENTION_OP, "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_cudnn_attention"}


def policy(ctx, op, *args, **kwargs):
    # A keep-list rather than a recompute-list: buffers that attention fills in place (Ulysses outputs, receive
    # buffers) must never be kept, and a keep-list never names them. Nothing that runs without grad is kept, our
    # attention op aside: the forward of an autograd.Function (a tiled op, which keeps only its input and recomputes
    # its tiles itself) saves what it needs on its own.
    name = op.name()
    keep = (op in KEPT or name in ATTENTION_OPS) and (torch.is_grad_enabled() or name == ATTENTION_OP)
    return CheckpointPolicy.PREFER_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
