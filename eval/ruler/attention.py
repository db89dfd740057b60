"""The attention RULER's generation runs in place of the model's own (eval/ruler/generate.py): `prefill_attention`,
a prompt's new tokens against its cached ones with no mask tensor, and `decode_attention`, a CPU decode step with
GQA folded into SDPA's query length.

The prefill computes every layer longstride's training attention computes (parallel/pattern.py): plain causal layers
as one lower-right causal block (two CPU flash calls on CPU, one SDPA call elsewhere); sliding windows, chunks
(Llama 4: placed by the positions the mask call gives, `prefill_mask`), soft-capped scores (Gemma 2) and sinks
(GPT-OSS) through the block kernels in query tiles against the keys each tile sees (parallel/dense.py), or the flash
kernels in bf16/fp16 on CUDA: memory grows with the prompt, not with prefill_chunk x prompt as the model's eager
attention's scores (or SDPA's mask) do. `prefill_computes` says where it runs; generate.py runs the model's own
attention elsewhere. The decode computes the scores (soft-capped and sinks too) under transformers' SDPA mask, which
carries a sliding layer's window, on CPU where the cache keeps every token (hf_adapter.full_attention_layers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from longstride.eval.hf_adapter import SDPA_MASK, attention_implementation, cache_kw, new_cache, probe_refusal
from longstride.eval.ruler.notes import note
from longstride.model.loss import text_decoder
from longstride.parallel.attention import MaskNote, no_mask, refuse_call, unsupported_attention
from longstride.parallel.dense import DENSE, expand_kv
from longstride.parallel.kernels import block_forward, resolve_kernel
from longstride.parallel.pattern import ABSENT, Pattern, fold_sinks, layer_pattern
from longstride.parallel.ring import merge
from longstride.parallel.varlen import VARLEN, VarlenCall, as_block

PREFILL_ATTENTION = "longstride_prefill"
DECODE_ATTENTION = "longstride_decode"


def prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One unpadded prompt's new tokens attending to its cached ones and causally to each other, with no mask:
    query: (1, H, s, D), key/value: (1, Hkv, c + s, D), the first c cached -> ((1, s, H, D), None). The last
    layer computes the last token's row only (the others are zero): a prefill keeps the logits of its last
    token alone, and decoding reads the layer's keys and values, which are in the cache already. A plain causal
    layer runs `_prefill_cpu` on CPU, `_prefill_lower_right` elsewhere; a window, soft-cap or sinks
    `_prefill_pattern`; a chunked layer `_prefill_chunks`."""
    if dropout:
        raise NotImplementedError("prefill_attention computes no attention dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pattern, sinks = prefill_pattern(module, attention_mask, query, key, kwargs)
    last = module.layer_idx == module.config.num_hidden_layers - 1
    q = query[:, :, -1:] if last else query
    if pattern.chunk:
        offset = query.shape[2] - q.shape[2]  # the last row alone: its queries start that much later
        out = _prefill_chunks(q, key, value, scale, pattern, sinks, attention_mask.q_offset + offset,
                              attention_mask.kv_offset)
    elif pattern != Pattern() or sinks is not None:
        out = _prefill_pattern(q, key, value, scale, pattern, sinks)
    else:
        out = (_prefill_cpu if query.device.type == "cpu" else _prefill_lower_right)(q, key, value, scale, not last)
    if not last:
        return out.transpose(1, 2).contiguous(), None
    full = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[-1])
    full[:, -1:] = out.transpose(1, 2)
    return full, None


def prefill_pattern(module, mask, query, key, kwargs: dict) -> tuple[Pattern, Optional[torch.Tensor]]:
    """(the layer's Pattern over the call's keys, its sinks or None) as the model's own attention computes them: the
    window its mask holds (eager and SDPA read the mask, built from config.sliding_window and config.layer_types,
    not the call's sliding_window), the call's soft-cap and sinks (s_aux); a chunked layer's chunk (Llama 4), which
    `prefill_mask`'s positions place. A mask holding padding or more than a causal window, and what longstride's
    training attention refuses (bidirectional attention, a position bias, sparse indices) are refused
    (prefill_computes keeps such models on their own attention)."""
    where = refuse_call(module, query, kwargs, "prefill_attention")
    chunk = layer_pattern(module, kwargs.get("sliding_window", ABSENT)).chunk
    if chunk and not isinstance(mask, PrefillNote):
        raise NotImplementedError(f"{where} is a chunked attention layer, whose chunks count from positions its "
                                  "mask call did not give (prefill_mask's)")
    note = MaskNote() if mask is None else mask
    if not isinstance(note, MaskNote) or note.padding or note.beyond_causal:
        raise NotImplementedError(f"{where}: prefill_attention computes one unpadded prompt with a causal mask "
                                  f"(sliding or not), and this call's mask holds more: {note}")
    sinks = kwargs.get("s_aux")
    softcap = float(kwargs.get("softcap") or 0) or None
    if chunk:  # the mask's local size is the chunk: counted from positions, not cut by the keys' count
        return Pattern(None, chunk, softcap), sinks
    return Pattern(note.local, None, softcap).within(key.shape[2]), sinks


