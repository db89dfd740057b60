"""RULER's metrics and summaries.

string_match_all: per sample, the fraction of the references found (case-insensitive substring) in
the prediction; string_match_part: 1 if any reference is found. Both are averaged over samples and
reported as percentages. Summaries: per task and length; the mean over tasks per length; RULER's
weighted averages over lengths (weights rising with length, "inc", or falling, "dec"); and the
effective length: the longest length up to which every length's mean reaches the threshold
(RULER's 85.6, Llama-2-7B's score at 4K).
"""
from __future__ import annotations

import re
from typing import Optional

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's cleaning of a prediction: control characters become newlines, ends stripped."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def sample_score(prediction: str, references: list[str], metric: str) -> float:
    pred = postprocess(prediction).lower()
    hits = [1.0 if r.lower() in pred else 0.0 for r in references]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return max(hits)
    raise ValueError(f"unknown metric {metric!r}; use 'all' or 'part'")


def string_match_all(predictions: list[str], references: list[list[str]]) -> float:
    return 100 * sum(sample_score(p, r, "all") for p, r in zip(predictions, references)) / len(predictions)


def string_match_part(predictions: list[str], references: list[list[str]]) -> float:
    return 100 * sum(sample_score(p, r, "part") for p, r in zip(predictions, references)) / len(predictions)


def summarize(records: list[dict], threshold: float = 85.6) -> dict:
    """records: one per sample with task, length and score (0..1). Returns the task x length table
    (percent), the mean over tasks per length, wAvg inc/dec and the effective length."""
    table: dict[str, dict[int, float]] = {}
    counts: dict[tuple, int] = {}
    for r in records:
        cell = table.setdefault(r["task"], {})
        cell[r["length"]] = cell.get(r["length"], 0.0) + r["score"]
        counts[r["task"], r["length"]] = counts.get((r["task"], r["length"]), 0) + 1
    for task, cells in table.items():
        for length in cells:
            cells[length] = 100 * cells[length] / counts[task, length]
    lengths = sorted({r["length"] for r in records})
    # the mean over the tasks scored at every length, so a task missing at one length does not skew it
    full = [t for t, cells in table.items() if all(L in cells for L in lengths)]
    mean = {L: sum(table[t][L] for t in full) / len(full) for L in lengths} if full else {}
    out = {"table": table, "mean": mean, "tasks_in_mean": full, "lengths": lengths, "threshold": threshold}
    if mean:
        n = len(lengths)
        inc, dec = range(1, n + 1), range(n, 0, -1)
        out["wavg_inc"] = sum(w * mean[L] for w, L in zip(inc, lengths)) / sum(inc)
        out["wavg_dec"] = sum(w * mean[L] for w, L in zip(dec, lengths)) / sum(dec)
        out["effective_length"] = effective_length(mean, threshold)
    return out


def effective_length(mean: dict[int, float], threshold: float) -> Optional[int]:
    best = None
    for length in sorted(mean):
        if mean[length] < threshold:
            break
        best = length
    return best
