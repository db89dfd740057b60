"""The CUDA varlen path checked on CPU: which kernel runs when (and the errors), the packing of documents,
rows and ring blocks into varlen calls (cu_seqlens, views, LSE layout), and the attention math through
that interface. parallel/varlen.emulate stands in for torch's flash kernel: the same contract over the CPU
flash op, asserting what the CUDA kernel requires of its inputs. On a GPU, tests/gpu runs the real kernel.
"""
from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch

from longstride.parallel import kernels, varlen
from longstride.parallel.blocks import ring_plan
from longstride.parallel.dense import DENSE
from longstride.parallel.kernels import doc_attention, doc_attention_forward, resolve_kernel, step_forward
from longstride.parallel.flash_contract import ContractError
from longstride.parallel.spawn import run_gloo
from longstride.parallel.varlen import VarlenCall, emulate, gather
from longstride.parallel.zigzag import shard
from tests import test_ring, test_ulysses
from tests.conftest import compose_cfg
from tests.test_attention import dense_reference
from tests.test_ring import B, D, L, check_ring_results, inputs, layouts

EMULATED = emulate(*DENSE["sdpa"])


def _emulate_torch_flash() -> None:
    varlen.VARLEN["torch_flash"] = EMULATED


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setitem(varlen.VARLEN, "torch_flash", EMULATED)


def seq_major(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) laid out as transformers lays q/k/v out: over a (B, L, H, D) buffer."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def test_documents_of_every_row_are_one_call_over_views(emulated):
    bounds = [((0, 1), (1, 7), (7, 12)), ((0, 12),)]
    call = kernels._doc_call(bounds, 12)
    assert call.cu_q == call.cu_k == [0, 1, 7, 12, 24] and call.max_q == 12 and call.causal
    q = seq_major(torch.randn(2, 4, 12, 8))
    packed = gather(q, call.q_ranges)
    assert packed.shape == (24, 4, 8) and packed.data_ptr() == q.data_ptr(), "rows in order are packed as a view"
    assert torch.equal(packed[12:24], q[1].transpose(0, 1))
    # ranges out of order are gathered (a copy) in the order given
    picked = gather(q, [(12, 14), (0, 2)])
    assert torch.equal(picked, torch.cat([q[1, :, 0:2].transpose(0, 1), q[0, :, 0:2].transpose(0, 1)]))


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doc_attention_through_the_varlen_interface(emulated, heads, dtype):
    # out, LSE and gradients of the one-call path against the per-document kernel and the fp64 reference
    h, hkv = heads
    for lname, doc in layouts().items():
        g = torch.Generator().manual_seed(1)
        q, k, v, dout = (torch.randn(B, n, L, D, generator=g).to(dtype) for n in (h, hkv, hkv, h))
        q, k, v = map(seq_major, (q, k, v))
        results = {}
        for kernel in ("torch_flash", "sdpa"):
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = doc_attention(*x, doc, D ** -0.5, kernel)
            out.backward(dout)
            bounds = kernels.doc_bounds(doc) if doc is not None else [[(0, L)]] * B
            _, lse = doc_attention_forward(q, k, v, bounds, kernel, D ** -0.5)
            results[kernel] = [out.detach(), lse, *(t.grad for t in x)]
        got, per_doc = results["torch_flash"], results["sdpa"]
        assert got[1].shape == (B, h, L) and got[1].dtype == torch.float32
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, per_doc):
            err = (a.double() - b.double()).abs().max().item()
            assert err <= tol, f"{lname} {heads} {dtype} {name}: varlen vs per document {err:.2e}"
        ids = doc if doc is not None else torch.zeros(B, L, dtype=torch.long)
        ref = dense_reference(q, k, v, ids, D ** -0.5)
        err = (got[0].double() - ref).abs().max().item()
        assert err <= (1e-5 if dtype == torch.float32 else 3e-2), f"{lname} {heads} {dtype}: vs fp64 {err:.2e}"


