"""One training step's parts, built in one place: the stage loop (recipes/run/stage.py), the memory tracer
(recipes/memory/trace.py, which `longstride plan` runs) and the benchmarks build their model, attention, loss and
optimizer here, so what is traced and measured is the model that trains; the stage loop and the GPU step benchmark
(benchmarks/gpu_bench.py) also share the update around them (optimizer_step: micro-batch accumulation over the
global token count, the gradient norm and clipping, the update unless the non-finite guard says no, the schedule).

    step = build_step(lm, StepSpec(...), cp)       # the model patched, longstride's attention on, the loss wrapped
    local = step.prep(batch)                        # this rank's share of a PackedBatch and its attention layout
    loss = loss_sum(step.module, local, device)     # the summed token loss of that share (the model's forward)
    optimizer = build_optimizer(step.lm, optim, lr)  # AdamW over the run's parameter groups
    model = parallelize(step.module, ...)           # DDP or FSDP2 (parallel/parallelize.py)
    done = optimizer_step(model, optimizer, [local, ...], count, device, grad_clip, scheduler, allow)

A PackedBatch has data.batch.BATCH_KEYS (made by data.batch.packed_item / collate); the forward reads
STEP_KEYS of it, and the attention layout carries the documents.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.profiler import record_function

from longstride.host_copy import to_device
from longstride.model.compile import compile_layers, compiled_loss_tile
from longstride.model.loss import IGNORE_INDEX, ChunkedLossLM
from longstride.model.prepare import patch_model
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.collectives import all_reduce
from longstride.parallel.cp import CPContext, DocLayout, shard_for_cp
from longstride.parallel.pattern import model_patterns
from longstride.recipes.run.schedule import param_groups

STEP_KEYS = ("input_ids", "labels", "position_ids")  # what the loss forward reads of a PackedBatch


@dataclass(frozen=True)
class StepSpec:
    """How a stage's step is built (recipes/config/plan.StagePlan resolves these per stage): activation checkpointing
    mode, offload of checkpointed inputs, MLP tile tokens (0: off), the lean RMSNorm backward, the loss's tile
    tokens, document masking; simulate_offload: count offloaded bytes without a device (the tracer);
    checkpoint_layers: the decoder layers checkpointed, the first N (None: every one); compile: torch.compile of each
    decoder layer's parts, their tiles and the loss's tile (model/compile.py)."""

    checkpointing: str = "none"
    offload: bool = False
    mlp_tile: int = 0
    lean_norms: bool = True
    loss_tile: int = 1024
    doc_masking: bool = True
    simulate_offload: bool = False
    checkpoint_layers: Optional[int] = None  # checkpoint the first N decoder layers only; None: every layer
    compile: bool = False


@dataclass
class Step:
    """A built step: the transformers model, the module whose forward returns the summed token loss, this
    rank's CP context (with the model's layer patterns), the offloader of checkpointed inputs (or None) and how many
    modules torch.compile compiles (0: none)."""

    lm: torch.nn.Module
    module: ChunkedLossLM
    cp: CPContext
    spec: StepSpec
    offloader: Optional[object] = None
    compiled: int = 0

    def prep(self, batch: dict) -> tuple[dict, DocLayout]:
        """A full PackedBatch -> this rank's share of it and its attention layout."""
        return shard_for_cp(batch, self.spec.doc_masking, self.cp)


def build_step(lm: torch.nn.Module, spec: StepSpec, cp: Optional[CPContext] = None) -> Step:
    """Patches `lm` as the spec says (model/prepare.py), switches on longstride's attention, compiles the layers'
    parts, tiles and loss tile if the spec says so (model/compile.py) and wraps the chunked loss; cp: this rank's
    CPContext (one device when None), completed with the model's layer patterns (what the document balancer
    weighs)."""
    offloader = patch_model(lm, spec.checkpointing, spec.offload, spec.mlp_tile, spec.lean_norms,
                            simulate_offload=spec.simulate_offload, checkpoint_layers=spec.checkpoint_layers,
                            compile_tiles=spec.compile).offloader
    use_longstride_attention(lm)
    compiled = compile_layers(lm, spec.checkpointing) if spec.compile else 0
    cp = dataclasses.replace(cp or CPContext(), patterns=model_patterns(lm))
    loss = ChunkedLossLM(lm, spec.loss_tile, compiled_loss_tile() if spec.compile else None)
    return Step(lm, loss, cp, spec, offloader, compiled)


def loss_sum(module, local: tuple[dict, DocLayout], device) -> torch.Tensor:
    """Summed token loss of this rank's share of one PackedBatch (moved to `device`); module: Step.module or
    what wraps it (parallel/parallelize.py)."""
    mb, layout = local
    mb = {k: to_device(mb[k], device) for k in STEP_KEYS}  # on CUDA without blocking: the host queues ahead
    return module(mb["input_ids"], mb["labels"], mb["position_ids"], doc_layout=layout)


def label_count(local: tuple[dict, DocLayout]) -> int:
    return int((local[0]["labels"] != IGNORE_INDEX).sum())


