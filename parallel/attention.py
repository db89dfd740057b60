"""longstride's attention inside transformers models, through transformers' registries.

`register()` adds the name "longstride" to AttentionInterface and AttentionMaskInterface. The mask
function returns None (no L x L mask is ever built); the attention function reads the batch's
document layout from the `doc_layout` keyword that the training step passes to the model forward,
which transformers forwards untouched to every attention call.

With context parallelism, `parallel.cp.shard_for_cp` cuts a packed batch into this rank's share and
builds the ring plan from the full batch's document ids; the model then sees only local tokens (RoPE
is computed for local positions only) and every attention call runs the stage's CP method
(parallel/cp.py METHODS).
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from longstride.model.tiling import autocast_on
from longstride.parallel.cp import DocLayout, method
from longstride.parallel.kernels import doc_attention

NAME = "longstride"


def longstride_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         doc_layout: Optional[DocLayout] = None, **kwargs):
    # query: (B, H, L, D), key/value: (B, Hkv, L, D) -> ((B, L, H, D), None)
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstride attention")
    layout = doc_layout or DocLayout(None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = _same_dtype(query, key, value)
    if layout.cp.method is None:
        out = doc_attention(query, key, value, layout.doc_ids, scale, layout.cp.kernel, layout.bounds)
    else:
        out = method(layout.cp.method).attention(query, key, value, layout, scale)
    return out.transpose(1, 2).contiguous(), None


def _same_dtype(q, k, v):
    """Under autocast, transformers hands attention q/k in fp32 (RoPE multiplies them by fp32 cos/sin) and v in
    the autocast dtype; the kernels and the ring's messages need one dtype: autocast's (as SDPA would cast
    to), else the widest of the three. A cast keeps the tensor's (B, L, H, D) memory layout."""
    device = q.device.type
    if autocast_on(device):
        dtype = torch.get_autocast_dtype(device)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(NAME, longstride_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def use_longstride_attention(model: torch.nn.Module) -> None:
    register()
    model.set_attn_implementation(NAME)
