"""Activation checkpointing of decoder layers, and offload of what it keeps.

full       each decoder layer keeps only its input; backward recomputes the layer (transformers'
           activation checkpointing over torch's non-reentrant checkpoint).
selective  inside each layer, the outputs of the matmuls (the q/k/v, output and MLP projections) are
           kept and everything else is recomputed from them (norms, RoPE, residual adds, activations,
           autocast's casts: cheap elementwise ops) and the attention forward, through torch's
           selective-checkpoint contexts (op-level selective checkpointing as torchtitan's: its backward
           recomputes almost no FLOPs beyond attention's, for about half of what no checkpointing keeps).
offload    (CUDA runs, with full or selective) the checkpointed layer inputs are held in pinned
           host memory instead of on the device, copied out and back on a side stream that overlaps
           with compute (model/offload.py). On CPU runs it changes nothing.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from longstride.model.loss import decoder, decoder_layers
from longstride.model.offload import ActivationOffload

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# the matmuls whose outputs selective checkpointing keeps (a linear layer is one of them under a view; experts are
# grouped matmuls); everything else is recomputed. _unsafe_view (matmul's reshape of its mm) aliases a kept output
# without sharing its version counter: kept too (no new memory), so that an op changing it in place is caught by the
# cache's mutation check instead of handing backward a changed value. (A reshape that must copy also ends in one, and
# its copy would be kept: none of the nine architectures tests/test_memory_estimate.py measures does one in a layer.)
KEPT = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._unsafe_view.default,
        *([_aten._grouped_mm.default] if hasattr(_aten, "_grouped_mm") else [])}


def _selective_policy(ctx, op, *args, **kwargs):
    # A keep-list rather than a recompute-list: buffers that attention fills in place (ring and Ulysses
    # outputs, receive buffers) must never be cached, and a keep-list of matmuls never caches them. Nothing that runs
    # without grad is cached either: the forward of an autograd.Function (a tiled op, which keeps only its
    # input and recomputes its tiles itself; ring and Ulysses attention) saves what it needs on its own.
    keep = op in KEPT and torch.is_grad_enabled()
    return CheckpointPolicy.PREFER_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def disable_checkpointing(lm: torch.nn.Module) -> None:
    """enable_checkpointing undone (the offloader's hooks are its own: ActivationOffload.detach)."""
    if hasattr(lm, "activation_checkpointing_disable"):  # transformers >= 5.2x
        lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_disable()


def enable_checkpointing(lm: torch.nn.Module, mode: str, offload: bool = False,
                         simulate_offload: bool = False) -> Optional[ActivationOffload]:
    """mode: none | full | selective (see the module docstring); offload: hold the checkpointed inputs in
    host memory (the caller passes it only for CUDA runs; `simulate_offload` runs its bookkeeping on CPU
    for tests). Returns the offloader, if any."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; use one of {MODES}")
    if mode == "none":
        return None
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
        lm.activation_checkpointing_enable(kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not (offload or simulate_offload):
        return None
    offloader = ActivationOffload(simulate=simulate_offload)
    body = decoder(lm)
    if not any(getattr(m, "gradient_checkpointing", False) for m in body.modules()):
        raise ValueError(f"model.offload_activations: {type(lm).__name__} has no transformers checkpointing "
                         f"layers to offload from; set model.offload_activations=false")
    # The offload hooks are saved-tensor hooks around the decoder stack's forward, up to the end of its last
    # layer. Inside each checkpointed layer torch's checkpoint installs its own hooks, which take precedence,
    # so what reaches the offloader is what checkpoint keeps: each layer's inputs.
    offloader.attach(body, until=decoder_layers(lm)[-1])
    return offloader
