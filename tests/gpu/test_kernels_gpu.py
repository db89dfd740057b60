"""Each CUDA attention kernel against the fp64 dense reference, with documents (length-1 documents, documents
spanning ring chunks) and GQA: out, LSE, dQ, dK, dV. torch_flash (and flash_attn where installed) in bf16 and
fp16, held to the CPU tests' bf16 rule (mean error at most 1.5x the CPU flash op's in the same dtype, LSE within
2e-2); the fp32 kernels on CUDA (math, and sdpa on one device) within 1e-5 as on CPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_kernel_figures import run_kernel
from longstride.parallel.kernels import doc_attention
from longstride.parallel.varlen import flash_attn_available
from tests.test_ring import D, HEADS, inputs, layouts, reference

CUDA = torch.device("cuda")


def kernels_to_test():
    return ["torch_flash"] + (["flash_attn"] if flash_attn_available() else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", kernels_to_test())
def test_flash_kernels_against_fp64_reference(kernel, dtype):
    for lname, doc in layouts().items():
        for hname, (h, hkv) in HEADS.items():
            ref = reference(*inputs(h, hkv, torch.float64), doc)
            cpu = run_kernel("sdpa", *inputs(h, hkv, dtype), doc)
            got = run_kernel(kernel, *(t.to(CUDA) for t in inputs(h, hkv, dtype)), None if doc is None else doc.to(CUDA))
            case = f"{kernel} {dtype} {lname} {hname}"
            assert got[1].dtype == torch.float32 and got[1].shape == ref[1].shape, case
            err = (got[1].cpu() - ref[1]).abs().max().item()
            assert err <= 2e-2, f"{case} lse: max error {err:.2e}"
            for name, g, c, r in zip(("out", "dq", "dk", "dv"), [got[0], *got[2:]], [cpu[0], *cpu[2:]],
                                     [ref[0], *ref[2:]]):
                e_gpu = (g.cpu().double() - r).abs().mean().item()
                e_cpu = (c.double() - r).abs().mean().item()
                assert e_gpu <= 1.5 * e_cpu + 1e-4, f"{case} {name}: GPU error {e_gpu:.2e} vs CPU {e_cpu:.2e}"


@pytest.mark.parametrize("kernel", ["math", "sdpa"])
def test_fp32_kernels_on_cuda(kernel):
    torch.backends.cuda.matmul.allow_tf32 = False
    for lname, doc in layouts().items():
        h, hkv = HEADS["gqa3"]
        ref = reference(*inputs(h, hkv, torch.float64), doc)
        got = run_kernel(kernel, *(t.to(CUDA) for t in inputs(h, hkv, torch.float32)),
                         None if doc is None else doc.to(CUDA))
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            if g is None:
                continue
            err = (g.cpu().double() - r).abs().max().item()
            assert err <= 1e-5, f"{kernel} fp32 {lname} {name}: max error {err:.2e}"


def test_torch_flash_refuses_fp32_with_the_fix():
    q, k, v, _ = (t.to(CUDA) for t in inputs(4, 2, torch.float32))
    with pytest.raises(ValueError, match="train.precision=bf16"):
        doc_attention(q, k, v, None, D ** -0.5, "torch_flash")


def test_host_copies_queued_behind_gpu_work_arrive_whole():
    """longstride/host_copy: a host tensor copied to the GPU through pinned memory without blocking, queued behind a
    long kernel and its host original dropped at once, arrives with its values (the staging buffer is kept until the
    copy has run); a GPU tensor and a CPU target are plain copies."""
    from longstride.host_copy import as_device_tensor, to_device

    busy = torch.randn(4096, 4096, device=CUDA)
    for _ in range(20):  # queued work ahead of the copies
        busy = busy @ busy / 64
    want = [torch.arange(i, i + 100_000) for i in range(8)]
    got = [to_device(w.clone(), CUDA) for w in want]  # each host clone freed as soon as its copy is queued
    got.append(as_device_tensor(list(range(1000)), torch.int32, CUDA))
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert g.device.type == "cuda" and torch.equal(g.cpu(), w)
    assert torch.equal(got[-1].cpu(), torch.arange(1000, dtype=torch.int32))
    assert to_device(got[0], CUDA) is got[0] and torch.equal(to_device(got[0], "cpu"), want[0])