def test_a_broadcast_output_gradient_reaches_the_kernel_dense(emulated):
    """out.sum().backward() hands attention a gradient with stride 0 in every dimension; CUDA's flash backward (and
    the emulation) needs a dense last dimension, so it is made dense first. The gradients match the per-document
    kernel's."""
    q, k, v = (seq_major(torch.randn(B, 4, L, D, generator=torch.Generator().manual_seed(i))) for i in range(3))
    doc = layouts()["docs_random"]
    grads = {}
    for kernel in ("torch_flash", "sdpa"):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        doc_attention(*x, doc, D ** -0.5, kernel).sum().backward()
        grads[kernel] = [t.grad for t in x]
    for name, a, b in zip(("dq", "dk", "dv"), grads["torch_flash"], grads["sdpa"]):
        assert (a - b).abs().max().item() <= 1e-5, name


def test_a_ring_step_is_one_call_per_mask_kind_over_all_rows(emulated):
    calls = []

    def counting(*a, **kw):
        calls.append(kw["causal"])
        return EMULATED.forward(*a, **kw)

    varlen.VARLEN["torch_flash"] = varlen.Varlen(counting, EMULATED.backward)
    doc = layouts()["docs_spanning"]
    n = 3
    q, k, v, _ = inputs(8, 2, torch.float32)
    for rank in range(n):
        plan = ring_plan(doc, B, L, n, rank)
        loc = [seq_major(shard(x, n, rank, dim=2)) for x in (q, k, v)]
        for t, step in enumerate(plan.steps):
            calls.clear()
            got = list(step_forward("torch_flash", *loc, plan, t, D ** -0.5))
            want = list(step_forward("sdpa", *loc, plan, t, D ** -0.5))
            kinds = {b.segments is not None for _, blocks in step for b in blocks}
            assert sorted(calls) == sorted(kinds), f"rank {rank} step {t}: {len(calls)} calls for kinds {kinds}"
            built = plan.derived[("varlen", t)]
            list(step_forward("torch_flash", *loc, plan, t, D ** -0.5))  # a second layer: the same packed calls
            assert plan.derived[("varlen", t)] is built
            # the same blocks (one per row here), the same outputs and LSE
            per_row = {(r.start, b): (o, l) for r, b, o, l in got}
            for rows, b, o, l in want:
                for i, row in enumerate(range(rows.start, rows.stop)):
                    o2, l2 = per_row[row, b]
                    assert torch.allclose(o2[0], o[i], atol=1e-6) and torch.allclose(l2[0], l[i], atol=1e-6)


def _ring_emulated(rank: int, n: int, path: str) -> None:
    _emulate_torch_flash()
    test_ring._ring_worker(rank, n, "torch_flash", path)


@pytest.mark.parametrize("n", [3])  # an odd ring; ring 2 runs inside the hybrid test below
def test_ring_through_the_varlen_interface_matches_single_process(n, tmp_path):
    path = str(tmp_path / "ring.pt")
    run_gloo(_ring_emulated, n, path)
    check_ring_results(n, torch.load(path))


def _hybrid_emulated(rank: int, world: int, ring: int, path: str) -> None:
    _emulate_torch_flash()
    test_ulysses._worker(rank, world, ring, path, "torch_flash")


def test_hybrid_and_upipe_through_the_varlen_interface_match_single_process(tmp_path):
    path = str(tmp_path / "hybrid.pt")
    run_gloo(_hybrid_emulated, 4, 2, path)
    test_ulysses.check_results(2, 2, torch.load(path))


# ---- which kernel runs when, and the errors ----

@pytest.fixture
def cuda_kernels(monkeypatch):
    """As on a CUDA machine with torch's flash attention and without flash-attn."""
    monkeypatch.setitem(kernels._AVAILABLE, "torch_flash", lambda: True)
    monkeypatch.setitem(kernels._AVAILABLE, "flash_attn", lambda: False)