def next_micro_batches(loader, accum: int, prep: Callable, pairs: Optional[Callable] = None
                       ) -> tuple[list[tuple[dict, DocLayout]], torch.Tensor]:
    """A step's `accum` PackedBatches from `loader`, each prep'd to this rank's share, and the step's totals over
    every rank (float64, exact to 2^53): its labelled tokens and pairs(doc_ids) summed over its batches (0 without
    `pairs`). Collective: a rank whose data failed (a streamed record it cannot decode, a share with no usable
    document) raises its own error, every other one a ValueError naming another rank, in the all-reduce the totals
    take anyway, instead of waiting there for a rank that has left."""
    error, micro, local = None, [], [0.0, 0.0]
    try:
        batches = [next(loader) for _ in range(accum)]
        local[1] = float(sum(pairs(b["doc_ids"]) for b in batches)) if pairs is not None else 0.0  # whole rows
        micro = [prep(b) for b in batches]
        local[0] = float(sum(label_count(m) for m in micro))
    except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
        error = e
    totals = all_reduce(torch.tensor([*local, float(error is not None)], dtype=torch.float64))
    if error is not None:
        raise error
    if totals[2]:
        raise ValueError("another rank failed to read or prepare this step's data (its log says why)")
    return micro, totals[:2]


@dataclass(frozen=True)
class Update:
    """What one optimizer step did: the mean token loss over every micro-batch and rank, the global gradient norm
    (before clipping), the learning rate the update applied (or would have) and whether it was applied."""

    loss: float
    grad_norm: float
    lr: float
    applied: bool


def optimizer_step(model, optimizer: torch.optim.Optimizer, micro: Sequence[tuple[dict, DocLayout]],
                   count: torch.Tensor, device, grad_clip: float, scheduler=None,
                   allow: Optional[Callable[[float, float], bool]] = None) -> Update:
    """One optimizer step over this rank's micro-batches (each `step.prep`'s share of a PackedBatch): forward and
    backward of each, the global gradient norm (clipped to grad_clip when > 0), then the update and the schedule's
    step unless allow(loss, grad_norm) says no (the stage's non-finite guard, recipes/run/faults.py); the gradients
    are cleared either way. model: a Parallelized (parallel/parallelize.py); count: the labelled tokens of the step
    over every micro-batch and rank (a tensor on the host). The update is that of the global token sum / count, for
    any accumulation, dp and cp."""
    summed = torch.zeros((), dtype=torch.float32, device=device)  # on the device: no host sync per micro-batch
    count = count.clamp(min=1)
    scale = model.world / count.item()
    for i, mb in enumerate(micro):  # each micro-batch a range of its own in a profile's trace
        with model.grad_sync(last=i == len(micro) - 1), record_function(f"micro-batch {i + 1}"):
            part = loss_sum(model, mb, device)
            # DDP and FSDP2 average gradients over all dp x cp ranks; each CP rank holds part of the sequence's
            # gradient (its tokens' loss, plus the dK/dV its ring received), so scaling by world makes the
            # update the global sum / global count.
            model.backward(part * scale)
        summed += part.detach().float()
    with record_function("gradient norm"):  # the global norm: the non-finite check needs it, clipping or not
        grad_norm = model.clip_grad_norm(grad_clip if grad_clip > 0 else math.inf)
    lr = optimizer.param_groups[0]["lr"]
    loss = (all_reduce(summed) / count).item()
    applied = allow is None or allow(loss, grad_norm)
    if applied:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return Update(loss, grad_norm, lr, applied)


def group_summary(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's size and settings (not its tensors): what two builds of a step compare."""
    return [{"numel": sum(p.numel() for p in g["params"]), "tensors": len(g["params"]),
             **{k: v for k, v in g.items() if k in ("weight_decay", "betas", "eps")}} for g in optimizer.param_groups]


IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


def adamw_implementation(name: str, device_type: Optional[str]) -> dict:
    """AdamW's `fused` / `foreach` options for optim.implementation `name` on `device_type`; None: not known (the
    memory trace, on fake or meta tensors that have no fused kernel), torch's own choice whatever the name. auto:
    fused on CUDA, torch's choice elsewhere."""
    if name != "auto" and name not in IMPLEMENTATIONS:
        raise ValueError(f"optim.implementation={name!r}: use auto or one of {sorted(IMPLEMENTATIONS)}")
    if device_type is None:
        return {}
    if name == "auto":
        return {"fused": True} if device_type == "cuda" else {}
    return IMPLEMENTATIONS[name]


def build_optimizer(model: torch.nn.Module, optim, lr: float, device_type: Optional[str] = None) -> torch.optim.AdamW:
    """AdamW over the run's parameter groups (recipes/run/schedule.param_groups: no decay on norms, biases and
    embeddings); optim: recipes.config.schema.OptimConfig, its implementation resolved for `device_type`
    (adamw_implementation)."""
    return torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=lr, betas=tuple(optim.betas),
                             eps=optim.eps, **adamw_implementation(str(optim.implementation), device_type))
