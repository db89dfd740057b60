"""Exact length targeting: the largest haystack whose prompt, in the checkpoint's own tokenizer and
chat template, plus the task's new-token budget fits the target length.

The prompt is the user turn through the chat template (when the tokenizer has one and chat is on)
followed by the task's answer prefix, so the model continues the prefix; without a template it is
the user text and the prefix as plain text. The haystack size is found by doubling then binary
search over `Sampler.render(units)`, or, given a guess (the size another sample of the same task and
length found), by galloping out from the guess then binary search: the same size, since a larger
haystack never has fewer tokens, in 2 or 3 tokenizations instead of about 15. Every size tried is
tokenized in full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from longstride.eval.ruler.tasks import QAData, Sampler, Task


class DoesNotFit(ValueError):
    """A task's fixed parts alone exceed the target length."""


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


def prompt_ids(tokenizer, content: str, answer_prefix: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text + answer_prefix, add_special_tokens=False)["input_ids"]
    return tokenizer(content + answer_prefix)["input_ids"]


def make_sample(task: Task, length: int, index: int, tokenizer, *, seed: int = 42, chat: bool = True,
                haystack: Optional[str] = None, qa: Optional[QAData] = None, guess: Optional[int] = None) -> Sample:
    sampler = Sampler(task, length, seed, index, haystack, qa)
    budget = length - task.max_new_tokens
    tried: dict[int, tuple] = {}

    def fits(units: int) -> bool:
        if units not in tried:
            r = sampler.render(units)
            ids = prompt_ids(tokenizer, r.content, r.answer_prefix, chat)
            tried[units] = (len(ids) <= budget, ids, r)
        return tried[units][0]

    lo = sampler.min_units
    if not fits(lo):
        raise DoesNotFit(f"{task.name} does not fit in {length} tokens: its fixed parts take {len(tried[lo][1])} "
                         f"prompt tokens + {task.max_new_tokens} new tokens; use lengths >= "
                         f"{len(tried[lo][1]) + task.max_new_tokens}")
    # Each unit is at least one token, so the answer is below `length` units (or the task's cap).
    cap = min(sampler.cap or length, length)
    if guess is not None and sampler.monotone and lo < guess <= cap:
        if fits(guess):
            lo, step = guess, 1
            while lo + step <= cap and fits(lo + step):
                lo, step = lo + step, step * 2
            hi = min(lo + step, cap + 1)
        else:
            hi, step = guess, 1
            while hi - step > lo and not fits(hi - step):
                hi, step = hi - step, step * 2
            lo = max(hi - step, lo)
    else:
        hi = lo
        while hi < cap and fits(min(hi * 2, cap)):
            hi = min(hi * 2, cap)
        lo, hi = hi, min(hi * 2, cap) if hi < cap else cap + 1
    while hi - lo > 1:  # lo fits; hi does not (or is past the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    _, ids, r = tried[lo]
    return Sample(task.name, length, index, prompt_ids=ids, answers=r.answers, units=lo, depth=r.depth,
                  max_new_tokens=task.max_new_tokens, metric=task.metric)
