"""The optimizer's parameter groups (recipes/run/stage.py's step and the traced step of recipes/memory/trace.py) and the
learning-rate schedules, as multipliers of the stage's peak LR: warmup + cosine, WSD, constant."""
from __future__ import annotations

import math

from longstride.choices import Choice


class Schedule(Choice):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


SCHEDULES = tuple(Schedule.names())


def param_groups(model, weight_decay: float) -> list[dict]:
    """No weight decay on norms, biases and embeddings (1-D tensors, and embedding tables: any nn.Embedding's
    weight, whatever the model names it, GPT-2's wte and wpe say, and a parameter whose name says embed)."""
    from torch import nn  # here: the schema imports Schedule without torch

    tables = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in tables or "embed" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_multiplier(step: int, total: int, warmup: int, kind: str, min_ratio: float, decay_fraction: float) -> float:
    """Multiplier for the update at 0-based `step` of `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(total - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "wsd":  # warmup-stable-decay (MiniCPM): linear decay over the last decay_fraction
        decay_steps = max(int(round(total * decay_fraction)), 1)
        start = total - decay_steps
        if step < start:
            return 1.0
        return min_ratio + (1 - min_ratio) * (1 - (step - start + 1) / decay_steps)
    raise ValueError(f"schedule={kind!r} is unknown; use one of {SCHEDULES}")


def build_scheduler(optimizer, total: int, warmup: int, kind: str, min_ratio: float, decay_fraction: float):
    from torch.optim.lr_scheduler import LambdaLR  # here: the schema imports Schedule without torch

    return LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total, warmup, kind, min_ratio, decay_fraction)
    )
