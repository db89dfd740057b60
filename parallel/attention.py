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


# Attention arguments transformers models pass that change what attention computes, and which longstride's kernels
# do not implement: refused when set, never dropped (sliding windows: Mistral, Qwen2, Gemma 2/3, OLMo 3, GPT-OSS;
# sinks: GPT-OSS; logit soft-capping: Gemma 2)
UNSUPPORTED_KWARGS = {"sliding_window": "a sliding window", "s_aux": "attention sinks", "softcap": "logit soft-capping"}
# Config fields with the same effect through the mask alone (transformers builds it; longstride builds none)
UNSUPPORTED_CONFIG = {"attention_chunk_size": "chunked attention", "attn_logit_softcapping": "logit soft-capping"}


def unsupported_attention(model: torch.nn.Module, longest: int | None = None) -> list[str]:
    """What in `model` longstride's attention (causal within documents, nothing else) would not compute: layer
    types other than full attention, chunked or soft-capped attention in the config, attention modules with a
    sliding window, sinks, or no causal mask. Empty for Llama, Qwen3, SmolLM3 and the like. A sliding window of
    at least `longest` tokens (default: the config's max_position_embeddings) never cuts anything: not counted."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest = longest or getattr(cfg, "max_position_embeddings", None)
    cuts = lambda w: bool(w) and not (longest and w >= longest)  # noqa: E731
    found = []
    types = list(getattr(cfg, "layer_types", None) or [])
    if not cuts(getattr(cfg, "sliding_window", None)):  # sliding layers whose window spans every sequence
        types = ["full_attention" if t == "sliding_attention" else t for t in types]
    other = [i for i, t in enumerate(types) if t != "full_attention"]
    if other:
        found.append(f"config.layer_types: {sorted({types[i] for i in other})} at layers {other[:6]}"
                     + ("..." if len(other) > 6 else ""))
    for field, what in UNSUPPORTED_CONFIG.items():
        if getattr(cfg, field, None):
            found.append(f"config.{field}={getattr(cfg, field)} ({what})")
    if cuts(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True) and not types:
        found.append(f"config.sliding_window={cfg.sliding_window} (a sliding window on every layer)")
    for name, mod in model.named_modules():
        if not name.endswith("attn") and not name.endswith("attention"):
            continue
        if cuts(getattr(mod, "sliding_window", None)):
            found.append(f"{name}.sliding_window={mod.sliding_window}")
        if isinstance(getattr(mod, "sinks", None), torch.Tensor):
            found.append(f"{name}.sinks (attention sinks)")
        if getattr(mod, "is_causal", True) is False:
            found.append(f"{name}.is_causal=False (bidirectional attention)")
    return found


def check_supported(model: torch.nn.Module, longest: int | None = None) -> None:
    """Refuses, before compute, a model whose attention longstride would compute wrongly (naming each layer and
    field); plain causal models pass."""
    found = unsupported_attention(model, longest)
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise NotImplementedError(
            f"{type(model).__name__}: longstride's attention computes causal attention within documents only, and "
            f"this model's attention needs more: {shown}. Refused rather than silently dropped. Train it without "
            f"longstride's attention (attn_implementation='sdpa' or 'eager', no context parallelism), or, where a "
            f"window is at least your longest sequence, set it to None in the model's config")


def longstride_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         doc_layout: Optional[DocLayout] = None, **kwargs):
    # query: (B, H, L, D), key/value: (B, Hkv, L, D) -> ((B, L, H, D), None)
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstride attention")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{type(module).__name__} asks for bidirectional attention (is_causal=False), which "
                                  "longstride's attention does not implement; refused rather than dropped")
    # the keys' whole length: this rank's share times the CP degree (a window at least that long cuts nothing)
    longest = key.shape[2] * (doc_layout.cp.degrees.cp if doc_layout is not None and doc_layout.cp.method else 1)
    for key_name, what in UNSUPPORTED_KWARGS.items():
        arg = kwargs.get(key_name)
        if arg is not None and not (key_name == "sliding_window" and arg >= longest):
            raise NotImplementedError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) asks "
                                      f"for {what} ({key_name}), which longstride's attention does not implement; "
                                      f"refused rather than dropped")
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
    check_supported(model)
    register()
    model.set_attn_implementation(NAME)
