"""Greedy generation for RULER: each prompt prefilled alone from the cache of the prefix it shares with the
prompt before it, answers decoded together, a KV cache that never copies.

Prefix caching, always on. A batch's prompts are prefilled in lexicographic order of their token ids, each
starting from the KV cache of its longest common token prefix with the prompt before it (the most it shares
with any earlier one: the total prefilled is the token trie's size), so only the rest of it is run. RULER's
prompts share much: every niah_single_1 prompt of a length is the same noise haystack up to its needle.
Each prompt is run alone (no padding), `prefill_chunk` tokens per forward; on CPU its tokens attend to the
cached ones and causally to each other with no mask (`prefill_attention`: the dense block over the cache and
the causal block, each one CPU flash call, merged by their log-sum-exp as ring attention merges its blocks),
and the last layer computes only the last token's row, the one whose logits are kept. The cache and logits
are the full forward's to fp32 rounding (tests/test_ruler.py).

The prompt's KV cache is then copied into a batch buffer with room for the whole answer, the rows left-padded
to the longest prompt, and the rows are decoded one token per forward for all of them together
(transformers' DynamicCache concatenates: a copy of the whole cache per token and layer, most of a decode
step's time on CPU). A row leaves the batch at EOS, at its token budget, or, given references, once its
score is decided (`decided`). Answers are the generated token ids decoded, never the prompt stripped from
a decoded output.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface

from longstride.eval.ruler.score import sample_score
from longstride.parallel.attention import no_mask
from longstride.parallel.kernels import block_forward
from longstride.parallel.ring import merge

PREFILL_ATTENTION = "longstride_prefill"


def stop_ids(model, tokenizer) -> list[int]:
    """The token ids that end an answer: the model's and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _decode(tokenizer, new: list[int], eos: list[int]) -> str:
    cut = next((j for j, t in enumerate(new) if t in eos), len(new))
    return tokenizer.decode(new[:cut], skip_special_tokens=True)


def decided(text: str, references: list[str], metric: str) -> bool:
    """RULER's metrics are case-insensitive substring matches of the references in the answer: once every
    reference ("all") or one ("part") is in the text so far, nothing generated after it changes the score."""
    return sample_score(text, references, metric) == 1.0


