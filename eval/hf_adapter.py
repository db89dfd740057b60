"""Everything eval/ does inside transformers' internals, in one place: the KV cache's layers, the forward's
name for the cache, running a model under an attention implementation of ours for a while, and tokenizing
through the Rust tokenizer directly where that gives the call's own ids (`encode`).

RULER's generation (eval/ruler/generate.py) keeps a batch's KV cache in buffers sized once for prompt and
answer (`BufferLayer`, a DynamicLayer that writes in place instead of concatenating) and moves prompts'
caches into and out of them (`buffer_cache`, `put_row`, `row_prefix`, `keep_rows`); the context-parallel
prefill (eval/ruler/cp_prefill.py) and generation swap the model's attention for a block
(`attention_implementation`); a two-token probe of what attention calls refuse (`probe_refusal`); and which
prefill chunks transformers' length-dependent RoPE would rotate otherwise than one forward (`check_prefill_chunk`).
When transformers changes its cache, attention or tokenizer plumbing, this file is what changes.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_MASK = sdpa_mask  # transformers' boolean SDPA mask (B, 1, q, n), for an attention of ours that reads one


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


def cache_kw(model) -> str:
    """The forward's name for the KV cache: `cache` in recent transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model, full: bool = False) -> DynamicCache:
    """An empty KV cache for `model` (its layers made as the forward fills them): the kinds of layer its config
    asks for (a sliding-window layer keeps only its window's last tokens), or with `full` a plain growing layer for
    every layer (every token kept, the masks applying the windows: what a batch of left-padded rows needs)."""
    return DynamicCache() if full else DynamicCache(config=model.config)


def plain_layers(cache: DynamicCache) -> bool:
    """Whether every layer is transformers' plain growing layer (full attention: no sliding window or other
    special layer that keeps its own cache)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def full_attention_layers(cache: DynamicCache) -> bool:
    """Whether every layer holds all of its tokens' keys and values: a plain layer or a BufferLayer."""
    return all(type(layer) in (DynamicLayer, BufferLayer) for layer in cache.layers)


def buffered(cache: DynamicCache) -> bool:
    """Whether every layer is a BufferLayer (`buffer_cache`'s)."""
    return all(isinstance(layer, BufferLayer) for layer in cache.layers)


def buffer_columns(cache: DynamicCache) -> int:
    """A BufferLayer cache's columns, filled or not."""
    return cache.layers[0].buf_k.shape[-2]


def buffer_cache(model, like: DynamicCache, rows: int, columns: int, filled: int) -> DynamicCache:
    """An empty batch cache shaped like `like` (one prefilled row): `rows` rows of `columns` columns, the first
    `filled` of them the (left-padded) prompts."""
    cache = new_cache(model)
    cache.layers = [BufferLayer(layer.keys.new_zeros(rows, layer.keys.shape[1], columns, layer.keys.shape[-1]),
                                layer.values.new_zeros(rows, layer.values.shape[1], columns, layer.values.shape[-1]),
                                filled) for layer in like.layers]
    return cache


def put_row(cache: DynamicCache, row: int, prefilled: DynamicCache, width: int) -> None:
    """One prompt's cache into row `row` of a BufferLayer cache, right-aligned at column `width` (left padding
    before it)."""
    for dst, src in zip(cache.layers, prefilled.layers):
        w = src.keys.shape[-2]
        dst.buf_k[row, :, width - w:width] = src.keys[0]
        dst.buf_v[row, :, width - w:width] = src.values[0]


def row_prefix(model, batch: DynamicCache, row: int, start: int, n: int) -> Optional[DynamicCache]:
    """The first `n` cached tokens of a BufferLayer cache's row `row` (its prompt starts at column `start`) as
    one prompt's own cache (plain layers, every token kept: a sliding-window model's batch keeps them too);
    None when n is 0."""
    if not n:
        return None
    cache = new_cache(model, full=True)
    for i, layer in enumerate(batch.layers):
        cache.update(layer.buf_k[row:row + 1, :, start:start + n], layer.buf_v[row:row + 1, :, start:start + n], i)
    return cache


def keep_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Only these rows (ascending) of a BufferLayer cache from now on (BufferLayer.keep)."""
    for layer in cache.layers:
        layer.keep(rows)


@contextmanager
def attention_implementation(model, name: Optional[str], attention: Optional[Callable] = None,
                             mask: Optional[Callable] = None):
    """The model runs `attention` (registered as `name`, with the mask function `mask`) inside the block, and
    its previous implementation again after it; name None: the model's own, untouched."""
    if name is None:
        yield
        return
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer(text)["input_ids"]`, through the Rust tokenizer's path without character offsets where the
    tokenizer is transformers' plain TokenizersBackend (no subclass encoding its own way) and the call would not
    change its Rust tokenizer (no truncation, padding or special-token splitting set): the same ids in about half
    the time, which the search's full tokenizations of 64K-128K-token prompts spend."""
    from transformers import TokenizersBackend
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    backend = getattr(tokenizer, "backend_tokenizer", None)
    own_call = (isinstance(tokenizer, TokenizersBackend)  # a subclass that encodes its own way takes its call
                and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
                and type(tokenizer).__call__ is PreTrainedTokenizerBase.__call__)
    if (own_call and hasattr(backend, "encode_batch_fast") and backend.truncation is None
            and backend.padding is None and not getattr(tokenizer, "split_special_tokens", False)
            and not getattr(backend, "encode_special_tokens", False)):
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


@torch.no_grad()
def probe_refusal(forward, device) -> Optional[str]:
    """The message an attention call refuses a two-token forward with (`forward(ids)`, its NotImplementedError), or
    None where it runs: what a layer's call asks for and no config shows (a position bias, sparse indices), found
    before any real input."""
    try:
        forward(torch.zeros(1, 2, dtype=torch.long, device=device))
    except NotImplementedError as e:
        return str(e)
    return None


def check_prefill_chunk(config, chunk: int, longest: int) -> None:
    """Refuses a prefill_chunk under which a chunked prefill would rotate keys otherwise than one forward over the
    prompt: longrope takes its long factors only in forwards that reach past its window (so chunks must too, once
    prompts do); dynamic NTK rescales by each forward's length and keeps the scale, which prefix caching across
    prompts cannot reproduce: refused past its window."""
    from longstride.model.rope import length_dependent

    for key, kind, window in length_dependent(config):
        where = f"rope_type={kind}" + (f" ({key} layers)" if key else "")
        if kind == "longrope" and longest > window >= chunk:
            raise ValueError(f"prefill_chunk={chunk}: the model's {where} picks its frequencies from each forward's "
                             f"largest position, long past {window} positions, and prompts of up to {longest} tokens "
                             f"would be prefilled in pieces that do not reach it; set prefill_chunk > {window}")
        if kind == "dynamic" and longest > window:
            raise ValueError(f"lengths up to {longest}: the model's {where} rescales its frequencies by each forward's "
                             f"length past {window} positions (and transformers keeps the scale for later forwards), "
                             "while RULER's prompts are prefilled from keys cached by other prompts' forwards, so "
                             f"scores would depend on the order of work; give lengths up to {window}, or measure it "
                             "with eval ppl (one forward per document and length)")
