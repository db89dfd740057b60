"""Data x context parallelism applied to a single-device model from outside: FSDP2 or DDP (through
accelerate), behind one interface so that the training step, clipping and checkpointing never branch
on which.

    model = parallelize(ChunkedLossLM(lm, ...), decoder_layers(lm), fsdp, accelerator)
    with model.grad_sync(last=i == accum - 1): model.backward(model(...))
    norm = model.clip_grad_norm(max_norm)

Both reduce gradients as a mean over all dp x cp ranks (parallel/fsdp.py), so the step's loss scaling is
the same for both.
"""
from __future__ import annotations

import contextlib

import torch

from longstride.model.build import save_config
from longstride.parallel.fsdp import HF_SHARD_BYTES, apply_fsdp, grad_norm_clip, stream_weights
from longstride.parallel.shards import load_shards, save_shards


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

    @property
    def world(self) -> int:
        """The processes whose gradients the wrapper averages (every dp x cp rank)."""
        return self.acc.num_processes

    def grad_sync(self, last: bool):
        """Context for one micro-batch's forward and backward. DDP reduces gradients only on the last micro-batch
        of an optimizer step (its replicas hold whole gradients anyway). FSDP2 reduce-scatters after every
        micro-batch, as torchtitan does: skipping it (set_requires_gradient_sync(False)) would keep each
        parameter's whole gradient, in fp32, on every rank until the last one, which the memory plan
        (model/memory.py: gradients / world) does not count."""
        if self.fsdp:
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.acc.no_sync(self.module)

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm (over every shard and rank), clipping to max_norm (inf: measure only)."""
        clip = grad_norm_clip if self.fsdp else self.acc.clip_grad_norm_
        return float(clip(self.module.parameters(), max_norm))

    def save_weights(self, lm: torch.nn.Module, directory: str, is_main: bool,
                     shard_bytes: int = HF_SHARD_BYTES) -> None:
        """Collective: `lm` (the single-device model inside) written as an HF model directory by the main rank
        (weights, config, generation config). Under FSDP2 the weights are gathered one tensor at a time and
        written in files of at most `shard_bytes`, so the main rank never holds the whole model
        (parallel/fsdp.stream_weights); under DDP the main rank's replica is saved as it is."""
        if not self.fsdp:
            if is_main:  # files of the same size as FSDP2's, so a final's layout does not depend on the wrapper
                self.acc.unwrap_model(self.module).lm.save_pretrained(directory, max_shard_size=shard_bytes)
                save_config(lm, directory)  # the configs as every saved directory has them (KV cache on)
            return
        stream_weights(lm, directory, is_main, shard_bytes)
        if is_main:
            save_config(lm, directory)

    def save_state(self, directory: str, optimizer, background: bool = False):
        """Collective: the model and optimizer state written as per-rank shards (parallel/shards.py): FSDP2's
        shards as they are, DDP's replicas split between the ranks; nothing gathered. background: returns the
        future of the writes, the state already copied (save_shards)."""
        return save_shards(directory, self.module, optimizer, background)

    def load_state(self, directory: str, optimizer) -> None:
        """Collective: the model and optimizer state read back from shards written by any number of processes,
        with or without FSDP2, re-sharded to this run."""
        load_shards(directory, self.module, optimizer)


class OneDevice:
    """A model on one device and one process, with Parallelized's step interface and no launcher: the GPU step
    benchmark's (benchmarks/gpu_bench.py). autocast: the forward's autocast dtype (bf16, as accelerate's bf16 mixed
    precision runs it), or None."""

    world = 1

    def __init__(self, module: torch.nn.Module, autocast: torch.dtype | None = None):
        self.module, self.autocast = module, autocast

    def __call__(self, *args, **kwargs):
        device = next(self.module.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast, enabled=self.autocast is not None):
            return self.module(*args, **kwargs)

    def grad_sync(self, last: bool):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))


def parallelize(model: torch.nn.Module, layers, fsdp: bool, accelerator, mesh=None) -> Parallelized:
    """FSDP2 over all ranks of `mesh` (the run's WorldMesh; each of `layers` one unit, then the root; bf16
    compute under accelerate's bf16 mixed precision), or DDP through accelerate.prepare."""
    if not fsdp:
        return Parallelized(accelerator.prepare(model), False, accelerator)
    # not moved to the device first: fully_shard moves each unit's states as it shards them, so a GPU holds one
    # layer unsharded at a time, never the whole fp32 model
    bf16 = torch.bfloat16 if accelerator.mixed_precision == "bf16" else None
    sharded = apply_fsdp(model, layers, accelerator.device.type, accelerator.num_processes, bf16, mesh)
    if accelerator.device.type == "cuda":
        torch.cuda.empty_cache()  # the unsharded layers' blocks, in sizes the training's tensors may not reuse
    return Parallelized(sharded, True, accelerator)