def test_auto_picks_torch_flash_on_cuda_in_bf16_and_cpu_kernels_elsewhere(cuda_kernels):
    assert resolve_kernel("auto", "cuda", ring=False, half=True) == "torch_flash"
    assert resolve_kernel("auto", "cuda", ring=True, half=True) == "torch_flash"
    assert resolve_kernel("auto", "cuda", ring=False, half=False) == "sdpa"  # SDPA per document in fp32
    assert resolve_kernel("auto", "cuda", ring=True, half=False) == "math"
    assert resolve_kernel("auto", "cpu", ring=True, half=False) == "sdpa"
    assert resolve_kernel("torch_flash", "cuda", ring=True) == "torch_flash"
    assert resolve_kernel("math", "cuda", ring=True, half=False) == "math"
    # heads the flash kernels do not take (multiples of 8 up to 256): auto falls back, an explicit choice is refused
    assert resolve_kernel("auto", "cuda", ring=False, half=True, head_dim=128) == "torch_flash"
    assert resolve_kernel("auto", "cuda", ring=False, half=True, head_dim=60) == "sdpa"
    assert resolve_kernel("auto", "cuda", ring=True, half=True, head_dim=288) == "math"
    with pytest.raises(ValueError, match=r"parallel.kernel=torch_flash: the model's head size 60 is not one the "
                                         r"flash kernels take"):
        resolve_kernel("torch_flash", "cuda", ring=True, head_dim=60)


def test_the_plan_picks_a_kernel_for_the_models_head_size():
    """longstride plan on GPUs: a model whose heads the flash kernels take runs torch_flash; one with head size 36
    runs math in its ring stages (the flash kernel would fail at the first forward)."""
    from longstride.recipes.config.plan import validate

    base = ["recipe=tiny", "train.precision=bf16", "model.hidden_size=144", "model.num_attention_heads=4",
            "model.num_key_value_heads=2"]
    for head_dim, want in ((None, "math"), (32, "torch_flash")):
        over = base + ([f"model.head_dim={head_dim}"] if head_dim else [])  # 144 / 4 = 36 by default
        plans = validate(compose_cfg(over), 2, "cuda", assume_gpu=True, check_data=False)
        assert {p.kernel for p in plans.values() if p.stage.cp > 1} == {want}, (head_dim, plans)


def test_kernel_errors_name_the_field_and_the_fix(cuda_kernels):
    cases = {("torch_flash", "cpu", True): r"parallel.kernel=torch_flash needs CUDA",
             ("flash_attn", "cuda", True): r"parallel.kernel=flash_attn needs CUDA and flash_attn; pip install",
             ("torch_flash", "cuda", False): r"runs bf16/fp16 attention but this run is fp32; set train.precision",
             ("sdpa", "cuda", True): r"parallel.kernel=sdpa: ring attention's sdpa blocks are the CPU flash op"}
    for (kernel, device, half), msg in cases.items():
        with pytest.raises(ValueError, match=msg):
            resolve_kernel(kernel, device, ring=True, half=half)


def test_flash_impl_needs_torch_flash_and_its_package():
    from longstride.recipes.config.plan import validate

    with pytest.raises(ValueError, match=r"parallel.flash_impl=FA3 applies to parallel.kernel=torch_flash"):
        validate(compose_cfg(["parallel.flash_impl=FA3"]), 2)
    with pytest.raises(ValueError, match=r"parallel.flash_impl=FA3 could not be activated"):
        kernels.activate_flash_impl("FA3")  # no FA3 package here
    kernels.activate_flash_impl("FA2")  # torch's own: nothing to do


def test_flash_kernels_refuse_fp32_and_unexpected_lse_layouts():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"parallel.kernel=torch_flash runs fp16/bf16 attention, got torch.float32"):
        varlen._torch_flash_forward(q, q, q, cu, cu, 6, 6, 0.1, True)
    with pytest.raises(RuntimeError, match=r"expected the unpadded varlen layout \(heads, tokens\) = \(2, 6\)"):
        varlen._packed_lse(torch.zeros(1, 2, 8), q)


def test_emulated_kernel_checks_what_cuda_requires():
    q = torch.randn(6, 2, 8)
    with pytest.raises(ContractError, match="cu_seqlens_q must be a contiguous 1-D int32 tensor, got torch.int64"):
        EMULATED.forward(q, q, q, torch.tensor([0, 6]), torch.tensor([0, 6]), 6, 6, 0.1, True)
    with pytest.raises(ContractError, match=r"cumulative lengths \[0, 5\] with max 5: .* end at the 6 packed"):
        cu = torch.tensor([0, 5], dtype=torch.int32)
        EMULATED.forward(q, q, q, cu, cu, 5, 5, 0.1, True)
    with pytest.raises(ValueError, match="square"):
        VarlenCall([(0, 0, 4, 0, 6)], 8, causal=True)


