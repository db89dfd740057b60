"""FSDP2 as a stage runs it (parallel/parallelize.parallelize), on 2 gloo processes: gradient accumulation keeps
every rank's gradients sharded and ends with DDP's gradient, with full activation checkpointing of the first layer
only too (model.checkpoint_layers=1: that layer alone runs again in backward); under bf16 mixed precision with ring CP, the plans
a batch derives once (parallel/blocks.Derived) survive FSDP2's per-layer input casts instead of being built
again in every layer."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longstride.parallel.spawn import rank_accelerator, run_gloo


def _batches(rank: int) -> list[dict]:
    from tests.test_cp_model import L, packed_batch

    out = []
    for i in range(2):  # two micro-batches, each rank its own tokens
        b = packed_batch()
        g = torch.Generator().manual_seed(10 * rank + i)
        b["input_ids"] = torch.randint(2, 50, (1, L), generator=g)
        keep = b["labels"] != -100
        b["labels"][keep] = torch.roll(b["input_ids"], -1, dims=1)[keep]
        out.append(b)
    return out


def _accumulate(rank, world, fsdp: bool, ac: str = "none", layers: Optional[int] = None) -> dict:
    """Two micro-batches of one optimizer step; the whole gradient of every parameter after it, after the
    first micro-batch whether each parameter already held a gradient and its local size, and how many times each
    decoder layer's attention module ran again in the backwards (activation checkpointing `ac` of the first `layers`)."""
    from torch.distributed.tensor import DTensor

    from longstride.parallel.config import WorldMesh
    from longstride.parallel.cp import DocLayout
    from longstride.parallel.parallelize import parallelize
    from tests.test_cp_model import tiny_model

    acc = rank_accelerator(rank, world)
    inner = tiny_model(ac, layers=layers)
    names = [n for n, _ in inner.named_parameters()]
    calls = [0] * len(inner.lm.model.layers)
    for j, layer in enumerate(inner.lm.model.layers):  # transformers checkpoints forward, inside the layer's hooks
        layer.self_attn.register_forward_pre_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    model = parallelize(inner, inner.lm.model.layers, fsdp, acc, WorldMesh("cpu", world))
    first, reruns = None, [0] * len(calls)
    for i, b in enumerate(_batches(rank)):
        with model.grad_sync(last=i == 1):
            loss = model(b["input_ids"], b["labels"], b["position_ids"], doc_layout=DocLayout(b["doc_ids"]))
            before = list(calls)
            model.backward(loss / 100)
            reruns = [r + c - b for r, c, b in zip(reruns, calls, before)]
        if i == 0:
            first = {n: (p.grad is not None, p.grad.to_local().numel() if isinstance(p.grad, DTensor) else
                         (p.grad.numel() if p.grad is not None else 0), tuple(p.shape))
                     for n, p in zip(names, model.parameters())}
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in zip(names, model.parameters())}
    return {"first": first, "grads": grads, "reruns": reruns}


def _accumulation_worker(rank, world, path):
    out = {"ddp": _accumulate(rank, world, False), "fsdp": _accumulate(rank, world, True),
           "fsdp_first_layer": _accumulate(rank, world, True, "full", layers=1)}
    if rank == 0:
        torch.save(out, path)


def test_fsdp2_accumulation_keeps_gradients_sharded_and_ends_with_ddps_gradient(tmp_path):
    path = tmp_path / "grads.pt"
    run_gloo(_accumulation_worker, 2, str(path))
    out = torch.load(path)
    for name, (held, local, shape) in out["fsdp"]["first"].items():
        # reduce-scattered after the first micro-batch: rank 0's shard (the first half of dim 0), never the whole
        assert held and local == -(-shape[0] // 2) * torch.Size(shape[1:]).numel(), (name, held, local, shape)
    for run in ("fsdp", "fsdp_first_layer"):
        for name, want in out["ddp"]["grads"].items():
            got = out[run]["grads"][name]
            assert (got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1e-12), (run, name)
    # checkpoint_layers=1 under FSDP2 (its class swap keeps each layer's own flag): the first layer runs again in
    # each of the two backwards, the second never; without checkpointing neither does
    assert out["fsdp_first_layer"]["reruns"] == [2, 0] and out["fsdp"]["reruns"] == [0, 0], out


def _cast_worker(rank, world, path):
    from longstride.parallel import kernels, varlen
    from longstride.parallel.config import ParallelConfig, ParallelDims, WorldMesh
    from longstride.parallel.cp import cp_context, cp_degrees, shard_for_cp
    from longstride.parallel.parallelize import parallelize
    from tests.test_cp_model import tiny_model
    from tests.test_varlen import EMULATED

    varlen.VARLEN["torch_flash"] = EMULATED  # the CUDA varlen path, over the CPU kernel
    builds = []
    real = kernels._build_step_calls
    kernels._build_step_calls = lambda *a: builds.append(1) or real(*a)
    acc = rank_accelerator(rank, world, mixed_precision="bf16")
    par = ParallelConfig(cp_impl="ring")
    cp = cp_context("ring", ParallelDims(world, 1, world), cp_degrees(par, world, heads=4), "cpu", "torch_flash",
                    par.balance)
    inner = tiny_model()
    model = parallelize(inner, inner.lm.model.layers, True, acc, WorldMesh("cpu", world))
    local, layout = shard_for_cp(_batches(rank)[0], True, cp)
    copies = []  # a layer's doc_layout after FSDP2's pre-forward (its input casts) that is not the one passed
    for layer in inner.lm.model.layers:
        layer.register_forward_pre_hook(lambda _, args, kw: copies.append(kw["doc_layout"] is not layout),
                                        with_kwargs=True)
    loss = model(local["input_ids"], local["labels"], local["position_ids"], doc_layout=layout)
    model.backward(loss / 100)
    count = torch.tensor([len(builds), len(layout.plan.steps), len(inner.lm.model.layers), len(copies), sum(copies)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save(count.tolist(), path)


def test_the_plans_a_batch_derives_are_built_once_under_fsdp2s_input_casts(tmp_path):
    """Each ring step's packed varlen calls are built once per batch on each rank (forward and backward of every
    layer reuse them), not once per layer; every layer receives the DocLayout passed to the model, not a copy
    (FSDP2's bf16 input casts rebuild the dataclasses, lists and tuples in a layer's keyword arguments)."""
    path = tmp_path / "count.pt"
    run_gloo(_cast_worker, 2, str(path))
    builds, steps, layers, seen, copied = torch.load(path)
    assert layers == 2 and steps == 2
    assert seen == layers and copied == 0, f"{copied} of {seen} layers got a copy of the layout"
    assert builds == steps, f"{builds} builds of {steps} ring steps' calls over {layers} layers"