def prefill_kernel(query: torch.Tensor, softcap: Optional[float]) -> str:
    """The kernel `_prefill_pattern` runs: the one a training stage's parallel.kernel=auto picks for this device,
    dtype and head size (on CPU the CPU flash op, or math for soft-capped scores; on CUDA torch_flash in
    bf16/fp16, flash_attn for soft-capped scores where installed), math where that pick is SDPA off CPU (the
    block kernels' sdpa is the CPU op)."""
    device = query.device.type
    kernel = resolve_kernel("auto", device, half=query.dtype in (torch.float16, torch.bfloat16),
                            head_dim=query.shape[-1], softcap=bool(softcap))
    return "math" if kernel == "sdpa" and device != "cpu" else kernel


def _prefill_pattern(query, key, value, scale, pattern: Pattern, sinks):
    """(1, H, s, D) queries, the suffix of (1, Hkv, c + s, D) keys, through a window (pattern.window, or all the
    keys), with the pattern's soft-cap and the sinks."""
    if pattern.window:  # the keys some query's window reaches (a full cache holds them all): what a varlen call copies
        key, value = (x[:, :, -(pattern.window - 1 + query.shape[2]):] for x in (key, value))
    return fold_sinks(*_suffix(query, key, value, scale, pattern.window or key.shape[2], pattern.softcap), sinks)[0]


def _prefill_chunks(query, key, value, scale, pattern: Pattern, sinks, q_first: int, k_first: int):
    """A chunked layer: queries at positions q_first.., keys at k_first.. (what the model's sliding cache kept of
    the chunk so far, then the new tokens); each run of queries in one chunk of pattern.chunk positions (counted
    from 0, as transformers' chunked mask for one unpadded row) attends causally to its chunk's keys, the suffix of
    which it is."""
    size, s = pattern.chunk, query.shape[2]
    outs, lses, a = [], [], q_first
    while a < q_first + s:
        start = a // size * size
        b = min(q_first + s, start + size)
        ks, ke = max(k_first, start) - k_first, b - k_first
        o, l = _suffix(query[:, :, a - q_first:b - q_first], key[:, :, ks:ke], value[:, :, ks:ke], scale, ke - ks,
                       pattern.softcap)
        outs.append(o)
        lses.append(l)
        a = b
    out, lse = (torch.cat(x, dim=2) if len(x) > 1 else x[0] for x in (outs, lses))
    return fold_sinks(out, lse, sinks)[0]


def _suffix(query, key, value, scale, window: int, softcap):
    """(out, lse) of (1, H, s, D) queries, the suffix of (1, Hkv, n, D) keys, each seeing the `window` keys up to
    itself: a dense kernel in query tiles on (B, H, L, D) views, no copy of the keys; a varlen kernel (CUDA flash)
    as one varlen piece, on a (tokens, heads, D) copy of them (the cache is laid out (B, H, L, D))."""
    kernel = prefill_kernel(query, softcap)
    if kernel in DENSE:
        return DENSE[kernel][0](query, key, value, scale, True, window, softcap)
    out, lse = VarlenCall.of_ranges([(0, query.shape[2])], [(0, key.shape[2])], window).forward(
        VARLEN[kernel], query, key, value, scale, softcap)
    return as_block(out, slice(None)), lse.unsqueeze(0)


@dataclass(frozen=True)
class PrefillNote(MaskNote):
    """A windowed or chunked layer's MaskNote with the positions of the call's first query and first key."""
    q_offset: int = 0
    kv_offset: int = 0


def prefill_mask(*args, q_offset=0, kv_offset=0, local_size=None, **kwargs):
    """prefill_attention's mask function: no_mask's note, and for a layer with a local size (a window or a chunk)
    the positions its chunks count from (transformers' q_offset / kv_offset); None for a plain causal layer."""
    note = no_mask(*args, local_size=local_size, q_offset=q_offset, kv_offset=kv_offset, **kwargs)
    if not local_size or note is None:
        return note
    return PrefillNote(note.padding, note.beyond_causal, note.local, note.rule, int(q_offset), int(kv_offset))


