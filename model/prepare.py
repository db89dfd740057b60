"""A stage's memory patches on a built transformers model, in one step that can be undone.

`patch_model` decides every module's forward first and then sets them all: the lean RMSNorm forward
(model/rmsnorm.py) where a norm computes the Llama formula, the tiled forwards of each layer's
position-wise parts (model/tiling.py), whose tiles call the forward each module would otherwise have (so
a norm folded into the tiles normalises with the lean backward), then activation checkpointing and its
offload (model/checkpointing.py), which wrap whole decoder layers and so compose with whatever runs inside
them. The returned `Patched` remembers each module's forward from before, and `undo()` gives them back,
turns checkpointing off and removes the offload hooks. Parameters, their names and saved checkpoints stay
plain transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from longstride.model.checkpointing import disable_checkpointing, enable_checkpointing
from longstride.model.compile import compile_tile
from longstride.model.loss import decoder_layers
from longstride.model.offload import ActivationOffload
from longstride.model.rmsnorm import lean_forwards
from longstride.model.tiling import tiled_forwards

_PATCHED = "_longstride_patched"  # set on a patched model (the instance, never a module-level table)


@dataclass
class Patched:
    """What patch_model changed on one model: how many norms went lean, how many layers are tiled, the
    checkpointing mode, the offloader (or None), and each patched module's forward from before (None: its
    class's)."""

    model: torch.nn.Module
    lean_norms: int = 0
    tiled_layers: int = 0
    checkpointing: str = "none"
    offloader: Optional[ActivationOffload] = None
    before: dict = field(default_factory=dict)

    def undo(self) -> None:
        """The model as it was built: every forward back, checkpointing off, no offload hooks."""
        for module, forward in self.before.items():
            if forward is None:
                vars(module).pop("forward", None)
            else:
                module.forward = forward
        self.before = {}
        if self.checkpointing != "none":
            disable_checkpointing(self.model)
        if self.offloader is not None:
            self.offloader.detach()
        vars(self.model).pop(_PATCHED, None)


def patch_model(lm: torch.nn.Module, checkpointing: str, offload: bool, mlp_tile: int, lean_norms: bool,
                simulate_offload: bool = False, checkpoint_layers: Optional[int] = None,
                compile_tiles: bool = False) -> Patched:
    """checkpointing: none | full | selective; offload: checkpointed inputs to pinned host memory (CUDA);
    simulate_offload: the same bookkeeping on CPU tensors (tests, a traced step); mlp_tile: tokens per tile,
    0 = off; lean_norms: model.lean_rms_norm; checkpoint_layers: checkpoint the first N decoder layers only (None:
    all); compile_tiles: each tile's function through torch.compile (train.compile, model/compile.py). A model is
    patched once: undo() before patching it again."""
    if vars(lm).get(_PATCHED):
        raise ValueError(f"{type(lm).__name__} is already patched; call .undo() on its Patched first")
    lean = lean_forwards(lm) if lean_norms else {}
    tiled = tiled_forwards(lm, mlp_tile, lambda m: lean.get(m, m.forward), compile_tile if compile_tiles else None)
    forwards = {**lean, **tiled}
    done = Patched(lm, lean_norms=len(lean), tiled_layers=len(decoder_layers(lm)) if tiled else 0,
                   checkpointing=checkpointing)
    for module, forward in forwards.items():
        done.before[module] = vars(module).get("forward")
        module.forward = forward
    try:
        done.offloader = enable_checkpointing(lm, checkpointing, offload=offload and not simulate_offload,
                                              simulate_offload=offload and simulate_offload, layers=checkpoint_layers)
    except Exception:
        done.checkpointing = "none"
        done.undo()  # a refused mode or offload leaves the model as it was built, never half patched
        raise
    vars(lm)[_PATCHED] = True
    return done
