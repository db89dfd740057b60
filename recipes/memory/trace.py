"""One training step of one rank, traced without running it: every aten call a stage's step makes, on fake
tensors, and the bytes it keeps alive. `longstride plan` (recipes/memory/memplan.py) and the trace tests read it.

The mode, and why: FakeTensorMode on the *cpu* device. Fake tensors carry shapes, dtypes, strides and devices
and run torch's own meta kernels, so every aten call is checked against its schema and no memory is
allocated; on the cpu device autograd runs (fake CUDA tensors abort in the autograd engine on CPU builds of
torch, and the meta device breaks the fake process group's point-to-point ops and the packed-sequence probe
of transformers' masks). The GPU program is selected explicitly rather than by the device: the attention
kernel is `torch_flash` (aten._flash_attention_forward / _backward, whose meta kernels give the kernel's
real outputs: out and a (heads, tokens) fp32 log-sum-exp, never an L x L matrix), every call of it checked
as the CUDA kernel checks its inputs (parallel/flash_contract.py); bf16 is autocast (one GPU: fp32 weights,
bf16 compute, as train.precision=bf16 runs under DDP) or FSDP2's bf16 parameters with fp32 gradient reduction
(several GPUs); CP and FSDP2 collectives go through a fake process group of the run's world size, this
process being one rank of it. Document ids stay real tensors: the ring plan is built from their values.

Memory is counted as a caching allocator's "allocated" figure: every live storage, rounded up to 512 bytes on
a GPU, plus the parameters and buffers that exist before the step. It excludes the allocator's own slack
(fragmentation, cached blocks), NCCL buffers and the CUDA context, which the plan keeps as a reserve
(configs/hardware/). Activation offload runs its CPU bookkeeping; what it moves to host memory is counted apart.

    from longstride.recipes.memory.trace import StepProgram, trace_step
    trace_step(StepProgram(config, seq_len=8192, world=8, cp=8, cp_impl="ring", degrees=CPDegrees(ring=8)))
"""
from __future__ import annotations

import contextlib
import copy
import time
import weakref
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from longstride.data.batch import collate, packed_item
from longstride.model.loss import decoder_layers
from longstride.model.memory import layer_parts
from longstride.model.offload import pinned_bytes
from longstride.parallel.attention import register
from longstride.parallel.attention_call import is_attention_op, run_inside
from longstride.parallel.config import CPDegrees, ParallelDims, WorldMesh
from longstride.parallel.cp import cp_context
from longstride.parallel.flash_contract import FlashOpCheck
from longstride.parallel.fsdp import apply_fsdp
from longstride.parallel.pattern import config_softcap
from longstride.recipes.config.schema import OptimConfig
from longstride.recipes.run.step import Step, StepSpec, build_optimizer, build_step, group_summary, loss_sum

GPU_ROUND = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


@dataclass(frozen=True)
class StepProgram:
    """What one rank runs in one training step. config: the transformers model config (RoPE base, YaRN set);
    kernel: torch_flash (the GPU program), sdpa (the CPU one) or math; step: how the step is built (checkpointing,
    offload, tiles; recipes/run/step.StepSpec); plain: transformers' own step instead (its SDPA attention, loss from
    full logits through labels=, no longstride patch), the usual baseline; docs: documents per sequence; gpu: count as
    a GPU allocator does (512-byte blocks)."""

    config: object
    seq_len: int
    micro_batch: int = 1
    world: int = 1
    cp: int = 1
    cp_impl: str = "ring"
    degrees: CPDegrees = CPDegrees()
    kernel: str = "torch_flash"
    step: StepSpec = StepSpec(checkpointing="full")
    fsdp: bool = False
    bf16: bool = True
    gpu: bool = True
    docs: int = 1
    balance: str = "zigzag"
    plain: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)  # the run's optimizer settings (its parameter groups' weight decay)

    def at(self, seq_len: int) -> "StepProgram":
        return replace(self, seq_len=seq_len)

    def with_step(self, **changes) -> "StepProgram":
        """This program with its step changed (e.g. mlp_tile=1024)."""
        return replace(self, step=replace(self.step, **changes))

    def spec(self) -> StepSpec:
        """The step as recipes/run/step.py builds it, documents masked, offload counted without a device, and not
        compiled (the trace runs on fake tensors: a compiled step's memory is the uncompiled one's, estimated)."""
        return replace(self.step, doc_masking=True, simulate_offload=True, compile=False)


