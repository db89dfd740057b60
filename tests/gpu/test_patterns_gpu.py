"""Sliding windows, chunks and sinks on torch's flash kernel (its window_size_left, the halo's pieces whose
queries are the suffix of their keys): bf16 outputs and gradients (sinks' included) against the fp64 math
path, held to the CPU flash op's own bf16 error on the same inputs (mean error at most 1.5x, as the other GPU
kernel tests); on one device, and on the halo under ring CP with 2 gloo ranks sharing the GPU. Soft-capped scores
(Gemma 2) on the CUDA math kernel, which auto runs for them where flash-attn is not installed."""
from __future__ import annotations

import pytest
import torch

from longstride.parallel.blocks import ring_plan
from longstride.parallel.config import CPDegrees, ParallelDims
from longstride.parallel.cp import cp_context
from longstride.parallel.kernels import doc_attention
from longstride.parallel.pattern import Pattern
from longstride.parallel.ring import ring_attention
from longstride.parallel.spawn import gather_cat, run_gloo
from longstride.parallel.zigzag import shard, unshard
from tests.test_ring import D, inputs, layouts

CUDA = torch.device("cuda")
PATTERNS = {"window 7": Pattern(window=7), "window 40": Pattern(window=40), "chunk 16": Pattern(chunk=16)}
H, HKV = 8, 2


def run(kernel: str, device, dtype, doc, pattern: Pattern, with_sinks: bool):
    """(out, dq, dk, dv, dsinks) of doc_attention on `device` in `dtype`."""
    q, k, v, dout = (x.to(device=device, dtype=dtype).requires_grad_(True) for x in inputs(H, HKV, torch.float64))
    sinks = (torch.linspace(-2, 2, H, dtype=torch.float32, device=device).requires_grad_(True) if with_sinks
             else None)
    out = doc_attention(q, k, v, None if doc is None else doc.to(device), D ** -0.5, kernel=kernel, pattern=pattern,
                        sinks=sinks)
    out.backward(dout.detach())
    return [out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad]


def errors(got, ref):
    return [None if g is None else (g.cpu().double() - r.cpu().double()).abs().mean().item() for g, r in zip(got, ref)]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("pname", list(PATTERNS))
def test_patterns_on_the_flash_kernel(pname, with_sinks):
    pattern = PATTERNS[pname]
    for lname, doc in layouts().items():
        ref = run("math", "cpu", torch.float64, doc, pattern, with_sinks)
        cpu = errors(run("sdpa", "cpu", torch.bfloat16, doc, pattern, with_sinks), ref)
        gpu = errors(run("torch_flash", CUDA, torch.bfloat16, doc, pattern, with_sinks), ref)
        for name, e_gpu, e_cpu in zip(("out", "dq", "dk", "dv", "dsinks"), gpu, cpu):
            if e_gpu is not None:
                assert e_gpu <= 1.5 * e_cpu + 1e-4, f"{pname} {lname} {name}: GPU {e_gpu:.2e} vs CPU {e_cpu:.2e}"


def _ring_worker(rank: int, n: int, path: str) -> None:
    torch.cuda.set_device(0)
    cp = cp_context("ring", ParallelDims(n, 1, n), CPDegrees(ring=n), "cpu", "torch_flash")
    results = {}
    for pname, pattern in PATTERNS.items():
        for lname, doc in layouts().items():
            q, k, v, dout = (x.to(CUDA, torch.bfloat16) for x in inputs(H, HKV, torch.float64))
            plan = ring_plan(doc, q.shape[0], q.shape[2], n, rank)
            ql, kl, vl = (shard(x, n, rank, dim=2).requires_grad_(True) for x in (q, k, v))
            out = ring_attention(ql, kl, vl, plan, "torch_flash", D ** -0.5, cp.ring_comm, pattern)
            out.backward(shard(dout, n, rank, dim=2))
            results[pname, lname] = [unshard(gather_cat(x.cpu()), dim=2) for x in (out.detach(), ql.grad, kl.grad,
                                                                                    vl.grad)]
    if rank == 0:
        torch.save(results, path)


def test_windows_and_chunks_under_ring_on_the_flash_kernel(tmp_path):
    path = str(tmp_path / "ring.pt")
    run_gloo(_ring_worker, 2, path)
    results = torch.load(path)
    for pname, pattern in PATTERNS.items():
        for lname, doc in layouts().items():
            ref = run("math", "cpu", torch.float64, doc, pattern, False)[:4]
            one = errors(run("torch_flash", CUDA, torch.bfloat16, doc, pattern, False)[:4], ref)
            got = errors(results[pname, lname], ref)
            for name, e_cp, e_one in zip(("out", "dq", "dk", "dv"), got, one):
                assert e_cp <= 1.5 * e_one + 1e-4, f"ring 2 {pname} {lname} {name}: {e_cp:.2e} vs one rank {e_one:.2e}"


@pytest.mark.parametrize("pname", ["causal", "window 7"])
def test_soft_capped_scores_on_cuda(pname):
    """Gemma 2's soft-capped scores on CUDA (without flash-attn, auto runs the math kernel there): bf16 outputs and
    gradients against the fp64 CPU math path, held to the same kernel's bf16 error on the CPU."""
    pattern = Pattern(window=7 if pname == "window 7" else None, softcap=2.0)
    for lname, doc in layouts().items():
        ref = run("math", "cpu", torch.float64, doc, pattern, False)
        cpu = errors(run("math", "cpu", torch.bfloat16, doc, pattern, False), ref)
        gpu = errors(run("math", CUDA, torch.bfloat16, doc, pattern, False), ref)
        for name, e_gpu, e_cpu in zip(("out", "dq", "dk", "dv"), gpu, cpu):
            assert e_gpu <= 1.5 * e_cpu + 1e-4, f"softcap {pname} {lname} {name}: GPU {e_gpu:.2e} vs CPU {e_cpu:.2e}"
