"""Ulysses, UPipe and Ulysses x ring parity: gloo processes against one process, outputs and all
gradients asserted, with document masking and GQA (9:3, the SmolLM2-135M shape, included).

One spawn per process layout runs every case of that layout: seeded Q/K/V and output gradient cut
into each rank's share (ring zig-zag share, then its Ulysses piece), forward and backward, gathered,
put back in sequence order and compared with the fp64 dense reference of tests/test_ring.py and with
the single-process document attention.
"""
from __future__ import annotations

import pytest
import torch

from longstride.parallel.cp import CPContext, cp_context, cp_degrees, shard_for_cp
from longstride.parallel.blocks import ring_plan
from longstride.parallel.config import CPDegrees, ParallelConfig, ParallelDims, describe_cp
from longstride.parallel.ulysses import HeadComm, ulysses_attention
from longstride.parallel.heads import head_schedule
from longstride.parallel.zigzag import shard, split, unshard
from longstride.parallel.spawn import gather_cat, run_gloo
from tests.test_ring import B, D, L, inputs, layouts, reference, single_process

# (ring degree, Ulysses degree) -> cases (query heads, K/V heads, U; 0 = plain Ulysses)
LAYOUTS = {
    (1, 2): [(8, 2, 0), (8, 2, 2), (8, 2, 4), (6, 2, 2)],
    (1, 3): [(9, 3, 0), (9, 3, 3), (6, 2, 0), (6, 2, 3)],  # 6:2 over 3 ranks replicates K/V to 6 heads
    (1, 4): [(8, 2, 0), (8, 2, 4), (12, 4, 4)],  # 8:2 over 4 ranks replicates K/V to 4 heads
    # hybrid: Ulysses inside each rank of a zig-zag ring; 12:4 puts two K/V heads on each Ulysses rank, where
    # a (B, H, L, D) and a (B, L, H, D) layout of the ring's K/V and dK/dV are different bytes
    (2, 2): [(8, 2, 0), (8, 2, 2), (12, 4, 0), (12, 4, 4)],
}
# Besides the whole batch (fp32 and bf16), each case runs with row 1 alone in fp32: with one row a ring
# block's dK/dV is the kernel's own tensor, laid out by the kernel path, differently on neighbouring ranks.
RUNS = ((slice(0, 2), torch.float32), (slice(0, 2), torch.bfloat16), (slice(1, 2), torch.float32))


def _key(rows: slice, dtype) -> str:
    return f"rows {rows.start}:{rows.stop} {dtype}"


def local_share(x: torch.Tensor, ring: int, ring_rank: int, uly: int, uly_rank: int) -> torch.Tensor:
    return split(shard(x, ring, ring_rank, dim=2), uly, uly_rank, dim=2)


def full_sequence(parts: list[torch.Tensor], ring: int, uly: int) -> torch.Tensor:
    """Inverse of local_share over all ranks (global rank = ring_rank * uly + uly_rank)."""
    shares = [torch.cat(parts[r * uly:(r + 1) * uly], dim=2) for r in range(ring)]
    return unshard(shares, dim=2) if ring > 1 else shares[0]


def _worker(rank: int, world: int, ring: int, path: str, kernel: str = "sdpa") -> None:
    uly = world // ring
    cp = cp_context("hybrid", ParallelDims(world, 1, world), CPDegrees(ring, uly), "cpu", kernel)
    results = {}
    for h, hkv, U in LAYOUTS[ring, uly]:
        for lname, doc in layouts().items():
            for rows, dtype in RUNS:
                q, k, v, dout = (x[rows] for x in inputs(h, hkv, dtype))
                plan = ring_plan(None if doc is None else doc[rows], q.shape[0], L, ring, cp.ring_rank)
                ql, kl, vl = (local_share(x, ring, cp.ring_rank, uly, cp.ulysses_rank).requires_grad_(True)
                              for x in (q, k, v))
                out = ulysses_attention(ql, kl, vl, plan, kernel, D ** -0.5, cp.ring_comm, cp.head_comm, U)
                out.backward(local_share(dout, ring, cp.ring_rank, uly, cp.ulysses_rank))
                got = [out.detach(), ql.grad, kl.grad, vl.grad]
                results[h, hkv, U, lname, _key(rows, dtype)] = [full_sequence(gather_cat(x), ring, uly) for x in got]
    if rank == 0:
        torch.save(results, path)


