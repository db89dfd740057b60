"""Chunked cross-entropy from final hidden states: never holds all L x V logits at once.

Each tile of `tile` tokens computes its logits, its summed loss, and is checkpointed, so the
backward pass recomputes one tile's logits at a time. The result is the *sum* of token losses and
the count of labelled tokens; the caller divides by the global count (over micro-batches, data
ranks and context ranks), which is what makes CP and gradient accumulation exact.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


class Head(NamedTuple):
    """A causal LM's output head as its forward computes logits: (hidden @ weight.T + bias) * scale, then
    softcap * tanh(logits / softcap) when softcap is set."""

    weight: torch.Tensor  # (V, D)
    bias: Optional[torch.Tensor] = None  # (V,): Phi-1/2's lm_head
    scale: float = 1.0  # Cohere's logit_scale; 1 / Granite's logits_scaling
    softcap: Optional[float] = None  # final_logit_softcapping (Gemma 2 and 3)


def output_head(lm: torch.nn.Module) -> Head:
    """`lm`'s output head with the terms transformers' CausalLM forwards add after lm_head: its bias, Cohere's
    `logit_scale`, Granite's `logits_scaling` and `final_logit_softcapping`, so the chunked loss is the model's own."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    head = lm.get_output_embeddings()
    scale = getattr(lm, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        raise NotImplementedError(f"{type(lm).__name__} scales its logits by a learned tensor (logit_scale), which "
                                  "longstride's chunked loss does not compute; refused rather than dropped")
    scale = float(scale or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
    return Head(head.weight, head.bias, scale, getattr(config, "final_logit_softcapping", None) or None)


def _tile_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor],
                   scale: float, softcap: Optional[float]) -> torch.Tensor:
    # hidden: (T, D), weight: (V, D), labels: (T,) -> scalar fp32 sum over labelled tokens
    logits = F.linear(hidden, weight, bias).float()
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, head: Head | torch.Tensor, labels: torch.Tensor, tile: int = 1024
) -> torch.Tensor:
    """hidden: (B, L, D); head: the output head (output_head), or an lm-head weight (V, D) alone; labels: (B, L)
    already aligned (label[t] is the target of position t; IGNORE_INDEX where there is none). Returns the fp32
    loss sum."""
    if tile <= 0:
        raise ValueError(f"model.loss_tile_tokens={tile} must be positive")
    head = head if isinstance(head, Head) else Head(head)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    trainable = any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias))
    # every tile runs, also one without a target (its sum is 0): skipping it would read the labels on the host,
    # a device sync per tile on a GPU, and a traced step (recipes/memory/trace.py) has no values to read
    for start in range(0, hidden.shape[0], tile):
        h, y = hidden[start:start + tile], labels[start:start + tile]
        args = (h, head.weight, y, head.bias, head.scale, head.softcap)
        if torch.is_grad_enabled() and trainable:
            total = total + checkpoint(_tile_loss_sum, *args, use_reentrant=False)
        else:
            total = total + _tile_loss_sum(*args)
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
        output_head(lm)  # a head the loss cannot compute is refused here, before any step

    def forward(self, input_ids, labels, position_ids, **attn_kwargs) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **attn_kwargs).last_hidden_state
        # read at each forward: FSDP2 swaps the head's parameters for their gathered copies around it
        return chunked_cross_entropy_sum(hidden, output_head(self.lm), labels, self.tile)
