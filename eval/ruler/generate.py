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

Prompt-lookup drafting (speculative decoding with the context as the draft model; Saxena 2023, HF's
`prompt_lookup_num_tokens`, vLLM's n-gram proposer): each step, a row whose last tokens (3, else 2, else 1) occurred earlier
in its prompt or answer proposes the up to `draft` tokens that followed them there; one forward runs the row's
last token and its draft, and the row keeps the draft's tokens up to the first one greedy decoding would not
have chosen, plus greedy's own next token. The kept tokens are the ones one-token-a-step decoding gives (the
verification is the same argmax), in fewer forwards: RULER answers copy from the prompt, and a model that has not
found the needle repeats itself. A row's rejected draft columns stay in the cache as holes that the attention
mask skips. On CPU the decode runs `decode_attention` (SDPA with GQA and the mask; transformers' SDPA copies
K/V per query head whenever there is a mask).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from longstride.eval.ruler.score import sample_score
from longstride.parallel.attention import no_mask
from longstride.parallel.kernels import block_forward
from longstride.parallel.ring import merge

PREFILL_ATTENTION = "longstride_prefill"
DECODE_ATTENTION = "longstride_decode"
DRAFT_NGRAM = 3  # the longest suffix looked up for a draft (then shorter ones, down to the last token)


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

    def keep(self, rows: list[int]) -> None:
        """Only these rows (ascending batch indices) from now on: each kept row moves down into the first free
        slot, in place (row j's source rows[j] >= j is never a slot written before it is read), and the buffers
        become views of the first len(rows) rows. Only the filled columns of the rows after the first dropped one
        are copied."""
        n = self.filled  # the columns after it are written before they are read
        for j, r in enumerate(rows):
            if r != j:
                self.buf_k[j, :, :n], self.buf_v[j, :, :n] = self.buf_k[r, :, :n], self.buf_v[r, :, :n]
        self.buf_k, self.buf_v = self.buf_k[:len(rows)], self.buf_v[:len(rows)]
        self.keys, self.values = self.buf_k[:, :, :self.filled], self.buf_v[:, :, :self.filled]


def _cache_kw(model) -> str:
    """The forward's name for the KV cache: `cache` in recent transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _full_attention_only(name: str, dropout: float, kwargs: dict) -> None:
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{name} is full causal attention: no dropout, window, softcap or sinks")


def prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One unpadded prompt's new tokens attending to its cached ones and causally to each other, with no mask:
    query: (1, H, s, D), key/value: (1, Hkv, c + s, D), the first c cached -> ((1, s, H, D), None). The last
    layer computes the last token's row only (the others are zero): a prefill keeps the logits of its last
    token alone, and decoding reads the layer's keys and values, which are in the cache already."""
    _full_attention_only("prefill_attention", dropout, kwargs)
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


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A decode step on CPU: query (B, H, q, D), the q new tokens (the last one and its draft), against the
    cache's key/value (B, Hkv, n, D), with transformers' boolean SDPA mask (B, 1, q, n) (left padding, draft holes,
    causality among the new tokens) or none (one new token, nothing masked) -> ((B, q, H, D), None). The g query
    heads that share a K/V head go into the query-length dimension, (B, Hkv, g*q, D), so SDPA reads each K/V
    head once with no GQA expansion (transformers' SDPA copies K/V per query head whenever there is a mask; SDPA's
    own enable_gqa path was 2x slower than this at 8K)."""
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
    """Whether prefill and decode run this module's CPU attention (`prefill_attention`, `decode_attention`);
    elsewhere (a GPU) the model's own attention runs with transformers' masks."""
    return device.type == "cpu"


_ATTENTION = {PREFILL_ATTENTION: (prefill_attention, no_mask), DECODE_ATTENTION: (decode_attention, sdpa_mask)}


@contextmanager
def _attention(model, name: Optional[str]):
    """The model runs attention `name` (with its mask function) inside the block; None: the model's own."""
    if name is None:
        yield
        return
    attention, mask = _ATTENTION[name]
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


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
    unmasked = cpu_kernels(device) and all(type(layer) is DynamicLayer for layer in cache.layers)
    with _attention(model, PREFILL_ATTENTION if unmasked else None):
        for s in range(start, len(ids), chunk):
            logits = model(input_ids=x[:, s:s + chunk], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
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
                    references: Optional[list[list[str]]] = None, metric: str = "all", draft: int = 0) -> list[str]:
    """Decoded greedy continuations of `prompts` (token id lists), in the given order. Rows decoded together:
    `batch_size`, or with 0 as many as keep rows x (longest prompt + max_new_tokens x (1 + draft)) within
    `batch_tokens` (the KV cache's tokens, draft holes included). With `references` (one list per prompt) a row
    stops as soon as its score under `metric` is decided: the same score, a shorter answer. `draft` > 0: each
    step also verifies up to that many prompt-lookup tokens per row (the same answers in fewer forwards)."""
    eos = stop_ids(model, tokenizer)
    device, kw = next(model.parameters()).device, _cache_kw(model)
    answers: list[str] = [""] * len(prompts)

    def prefill(i: int, cache: Optional[DynamicCache] = None) -> tuple[DynamicCache, int]:
        cache, logits = _prefill(model, prompts[i], prefill_chunk, device, kw, cache)
        return cache, int(logits.argmax())

    room = max_new_tokens * (1 + draft)  # answer columns: each step's rejected draft columns stay as holes
    for rows in batches([len(p) + room for p in prompts], batch_size, batch_tokens):
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
        cache, first = _batch_cache(model, one, len(rows), width + room, width), []
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
            mask = torch.zeros(len(rows), width + room, dtype=torch.long, device=device)
            for r, w in enumerate(widths):
                mask[r, width - w:width] = 1
        for i, text in _decode_rows(model, tokenizer, rows, widths, first, cache, mask, max_new_tokens, eos,
                                    references, metric, kw, prompts, draft).items():
            answers[i] = text
    return answers


