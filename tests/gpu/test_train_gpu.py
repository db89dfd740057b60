"""Training on one GPU: the micro recipe in bf16 on torch's flash kernel (loss falls, step checkpoints written in
the background verify, a killed run resumes from its checkpoint, finals reload), an FSDP2 bf16 step and resume
through torch.distributed.checkpoint's optimizer state on one rank, the side-stream activation offload (same
gradients, lower peak memory), and a compiled bf16 step (train.compile: the eager step's gradients). AdamW runs
fused, as a stage runs it on a GPU."""
from __future__ import annotations

import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from longstride.model.build import build_model
from longstride.model.checkpointing import enable_checkpointing
from longstride.model.config import ModelConfig
from longstride.model.loss import IGNORE_INDEX, ChunkedLossLM
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.cp import CPContext, DocLayout
from longstride.parallel.parallelize import parallelize
from longstride.recipes.config.plan import validate
from longstride.recipes.config.schema import OptimConfig
from longstride.recipes.run.step import build_optimizer, label_count, optimizer_step
from longstride.recipes.train import run
from tests.conftest import compose_cfg, crash_after, micro_overrides, read_metrics, run_cli

CUDA = torch.device("cuda")


def recipe(root, cache, steps: int = 30) -> list[str]:
    return micro_overrides(root, cache) + [
        "train.precision=bf16", f"recipe.stages.s1_256.steps={steps}", "recipe.stages.s1_256.lr=3e-3",
        "recipe.stages.s1_256.save_every=10"]


def test_micro_recipe_in_bf16_on_flash_kernel_loss_falls_and_finals_reload(tmp_path, cache_dir):
    """Its step checkpoints are written in the background (train.async_save: the GPU state copied to host memory,
    then written behind the steps) and verify."""
    from longstride.recipes.checkpoint.format import verify

    cfg = compose_cfg(recipe(tmp_path / "out", cache_dir) + ["train.async_save=true"])
    assert {p.kernel for p in validate(cfg, 1, "cuda").values()} == {"torch_flash"}
    finals = run(cfg)
    stage = tmp_path / "out" / "tiny" / "s1_256"
    assert [verify(str(stage / n)) for n in ("step_000010", "step_000020")] == [None, None]
    m = read_metrics(stage)
    losses = [m[s]["loss"] for s in range(1, 31)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses
    assert m[30]["val_loss"] < m[0]["val_loss"] - 0.3
    for final in finals:
        lm = AutoModelForCausalLM.from_pretrained(final).to(CUDA)
        ids = torch.randint(0, lm.config.vocab_size, (1, 64), device=CUDA)
        assert torch.isfinite(lm(ids, labels=ids).loss)


def test_killed_bf16_stage_resumes_from_its_checkpoint(tmp_path, cache_dir):
    stage1 = ["stage=s1_256"]
    clean = compose_cfg(recipe(tmp_path / "clean", cache_dir, 20) + stage1)
    run(clean)
    killed = recipe(tmp_path / "killed", cache_dir, 20) + stage1
    first = run_cli(killed, crash_after(13))
    assert first.returncode != 0
    second = run_cli(killed)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout + second.stderr
    a, b = (read_metrics(tmp_path / d / "tiny" / "s1_256") for d in ("clean", "killed"))
    for s in range(11, 21):  # resumed from step 10; flash backward sums in a nondeterministic order
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=2e-2), s


def tiny(hidden=32, layers=2, heads=4, kv=2, seq=96) -> ChunkedLossLM:
    cfg = ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, nope_interval=2)
    lm = build_model(cfg, rope_theta=1e4, seq_len=seq, vocab_size=64, eos_id=0, pad_id=1, seed=5)
    use_longstride_attention(lm)
    return ChunkedLossLM(lm, 4096)


def packed(length: int, docs: int = 5, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(length - 1, generator=g)[:docs - 1].add(1).tolist())
    lens = torch.tensor(np.diff([0, *cuts, length]))
    ids = torch.randint(2, 64, (1, length), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, :-1] = ids[0, 1:]
    labels[0, lens.cumsum(0) - 1] = IGNORE_INDEX
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)[None]
    return {k: v.to(CUDA) for k, v in {"input_ids": ids, "labels": labels,
                                        "position_ids": (torch.arange(length) - starts)[None], "doc_ids": doc}.items()}


