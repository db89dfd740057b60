"""Activation checkpointing of decoder layers, and offload of what it keeps.

full       each decoder layer keeps only its input; backward recomputes the layer (transformers'
           activation checkpointing over torch's non-reentrant checkpoint).
selective  inside each layer, the outputs of the matmuls (the q/k/v, output and MLP projections) and attention's
           output and log-sum-exp (on one device and under every CP method; plain Ulysses' head-layout q and
           K/V too, parallel/ulysses.py) are kept; everything else is recomputed from them (norms, RoPE,
           residual adds, activations, autocast's casts: cheap elementwise ops), through torch's selective-
           checkpoint contexts with the policy of model/selective.py (op-level selective checkpointing as
           torchtitan's, for about half of what no checkpointing keeps).
layers     (model.checkpoint_layers) the first N decoder layers only; the others keep all they save, as without
           checkpointing.
offload    (CUDA runs, with full or selective) the checkpointed layer inputs are held in pinned
           host memory instead of on the device, copied out and back on a side stream that overlaps
           with compute (model/offload.py). On CPU runs it changes nothing.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from longstride.model.config import check_layers
from longstride.model.loss import decoder, decoder_layers
from longstride.model.offload import ActivationOffload
from longstride.model.selective import policy as _selective_policy

MODES = ("none", "full", "selective")

def disable_checkpointing(lm: torch.nn.Module) -> None:
    """enable_checkpointing undone (the offloader's hooks are its own: ActivationOffload.detach)."""
    if hasattr(lm, "activation_checkpointing_disable"):  # transformers >= 5.2x
        lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_disable()


def enable_checkpointing(lm: torch.nn.Module, mode: str, offload: bool = False,
                         simulate_offload: bool = False, layers: Optional[int] = None) -> Optional[ActivationOffload]:
    """mode: none | full | selective (see the module docstring); offload: hold the checkpointed inputs in
    host memory (the caller passes it only for CUDA runs; `simulate_offload` runs its bookkeeping on CPU
    for tests); layers: checkpoint the first `layers` decoder layers only, the others keeping all they save
    (model.checkpoint_layers; None: every layer). Returns the offloader, if any."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; use one of {MODES}")
    if mode == "none":
        return None
    every = decoder_layers(lm)
    if layers is not None:
        check_layers(layers, len(every), offload or simulate_offload)
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
        lm.activation_checkpointing_enable(kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in every[layers:] if layers is not None else ():  # transformers' layers skip checkpoint on False
        layer.gradient_checkpointing = False
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