_COMPUTES: WeakKeyDictionary = WeakKeyDictionary()  # model -> prefill_computes' answer, found once


def prefill_computes(model) -> bool:
    """Whether `prefill_attention` computes every layer of `model`'s text decoder (a vision-language model's vision
    tower, bidirectional and never run on RULER's text, aside: Gemma 3 4B and up load as one): what longstride's
    training attention computes (parallel/attention.unsupported_attention: full, sliding-window and chunked layers,
    soft-capped scores, sinks); and what the layers' calls ask for, which no config shows (a position bias, sparse
    indices), found by a two-token forward on a cache of its own (`_probe`) before any prompt's."""
    if model not in _COMPUTES:
        _COMPUTES[model] = not unsupported_attention(text_decoder(model)) and _probe(model)
    return _COMPUTES[model]


def _probe(model) -> bool:
    """A two-token prefill under prefill_attention; False (with a note) where a layer's call refuses there."""
    def prefill(ids):
        with use_attention(model, PREFILL_ATTENTION):
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw(model): new_cache(model)})

    refused = probe_refusal(prefill, next(model.parameters()).device)
    if refused:
        note(f"note: {type(model).__name__} generates on its own attention: {refused}", who="eval")
    return not refused


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
    causality among the new tokens, a sliding layer's window) or none (one new token, nothing masked: transformers
    skips the mask only where the window reaches every key) -> ((B, q, H, D), None). The g query
    heads that share a K/V head go into the query-length dimension, (B, Hkv, g*q, D), so SDPA reads each K/V
    head once with no GQA expansion (transformers' SDPA copies K/V per query head whenever there is a mask).
    Soft-capped scores (Gemma 2) and sinks (GPT-OSS) run the same folded heads through explicit scores
    (`_decode_scores`): a few queries' rows, not a prompt's."""
    if dropout:
        raise NotImplementedError("decode_attention computes no attention dropout")
    B, H, q, D = query.shape
    if attention_mask is None and q > 1:  # transformers' contract, not ours: checked under python -O too
        raise RuntimeError(f"{q} new tokens after a cache came without an attention mask; this transformers "
                           "release calls attention otherwise than decode_attention expects")
    g = H // key.shape[1]
    folded = query.reshape(B, H // g, g * q, D)  # heads kv*g .. kv*g+g-1 share K/V head kv (repeat_kv's order)
    if attention_mask is not None and g > 1:
        attention_mask = attention_mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(B, 1, g * q, -1)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap or sinks is not None:
        out = _decode_scores(folded, key, value, attention_mask, scaling, softcap, sinks, q)
    else:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.view(B, H, q, D).transpose(1, 2).contiguous(), None


def _decode_scores(folded, key, value, mask, scale, softcap, sinks, q: int):
    """decode_attention's folded heads (B, Hkv, g*q, D) with Gemma 2's soft-cap applied to the scores before the
    mask, and GPT-OSS's sinks (H,) joining each query head's softmax with a zero value, as the models' eager
    attention computes them, in fp32."""
    scale = scale if scale is not None else folded.shape[-1] ** -0.5
    s = torch.matmul(folded.float(), key.float().transpose(-1, -2)).mul_(scale)
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.matmul(s.sub_(lse).exp_(), value.float())
    if sinks is not None:  # folded row j * q + t is query head kv * g + j's token t: (B, H, q) in head order
        B, Hkv, gq, D = out.shape
        out = fold_sinks(out.view(B, -1, q, D), lse.view(B, -1, q), sinks)[0].view(B, Hkv, gq, D)
    return out.to(folded.dtype)


def cpu_kernels(device: torch.device) -> bool:
    """Whether decoding runs this module's CPU attention (`decode_attention`); elsewhere (a GPU) the model's own
    attention runs with transformers' masks."""
    return device.type == "cpu"


_ATTENTION = {PREFILL_ATTENTION: (prefill_attention, prefill_mask),
              DECODE_ATTENTION: (decode_attention, SDPA_MASK)}


def use_attention(model, name: Optional[str]):
    """The model runs attention `name` (with its mask function) inside the block; None: the model's own."""
    return attention_implementation(model, name, *_ATTENTION.get(name, (None, None)))