def stage_program(cfg, plan, world: int, docs: int, config, gpu: bool = True, bf16: bool = True) -> StepProgram:
    """The StepProgram of a planned stage (cfg: recipes.config.schema.Config, plan: its StagePlan) for a model
    config (a training stage's loaded model's, or `longstride plan`'s read from the recipe). flash-attn has no fake
    implementation: its stages are traced on torch's flash kernel, the same algorithm and workspace; a model's
    soft-capped scores, which that kernel lacks and which move no bytes, are left out of the traced copy."""
    s = plan.stage
    kernel = plan.kernel
    if kernel == "flash_attn":
        kernel = "torch_flash"
        if config_softcap(config.get_text_config()):
            config = copy.deepcopy(config)
            config.get_text_config().attn_logit_softcapping = None
    return StepProgram(config, s.seq_len, micro_batch=s.micro_batch_size, world=world, cp=plan.dims.cp,
                       cp_impl=cfg.parallel.cp_impl, degrees=plan.degrees, kernel=kernel, step=plan.step,
                       fsdp=plan.fsdp, bf16=bf16, gpu=gpu, docs=docs, balance=plan.balance, optim=cfg.optim)


class LiveBytes(TorchDispatchMode):
    """Bytes of every live storage, counted as each op returns (the outputs' storages, once each; freed when
    the storage dies) and its peak. `host()` pauses counting: what is allocated under it is host memory."""

    def __init__(self, round_to: int = 1):
        super().__init__()
        self.round_to, self.live, self.peak, self.host_bytes = round_to, 0, 0, 0
        self.sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._host = False
        self._resize = None

    def _bytes(self, n: int) -> int:
        return -(-n // self.round_to) * self.round_to

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self.sizes:
            return
        n = 0 if self._host else self._bytes(st.nbytes())
        self.sizes[st] = n
        self.host_bytes += pinned_bytes(st.nbytes()) if self._host else 0
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def add_all(self, tensors) -> None:
        for t in tensors:
            self.add(t.to_local() if isinstance(t, DTensor) else t)

    @contextlib.contextmanager
    def host(self):
        self._host = True
        try:
            yield
        finally:
            self._host = False

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):  # let DTensor run its local ops, which are counted
            return NotImplemented
        if is_attention_op(func):  # its buffers and outputs are counted as its ops make them
            return run_inside(self, args, kwargs)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

    def __enter__(self):
        # FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_, which no dispatch
        # mode sees: count it here
        self._resize = orig = torch.UntypedStorage.resize_

        def resize_(st, size):
            before = st.nbytes()
            orig(st, size)
            if st in self.sizes and not self._host:
                delta = self._bytes(st.nbytes()) - self._bytes(before)
                self.live += delta
                self.peak = max(self.peak, self.live)
                self.sizes[st] = self._bytes(st.nbytes())

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """This process as rank `rank` of a fake process group of `world` ranks: collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group exists already: trace a step in a process without one")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def synthetic_batch(micro_batch: int, seq_len: int, docs: int) -> dict:
    """A PackedBatch (data.batch.packed_item) of `docs` equal documents per row (the last takes the remainder),
    real CPU tensors."""
    bounds = [i * seq_len // docs for i in range(docs + 1)]
    item = packed_item([np.ones(b - a, dtype=np.int64) for a, b in zip(bounds, bounds[1:])], seq_len, pad_id=0)
    return collate([item] * micro_batch)


def _build(prog: StepProgram, device: str, cp) -> Step:
    """The traced step (recipes/run/step.py; for a plain program, transformers' own model with SDPA and no step
    parts). On meta the parameters are bf16 when the program is (no autocast there), else fp32 (autocast or
    FSDP2 casts them)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "meta" and prog.bf16 else torch.float32
    register()  # a live model's config names longstride's attention, which this process may not know yet
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(prog.config, dtype=dtype)
    if prog.plain:
        lm.set_attn_implementation("sdpa")
        return Step(lm, lm, cp, prog.spec())
    return build_step(lm, prog.spec(), cp)


