"""Greedy generation for RULER: each prompt prefilled alone from the cache of the prefix it shares with the
prompt before it, answers decoded together, a KV cache that never copies.

Prefix caching, always on. A batch's prompts are prefilled in lexicographic order of their token ids, each
starting from the KV cache of its longest common token prefix with the prompt before it (the most it shares
with any earlier one: the total prefilled is the token trie's size), so only the rest of it is run. RULER's
prompts share much: every niah_single_1 prompt of a length is the same noise haystack up to its needle.
Each prompt is run alone (no padding), `prefill_chunk` tokens per forward; its tokens attend to the cached
ones and causally to each other with no mask tensor (eval/ruler/attention.py `prefill_attention`: on CPU the
dense block over the cache and the causal block, each one CPU flash call, merged by their log-sum-exp as ring
attention merges its blocks; on a GPU one SDPA call with torch's lower-right causal bias: the flash kernel in
bf16/fp16, the memory-efficient one in fp32; windowed, soft-capped and sink layers through the block kernels in
query tiles), and the last layer computes only the last token's row, the one whose logits are kept. The cache
and logits are the full forward's to fp32 rounding (tests/test_ruler.py, tests/test_prefill_patterns.py).

The prompt's KV cache is then copied into a batch buffer with room for the whole answer, the rows left-padded
to the longest prompt (a sliding-window model's batch keeps every token in every layer, its masks applying the
windows), and the rows are decoded one token per forward for all of them together
(transformers' DynamicCache concatenates: a copy of the whole cache per token and layer). A row leaves the
batch at EOS, at its token budget, or, given references, once its score is decided (`decided`). Answers are
the generated token ids decoded, never the prompt stripped from a decoded output.

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

from dataclasses import dataclass, replace
from typing import Optional
from weakref import WeakSet

import numpy as np
import torch

from longstride.eval.hf_adapter import (DynamicCache, buffer_cache, buffer_columns, buffered, cache_kw,
                                        check_prefill_chunk, full_attention_layers, keep_rows, new_cache, plain_layers,
                                        put_row, row_prefix)
from longstride.eval.ruler.attention import (DECODE_ATTENTION, PREFILL_ATTENTION, cpu_kernels, prefill_computes,
                                             use_attention)
from longstride.eval.ruler.notes import note
from longstride.eval.ruler.score import sample_score
from longstride.parallel.pattern import layer_types

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


def _prefill(model, ids: list[int], chunk: int, device, kw: str,
             cache: Optional[DynamicCache] = None) -> tuple[DynamicCache, torch.Tensor]:
    """One prompt alone, `chunk` tokens per forward (a later chunk attends to the earlier ones): its KV cache
    and the logits of its last token. With `cache` holding the prompt's first tokens already (a shared prefix,
    or a context-parallel prefill), only the rest is run. Where `prefill_computes` (full, sliding-window and chunked
    layers, soft-capped scores, sinks) the forward runs `prefill_attention` (no mask tensor); elsewhere the model's
    own attention with its mask."""
    cache = cache if cache is not None else new_cache(model)
    start = cache.get_seq_length()
    if start >= len(ids):
        raise ValueError(f"nothing to prefill: a prompt of {len(ids)} tokens with {start} already cached")
    x = torch.tensor([ids], device=device)
    with use_attention(model, PREFILL_ATTENTION if prefill_computes(model) else None):
        for s in range(start, len(ids), chunk):
            logits = model(input_ids=x[:, s:s + chunk], use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    return cache, logits[0, -1]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens b shares with a, at most len(b) - 1 (b's last token is run for its logits)."""
    n = min(len(a), len(b) - 1)
    return next((j for j in range(n) if a[j] != b[j]), n)