class Drafts:
    """Prompt lookup: each row's context (prompt + answer so far) and, each step, the tokens that followed the
    latest earlier occurrence of its last n tokens (n from DRAFT_NGRAM down to 1). Per row in numpy: a step
    scans each row's context once for its last token (torch's per-op overhead on 8K-token rows cost more than
    a decode step)."""

    def __init__(self, prompts: list[list[int]], room: int):
        self.ctx = [np.concatenate([np.asarray(p, dtype=np.int64), np.zeros(room, dtype=np.int64)]) for p in prompts]
        self.end = [len(p) for p in prompts]

    def append(self, row: int, token: int) -> None:
        self.ctx[row][self.end[row]] = token
        self.end[row] += 1

    def keep(self, rows: list[int]) -> None:
        self.ctx, self.end = [self.ctx[r] for r in rows], [self.end[r] for r in rows]

    def _one(self, row: int, k: int) -> np.ndarray:
        a, end = self.ctx[row], self.end[row]
        at = np.flatnonzero(a[:end - 1] == a[end - 1])  # earlier occurrences of the last token
        if not len(at):
            return a[:0]
        for n in range(min(DRAFT_NGRAM, end - 1), 1, -1):  # the longest suffix that recurs
            ok = at >= n - 1
            for j in range(1, n):
                ok[ok] = a[at[ok] - j] == a[end - 1 - j]
            if ok.any():
                at = at[ok]
                break
        room = at[at + 1 + k <= end]  # the latest occurrence with k tokens after it, else the latest
        p = int(room[-1] if len(room) else at[-1]) + 1
        return a[p:min(p + k, end)]

    def propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts (rows, k), lengths (rows,)): up to k tokens per row, none where the last token is new."""
        out = torch.zeros(len(self.end), k, dtype=torch.long)
        length = torch.zeros(len(self.end), dtype=torch.long)
        for r in range(len(self.end)):
            d = self._one(r, k)
            out[r, :len(d)], length[r] = torch.from_numpy(d), len(d)
        return out, length


def _decode_rows(model, tokenizer, rows, widths, first, cache, mask, max_new_tokens, eos, references, metric,
                 kw, prompts=None, draft=0) -> dict[int, str]:
    """Greedy decoding of prefilled rows (prompt index, prompt length, first new token) sharing `cache`; a row
    leaves the batch at EOS, at `max_new_tokens`, or once `references` decide its score. With `prompts` (the
    token ids by prompt index) and `draft` > 0, and a BufferLayer cache with room for max_new_tokens x
    (1 + draft) columns, each step also verifies up to `draft` prompt-lookup tokens per row (module docstring)."""
    device = next(model.parameters()).device
    new = {i: [] for i in rows}
    out: dict[int, str] = {}
    drafts = None  # drafting needs the prompts and a buffer cache with room for the draft columns
    if draft and prompts is not None and all(isinstance(layer, BufferLayer) for layer in cache.layers):
        drafts = Drafts([prompts[i] for i in rows], max(max_new_tokens, 1))
        if mask is None:
            mask = torch.ones(len(rows), cache.layers[0].buf_k.shape[-2], dtype=torch.long, device=device)

    def add(r: int, i: int, t: int) -> bool:
        """Token t onto row r (prompt i); True when the row ends with it. The text is decoded every token only
        when references can end a row early."""
        new[i].append(t)
        if drafts is not None:
            drafts.append(r, t)
        ended = t in eos or len(new[i]) >= max_new_tokens
        text = _decode(tokenizer, new[i], eos) if ended or references is not None else None
        if ended or (references is not None and decided(text, references[i], metric)):
            out[i] = text
            return True
        return False

    live, pos = list(rows), torch.tensor(widths, device=device)
    token, filled = torch.tensor(first, device=device), max(widths)
    done = [r for r, (i, t) in enumerate(zip(rows, first)) if add(r, i, t)]
    full = all(type(layer) in (DynamicLayer, BufferLayer) for layer in cache.layers)
    with _attention(model, DECODE_ATTENTION if cpu_kernels(device) and full else None):
        while True:
            if len(done) == len(live):
                return out
            if done:
                rows_kept = [r for r in range(len(live)) if r not in done]
                keep = torch.tensor(rows_kept, device=device)
                live = [live[r] for r in rows_kept]
                pos, token = pos[keep], token[keep]
                mask = mask[keep] if mask is not None else None
                for layer in cache.layers:
                    layer.keep(rows_kept)
                if drafts is not None:
                    drafts.keep(rows_kept)
            k = 0
            if drafts is not None:  # no more draft columns than the rows could keep, nor than the buffer has room for
                left = max_new_tokens - min(len(new[i]) for i in live)
                k = min(draft, left - 1, cache.layers[0].buf_k.shape[-2] - filled - left)
            if k > 0:
                guess, length = drafts.propose(k)
                k = int(length.max())  # 0 when no row's last tokens recur
            ids = torch.cat([token[:, None], guess[:, :k].to(device)], 1) if k else token[:, None]
            step = {}
            if mask is not None:
                mask[:, filled:filled + 1 + k] = 1
                step["attention_mask"] = mask[:, :filled + 1 + k]
            logits = model(input_ids=ids, position_ids=pos[:, None] + torch.arange(1 + k, device=device),
                           use_cache=True, **step, **{kw: cache}).logits
            best = logits.argmax(-1).cpu()  # (rows, 1 + k): greedy's choice after each of the step's tokens
            kept = torch.zeros(len(live), dtype=torch.long)
            if k:
                agree = (guess[:, :k] == best[:, :k]) & (torch.arange(k) < length[:, None])
                kept = agree.long().cumprod(1).sum(1)  # the draft's tokens up to its first disagreement
            done = []
            for r, i in enumerate(live):
                a = int(kept[r])
                if any(add(r, i, t) for t in best[r, :a + 1].tolist()):  # draft tokens kept, then greedy's next
                    done.append(r)
                if a < k:  # (drafting always has a mask)
                    mask[r, filled + 1 + a:filled + 1 + k] = 0  # the rejected draft's columns: holes
            token = best[torch.arange(len(live)), kept].to(device)
            pos, filled = pos + 1 + kept.to(device), filled + 1 + k


@torch.no_grad()
def greedy_generate_cached(model, tokenizer, prompt: list[int], cache: DynamicCache, max_new_tokens: int,
                           prefill_chunk: int = 8192) -> str:
    """One prompt whose first tokens are already in `cache` (a context-parallel prefill): the rest of the
    prompt is prefilled into it and the answer decoded from it, as greedy_generate does one row."""
    device, kw = next(model.parameters()).device, _cache_kw(model)
    cache, logits = _prefill(model, prompt, prefill_chunk, device, kw, cache)
    return _decode_rows(model, tokenizer, [0], [len(prompt)], [int(logits.argmax())], cache, None, max_new_tokens,
                        stop_ids(model, tokenizer), None, "all", kw)[0]
