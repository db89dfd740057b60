"""FSDP2 (torch's `fully_shard`) over all data x context ranks, applied to the model from outside.

Each decoder layer is one FSDP unit (its parameters are all-gathered for its forward and backward
only), then the root (embeddings, final norm, LM head). Every rank of the world holds 1/world of the
parameters, gradients and optimizer state whatever the split into dp x cp: CP ranks hold different
tokens of the same sequences, so they shard the model like data ranks do. Gradients are reduced as
a mean over the world, like DDP's, so the training step's loss scaling is the same for both.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from longstride.parallel.config import WorldMesh
from longstride.parallel.shards import tied_names

FSDP_CHOICES = ("auto", "true", "false")
HF_SHARD_BYTES = 2 ** 30  # the largest weights file an FSDP2 final writes (and the most the main rank holds)


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


def stream_weights(lm: torch.nn.Module, directory: str, is_main: bool, shard_bytes: int = HF_SHARD_BYTES) -> None:
    """Collective: an FSDP2-sharded `lm`'s weights as HF safetensors files in `directory`, gathered one tensor
    at a time in state-dict order (the same on every rank); the main rank keeps at most one file's tensors
    (`shard_bytes`) and writes them: `model.safetensors` when one file holds them all, else
    `model-0000i-of-0000n.safetensors` and the index save_pretrained writes. A tied repeat (the LM head sharing
    the embedding) is written once, as save_pretrained does; the bytes equal save_pretrained's."""
    tied = tied_names(lm)
    items = [(k, v) for k, v in lm.state_dict().items() if k not in tied]
    files, size = [[]], 0
    for k, v in items:  # the plan, from global shapes: which tensors go in which file
        n = v.numel() * v.element_size()
        if files[-1] and size + n > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(k)
        size += n
    values = dict(items)
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map, total, failed = {}, 0, None
    for name, keys in zip(names, files):
        shard = {}
        for k in keys:
            v = values[k]
            full = v.full_tensor() if isinstance(v, DTensor) else v  # every rank: the all-gather is collective
            if is_main:
                shard[k] = full.detach().to("cpu").contiguous()
                weight_map[k], total = name, total + full.numel() * full.element_size()
        if is_main and failed is None:
            try:
                save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
            except Exception as e:  # a full disk: keep gathering with the others (they are in the same collectives)
                failed = e
    if is_main and failed is None and len(files) > 1:
        try:
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        except OSError as e:  # told to the others below, as a weights file's failure is
            failed = e
    flag = torch.tensor([float(failed is not None)], device=items[0][1].device)
    torch.distributed.all_reduce(flag)  # every rank raises, or none
    if flag.item():
        raise OSError(f"the main rank could not write the weights: {failed}" if failed else
                      "the main rank could not write the weights")


def grad_norm_clip(params, max_norm: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