def _storage_bytes(tensors, round_to: int) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += -(-st.nbytes() // round_to) * round_to
    return total


def trace_step(prog: StepProgram, rank: int = 0, device: str = "cpu") -> dict:
    """Bytes one rank holds in a steady-state training step (the optimizer state exists already), and the
    model's num_params:
    parameters, gradients and optimizer state, activations (what the forward keeps for the backward),
    peak_backward (the peak of forward + backward, with the optimizer state), peak_optimizer (the update's
    own peak), peak (the larger), host (offloaded to host memory); plus the trace's seconds.

    device: cpu, the memory trace (see the module docstring); meta, the device check: the GPU program's
    tensors live on the meta device, so a host (cpu) tensor that reaches one of its ops fails as it would
    against a CUDA tensor (FakeTensorMode checks devices; a kernel's cumulative lengths are checked by
    parallel/flash_contract.py), with bf16 parameters in place of autocast."""
    t0 = time.perf_counter()
    round_to = GPU_ROUND if prog.gpu else 1
    with fake_process_group(prog.world, rank):
        # one mesh for the traced rank, as a run has; made before the fake mode (a mesh reads its ranks)
        mesh = WorldMesh("cpu", prog.world) if prog.fsdp or prog.cp > 1 else None
        cp = cp_context(prog.cp_impl, ParallelDims.from_world(prog.world, prog.cp), prog.degrees, "cpu", prog.kernel,
                        prog.balance, mesh=mesh)
        # non-fake inputs: the batch, and the small index tensors made once and cached (cumulative lengths,
        # head schedules), which stay real so that a later real run never meets a fake one
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, FlashOpCheck() as flash:
            step = _build(prog, device, cp)
            model, lm, offloader = step.module, step.lm, step.offloader
            parts = layer_parts(lm, prog.step.lean_norms)  # read before FSDP2 wraps the layers
            with unset_fake_temporarily():  # the batch's share and plan are real, as in a run
                local, layout = step.prep(synthetic_batch(prog.micro_batch, prog.seq_len, prog.docs))
            if prog.fsdp:
                apply_fsdp(model, decoder_layers(lm), "cpu", prog.world, torch.bfloat16 if prog.bf16 else None, mesh)
            opt = build_optimizer(model, prog.optim, lr=1e-4)  # the run's parameter groups
            mb = {k: mode.from_tensor(v).to(device) for k, v in local.items()}
            count = LiveBytes(round_to)
            if offloader is not None:
                pack = offloader.pack
                offloader.pack = lambda t: _host_call(count, pack, t)
            count.add_all([*model.parameters(), *model.buffers()])
            fixed = count.live
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if prog.bf16 and not prog.fsdp and \
                device == "cpu" else contextlib.nullcontext()
            with count:
                with autocast, _eager_masks(prog.plain):
                    if prog.plain:
                        loss = lm(input_ids=mb["input_ids"], labels=mb["input_ids"]).loss
                    else:
                        loss = loss_sum(model, (mb, layout), device)
                activations = count.live - fixed
                loss.backward()
                fb_peak = count.peak
                grads = _storage_bytes([p.grad for p in model.parameters() if p.grad is not None], round_to)
                count.reset_peak()
                opt.step()
                state = _storage_bytes([t for s in opt.state.values() for t in s.values()
                                        if isinstance(t, torch.Tensor) and t.dim() > 0], round_to)
                opt_peak = count.peak
            params = _storage_bytes(list(model.parameters()), round_to)
            numel = sum(p.numel() for p in model.parameters())  # the full count: a DTensor's numel is global
    return {"num_params": numel, "parameters": params, "gradients": grads, "optimizer": state, "activations": activations,
            "peak_backward": fb_peak + state, "peak_optimizer": opt_peak,
            "peak": max(fb_peak + state, opt_peak), "host": count.host_bytes, "flash_calls": flash.calls,
            "windowed_flash_calls": flash.windowed, "batch_keys": sorted(local), "optimizer_groups": group_summary(opt),
            "layer_parts": parts, "seconds": time.perf_counter() - t0}


def _trace_child(conn, prog: StepProgram) -> None:
    try:
        conn.send((True, trace_step(prog)))
    except Exception as e:  # noqa: BLE001 - handed to the parent, which reports it
        conn.send((False, f"{type(e).__name__}: {e}"))


def trace_in_child(prog: StepProgram, timeout_s: float = 600) -> dict:
    """trace_step(prog) in a fresh process: a training process has its real process group, and the trace needs
    a fake one of its own. A child still tracing after timeout_s is killed and TimeoutError raised (the other
    ranks wait in their next collective meanwhile); a child that fails or dies raises RuntimeError."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_trace_child, args=(there, prog))
    child.start()
    there.close()
    try:
        if not here.poll(timeout_s):
            raise TimeoutError(f"the memory trace took longer than {timeout_s:g} s")
        try:
            ok, value = here.recv()
        except EOFError:
            child.join(5)
            raise RuntimeError(f"the memory trace's process died (exit code {child.exitcode})") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        here.close()
    if not ok:
        raise RuntimeError(value)
    return value


@contextlib.contextmanager
def _eager_masks(on: bool):
    """transformers takes fake tensors for a compile trace and then builds the L x L causal mask that an eager
    run skips (it hands SDPA is_causal instead); the plain step (one document per row: transformers finds no
    packed sequences in its positions) is traced as it runs eagerly."""
    if not on:
        yield
        return
    from unittest import mock

    from transformers import masking_utils

    with mock.patch.object(masking_utils, "is_tracing", lambda *a, **k: False), \
            mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None):
        yield


def _host_call(count: LiveBytes, fn, *args):
    with count.host():
        return fn(*args)
