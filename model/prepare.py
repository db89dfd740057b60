"""A stage's memory patches on a built transformers model, always in this order: lean RMSNorm backwards
(model/rmsnorm.py), activation checkpointing and its offload (model/checkpointing.py), then tiling of
each layer's position-wise parts (model/tiling.py). Parameters, their names and saved checkpoints stay
plain transformers."""
from __future__ import annotations

from typing import Optional

import torch

from longstride.model.checkpointing import enable_checkpointing
from longstride.model.offload import ActivationOffload
from longstride.model.rmsnorm import lean_rms_norms
from longstride.model.tiling import tile_mlps


def prepare_model(lm: torch.nn.Module, checkpointing: str, offload: bool, mlp_tile: int, lean_norms: bool,
                  simulate_offload: bool = False) -> Optional[ActivationOffload]:
    """checkpointing: none | full | selective; offload: checkpointed inputs to pinned host memory (CUDA);
    simulate_offload: the same bookkeeping on CPU tensors (tests, a traced step); mlp_tile: tokens per tile,
    0 = off; lean_norms: model.lean_rms_norm. Returns the offloader, if any."""
    if lean_norms:
        lean_rms_norms(lm)
    offloader = enable_checkpointing(lm, checkpointing, offload=offload and not simulate_offload,
                                     simulate_offload=offload and simulate_offload)
    tile_mlps(lm, mlp_tile)
    return offloader