def batches(widths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices of `widths` (each row's tokens: prompt + answer budget), sorted, cut into batches: `batch_size`
    rows each, or with batch_size 0 as many rows as keep rows x the widest within `batch_tokens` (at least one)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    if batch_size:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * widths[i] <= batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class BufferLayer(DynamicLayer):
    """A layer's KV cache in buffers sized once for prompt and answer: a new token is written in place and
    the layer hands attention a view of the columns filled so far."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
        super().__init__()
        self.buf_k, self.buf_v, self.filled = keys, values, filled
        self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, s = self.filled, key_states.shape[-2]
        if n + s > self.buf_k.shape[-2]:
            raise RuntimeError(f"KV buffer full: {n} + {s} tokens > {self.buf_k.shape[-2]} columns")
        self.buf_k[:, :, n:n + s] = key_states
        self.buf_v[:, :, n:n + s] = value_states
        self.filled = n + s
        self.keys, self.values = self.buf_k[:, :, :n + s], self.buf_v[:, :, :n + s]
        return self.keys, self.values

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows (batch indices) from now on."""
        self.buf_k, self.buf_v = self.buf_k[rows], self.buf_v[rows]
        self.keys, self.values = self.buf_k[:, :, :self.filled], self.buf_v[:, :, :self.filled]


def _cache_kw(model) -> str:
    """The forward's name for the KV cache: `cache` in recent transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One unpadded prompt's new tokens attending to its cached ones and causally to each other, with no mask:
    query: (1, H, s, D), key/value: (1, Hkv, c + s, D), the first c cached -> ((1, s, H, D), None). The last
    layer computes the last token's row only (the others are zero): a prefill keeps the logits of its last
    token alone, and decoding reads the layer's keys and values, which are in the cache already."""
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError("prefill_attention is full causal attention: no dropout, window, softcap or sinks")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s, c = query.shape[2], key.shape[2] - query.shape[2]
    if module.layer_idx == module.config.num_hidden_layers - 1:
        out = query.new_zeros(query.shape[0], s, query.shape[1], query.shape[-1])
        out[:, -1:] = block_forward("sdpa", query[:, :, -1:], key, value, scale)[0].transpose(1, 2)
        return out, None
    out, lse = block_forward("sdpa", query, key[:, :, c:], value[:, :, c:], scale, [(0, s)])
    if c:
        out = out.float()
        merge(out, lse, *block_forward("sdpa", query, key[:, :, :c], value[:, :, :c], scale))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _prefill(model, ids: list[int], chunk: int, device, kw: str,
             cache: Optional[DynamicCache] = None) -> tuple[DynamicCache, torch.Tensor]:
    """One prompt alone, `chunk` tokens per forward (a later chunk attends to the earlier ones): its KV cache
    and the logits of its last token. With `cache` holding the prompt's first tokens already (a shared prefix,
    or a context-parallel prefill), only the rest is run. On CPU, with full attention in every layer, the
    forward runs `prefill_attention` (no mask); elsewhere the model's own attention with its mask."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    start = cache.get_seq_length()
    if start >= len(ids):
        raise ValueError(f"nothing to prefill: a prompt of {len(ids)} tokens with {start} already cached")
    x = torch.tensor([ids], device=device)
    previous = model.config._attn_implementation
    unmasked = device.type == "cpu" and all(type(layer) is DynamicLayer for layer in cache.layers)
    if unmasked:
        AttentionInterface.register(PREFILL_ATTENTION, prefill_attention)
        AttentionMaskInterface.register(PREFILL_ATTENTION, no_mask)
        model.set_attn_implementation(PREFILL_ATTENTION)
    try:
        for s in range(start, len(ids), chunk):
            logits = model(input_ids=x[:, s:s + chunk], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    finally:
        if unmasked:
            model.set_attn_implementation(previous)
    return cache, logits[0, -1]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens b shares with a, at most len(b) - 1 (b's last token is run for its logits)."""
    n = min(len(a), len(b) - 1)
    return next((j for j in range(n) if a[j] != b[j]), n)


def _row_prefix(model, batch: DynamicCache, row: int, start: int, n: int) -> Optional[DynamicCache]:
    """The first `n` cached tokens of the batch cache's row `row` (its prompt starts at column `start`) as one
    prompt's own cache; None when n is 0."""
    if not n:
        return None
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(batch.layers):
        cache.update(layer.buf_k[row:row + 1, :, start:start + n], layer.buf_v[row:row + 1, :, start:start + n], i)
    return cache


def _batch_cache(model, like: DynamicCache, rows: int, columns: int, filled: int) -> DynamicCache:
    """An empty batch cache shaped like `like` (one prefilled row): `rows` rows of `columns` columns, the first
    `filled` of them the (left-padded) prompts."""
    cache = DynamicCache(config=model.config)
    cache.layers = [BufferLayer(layer.keys.new_zeros(rows, layer.keys.shape[1], columns, layer.keys.shape[-1]),
                                layer.values.new_zeros(rows, layer.values.shape[1], columns, layer.values.shape[-1]),
                                filled) for layer in like.layers]
    return cache


def _put_row(cache: DynamicCache, row: int, prefilled: DynamicCache, width: int) -> None:
    """One prompt's cache into row `row`, right-aligned at column `width` (left padding before it)."""
    for dst, src in zip(cache.layers, prefilled.layers):
        w = src.keys.shape[-2]
        dst.buf_k[row, :, width - w:width] = src.keys[0]
        dst.buf_v[row, :, width - w:width] = src.values[0]


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 0,
                    prefill_chunk: int = 8192, batch_tokens: int = 131072,
                    references: Optional[list[list[str]]] = None, metric: str = "all") -> list[str]:
    """Decoded greedy continuations of `prompts` (token id lists), in the given order. Rows decoded together:
    `batch_size`, or with 0 as many as keep rows x (longest prompt + max_new_tokens) within `batch_tokens`
    (the KV cache's tokens). With `references` (one list per prompt) a row stops as soon as its score under
    `metric` is decided: the same score, a shorter answer."""
    eos = stop_ids(model, tokenizer)
    device, kw = next(model.parameters()).device, _cache_kw(model)
    answers: list[str] = [""] * len(prompts)

    def prefill(i: int, cache: Optional[DynamicCache] = None) -> tuple[DynamicCache, int]:
        cache, logits = _prefill(model, prompts[i], prefill_chunk, device, kw, cache)
        return cache, int(logits.argmax())

    for rows in batches([len(p) + max_new_tokens for p in prompts], batch_size, batch_tokens):
        rows = sorted(rows, key=lambda i: prompts[i])  # lexicographic: the row before shares the longest prefix
        widths, width = [len(prompts[i]) for i in rows], max(len(prompts[i]) for i in rows)
        one, token = prefill(rows[0])
        if any(type(layer) is not DynamicLayer for layer in one.layers):
            # sliding-window or other special layers keep their own cache: those rows decode one at a time
            for r, i in enumerate(rows):
                c, t = (one, token) if r == 0 else prefill(i)
                answers[i] = _decode_rows(model, tokenizer, [i], [widths[r]], [t], c, None, max_new_tokens, eos,
                                          references, metric, kw)[i]
            continue
        # the batch's cache is made once; each prompt is copied in as soon as it is prefilled and dropped, and
        # the next prompt starts from the prefix it shares with it
        cache, first = _batch_cache(model, one, len(rows), width + max_new_tokens, width), []
        for r, i in enumerate(rows):
            if r:
                shared = shared_prefix(prompts[rows[r - 1]], prompts[i])
                c, t = prefill(i, _row_prefix(model, cache, r - 1, width - widths[r - 1], shared))
            else:
                c, t = one, token
            _put_row(cache, r, c, width)
            first.append(t)
        del one, c
        mask = None
        if min(widths) < width:  # left padding, masked out
            mask = torch.zeros(len(rows), width + max_new_tokens, dtype=torch.long, device=device)
            for r, w in enumerate(widths):
                mask[r, width - w:width] = 1
        for i, text in _decode_rows(model, tokenizer, rows, widths, first, cache, mask, max_new_tokens, eos,
                                    references, metric, kw).items():
            answers[i] = text
    return answers


def _decode_rows(model, tokenizer, rows, widths, first, cache, mask, max_new_tokens, eos, references, metric,
                 kw) -> dict[int, str]:
    """Greedy decoding of prefilled rows (prompt index, prompt length, first new token) sharing `cache`; a row
    leaves the batch at EOS, at `max_new_tokens`, or once `references` decide its score."""
    device = next(model.parameters()).device
    new = {i: [t] for i, t in zip(rows, first)}
    live, pos = list(rows), torch.tensor(widths, device=device)
    token, filled = torch.tensor(first, device=device), max(widths)
    out: dict[int, str] = {}
    while True:
        done = []
        for r, i in enumerate(live):  # the text is decoded every step only when references can end a row early
            ended = new[i][-1] in eos or len(new[i]) >= max_new_tokens
            text = _decode(tokenizer, new[i], eos) if ended or references is not None else None
            if ended or (references is not None and decided(text, references[i], metric)):
                out[i] = text
                done.append(r)
        if len(done) == len(live):
            return out
        if done:
            keep = torch.tensor([r for r in range(len(live)) if r not in done], device=device)
            live = [live[r] for r in keep.tolist()]
            pos, token = pos[keep], token[keep]
            mask = mask[keep] if mask is not None else None
            for layer in cache.layers:
                layer.keep(keep)
        step = {}
        if mask is not None:
            mask[:, filled] = 1
            step["attention_mask"] = mask[:, :filled + 1]
        logits = model(input_ids=token[:, None], position_ids=pos[:, None], use_cache=True, **step,
                       **{kw: cache}).logits
        token, pos, filled = logits[:, -1].argmax(-1), pos + 1, filled + 1
        for i, t in zip(live, token.tolist()):
            new[i].append(t)


@torch.no_grad()
def greedy_generate_cached(model, tokenizer, prompt: list[int], cache: DynamicCache, max_new_tokens: int,
                           prefill_chunk: int = 8192) -> str:
    """One prompt whose first tokens are already in `cache` (a context-parallel prefill): the rest of the
    prompt is prefilled into it and the answer decoded from it, as greedy_generate does one row."""
    device, kw = next(model.parameters()).device, _cache_kw(model)
    cache, logits = _prefill(model, prompt, prefill_chunk, device, kw, cache)
    return _decode_rows(model, tokenizer, [0], [len(prompt)], [int(logits.argmax())], cache, None, max_new_tokens,
                        stop_ids(model, tokenizer), None, "all", kw)[0]
