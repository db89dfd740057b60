"""Ring attention parity: N gloo processes against one process, outputs, LSE and gradients asserted.

Every case runs in one spawn per ring size: random seeded Q/K/V and output gradient, zig-zag
sharded, ring forward and backward, gathered and unsharded, compared with an fp64 dense reference
(test-only L x L mask) and with the single-process document attention.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longstride.parallel.cp import CPContext, shard_for_cp
from longstride.parallel.blocks import ring_plan
from longstride.parallel.kernels import doc_attention
from longstride.parallel.ring import RingComm, ring_attention, ring_forward, to_wire
from longstride.parallel.zigzag import shard, unshard
from longstride.parallel.spawn import gather_cat, run_gloo

L, D, B = 120, 16, 2  # L divisible by 2N for N in 1..4
HEADS = {"gqa4": (8, 2), "gqa3": (6, 2)}


def layouts() -> dict[str, torch.Tensor | None]:
    """Document ids (B, L) per case: None is plain causal attention."""
    def from_lengths(rows):
        out = []
        for lens in rows:
            assert sum(lens) == L
            out.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
        return torch.stack(out)

    g = torch.Generator().manual_seed(7)
    rand_rows = []
    for _ in range(B):
        lens, left = [], L
        while left:
            n = min(left, int(torch.randint(1, 40, (1,), generator=g)) if len(lens) % 3 else 1)  # length-1 docs
            lens.append(n)
            left -= n
        rand_rows.append(lens)
    return {
        "causal": None,
        "docs_random": from_lengths(rand_rows),
        "docs_spanning": from_lengths([[5, 70, 45], [100, 1, 19]]),  # documents across several chunks
        "one_doc": from_lengths([[L], [L]]),
    }


def inputs(h: int, hkv: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, hh, L, D, generator=g, dtype=torch.float64) for hh in (h, hkv, hkv, h))
    return [x.to(dtype) for x in (q, k, v, dout)]


def reference(q, k, v, dout, doc):
    """fp64 dense attention with an explicit mask; returns out, lse, dq, dk, dv."""
    q, k, v, dout = (x.double().requires_grad_(True) for x in (q, k, v, dout))
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ ke.transpose(-1, -2) * D ** -0.5
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    if doc is not None:
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ ve
    out.backward(dout)
    return [x.detach() for x in (out, lse, q.grad, k.grad, v.grad)]


def _ring_worker(rank: int, n: int, kernel: str, path: str) -> None:
    import torch.distributed as dist

    comm = RingComm(dist.group.WORLD)
    results = {}
    for lname, doc in layouts().items():
        for hname, (h, hkv) in HEADS.items():
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v, dout = inputs(h, hkv, dtype)
                plan = ring_plan(doc, B, L, n, rank)
                ql, kl, vl = (shard(x, n, rank, dim=2).requires_grad_(True) for x in (q, k, v))
                out = ring_attention(ql, kl, vl, plan, kernel, D ** -0.5, comm)
                out.backward(shard(dout, n, rank, dim=2))
                with torch.no_grad():
                    _, lse = ring_forward(ql, kl, vl, plan, kernel, D ** -0.5, comm)
                got = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
                results[lname, hname, str(dtype)] = [unshard(gather_cat(x), dim=2) for x in got]
    if rank == 0:
        torch.save(results, path)


NAMES = ("out", "lse", "dq", "dk", "dv")


def single_process(q, k, v, dout, doc):
    """The one-process document attention (the cp=1 training path) with autograd."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = doc_attention(q, k, v, doc, D ** -0.5, "sdpa")
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_matches_single_process(n, tmp_path):
    path = str(tmp_path / "ring.pt")
    run_gloo(_ring_worker, n, "sdpa", path)
    check_ring_results(n, torch.load(path))