def test_fsdp2_bf16_step_and_resume_on_one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        acc = SimpleNamespace(mixed_precision="bf16", device=CUDA, num_processes=1,
                              backward=lambda loss: loss.backward())
        b = packed(96)
        layout = DocLayout(b["doc_ids"], cp=CPContext(kernel="torch_flash"))

        def build():  # AdamW as a stage builds it on a GPU: fused (optim.implementation=auto), over DTensors
            m = tiny()
            par = parallelize(m, m.lm.model.layers, True, acc)
            opt = build_optimizer(m.lm, OptimConfig(), 1e-3, "cuda")
            assert all(g["fused"] for g in opt.param_groups)
            return par, opt

        count = torch.tensor(float(label_count((b, layout))))

        def step(par, opt) -> float:  # the stage loop's update (recipes/run/step.optimizer_step)
            return optimizer_step(par, opt, [(b, layout)], count, CUDA, grad_clip=1.0).loss

        par, opt = build()
        straight = [step(par, opt) for _ in range(3)]
        par, opt = build()
        step(par, opt)
        with tempfile.TemporaryDirectory() as shards:
            par.save_state(shards, opt)  # per-rank shards (DCP), read back into a freshly built model
            par, opt = build()
            par.load_state(shards, opt)
        resumed = [step(par, opt) for _ in range(2)]
        assert all(np.isfinite(straight)) and straight[2] < straight[0]
        assert resumed == pytest.approx(straight[1:], rel=1e-2), (straight, resumed)
    finally:
        dist.destroy_process_group()


def test_activation_offload_same_gradients_lower_peak_memory():
    b = packed(8192, docs=6)
    layout = DocLayout(b["doc_ids"], cp=CPContext(kernel="sdpa"))  # fp32: per-document SDPA on CUDA
    results = {}
    for offload in (False, True):
        m = tiny(hidden=256, layers=8, heads=4, kv=2, seq=8192).to(CUDA)
        enable_checkpointing(m.lm, "full", offload=offload)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = m(b["input_ids"], b["labels"], b["position_ids"], doc_layout=layout)
        loss.backward()
        torch.cuda.synchronize()
        results[offload] = (loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()},
                            torch.cuda.max_memory_allocated() - base)
        del m, loss
    (l0, g0, peak0), (l1, g1, peak1) = results[False], results[True]
    assert l1 == pytest.approx(l0, rel=1e-6)
    for n in g0:
        err = ((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp(min=1e-12)).item()
        assert err <= 1e-5, f"{n}: offload changes the gradient by {err:.2e}"
    assert peak1 < peak0 - 8 * 2 ** 20, f"peak {peak1 / 2**20:.1f} MiB with offload vs {peak0 / 2**20:.1f} without"


def test_this_gpus_rng_state_round_trips():
    """A rank's checkpoint holds its own GPU's generator (recipes/checkpoint/format.py); restoring it repeats the
    draws."""
    from longstride.recipes.checkpoint.format import rng_state, set_rng_state

    torch.cuda.manual_seed(3)
    state = rng_state()
    first = torch.rand(4, device=CUDA)
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device=CUDA), first)