@pytest.mark.parametrize("ring,uly", list(LAYOUTS), ids=[f"ring{r}xulysses{u}" for r, u in LAYOUTS])
def test_ulysses_upipe_hybrid_match_single_process(ring, uly, tmp_path):
    path = str(tmp_path / "ulysses.pt")
    run_gloo(_worker, ring * uly, ring, path)
    check_results(ring, uly, torch.load(path))


def check_results(ring: int, uly: int, results: dict) -> None:
    """_worker's results against the fp64 reference and the one-process attention."""
    for h, hkv, U in LAYOUTS[ring, uly]:
        for lname, doc in layouts().items():
            case = f"ring {ring} x ulysses {uly}, {h}:{hkv} heads, U={U or h}, {lname}"
            ref = reference(*inputs(h, hkv, torch.float64), doc)
            want = [ref[0], *ref[2:]]
            got32 = results[h, hkv, U, lname, _key(*RUNS[0])]
            single32 = single_process(*inputs(h, hkv, torch.float32), doc)
            for name, got, r64, one in zip(("out", "dq", "dk", "dv"), got32, want, single32):
                err = (got.double() - r64).abs().max().item()
                assert err <= 1e-5, f"{case} fp32 {name}: max |cp - fp64 ref| = {err:.2e}"
                err = (got - one).abs().max().item()
                assert err <= 1e-5, f"{case} fp32 {name}: max |cp - single process| = {err:.2e}"
            single16 = single_process(*inputs(h, hkv, torch.bfloat16), doc)
            for name, got, r64, one in zip(("out", "dq", "dk", "dv"), results[h, hkv, U, lname, _key(*RUNS[1])],
                                           want, single16):
                e_cp, e_one = ((x.double() - r64).abs().mean().item() for x in (got, one))
                assert e_cp <= 1.5 * e_one + 1e-4, f"{case} bf16 {name}: error {e_cp:.2e} vs single {e_one:.2e}"
            rows = RUNS[2][0]
            ref1 = reference(*(x[rows] for x in inputs(h, hkv, torch.float64)), None if doc is None else doc[rows])
            for name, got, r64 in zip(("out", "dq", "dk", "dv"), results[h, hkv, U, lname, _key(*RUNS[2])],
                                      [ref1[0], *ref1[2:]]):
                err = (got.double() - r64).abs().max().item()
                assert err <= 1e-5, f"{case}, row 1 alone, fp32 {name}: max |cp - fp64 ref| = {err:.2e}"


def test_upipe_schedule_exchanges_each_kv_head_once_and_covers_every_query_head():
    # 32:8 heads over N = 2 with U = 2 (Llama-3-8B's shape): stage s holds query head s of each of a
    # rank's K/V groups, i.e. one query head per rank, reading one kept K/V head through a slice
    sched = head_schedule(32, 8, 2, 2)
    assert len(sched.stages) == 16 and sched.kv_rep == 1 and sched.kv_per_rank == 4
    sent = torch.cat([st.send for st in sched.stages])
    assert sorted(sent.tolist()) == list(range(32))
    for st in sched.stages:
        q0, q1 = st.send.tolist()  # rank 0's query head, rank 1's
        assert q0 // 4 < 4 <= q1 // 4, "each rank's query heads read the K/V heads it holds"
        assert isinstance(st.kv, slice) and st.kv.stop - st.kv.start == 1 and q0 // 4 == st.kv.start
    # K/V heads not divisible by N: replicated to lcm(Hkv, N) heads, stated by the schedule
    assert head_schedule(6, 2, 3, 3).kv_travel == 6 and head_schedule(8, 2, 4, 0).kv_travel == 4
    # single-process stages (identity exchanges) against the one-call path, for a gather schedule too
    assert head_schedule(12, 6, 1, 4).stages[1].kv.tolist() == [0, 1, 4, 5], "U=4 of 12:6 needs a K/V gather"
    for heads_, kv_, U in ((12, 6, 4), (12, 6, 2), (12, 6, 0)):
        q, k, v, dout = inputs(heads_, kv_, torch.float32)
        doc = layouts()["docs_random"]
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = ulysses_attention(qq, kk, vv, ring_plan(doc, B, L, 1, 0), "sdpa", D ** -0.5, None, HeadComm(None), U)
        # token-major like the ring's output: the caller's out.transpose(1, 2) is a view, not a second copy kept
        assert out.transpose(1, 2).is_contiguous(), f"{heads_}:{kv_} U={U}: out is not token-major"
        out.backward(dout)
        for got, want in zip((out, qq.grad, kk.grad, vv.grad), single_process(q, k, v, dout, doc)):
            assert (got - want).abs().max().item() <= 1e-5, f"{heads_}:{kv_} U={U}"