def check_ring_results(n: int, results: dict) -> None:
    """_ring_worker's results against the fp64 reference and the one-process attention (fp32, bf16)."""
    for lname, doc in layouts().items():
        for hname, (h, hkv) in HEADS.items():
            ref = reference(*inputs(h, hkv, torch.float64), doc)
            q32 = inputs(h, hkv, torch.float32)
            single32 = single_process(*q32, doc)
            for name, got, want in zip(NAMES, results[lname, hname, str(torch.float32)], ref):
                err = (got.double() - want).abs().max().item()
                assert err <= 1e-5, f"N={n} {lname} {hname} fp32 {name}: max |ring - fp64 ref| = {err:.2e}"
            for name, got, want in zip(("out", "dq", "dk", "dv"),
                                       [results[lname, hname, str(torch.float32)][i] for i in (0, 2, 3, 4)],
                                       single32):
                err = (got - want).abs().max().item()
                assert err <= 1e-5, f"N={n} {lname} {hname} fp32 {name}: max |ring - single process| = {err:.2e}"
            # bf16: the ring's error against fp64 stays at the single-process bf16 error (fp32 merging)
            single16 = single_process(*inputs(h, hkv, torch.bfloat16), doc)
            ring16 = results[lname, hname, str(torch.bfloat16)]
            for name, got, one, want in zip(("out", "dq", "dk", "dv"), [ring16[i] for i in (0, 2, 3, 4)],
                                            single16, [ref[i] for i in (0, 2, 3, 4)]):
                e_ring = (got.double() - want).abs().mean().item()
                e_one = (one.double() - want).abs().mean().item()
                assert e_ring <= 1.5 * e_one + 1e-4, \
                    f"N={n} {lname} {hname} bf16 {name}: ring error {e_ring:.2e} vs single process {e_one:.2e}"
            err = (ring16[1] - ref[1]).abs().max().item()
            assert err <= 2e-2, f"N={n} {lname} {hname} bf16 lse: max error {err:.2e}"


# Batch rows run together and each alone: with one row, a block's dK/dV is the kernel's own tensor, whose
# memory layout depends on the kernel path (one document segment or several), so neighbouring ranks hold
# their dK/dV in different layouts; the ring's messages must not depend on either.
ROWS = {"both_rows": slice(0, 2), "row0": slice(0, 1), "row1": slice(1, 2)}
KERNELS = ("sdpa", "math")  # the block kernels available on CPU


def step0_segments(doc: torch.Tensor, n: int) -> list[int]:
    """Per rank, the document segments of its own chunks (one row): the kernel path of its step-0 block."""
    return [len(ring_plan(doc, 1, L, n, r).steps[0][0][1][0].segments) for r in range(n)]


def _wire_worker(rank: int, n: int, path: str) -> None:
    import torch.distributed as dist

    comm = RingComm(dist.group.WORLD)
    h, hkv = HEADS["gqa4"]
    results = {}
    for kernel in KERNELS:
        for lname, doc in layouts().items():
            for rname, rows in ROWS.items():
                q, k, v, dout = (x[rows] for x in inputs(h, hkv, torch.float32))
                d = None if doc is None else doc[rows]
                plan = ring_plan(d, q.shape[0], L, n, rank)
                ql, kl, vl = (shard(x, n, rank, dim=2).requires_grad_(True) for x in (q, k, v))
                out = ring_attention(ql, kl, vl, plan, kernel, D ** -0.5, comm)
                out.backward(shard(dout, n, rank, dim=2))
                got = [out.detach(), ql.grad, kl.grad, vl.grad]
                results[kernel, lname, rname] = [unshard(gather_cat(x), dim=2) for x in got]
    if rank == 0:
        torch.save(results, path)