@pytest.mark.parametrize("kernel, bf16", [("torch_flash", True), ("sdpa", False)])
def test_selective_checkpointing_keeps_the_gpu_kernels_attention_output(kernel, bf16):
    """On the CUDA kernels (torch's flash kernel in bf16, and per-document SDPA in fp32, which runs under autograd),
    selective checkpointing keeps attention's output: backward runs none of attention's forward kernels again
    (full checkpointing's does: the count's own check), and the gradients equal no checkpointing's (bf16: the flash
    backward's summation order varies, to bf16 rounding)."""
    from tests.test_cp_model import AttentionKernelCalls

    b = packed(2048, docs=4)
    layout = DocLayout(b["doc_ids"], cp=CPContext(kernel=kernel))
    results = {}
    for mode in ("none", "selective", "full"):
        m = tiny(hidden=128, layers=2, heads=4, kv=2, seq=2048).to(CUDA)
        if mode != "none":
            enable_checkpointing(m.lm, mode)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = m(b["input_ids"], b["labels"], b["position_ids"], doc_layout=layout)
        with AttentionKernelCalls() as calls:
            loss.backward()
        results[mode] = (loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters()}, calls.n)
    assert [results[m][2] > 0 for m in ("none", "selective", "full")] == [False, False, True], \
        {m: r[2] for m, r in results.items()}
    l0, g0, _ = results["none"]
    tol = 2e-2 if bf16 else 1e-5
    for mode in ("selective", "full"):
        assert results[mode][0] == pytest.approx(l0, rel=tol / 10)
        for n, g in g0.items():
            err = ((results[mode][1][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
            assert err <= tol, f"{mode} {n}: {err:.2e}"


def test_profiled_gpu_steps_hold_cuda_kernels_and_a_memory_snapshot(tmp_path):
    """profile.* on a GPU (recipes/run/profiling.py): the Chrome trace holds the steps' CUDA kernels, the log ranks
    ops by their own GPU time, and profile.memory_snapshot writes the allocator's history for memory_viz."""
    import gzip
    import json
    import pickle

    from longstride.recipes.config.schema import ProfileConfig
    from longstride.recipes.run.profiling import StepProfiler

    logged = []
    prof = StepProfiler(ProfileConfig(start_step=1, end_step=2, memory_snapshot=True), "s1", str(tmp_path), 0, CUDA,
                        logged.append)
    a = torch.randn(512, 512, device=CUDA)
    for n in (1, 2, 3):
        with prof.step(n):
            a = torch.tanh(a @ a.T / 512)
    stem = tmp_path / "profile" / "rank0-steps1-2"
    events = json.load(gzip.open(f"{stem}.json.gz"))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "CUDA kernels in the trace"
    assert [e["name"] for e in events if e.get("name", "").startswith("step ")] == ["step 1", "step 2"]
    recorded = sum(map(len, torch.cuda.memory._snapshot()["device_traces"]))
    torch.randn(1024, 1024, device=CUDA).sum()
    assert sum(map(len, torch.cuda.memory._snapshot()["device_traces"])) == recorded, "the history is off again"
    assert len(logged) == 1 and "own GPU time" in logged[0]
    with open(f"{stem}-memory.pickle", "rb") as f:  # written by this test's own run
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(t for t in snapshot["device_traces"])


def test_an_nsys_window_marks_its_steps_and_keeps_the_memory_snapshot(tmp_path):
    """profile.tool=nsys: cudaProfilerStart/Stop around the window (a no-op without nsys attached), NVTX step ranges,
    no torch.profiler files; the memory snapshot is still written."""
    from longstride.recipes.config.schema import ProfileConfig
    from longstride.recipes.run.profiling import StepProfiler

    logged = []
    prof = StepProfiler(ProfileConfig(tool="nsys", start_step=2, memory_snapshot=True), "s1", str(tmp_path), 0, CUDA,
                        logged.append)
    a = torch.randn(256, 256, device=CUDA)
    for n in (1, 2, 3):
        with prof.step(n):
            a = torch.tanh(a @ a.T / 256)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0-steps2-2-memory.pickle"]
    assert len(logged) == 1 and "steps 2-2 of rank 0 were nsys's capture range" in logged[0]


def test_a_compiled_bf16_step_on_the_flash_kernel_matches_the_eager_step():
    """train.compile on a GPU (model/compile.py): each layer's parts compiled by Inductor (Triton kernels), full
    checkpointing, torch's flash kernel outside the graphs, bf16 autocast: graphs are compiled and reused by the next
    step, and the loss and gradients equal the eager step's to bf16 rounding."""
    from torch._dynamo.utils import counters

    from longstride.model.compile import compile_layers

    b = packed(2048, docs=4)
    layout = DocLayout(b["doc_ids"], cp=CPContext(kernel="torch_flash"))
    results = {}
    for compiled in (False, True):
        m = tiny(hidden=128, layers=2, heads=4, kv=2, seq=2048).to(CUDA)
        enable_checkpointing(m.lm, "full")
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            assert compile_layers(m.lm, "full") == 8
        graphs = []
        for _ in range(2):
            m.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(b["input_ids"], b["labels"], b["position_ids"], doc_layout=layout)
            loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
        results[compiled] = (loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters()})
    assert graphs[0] >= 4 and graphs[1] == graphs[0], graphs
    (l0, g0), (l1, g1) = results[False], results[True]
    assert l1 == pytest.approx(l0, rel=2e-3)
    for n, g in g0.items():
        err = ((g1[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
        assert err <= 2e-2, f"{n}: {err:.2e}"
