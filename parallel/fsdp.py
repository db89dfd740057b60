"""FSDP2 (torch's `fully_shard`) over all data x context ranks, applied to the model from outside.

Each decoder layer is one FSDP unit (its parameters are all-gathered for its forward and backward
only), then the root (embeddings, final norm, LM head). Every rank of the world holds 1/world of the
parameters, gradients and optimizer state whatever the split into dp x cp: CP ranks hold different
tokens of the same sequences, so they shard the model like data ranks do. Gradients are reduced as
a mean over the world, like DDP's, so the training step's loss scaling is the same for both.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from longstride.parallel.config import WorldMesh

FSDP_CHOICES = ("auto", "true", "false")


def use_fsdp(choice: str, device_type: str, world: int) -> bool:
    """auto: FSDP2 on CUDA when there are several ranks, DDP otherwise (CPU runs are small)."""
    choice = str(choice).lower()  # the CLI's parallel.fsdp=true arrives as "True"
    if choice not in FSDP_CHOICES:
        raise ValueError(f"parallel.fsdp={choice!r}; use one of {FSDP_CHOICES}")
    if choice == "auto":
        return device_type == "cuda" and world > 1
    return choice == "true" and world > 1


def apply_fsdp(model: torch.nn.Module, layers, device_type: str, world: int,
               param_dtype: Optional[torch.dtype] = None, mesh: Optional[WorldMesh] = None) -> torch.nn.Module:
    """Shards `model` in place (each module of `layers`, then the root) over the world: `mesh` (the run's
    WorldMesh; one is built when none is given), whose single dimension is every dp x cp rank."""
    mesh = (mesh or WorldMesh(device_type, world)).mesh
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model: torch.nn.Module) -> dict:
    """Collective: the unsharded state dict, on the CPU, on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def grad_norm_clip(params, max_norm: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
