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
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import BaseModelOutputWithPast

IGNORE_INDEX = -100


class Head(NamedTuple):
    """A causal LM's output head as its forward computes logits: (hidden @ weight.T + bias) * scale, then
    softcap * tanh(logits / softcap) when softcap is set."""

    weight: torch.Tensor  # (V, D)
    bias: Optional[torch.Tensor] = None  # (V,): Phi-1/2's lm_head
    scale: float = 1.0  # Cohere's logit_scale; 1 / Granite's logits_scaling
    softcap: Optional[float] = None  # final_logit_softcapping (Gemma 2 and 3)


def output_head(lm: torch.nn.Module) -> Head:
    """`lm`'s output head as its own forward computes it: lm_head's weight and bias, and the terms transformers'
    CausalLM forwards add after lm_head (Cohere's `logit_scale`, Granite's `logits_scaling` divisor, HyperCLOVAX's
    multiplier of the same name, `final_logit_softcapping`). The terms are read off the forward itself
    (head_terms), so the chunked loss is the model's own; a head that no such reading reproduces is refused."""
    head = lm.get_output_embeddings()
    return Head(head.weight, head.bias, *head_terms(lm))


def head_terms(lm: torch.nn.Module) -> tuple[float, Optional[float]]:
    """(scale, softcap) of `lm`'s logits after lm_head, checked against its own forward on two random hidden
    states (only the head runs: the decoder is swapped for a stub returning them). Cached on `lm`; a model without
    values (meta or fake tensors: a traced step) takes the first candidate unchecked."""
    cached = getattr(lm, "_longstride_head_terms", None)
    if cached is not None:
        return cached
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    scale = getattr(lm, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        raise NotImplementedError(f"{type(lm).__name__} scales its logits by a learned tensor (logit_scale), which "
                                  "longstride's chunked loss does not compute; refused rather than dropped")
    head = lm.get_output_embeddings()
    learned = sorted(n for n, _ in head.named_parameters() if n not in ("weight", "bias"))
    if learned:  # such as Dory's head: equal logits at init (a scale of 1), then a term the loss never trains
        raise NotImplementedError(f"{type(lm).__name__}'s output head {type(head).__name__} holds learned tensors "
                                  f"besides its weight and bias ({', '.join(learned)}), which longstride's chunked "
                                  "loss does not compute; refused rather than dropped")
    scale = float(scale or 1.0)
    factor = float(getattr(config, "logits_scaling", None) or 1.0)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    candidates = [(s, c) for s in dict.fromkeys([scale / factor, scale * factor, scale]) for c in (softcap, None)]
    if head.weight.is_meta or is_fake(head.weight) or detect_fake_mode() is not None:  # a traced step: no values
        return candidates[0]
    hidden = torch.randn(1, 2, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(head.weight.device, head.weight.dtype)
    with torch.no_grad():  # logits well past any soft-cap, where a cap and no cap differ (tanh is ~x near 0)
        top = F.linear(hidden, head.weight).float().abs().max().clamp(min=1e-6)
    hidden = hidden * (3 * (softcap or 10.0) / top).to(hidden.dtype)
    want = _own_logits(lm, hidden)
    tol = 1e-3 if head.weight.dtype == torch.float32 else 3e-2  # a bf16 head may scale in bf16, ours in fp32
    for terms in candidates:
        got = _head_logits(hidden, Head(head.weight, head.bias, *terms))
        if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
            lm._longstride_head_terms = terms
            return terms
    raise NotImplementedError(f"{type(lm).__name__}'s logits are more than lm_head with a scale and a soft-cap "
                              "(none of those terms reproduces its own forward), so longstride's chunked loss would "
                              "not be the model's; refused rather than dropped")


class _StubOutput(BaseModelOutputWithPast):
    def __getattr__(self, name):  # what else a CausalLM forward reads of its decoder's output (router_logits): none
        return None


class _Stub(torch.nn.Module):
    """Stands in for a causal LM's decoder: returns the given hidden states, so that only the head runs."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _StubOutput(last_hidden_state=self.hidden)


def decoder_name(lm: torch.nn.Module) -> str:
    """The attribute holding a causal LM's decoder: the child get_decoder names (transformer: GPT-2; model: Llama,
    Qwen, ...), else model (Llama 4's text model, whose get_decoder returns the causal LM itself)."""
    return next((n for n, child in lm.named_children() if child is lm.get_decoder()), "model")


def decoder(lm: torch.nn.Module) -> torch.nn.Module:
    """A causal LM's decoder (decoder_name): its forward gives the hidden states the output head reads."""
    return getattr(lm, decoder_name(lm))


def text_decoder(lm: torch.nn.Module) -> torch.nn.Module:
    """The module holding a causal LM's text layers, whose attention implementation eval switches: get_decoder()'s
    (a vision-language model's language model, not the wrapper beside its vision tower), else decoder(lm)."""
    get = getattr(lm, "get_decoder", None)
    return get() if callable(get) else decoder(lm)


def decoder_layers(lm: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's stack of layers (what checkpointing, tiling and FSDP wrap one by one): its ModuleList of
    config.num_hidden_layers modules (layers: Llama, Qwen, GPT-NeoX; h: GPT-2). A ValueError naming the model where
    there is none."""
    body, config = decoder(lm), lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    n = getattr(config, "num_hidden_layers", None)
    found = [c for c in body.children() if isinstance(c, torch.nn.ModuleList) and len(c) == n]
    if len(found) != 1:
        raise ValueError(f"{type(lm).__name__}: longstride trains a decoder with one stack of config.num_hidden_layers"
                         f"={n} layers, and {type(body).__name__} holds {len(found)} such lists; train it with the "
                         "HF Trainer path (recipes/hf/trainer.py) or another trainer")
    return found[0]


@torch.no_grad()
def _own_logits(lm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    name = decoder_name(lm)
    body = getattr(lm, name)
    setattr(lm, name, _Stub(hidden))
    try:
        return lm(input_ids=torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)).logits.float()
    finally:
        setattr(lm, name, body)


def _head_logits(hidden: torch.Tensor, head: Head) -> torch.Tensor:
    # hidden: (..., D) -> fp32 logits (..., V) as the model's head computes them
    logits = F.linear(hidden, head.weight, head.bias).float()
    if head.scale != 1.0:
        logits = logits * head.scale
    if head.softcap:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return logits


def tile_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor],
                  scale: float, softcap: Optional[float]) -> torch.Tensor:
    # hidden: (T, D), weight: (V, D), labels: (T,) -> scalar fp32 sum over labelled tokens
    logits = _head_logits(hidden, Head(weight, bias, scale, softcap))
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, head: Head | torch.Tensor, labels: torch.Tensor, tile: int = 1024, tile_fn=None
) -> torch.Tensor:
    """hidden: (B, L, D); head: the output head (output_head), or an lm-head weight (V, D) alone; labels: (B, L)
    already aligned (label[t] is the target of position t; IGNORE_INDEX where there is none); tile_fn: what computes
    a tile's loss sum (None: tile_loss_sum; train.compile: its compiled form, model/compile.py). Returns the fp32
    loss sum."""
    if tile <= 0:
        raise ValueError(f"model.loss_tile_tokens={tile} must be positive")
    head = head if isinstance(head, Head) else Head(head)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    tile_fn = tile_fn or tile_loss_sum
    trainable = any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias))
    # every tile runs, also one without a target (its sum is 0): skipping it would read the labels on the host,
    # a device sync per tile on a GPU, and a traced step (recipes/memory/trace.py) has no values to read
    for start in range(0, hidden.shape[0], tile):
        h, y = hidden[start:start + tile], labels[start:start + tile]
        args = (h, head.weight, y, head.bias, head.scale, head.softcap)
        if torch.is_grad_enabled() and trainable:
            total = total + checkpoint(tile_fn, *args, use_reentrant=False)
        else:
            total = total + tile_fn(*args)
    return total


def router_aux_loss(config) -> str | None:
    """Why a model's loss would hold more than cross-entropy that longstride's loss leaves out, or None: a mixture
    of experts set to add its router's load-balancing loss (config.output_router_logits with a nonzero
    router_aux_loss_coef), which neither the recipe's chunked loss nor the HF Trainer path computes as the model
    would (the Trainer scales the whole loss by the process count for the token mean)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return None
    # the coefficient's names across transformers' MoE classes (Mixtral and most; JetMoE; DBRX's ffn_config)
    coefs = {"router_aux_loss_coef": getattr(text, "router_aux_loss_coef", None),
             "aux_loss_coef": getattr(text, "aux_loss_coef", None),
             "ffn_config.moe_loss_weight": getattr(getattr(text, "ffn_config", None), "moe_loss_weight", None)}
    named = {k: v for k, v in coefs.items() if v is not None}
    if named and not any(named.values()):
        return None  # a zero coefficient: the model adds no balancing term
    said = ", ".join(f"{k}={v}" for k, v in named.items()) or "a coefficient longstride cannot find"
    return (f"its config sets output_router_logits=true ({said}): a load-balancing loss longstride does not "
            "compute; set output_router_logits to false in its config.json (the experts train without the balancing "
            "term), refused rather than dropped")


class ChunkedLossLM(torch.nn.Module):
    """Wraps a transformers causal LM so that forward returns the summed chunked loss.

    Data-parallel wrappers (DDP, FSDP) wrap this module, so the loss is part of the wrapped
    forward. Extra keyword arguments (the attention's document layout) go to the decoder, which
    hands them to every attention call.
    """

    def __init__(self, lm: torch.nn.Module, tile: int = 1024, tile_fn=None):
        super().__init__()
        self.lm, self.tile, self.tile_fn = lm, tile, tile_fn  # tile_fn: chunked_cross_entropy_sum's
        # read (and a head the loss cannot compute refused) here, before any step and before DDP / FSDP2 wrap lm
        self.terms = head_terms(lm)
        self.body = decoder_name(lm)  # model (Llama, Qwen...), gpt_neox, transformer (GPT-2)

    def forward(self, input_ids, labels, position_ids, **attn_kwargs) -> torch.Tensor:
        hidden = getattr(self.lm, self.body)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                             **attn_kwargs).last_hidden_state
        # the weight and bias read at each forward: FSDP2 swaps them for their gathered copies around it
        head = self.lm.get_output_embeddings()
        return chunked_cross_entropy_sum(hidden, Head(head.weight, head.bias, *self.terms), labels, self.tile,
                                         self.tile_fn)