def test_wire_form_is_seq_major_for_every_layout():
    # what a ring message carries: x's (B, L, H, D)-contiguous bytes, without a copy when x already lies so
    x = torch.randn(2, 3, 8, 4)
    cases = {"(B, H, L, D)": x, "(B, L, H, D)": x.transpose(1, 2).contiguous().transpose(1, 2),
             "non-dense slice": torch.randn(2, 6, 8, 4)[:, ::2], "one head": torch.randn(2, 1, 8, 4)}
    for name, t in cases.items():
        wire = to_wire(t)
        assert wire.is_contiguous() and wire.shape == t.transpose(1, 2).shape, name
        assert torch.equal(wire.transpose(1, 2), t), name
    seq = cases["(B, L, H, D)"]
    assert to_wire(seq).data_ptr() == seq.data_ptr(), "a seq-major tensor is sent from its own buffer"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_gradients_for_every_kernel_batch_size_and_neighbour_layout(n, tmp_path):
    # precondition: in some row, neighbouring ranks' step-0 blocks have different segment counts, hence
    # (before the wire protocol) dK/dV in different memory layouts
    counts = step0_segments(layouts()["docs_spanning"][1:2], n)
    assert any(counts[r] != counts[(r + 1) % n] for r in range(n)), counts
    path = str(tmp_path / "wire.pt")
    run_gloo(_wire_worker, n, path)
    results = torch.load(path)
    h, hkv = HEADS["gqa4"]
    for lname, doc in layouts().items():
        for rname, rows in ROWS.items():
            ref = reference(*(x[rows] for x in inputs(h, hkv, torch.float64)), None if doc is None else doc[rows])
            for kernel in KERNELS:
                for name, got, want in zip(("out", "dq", "dk", "dv"), results[kernel, lname, rname],
                                           [ref[0], *ref[2:]]):
                    err = (got.double() - want).abs().max().item()
                    assert err <= 1e-5, f"N={n} {kernel} {lname} {rname} {name}: max |ring - fp64 ref| = {err:.2e}"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_zigzag_shard_round_trip_and_balanced_causal_work(n):
    length = 2 * n * 7
    x = torch.arange(3 * length).view(3, length)
    shards = [shard(x, n, r) for r in range(n)]
    assert torch.equal(unshard(shards), x)
    c = length // (2 * n)
    assert shards[0][0, :c].tolist() == list(range(c)) and shards[0][0, c:].tolist() == \
        list(range((2 * n - 1) * c, 2 * n * c)), "rank 0 holds the first and the last chunk"
    work = [ring_plan(None, 1, length, n, r).pairs() for r in range(n)]
    assert len(set(work)) == 1, f"zig-zag causal work per rank must be equal: {work}"
    assert sum(work) == length * (length + 1) // 2


def test_plan_skips_blocks_with_nothing_to_attend():
    # every document inside one chunk: no rectangle anywhere, only the local varlen-causal block
    n, length = 2, 16
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([4, 4, 4, 4]))[None]
    plan = ring_plan(doc, 1, length, n, 0)
    blocks = [b for step in plan.steps for _, bs in step for b in bs]
    assert all(b.segments is not None for b in blocks) and len(blocks) == 1
    assert plan.pairs() == 2 * 10


def test_bad_input_errors():
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 6"):
        shard(torch.zeros(1, 100), 3, 0)
    # a document must be one run: an id that comes back later is refused, by the ring plan and on one device
    split_doc = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 2]])
    with pytest.raises(ValueError, match=r"doc_ids row 0: document id 0 appears in separate runs \(starting at "
                                         r"positions 0 and 5\)"):
        ring_plan(split_doc, 1, 8, 2, 0)
    with pytest.raises(ValueError, match="document id 0 appears in separate runs"):
        shard_for_cp({"input_ids": torch.zeros_like(split_doc), "doc_ids": split_doc}, True, CPContext())
    # guard against the check refusing valid input: ids need not be sorted, runs are what counts, and unsorted
    # ids plan like sorted ones
    unsorted, ordered = torch.tensor([[3, 3, 3, 1, 1, 2, 2, 2]]), torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert ring_plan(unsorted, 1, 8, 2, 1) == ring_plan(ordered, 1, 8, 2, 1)
    q, k = torch.zeros(1, 6, 8, 4), torch.zeros(1, 4, 8, 4)
    with pytest.raises(ValueError, match="query heads 6 must be a multiple of key/value heads 4"):
        ring_forward(q, k, k, ring_plan(None, 1, 8, 1, 0), "sdpa", 0.5, None)


@pytest.mark.parametrize("impl, degrees, unit", [("ulysses", (1, 3), 6), ("hybrid", (2, 3), 12), ("ring", (3, 1), 6)])
def test_a_batch_split_over_cp_names_the_length_its_method_needs(impl, degrees, unit):
    """shard_for_cp (the HF Trainer collator's and CP prefill's way in) names the multiple the whole layout needs
    (2 chunks per ring rank, each split over the Ulysses group), not only the ring's 2 x ring."""
    from longstride.data.batch import collate, packed_item
    from longstride.parallel.config import CPDegrees

    cp = CPContext(impl, CPDegrees(*degrees))
    batch = collate([packed_item([np.arange(1, 20), np.arange(1, 14)], 33, 0)])
    ring, ulysses = degrees
    with pytest.raises(ValueError, match=rf"a packed batch of 33 tokens, split by cp_impl={impl} over ring {ring} "
                                         rf"x ulysses {ulysses}: its length must be a multiple of {unit}"):
        shard_for_cp(batch, True, cp)