@dataclass
class Generation:
    """What greedy generation needs besides the batch at hand: greedy_generate's arguments, resolved."""
    model: torch.nn.Module
    tokenizer: object
    prompts: list[list[int]]  # token ids by prompt index
    max_new_tokens: int
    eos: list[int]  # stop_ids
    device: torch.device
    kw: str  # the forward's name for the KV cache (hf_adapter.cache_kw)
    prefill_chunk: int = 8192
    references: Optional[list[list[str]]] = None  # by prompt index: a row ends once its score is decided
    metric: str = "all"
    draft: int = 0  # prompt-lookup tokens verified per decode step (with a BufferLayer cache)
    full: bool = False  # every layer's cache keeps every token (hf_adapter.new_cache(full=True)): batched windows

    @classmethod
    def of(cls, model, tokenizer, prompts: list[list[int]], max_new_tokens: int, **settings) -> Generation:
        check_prefill_chunk(model.config, settings.get("prefill_chunk", cls.prefill_chunk),
                            max(map(len, prompts), default=0))
        return cls(model, tokenizer, prompts, max_new_tokens=max_new_tokens, eos=stop_ids(model, tokenizer),
                   device=next(model.parameters()).device, kw=cache_kw(model), **settings)

    def prefill(self, i: int, cache: Optional[DynamicCache] = None) -> tuple[DynamicCache, int]:
        """Prompt i prefilled (from `cache`, its first tokens, when given): its cache and first new token."""
        cache = cache if cache is not None else new_cache(self.model, self.full)
        cache, logits = _prefill(self.model, self.prompts[i], self.prefill_chunk, self.device, self.kw, cache)
        return cache, int(logits.argmax())


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 0,
                    prefill_chunk: int = 8192, batch_tokens: int = 131072,
                    references: Optional[list[list[str]]] = None, metric: str = "all", draft: int = 0) -> list[str]:
    """Decoded greedy continuations of `prompts` (token id lists), in the given order. Rows decoded together:
    `batch_size`, or with 0 as many as keep rows x (longest prompt + max_new_tokens x (1 + draft)) within
    `batch_tokens` (the KV cache's tokens, draft holes included). With `references` (one list per prompt) a row
    stops as soon as its score under `metric` is decided: the same score, a shorter answer. `draft` > 0: each
    step also verifies up to that many prompt-lookup tokens per row (the same answers in fewer forwards); a model
    with sliding-window layers decodes without drafts (a rejected draft's columns would shift its windows)."""
    draft = 0 if windowed(model) else draft
    g = Generation.of(model, tokenizer, prompts, max_new_tokens, prefill_chunk=prefill_chunk, references=references,
                      metric=metric, draft=draft)
    answers: list[str] = [""] * len(prompts)
    room = max_new_tokens * (1 + draft)  # answer columns: each step's rejected draft columns stay as holes
    for rows in prefill_batches(prompts, room, batch_size, batch_tokens):
        for i, text in _generate_batch(g, rows, room).items():
            answers[i] = text
    return answers


def prefill_batches(prompts: list[list[int]], room: int, batch_size: int, batch_tokens: int) -> list[list[int]]:
    """greedy_generate's batches (`batches` of prompt + `room` answer columns), each in the order its prompts are
    prefilled: lexicographic, so the prompt before shares the longest prefix (`shared_prefix`)."""
    return [sorted(rows, key=lambda i: prompts[i])
            for rows in batches([len(p) + room for p in prompts], batch_size, batch_tokens)]


_NOTED: WeakSet = WeakSet()  # models whose batched windows the run has been told about


def chunked(model) -> bool:
    """Whether the model has chunked layers (Llama 4), whose chunks count positions: left padding moves them off a
    batch's cache columns, over which transformers' masks count."""
    return "chunked_attention" in layer_types(model.config.get_text_config(decoder=True))


def windowed(model) -> bool:
    """Whether the model's own cache keeps special layers (transformers' sliding-window layers, which keep only
    their window's last tokens; chunked or other layers)."""
    return not plain_layers(new_cache(model))


def _generate_batch(g: Generation, rows: list[int], room: int) -> dict[int, str]:
    """One batch's answers by prompt index: its prompts prefilled one by one (in `rows`' order, each from the
    prefix it shares with the one before), then decoded together with `room` answer columns per row. A batch of
    several rows of a sliding-window model keeps every token in every layer (the masks apply the windows, as they
    do over left padding); a lone row, a chunked model (`chunked`) or one prefill_attention does not compute keeps
    the model's own cache and runs alone (`_one_at_a_time`)."""
    widths = [len(g.prompts[i]) for i in rows]
    if len(rows) > 1 and windowed(g.model) and prefill_computes(g.model) and not chunked(g.model):
        g = replace(g, full=True)
        if g.model not in _NOTED:
            _NOTED.add(g.model)
            note(f"note: {type(g.model).__name__} has sliding-window layers; a batch of several prompts keeps "
                 "every token in every layer, as a full-attention model's does (rows x columns within batch_tokens); "
                 "lower batch_tokens, or batch_size=1 (one prompt at a time on the model's sliding caches), where "
                 "memory is short", who="eval")
    one, token = g.prefill(rows[0])
    if not plain_layers(one):
        return _one_at_a_time(g, rows, one, token)
    cache, first = _prefilled_batch(g, rows, one, token, room)
    del one  # in the batch cache now
    return _decode_rows(g, rows, widths, first, cache, _padding_mask(widths, room, g.device))