def test_sdpa_per_document_repeats_gqa_heads_and_matches(emulated):
    # the fp32 CUDA fallback (SDPA per document) runs device-agnostic code: checked here on CPU tensors
    q, k, v, _ = inputs(9, 3, torch.float32)
    doc = layouts()["docs_random"]
    got = kernels._sdpa_per_document(q, k, v, kernels.doc_bounds(doc), D ** -0.5)
    want = doc_attention(q, k, v, doc, D ** -0.5, "sdpa")
    assert (got - want).abs().max().item() <= 1e-5


def test_trainer_cp_reads_half_precision_from_training_arguments(cuda_kernels, monkeypatch):
    from longstride.recipes.hf.trainer import setup_cp

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what TrainingArguments(bf16=True) sets
    assert setup_cp(1, 8, device_type="cuda").kernel == "torch_flash"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what accelerate launch sets when not told: no answer
    with pytest.raises(ValueError, match="setup_cp: pass args=<your TrainingArguments>"):
        setup_cp(1, 8, device_type="cuda")
    assert setup_cp(1, 8, device_type="cuda", half=False).kernel == "sdpa"


# ---- soft-capped scores (Gemma 2): math and flash-attn only ----

def test_a_soft_capped_model_gets_a_kernel_that_caps(cuda_kernels, monkeypatch):
    """auto picks flash_attn where it would run and soft-caps in training, else math; sdpa and torch_flash are
    refused naming the fix, and so is flash_attn where it cannot soft-cap."""
    assert resolve_kernel("auto", "cpu", ring=True, half=False, softcap=True) == "math"
    assert resolve_kernel("auto", "cuda", ring=False, half=True, softcap=True) == "math"  # flash-attn not installed
    monkeypatch.setitem(kernels._AVAILABLE, "flash_attn", lambda: True)
    old = "flash-attn 2.6.1 has no soft-capped backward (upgrade to >= 2.6.2)"
    monkeypatch.setattr(kernels, "flash_attn_softcap_problem", lambda: old)
    assert resolve_kernel("auto", "cuda", ring=True, half=True, softcap=True) == "math"
    with pytest.raises(ValueError, match=r"parallel.kernel=flash_attn with soft-capped scores: flash-attn 2.6.1 "):
        resolve_kernel("flash_attn", "cuda", ring=True, half=True, softcap=True)
    assert resolve_kernel("flash_attn", "cuda", ring=True, half=True) == "flash_attn"  # no cap: any release
    assert resolve_kernel("auto", "cuda", half=True, softcap=True, assume_available=True) == "flash_attn"  # planning
    monkeypatch.setattr(kernels, "flash_attn_softcap_problem", lambda: None)
    assert resolve_kernel("auto", "cuda", ring=True, half=True, softcap=True) == "flash_attn"
    assert resolve_kernel("auto", "cuda", ring=True, half=False, softcap=True) == "math"
    assert resolve_kernel("auto", "cuda", ring=True, half=True, head_dim=60, softcap=True) == "math"
    assert resolve_kernel("math", "cuda", ring=True, half=True, softcap=True) == "math"
    for kernel in ("sdpa", "torch_flash"):
        with pytest.raises(ValueError, match=f"parallel.kernel={kernel} has no logit soft-capping"):
            resolve_kernel(kernel, "cuda", ring=False, half=True, softcap=True)


def _fake_flash_attn(monkeypatch, with_softcap: bool = True, version: str = "2.8.3"):
    """flash-attn's varlen forward and backward under their own argument names, computed by the math kernel."""
    import sys
    import types

    math = emulate(*DENSE["math"])
    window = lambda left: None if left < 0 else left + 1  # noqa: E731

    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
            causal=False, window_size=(-1, -1), softcap=0.0, return_attn_probs=False):
        out, lse = math.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                window(window_size[0]), softcap or None)
        return out, lse, None

    def old_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), return_attn_probs=False):
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, 0.0, return_attn_probs)

    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.flash_attn_varlen_func = fwd if with_softcap else old_fwd
    package.flash_attn_interface = types.SimpleNamespace(_flash_attn_varlen_backward=_flash_attn_backward_op())
    monkeypatch.setitem(sys.modules, "flash_attn", package)


