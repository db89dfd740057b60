"""Exact length targeting: the largest haystack whose prompt, in the checkpoint's own tokenizer and
chat template, plus the task's new-token budget fits the target length.

The prompt is the user turn through the chat template (when the tokenizer has one and chat is on)
followed by the task's answer prefix, so the model continues the prefix; without a template it is
BOS where training opens documents with it (data/tokenizer.py bos_prefix), then the user text and the
prefix as plain text. Where a larger haystack never has fewer tokens
(`Sampler.monotone`), the size is found by aiming over `Sampler.render(units)` with the average tokens a
unit (tokens grow about linearly with size), from a guess when given (the size another sample of the same task
and length found): 3-4 full tokenizations a guessed sample on average, up to about 7, and about 10 for a
length's first (tests/test_ruler_samples.py; the galloping search before it took 5-6 and 30). Otherwise (sizes whose
words are redrawn) by doubling then binary search. Every size tried is tokenized in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from longstride.data.tokenizer import bos_prefix
from longstride.eval.hf_adapter import encode
from longstride.eval.ruler.tasks import QAData, Sampler, Task


class DoesNotFit(ValueError):
    """A task's fixed parts alone exceed the target length; `needed`: the shortest length it fits."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


@dataclass
class Sample:
    task: str
    length: int
    index: int
    prompt_ids: list[int]
    answers: list[str]
    units: int  # haystack size found
    depth: Optional[float]  # single-needle depth (%)
    max_new_tokens: int
    metric: str


# The date a chat template prints where it reads `date_string` (Llama 3.x: else today's, so the prompts, and even
# the haystack that fits, would change with the day the evaluation runs)
CHAT_DATE = "26 Jul 2024"


def chat_template_note(tokenizer, chat: bool) -> str:
    """What the prompts go through, for the log: "" without a chat template (or chat=false)."""
    template = getattr(tokenizer, "chat_template", None) if chat else None
    if not template:
        return ""
    dated = "strftime_now" in str(template) and "date_string" not in str(template)
    return ("chat=true: prompts go through the tokenizer's chat template (RULER scores a base model without one: "
            "chat=false)" + ("; it prints today's date, which no setting pins: prompts and scores can differ from "
                             "one day to another" if dated else ""))


def prompt_ids(tokenizer, content: str, answer_prefix: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True, date_string=CHAT_DATE)
        return encode(tokenizer, text + answer_prefix, add_special_tokens=False)
    # BOS where training opens documents with it (bos_prefix), never a post-processor's EOS after the prefix
    return bos_prefix(tokenizer) + encode(tokenizer, content + answer_prefix, add_special_tokens=False)


def make_sample(task: Task, length: int, index: int, tokenizer, *, seed: int = 42, chat: bool = True,
                haystack: Optional[str] = None, qa: Optional[QAData] = None, guess: Optional[int] = None) -> Sample:
    sampler = Sampler(task, length, seed, index, haystack, qa)
    budget = length - task.max_new_tokens
    tried: dict[int, tuple] = {}  # size -> (prompt ids, rendered)
    tokens: dict[int, int] = {}  # size -> prompt tokens

    def fits(units: int) -> bool:
        if units not in tried:
            r = sampler.render(units)
            tried[units] = (prompt_ids(tokenizer, r.content, r.answer_prefix, chat), r)
            tokens[units] = len(tried[units][0])
        return tokens[units] <= budget

    lo = sampler.min_units
    if not fits(lo):
        needed = tokens[lo] + task.max_new_tokens
        raise DoesNotFit(f"{task.name} does not fit in {length} tokens: its fixed parts take {tokens[lo]} "
                         f"prompt tokens + {task.max_new_tokens} new tokens; use lengths >= {needed}", needed)
    # Each unit is at least one token, so the answer is below `length` units (or the task's cap).
    cap = min(sampler.cap or length, length)
    if sampler.monotone:
        lo = _largest_fitting(fits, tokens, lo, cap, budget, guess)
    else:
        lo = _doubled(fits, lo, cap)
        if sampler.soft_cap and lo == cap < length:
            lo = _doubled(fits, lo, length)
    ids, r = tried[lo]
    return Sample(task.name, length, index, prompt_ids=ids, answers=r.answers, units=lo, depth=r.depth,
                  max_new_tokens=task.max_new_tokens, metric=task.metric)


def _largest_fitting(fits, tokens: dict, lo: int, cap: int, budget: int, guess: Optional[int]) -> int:
    """The largest size up to `cap` that fits, for a token count that never falls as the size grows (`lo`
    fits; `tokens`: size -> prompt tokens of every size tried). Each aim steps from the size tried nearest the
    budget by its distance over the average tokens a unit (from the smallest size to it: units are alike, so
    it is nearly exact) and tries the size it lands on with its neighbour on the far side, which brackets the
    answer when the aim was right; after six aims, halving (doubling while no size is known not to fit). The
    first point: `guess`, else a small size."""
    hi, first = cap + 1, lo  # hi: the smallest size known not to fit (cap + 1: none known yet)
    x = guess if guess is not None and lo < guess <= cap else min(cap, lo + 16)
    if x > lo:
        lo, hi = (x, hi) if fits(x) else (lo, x)
    for aim in range(64):
        if hi - lo <= 1:
            return lo
        near = min((u for u in tokens if u != first), key=lambda u: abs(tokens[u] - budget))
        per_unit = (tokens[near] - tokens[first]) / (near - first)
        if aim < 6 and per_unit > 0:
            x = near + math.floor((budget - tokens[near]) / per_unit)
        else:
            x = (lo + hi) // 2 if hi <= cap else min(cap, 2 * lo)
        x = min(max(x, lo + 1), hi - 1)
        if fits(x):
            lo = x
            if x + 1 < hi:
                lo, hi = (x + 1, hi) if fits(x + 1) else (lo, x + 1)
        else:
            hi = x
            if x - 1 > lo:
                lo, hi = (x - 1, hi) if fits(x - 1) else (lo, x - 1)
    raise AssertionError("the haystack search did not converge")  # six aims, then halving: far under 64 rounds


def _doubled(fits, lo: int, cap: int) -> int:
    """The same for a token count that may dip as the size grows: doubling, then binary search (the largest
    fitting size it finds; sizes are redrawn, so no guess or line applies)."""
    hi = lo
    while hi < cap and fits(min(hi * 2, cap)):
        hi = min(hi * 2, cap)
    lo, hi = hi, min(hi * 2, cap) if hi < cap else cap + 1
    while hi - lo > 1:  # lo fits; hi does not (or is past the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