def _one_at_a_time(g: Generation, rows: list[int], one: DynamicCache, token: int) -> dict[int, str]:
    """A lone row of a sliding-window model, or any row of a model with chunked or other special layers, on the
    model's own cache (a sliding layer keeping only its window): prefilled and decoded one at a time, without
    drafts (the first, `rows[0]`, is prefilled already: `one`, `token`)."""
    alone, out = replace(g, draft=0), {}
    for r, i in enumerate(rows):
        cache, t = (one, token) if r == 0 else g.prefill(i)
        out.update(_decode_rows(alone, [i], [len(g.prompts[i])], [t], cache, None))
    return out


def _prefilled_batch(g: Generation, rows: list[int], one: DynamicCache, token: int,
                     room: int) -> tuple[DynamicCache, list[int]]:
    """The batch's cache, made once, with every prompt left-padded into its row, and each row's first new
    token. Each prompt is copied in as soon as it is prefilled and dropped, and the next prompt starts from
    the prefix it shares with it (the first, `rows[0]`, is prefilled already: `one`, `token`)."""
    widths = [len(g.prompts[i]) for i in rows]
    width = max(widths)
    cache, first = buffer_cache(g.model, one, len(rows), width + room, width), []
    for r, i in enumerate(rows):
        if r:
            shared = shared_prefix(g.prompts[rows[r - 1]], g.prompts[i])
            c, t = g.prefill(i, row_prefix(g.model, cache, r - 1, width - widths[r - 1], shared))
        else:
            c, t = one, token
        put_row(cache, r, c, width)
        first.append(t)
    return cache, first


def _padding_mask(widths: list[int], room: int, device) -> Optional[torch.Tensor]:
    """The batch's attention mask (rows, longest prompt + room): 1 on each prompt's columns, 0 on its left
    padding and on the answer columns (set as they fill); None when no row is padded."""
    width = max(widths)
    if min(widths) == width:
        return None
    mask = torch.zeros(len(widths), width + room, dtype=torch.long, device=device)
    for r, w in enumerate(widths):
        mask[r, width - w:width] = 1
    return mask


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

