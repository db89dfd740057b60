"""longstride's attention inside transformers models, through transformers' registries.

`register()` adds the name "longstride" to AttentionInterface and AttentionMaskInterface. The mask
function returns None (no L x L mask is ever built); the attention function reads the batch's
document layout from the `doc_layout` keyword that the training step passes to the model forward,
which transformers forwards untouched to every attention call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from parallel.kernels import doc_attention

NAME = "longstride"


@dataclass
class DocLayout:
    """What attention needs to know about a packed batch. doc_ids: (B, L) or None (plain causal)."""

    doc_ids: Optional[torch.Tensor]
    kernel: str = "sdpa"


def longstride_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         doc_layout: Optional[DocLayout] = None, **kwargs):
    # query: (B, H, L, D), key/value: (B, Hkv, L, D) -> ((B, L, H, D), None)
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstride attention")
    layout = doc_layout or DocLayout(None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = doc_attention(query, key, value, layout.doc_ids, scale, layout.kernel)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(NAME, longstride_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def use_longstride_attention(model: torch.nn.Module) -> None:
    register()
    model.set_attn_implementation(NAME)
