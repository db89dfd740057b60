"""The attention RULER's generation runs in place of the model's own (eval/ruler/generate.py): `prefill_attention`,
a prompt's new tokens against its cached ones with no mask tensor, and `decode_attention`, a CPU decode step with
GQA folded into SDPA's query length. Both compute full causal attention only (no window, soft-cap or sinks);
generate.py runs them where the model's layers and scores allow (hf_adapter.plain_layers, plain_scores), the
model's own attention elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from longstride.eval.hf_adapter import SDPA_MASK, attention_implementation
from longstride.parallel.attention import no_mask
from longstride.parallel.dense import expand_kv
from longstride.parallel.kernels import block_forward
from longstride.parallel.ring import merge

PREFILL_ATTENTION = "longstride_prefill"
DECODE_ATTENTION = "longstride_decode"


def _full_attention_only(name: str, dropout: float, kwargs: dict) -> None:
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{name} is full causal attention: no dropout, window, softcap or sinks")


def prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One unpadded prompt's new tokens attending to its cached ones and causally to each other, with no mask:
    query: (1, H, s, D), key/value: (1, Hkv, c + s, D), the first c cached -> ((1, s, H, D), None). The last
    layer computes the last token's row only (the others are zero): a prefill keeps the logits of its last
    token alone, and decoding reads the layer's keys and values, which are in the cache already. On CPU two
    CPU flash calls (`_prefill_cpu`); on other devices one SDPA call with a lower-right causal mask
    (`_prefill_lower_right`)."""
    _full_attention_only("prefill_attention", dropout, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    last = module.layer_idx == module.config.num_hidden_layers - 1
    run = _prefill_cpu if query.device.type == "cpu" else _prefill_lower_right
    if not last:
        return run(query, key, value, scale).transpose(1, 2).contiguous(), None
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[-1])
    out[:, -1:] = run(query[:, :, -1:], key, value, scale, causal=False).transpose(1, 2)
    return out, None


def _prefill_cpu(query, key, value, scale, causal=True):
    """(1, H, s, D) attending to the cache's first c keys densely and its last s causally: the two blocks are
    each one CPU flash call, merged by their log-sum-exp as ring attention merges its blocks."""
    if not causal:
        return block_forward("sdpa", query, key, value, scale)[0]
    s, c = query.shape[2], key.shape[2] - query.shape[2]
    out, lse = block_forward("sdpa", query, key[:, :, c:], value[:, :, c:], scale, [(0, s)])
    if c:
        out = out.float()
        merge(out, lse, *block_forward("sdpa", query, key[:, :, :c], value[:, :, :c], scale))
    return out.to(query.dtype)


def _prefill_lower_right(query, key, value, scale, causal=True):
    """The same in one SDPA call: query i of s attends to keys 0 .. c + i (torch's lower-right causal bias, which
    a GPU runs as the flash kernel, or the memory-efficient one, with no mask tensor; K/V heads repeated for the
    query heads that read them, as the flash path takes no grouped heads)."""
    groups = query.shape[1] // key.shape[1]
    key, value = expand_kv(key, groups), expand_kv(value, groups)
    mask = causal_lower_right(query.shape[2], key.shape[2]) if causal else None
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A decode step on CPU: query (B, H, q, D), the q new tokens (the last one and its draft), against the
    cache's key/value (B, Hkv, n, D), with transformers' boolean SDPA mask (B, 1, q, n) (left padding, draft holes,
    causality among the new tokens) or none (one new token, nothing masked) -> ((B, q, H, D), None). The g query
    heads that share a K/V head go into the query-length dimension, (B, Hkv, g*q, D), so SDPA reads each K/V
    head once with no GQA expansion (transformers' SDPA copies K/V per query head whenever there is a mask)."""
    _full_attention_only("decode_attention", dropout, kwargs)
    B, H, q, D = query.shape
    assert attention_mask is not None or q == 1, "several new tokens after a cache need a mask"
    g = H // key.shape[1]
    folded = query.reshape(B, H // g, g * q, D)  # heads kv*g .. kv*g+g-1 share K/V head kv (repeat_kv's order)
    if attention_mask is not None and g > 1:
        attention_mask = attention_mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(B, 1, g * q, -1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.view(B, H, q, D).transpose(1, 2).contiguous(), None


def cpu_kernels(device: torch.device) -> bool:
    """Whether decoding runs this module's CPU attention (`decode_attention`); elsewhere (a GPU) the model's own
    attention runs with transformers' masks."""
    return device.type == "cpu"


_ATTENTION = {PREFILL_ATTENTION: (prefill_attention, no_mask), DECODE_ATTENTION: (decode_attention, SDPA_MASK)}


def use_attention(model, name: Optional[str]):
    """The model runs attention `name` (with its mask function) inside the block; None: the model's own."""
    return attention_implementation(model, name, *_ATTENTION.get(name, (None, None)))