def _cfg(impl: str, ulysses: int = 0, upipe_heads: int = 0) -> ParallelConfig:
    return ParallelConfig(cp_impl=impl, ulysses=ulysses, upipe_heads=upipe_heads)


def test_degrees_and_their_errors():
    assert cp_degrees(_cfg("ring"), 4, 9) == CPDegrees(4, 1, 0)
    assert cp_degrees(_cfg("ulysses"), 3, 9) == CPDegrees(1, 3, 0)
    assert cp_degrees(_cfg("upipe"), 3, 9) == CPDegrees(1, 3, 3), "U defaults to the Ulysses degree"
    assert cp_degrees(_cfg("upipe", upipe_heads=8), 2, 32) == CPDegrees(1, 2, 8)
    assert cp_degrees(_cfg("hybrid", ulysses=2), 4, 8) == CPDegrees(2, 2, 0)
    with pytest.raises(ValueError, match=r"Ulysses degree 4 must divide the model's 9 query heads; valid Ulysses "
                                         r"degrees are \[3, 9\] \(nearest: \[3, 9\]\)"):
        cp_degrees(_cfg("ulysses"), 4, 9)
    with pytest.raises(ValueError, match=r"upipe_heads=6 must be a multiple of the Ulysses degree 4 and divide the 32 "
                                         r"query heads; valid: \[4, 8, 16, 32\] \(nearest: \[4, 8\]\)"):
        cp_degrees(_cfg("upipe", upipe_heads=6), 4, 32)
    assert cp_degrees(_cfg("hybrid", ulysses=2), 2, 8) == CPDegrees(1, 2, 0), "a stage's cp may equal the degree"
    assert describe_cp("ulysses", CPDegrees(1, 4, 0), kv_heads=2) == \
        " ulysses: ulysses 4, K/V 2 heads replicated to 4 for the all-to-all"
    assert describe_cp("upipe", CPDegrees(2, 2, 2), kv_heads=2) == " upipe: ring 2 x ulysses 2, 2 heads per stage"
    with pytest.raises(ValueError, match=r"parallel.ulysses=3: hybrid .* one of \[1, 2, 4, 8\]"):
        cp_degrees(_cfg("hybrid", ulysses=3), 8, 32)
    # the degrees offered pass the next check too: 12 query heads on 8 processes (6 and 12 were offered; 8 for hybrid)
    with pytest.raises(ValueError, match=r"parallel.ulysses=3: hybrid .* one of \[1, 2, 4\]$"):
        cp_degrees(_cfg("hybrid", ulysses=3), 8, 12)
    with pytest.raises(ValueError, match=r"Ulysses degree 8 must divide the model's 12 query heads; valid Ulysses "
                                         r"degrees are \[2, 4\] \(nearest: \[2, 4\]\)"):
        cp_degrees(_cfg("hybrid", ulysses=8), 8, 12)
    with pytest.raises(ValueError, match=r"valid Ulysses degrees are \[2, 4\] \(nearest: \[2, 4\]\)"):
        cp_degrees(_cfg("ulysses"), 8, 12, world=8)
    with pytest.raises(ValueError, match="use parallel.cp_impl=upipe"):
        cp_degrees(_cfg("ulysses", upipe_heads=2), 2, 8)


def test_shard_for_cp_gives_each_rank_its_ring_share_then_its_ulysses_piece():
    batch = {"input_ids": torch.arange(2 * 16).view(2, 16)}
    batch["doc_ids"] = torch.zeros_like(batch["input_ids"])
    cp = CPContext("hybrid", CPDegrees(2, 2), ring_rank=1, ulysses_rank=1, head_comm=HeadComm(None))
    local, layout = shard_for_cp(batch, True, cp)
    # ring rank 1 of 2 holds chunks 1 and 2 of 4 (positions 4..11); its Ulysses rank 1 the second half
    assert local["input_ids"][0].tolist() == [8, 9, 10, 11]
    assert layout.plan.n == 2 and layout.cp is cp
    with pytest.raises(ValueError, match=r"a packed batch of 16 tokens, split by cp_impl=hybrid over ring 2 x "
                                         r"ulysses 3: its length must be a multiple of 12"):
        shard_for_cp(batch, True, CPContext("hybrid", CPDegrees(2, 3), head_comm=HeadComm(None)))
