"""Data x context parallelism applied to a single-device model from outside: FSDP2 or DDP (through
accelerate), behind one interface so that the training step, clipping and checkpointing never branch
on which.

    model = parallelize(ChunkedLossLM(lm, ...), lm.model.layers, fsdp, accelerator)
    with model.grad_sync(last=i == accum - 1): model.backward(model(...))
    norm = model.clip_grad_norm(max_norm)

Both reduce gradients as a mean over all dp x cp ranks (parallel/fsdp.py), so the step's loss scaling is
the same for both.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from longstride.parallel.fsdp import apply_fsdp, full_state_dict, grad_norm_clip


class Parallelized:
    """`module`: the wrapped model (FSDP2-sharded in place, or accelerate's DDP); `fsdp` says which."""

    def __init__(self, module: torch.nn.Module, fsdp: bool, accelerator):
        self.module, self.fsdp, self.acc = module, fsdp, accelerator

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def grad_sync(self, last: bool):
        """Context for one micro-batch's forward and backward: gradients are reduced across ranks only on the
        last micro-batch of an optimizer step."""
        if self.fsdp:
            self.module.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.acc.no_sync(self.module)

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm (over every shard and rank), clipping to max_norm (inf: measure only)."""
        clip = grad_norm_clip if self.fsdp else self.acc.clip_grad_norm_
        return float(clip(self.module.parameters(), max_norm))

    def weights_saver(self, lm: torch.nn.Module) -> Callable[[str], None]:
        """A function that writes `lm` (the single-device model inside) with save_pretrained. Collective under
        FSDP2, where the full weights are gathered here: every rank calls it, the main rank then saves."""
        if not self.fsdp:
            return lambda d: self.acc.unwrap_model(self.module).lm.save_pretrained(d)
        full = {k.removeprefix("lm."): v for k, v in full_state_dict(self.module).items()}
        # a tied parameter (the LM head sharing the embedding) is written once, as DDP's save does: the gathered
        # copies no longer share storage, so the names beyond a parameter's first are dropped
        first = dict(lm.named_parameters())
        for name, _ in lm.named_parameters(remove_duplicate=False):
            if name not in first:
                full.pop(name, None)
        return lambda d: lm.save_pretrained(d, state_dict=full)

    def optimizer_state(self, optimizer) -> dict:
        """Collective: the whole optimizer state by parameter name, on the CPU (gathered from the shards under
        FSDP2), so that a run resumes on any number of processes, with or without FSDP."""
        return get_optimizer_state_dict(self.module, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        set_optimizer_state_dict(self.module, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


def parallelize(model: torch.nn.Module, layers, fsdp: bool, accelerator, mesh=None) -> Parallelized:
    """FSDP2 over all ranks of `mesh` (the run's WorldMesh; each of `layers` one unit, then the root; bf16
    compute under accelerate's bf16 mixed precision), or DDP through accelerate.prepare."""
    if not fsdp:
        return Parallelized(accelerator.prepare(model), False, accelerator)
    model.to(accelerator.device)
    bf16 = torch.bfloat16 if accelerator.mixed_precision == "bf16" else None
    return Parallelized(apply_fsdp(model, layers, accelerator.device.type, accelerator.num_processes, bf16, mesh), True,
                        accelerator)