@functools.lru_cache(maxsize=None)
def _flash_attn_backward_op():
    """flash-attn >= 2.7's varlen backward: a torch.library custom op (its own signature is (*args, **kwargs): read
    from it, the call was handed no argument), computed by the math kernel."""
    math = emulate(*DENSE["math"])

    @torch.library.custom_op("longstride_test::flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
            causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
            alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
            rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> None:
        grads = math.backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, None if window_size_left < 0 else window_size_left + 1,
                              softcap or None)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)

    return bwd


def test_flash_attn_is_handed_the_soft_cap(monkeypatch):
    """Document-masked attention with a soft-cap through flash-attn's argument names (a stand-in computed by the
    math kernel) equals the math kernel's, forward and backward, with and without a window; without the cap it
    would differ. The backward is a torch.library custom op, as from flash-attn 2.7 on: its (*args, **kwargs)
    signature made every call drop every argument. A flash-attn release before 2.6.2 (its backward ignores the
    cap), a ROCm build (it ignores the cap) and a build whose function takes no softcap are refused rather than run
    uncapped."""
    from longstride.parallel.pattern import Pattern

    _fake_flash_attn(monkeypatch)
    q, k, v, dout = inputs(4, 2, torch.bfloat16)
    q, k = q * 3, k * 3  # scores of several units: the cap of 2 bends them
    doc = layouts()["docs_random"]

    def run(kernel, pattern):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = doc_attention(*x, doc, D ** -0.5, kernel, pattern=pattern)
        out.backward(dout)
        return [out.detach().float()] + [t.grad.float() for t in x]

    for window in (None, 9):
        capped = Pattern(window, softcap=2.0)
        want = run("math", capped)
        for got, ref in zip(run("flash_attn", capped), want):
            assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()
        uncapped = run("math", Pattern(window))
        assert (uncapped[0] - want[0]).abs().max() > 0.1 * want[0].abs().max(), "the cap matters here"
    _fake_flash_attn(monkeypatch, version="2.6.1")
    with pytest.raises(ValueError, match=r"flash-attn 2.6.1 has no soft-capped backward \(upgrade to >= 2.6.2\)"):
        run("flash_attn", Pattern(softcap=2.0))
    run("flash_attn", Pattern())  # without a cap, that release runs
    _fake_flash_attn(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", "6.3")
    with pytest.raises(ValueError, match="flash-attn's ROCm build ignores softcap"):
        run("flash_attn", Pattern(softcap=2.0))
    monkeypatch.setattr(torch.version, "hip", None)
    _fake_flash_attn(monkeypatch, with_softcap=False)
    with pytest.raises(ValueError, match="this flash-attn build.s old_fwd takes no softcap"):
        run("flash_attn", Pattern(softcap=2.0))


def test_flash_attn_calls_pass_the_window_each_release_takes_and_refuse_one_without_windows():
    """flash-attn's varlen functions took the window as `window_size` (a pair, <= 2.6) or as two ints (later); a
    release without windows (< 2.3) was handed none, so a sliding layer attended to its whole document: refused."""
    from longstride.parallel.varlen import _flash_call

    def pair(q, window_size=(-1, -1), softcap=0.0):
        return window_size

    def ints(q, window_size_left=-1, window_size_right=-1, softcap=0.0):
        return window_size_left, window_size_right

    def old(q, softmax_scale=None):
        return "called"

    assert _flash_call(pair, q=0, window=8) == (7, 0) and _flash_call(ints, q=0, window=8) == (7, 0)
    assert _flash_call(pair, q=0) == (-1, -1) and _flash_call(old, q=0) == "called"
    with pytest.raises(ValueError, match="takes no window size, and this layer attends within a window of 8"):
        _flash_call(old, q=0, window=8)
