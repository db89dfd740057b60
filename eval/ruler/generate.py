"""Greedy batched generation with a KV cache and chunked prefill (transformers' `generate`).

Prompts are sorted by length and left-padded into batches; prompts longer than `prefill_chunk`
tokens are prefilled `prefill_chunk` tokens at a time (transformers' `prefill_chunk_size`), so the
prefill's activations are bounded by the chunk, not the prompt. Answers are the generated token ids
decoded, never the prompt stripped from a decoded output.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from longstride.eval.ruler.score import sample_score


def stop_and_pad(model, tokenizer) -> tuple[list[int], int]:
    """The token ids that end an answer (the model's and the tokenizer's EOS), and the padding id."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[0]


def _config(max_new_tokens: int, eos: list[int], pad: int, prefill_chunk=None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                            eos_token_id=eos, pad_token_id=pad, prefill_chunk_size=prefill_chunk)


def _decode(tokenizer, new: list[int], eos: list[int]) -> str:
    cut = next((j for j, t in enumerate(new) if t in eos), len(new))
    return tokenizer.decode(new[:cut], skip_special_tokens=True)


def batches(widths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices of `widths` (prompt lengths), sorted by length, cut into batches: `batch_size` rows each, or
    with batch_size 0 as many rows as keep rows x the longest prompt within `batch_tokens` (at least one)."""
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


class ScoreDecided(StoppingCriteria):
    """Ends a row once its score is decided: RULER's metrics are case-insensitive substring matches of the
    references in the answer, so once every reference ("all") or one ("part") is in the text generated so
    far, nothing generated after it can change the score. Rows still undecided run on to EOS or the budget."""

    def __init__(self, tokenizer, width: int, references: list[list[str]], metric: str, eos: list[int]):
        self.tokenizer, self.width, self.references, self.metric, self.eos = tokenizer, width, references, metric, eos

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        done = [sample_score(_decode(self.tokenizer, row[self.width:].tolist(), self.eos), refs, self.metric) == 1.0
                for row, refs in zip(input_ids, self.references)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1,
                    prefill_chunk: int = 2048, batch_tokens: int = 32768,
                    references: Optional[list[list[str]]] = None, metric: str = "all") -> list[str]:
    """Decoded continuations of `prompts` (token id lists), in the given order. batch_size 0: batches
    of up to `batch_tokens` prompt tokens (see `batches`). With `references` (one list per prompt) a row
    stops as soon as its score under `metric` is decided (`ScoreDecided`): same score, shorter answer."""
    eos, pad = stop_and_pad(model, tokenizer)
    device = next(model.parameters()).device
    answers: list[str] = [""] * len(prompts)
    for rows in batches([len(p) for p in prompts], batch_size, batch_tokens):
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):  # left padding: every row's last prompt token is at the same column
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        config = _config(max_new_tokens, eos, pad, prefill_chunk if width > prefill_chunk else None)
        stop = StoppingCriteriaList([ScoreDecided(tokenizer, width, [references[i] for i in rows], metric, eos)]) \
            if references is not None else None
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             stopping_criteria=stop)
        for r, i in enumerate(rows):
            answers[i] = _decode(tokenizer, out[r, width:].tolist(), eos)
    return answers


@torch.no_grad()
def greedy_generate_cached(model, tokenizer, prompt: list[int], cache, max_new_tokens: int) -> str:
    """One prompt whose first tokens are already in `cache` (a context-parallel prefill): generate runs
    the rest of the prompt and the decoding from it."""
    eos, pad = stop_and_pad(model, tokenizer)
    ids = torch.tensor(prompt, device=next(model.parameters()).device)[None]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         generation_config=_config(max_new_tokens, eos, pad))
    return _decode(tokenizer, out[0, len(prompt):].tolist(), eos)