class _Decoding:
    """The rows of one batch being decoded together: each row's prompt index (`live`), answer tokens so far,
    position and next token, the cache columns filled, the attention mask over them, and its drafts."""

    def __init__(self, g: Generation, rows: list[int], widths: list[int], first: list[int], cache: DynamicCache,
                 mask: Optional[torch.Tensor]):
        self.g, self.cache, self.mask = g, cache, mask
        self.new: dict[int, list[int]] = {i: [] for i in rows}
        self.out: dict[int, str] = {}
        self.drafts = None  # drafting needs a buffer cache with room for the draft columns
        if g.draft and buffered(cache):
            self.drafts = Drafts([g.prompts[i] for i in rows], max(g.max_new_tokens, 1))
            if mask is None:
                self.mask = torch.ones(len(rows), buffer_columns(cache), dtype=torch.long, device=g.device)
        self.live, self.pos = list(rows), torch.tensor(widths, device=g.device)
        self.token, self.filled = torch.tensor(first, device=g.device), max(widths)

    def add(self, r: int, i: int, t: int) -> bool:
        """Token t onto row r (prompt i); True when the row ends with it. The text is decoded every token only
        when references can end a row early."""
        g = self.g
        self.new[i].append(t)
        if self.drafts is not None:
            self.drafts.append(r, t)
        ended = t in g.eos or len(self.new[i]) >= g.max_new_tokens
        text = _decode(g.tokenizer, self.new[i], g.eos) if ended or g.references is not None else None
        if ended or (g.references is not None and decided(text, g.references[i], g.metric)):
            self.out[i] = text
            return True
        return False

    def drop(self, done: list[int]) -> None:
        """The rows at positions `done` leave the batch (their answers are in `out`)."""
        rows_kept = [r for r in range(len(self.live)) if r not in done]
        keep = torch.tensor(rows_kept, device=self.g.device)
        self.live = [self.live[r] for r in rows_kept]
        self.pos, self.token = self.pos[keep], self.token[keep]
        self.mask = self.mask[keep] if self.mask is not None else None
        keep_rows(self.cache, rows_kept)
        if self.drafts is not None:
            self.drafts.keep(rows_kept)

    def propose(self) -> tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """This step's draft width k and the drafts (rows, >= k) with their lengths (rows,); k 0: no draft."""
        if self.drafts is None:
            return 0, None, None
        # no more draft columns than the rows could keep, nor than the buffer has room for
        left = self.g.max_new_tokens - min(len(self.new[i]) for i in self.live)
        k = min(self.g.draft, left - 1, buffer_columns(self.cache) - self.filled - left)
        if k <= 0:
            return 0, None, None
        guess, length = self.drafts.propose(k)
        return int(length.max()), guess, length  # k 0 when no row's last tokens recur

    def step(self) -> list[int]:
        """One forward over every live row's next token and its draft: the positions of the rows it ended."""
        g = self.g
        k, guess, length = self.propose()
        ids = torch.cat([self.token[:, None], guess[:, :k].to(g.device)], 1) if k else self.token[:, None]
        step = {}
        if self.mask is not None:
            self.mask[:, self.filled:self.filled + 1 + k] = 1
            step["attention_mask"] = self.mask[:, :self.filled + 1 + k]
        logits = g.model(input_ids=ids, position_ids=self.pos[:, None] + torch.arange(1 + k, device=g.device),
                         use_cache=True, **step, **{g.kw: self.cache}).logits
        best = logits.argmax(-1).cpu()  # (rows, 1 + k): greedy's choice after each of the step's tokens
        kept = torch.zeros(len(self.live), dtype=torch.long)
        if k:
            agree = (guess[:, :k] == best[:, :k]) & (torch.arange(k) < length[:, None])
            kept = agree.long().cumprod(1).sum(1)  # the draft's tokens up to its first disagreement
        done = self._take(best, kept, k)
        self.token = best[torch.arange(len(self.live)), kept].to(g.device)
        self.pos, self.filled = self.pos + 1 + kept.to(g.device), self.filled + 1 + k
        return done

    def _take(self, best: torch.Tensor, kept: torch.Tensor, k: int) -> list[int]:
        """Each row's kept draft tokens, then greedy's next one, onto its answer, and its rejected draft columns
        made holes in the mask: the positions of the rows that ended."""
        done = []
        for r, i in enumerate(self.live):
            a = int(kept[r])
            if any(self.add(r, i, t) for t in best[r, :a + 1].tolist()):  # draft tokens kept, then greedy's next
                done.append(r)
            if a < k:  # (drafting always has a mask)
                self.mask[r, self.filled + 1 + a:self.filled + 1 + k] = 0  # the rejected draft's columns: holes
        return done


def _decode_rows(g: Generation, rows: list[int], widths: list[int], first: list[int], cache: DynamicCache,
                 mask: Optional[torch.Tensor]) -> dict[int, str]:
    """Greedy decoding of prefilled rows (prompt index, prompt length, first new token) sharing `cache`, with
    `mask` over its columns (None: no padding); a row leaves the batch at EOS, at max_new_tokens, or once its
    references decide its score. With g.draft > 0 and a BufferLayer cache with room for max_new_tokens x
    (1 + draft) columns, each step also verifies up to g.draft prompt-lookup tokens per row (module docstring)."""
    batch = _Decoding(g, rows, widths, first, cache, mask)
    done = [r for r, (i, t) in enumerate(zip(rows, first)) if batch.add(r, i, t)]
    ours = cpu_kernels(g.device) and full_attention_layers(cache) and prefill_computes(g.model)
    with use_attention(g.model, DECODE_ATTENTION if ours else None):
        while len(done) < len(batch.live):
            if done:
                batch.drop(done)
            done = batch.step()
    return batch.out


@torch.no_grad()
def greedy_generate_cached(model, tokenizer, prompt: list[int], cache: DynamicCache, max_new_tokens: int,
                           prefill_chunk: int = 8192) -> str:
    """One prompt whose first tokens are already in `cache` (a context-parallel prefill): the rest of the
    prompt is prefilled into it and the answer decoded from it, as greedy_generate does one row."""
    g = Generation.of(model, tokenizer, [prompt], max_new_tokens, prefill_chunk=prefill_chunk)
    cache, token = g.prefill(0, cache)
    return _decode_rows(g, [0], [len(prompt)], [token], cache, None)[0]
