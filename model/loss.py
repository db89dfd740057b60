"""Chunked cross-entropy from final hidden states: never holds all L x V logits at once.

Each tile of `tile` tokens computes its logits, its summed loss, and is checkpointed, so the
backward pass recomputes one tile's logits at a time. The result is the *sum* of token losses and
the count of labelled tokens; the caller divides by the global count (over micro-batches, data
ranks and context ranks), which is what makes CP and gradient accumulation exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _tile_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # hidden: (T, D), weight: (V, D), labels: (T,) -> scalar fp32 sum over labelled tokens
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tile: int = 1024
) -> torch.Tensor:
    """hidden: (B, L, D), weight: (V, D) lm-head weight, labels: (B, L) already aligned (label[t] is
    the target of position t; IGNORE_INDEX where there is none). Returns the fp32 loss sum."""
    if tile <= 0:
        raise ValueError(f"model.loss_tile_tokens={tile} must be positive")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    # every tile runs, also one without a target (its sum is 0): skipping it would read the labels on the host,
    # a device sync per tile on a GPU, and a traced step (recipes/memory/trace.py) has no values to read
    for start in range(0, hidden.shape[0], tile):
        h, y = hidden[start:start + tile], labels[start:start + tile]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + checkpoint(_tile_loss_sum, h, weight, y, use_reentrant=False)
        else:
            total = total + _tile_loss_sum(h, weight, y)
    return total


class ChunkedLossLM(torch.nn.Module):
    """Wraps a transformers causal LM so that forward returns the summed chunked loss.

    Data-parallel wrappers (DDP, FSDP) wrap this module, so the loss is part of the wrapped
    forward. Extra keyword arguments (the attention's document layout) go to the decoder, which
    hands them to every attention call.
    """

    def __init__(self, lm: torch.nn.Module, tile: int = 1024):
        super().__init__()
        self.lm, self.tile = lm, tile

    def forward(self, input_ids, labels, position_ids, **attn_kwargs) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **attn_kwargs).last_hidden_state
        return chunked_cross_entropy_sum(hidden, self.lm.lm_head.weight, labels, self.tile)
