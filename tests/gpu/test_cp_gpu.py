"""Ring, Ulysses, UPipe and hybrid attention on torch's flash kernel, several ranks on one GPU: ranks are gloo
processes sharing the GPU, their ring and all-to-all messages staged through host memory
(parallel/collectives.host_staged). bf16 outputs and gradients against the fp64 reference, held to the
one-rank flash kernel's own error (the CPU tests' rule: mean error at most 1.5x one rank's, LSE within 2e-2)."""
from __future__ import annotations

import pytest
import torch

from longstride.parallel.blocks import ring_plan
from longstride.parallel.config import CPDegrees, ParallelDims
from longstride.parallel.cp import cp_context
from longstride.parallel.ring import ring_attention, ring_forward
from longstride.parallel.spawn import gather_cat, run_gloo
from longstride.parallel.ulysses import ulysses_attention
from tests.gpu.test_kernels_gpu import run_kernel
from tests.test_ring import B, D, L, inputs, layouts, reference
from tests.test_ulysses import full_sequence, local_share

# (ring, ulysses) -> [(query heads, K/V heads, UPipe heads per stage; 0 = all at once)]
CASES = {(2, 1): [(8, 2, 0), (6, 2, 0)], (3, 1): [(8, 2, 0)], (1, 2): [(8, 2, 0), (8, 2, 2)],
         (1, 3): [(9, 3, 3)], (2, 2): [(8, 2, 0), (12, 4, 4)]}


def _worker(rank: int, world: int, ring: int, path: str) -> None:
    torch.cuda.set_device(0)
    uly = world // ring
    cp = cp_context("hybrid", ParallelDims(world, 1, world), CPDegrees(ring, uly), "cpu", "torch_flash")
    results = {}
    for h, hkv, U in CASES[ring, uly]:
        for lname, doc in layouts().items():
            q, k, v, dout = (x.cuda() for x in inputs(h, hkv, torch.bfloat16))
            plan = ring_plan(doc, B, L, ring, cp.ring_rank)
            share = lambda x: local_share(x, ring, cp.ring_rank, uly, cp.ulysses_rank)  # noqa: E731
            ql, kl, vl = (share(x).requires_grad_(True) for x in (q, k, v))
            if uly == 1:
                out = ring_attention(ql, kl, vl, plan, "torch_flash", D ** -0.5, cp.ring_comm)
                with torch.no_grad():
                    lse = ring_forward(ql, kl, vl, plan, "torch_flash", D ** -0.5, cp.ring_comm)[1]
            else:
                out = ulysses_attention(ql, kl, vl, plan, "torch_flash", D ** -0.5, cp.ring_comm, cp.head_comm, U)
                lse = None
            out.backward(share(dout))
            got = [out.detach(), ql.grad, kl.grad, vl.grad] + ([lse] if lse is not None else [])
            results[h, hkv, U, lname] = [full_sequence(gather_cat(x.cpu()), ring, uly) for x in got]
    if rank == 0:
        torch.save(results, path)


@pytest.mark.parametrize("ring,uly", list(CASES), ids=[f"ring{r}xulysses{u}" for r, u in CASES])
def test_cp_on_flash_kernel_matches_one_rank(ring, uly, tmp_path):
    path = str(tmp_path / "cp.pt")
    run_gloo(_worker, ring * uly, ring, path)
    results = torch.load(path)
    for h, hkv, U in CASES[ring, uly]:
        for lname, doc in layouts().items():
            case = f"ring {ring} x ulysses {uly}, {h}:{hkv} heads, U={U or h}, {lname}"
            ref = reference(*inputs(h, hkv, torch.float64), doc)
            one = run_kernel("torch_flash", *(t.cuda() for t in inputs(h, hkv, torch.bfloat16)),
                             None if doc is None else doc.cuda())
            got = results[h, hkv, U, lname]
            for name, g, o, r in zip(("out", "dq", "dk", "dv"), got, [one[0], *one[2:]], [ref[0], *ref[2:]]):
                e_cp, e_one = ((x.cpu().double() - r).abs().mean().item() for x in (g, o))
                assert e_cp <= 1.5 * e_one + 1e-4, f"{case} {name}: error {e_cp:.2e} vs one rank {e_one:.2e}"
            if len(got) == 5:
                err = (got[4] - ref[1]).abs().max().item()
                assert err <= 2e-2, f"{case} lse: max error {err:.2e}"
