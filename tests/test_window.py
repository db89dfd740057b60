"""A windowed layer under ring CP exchanges O(window) bytes (counted at torch.distributed on gloo processes), a
full layer the sequence; the document balancer weighs each layer type's real work. (Exactness of windows,
chunks and sinks under every method: tests/test_attention_patterns.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import transformers as T

from benchmarks.bench_window_traffic import D, HKV, measure
from longstride.parallel.balance import balanced_assignment, rank_work, token_work
from longstride.parallel.config import CPDegrees
from longstride.parallel.pattern import Pattern, chunk_docs
from longstride.parallel.window import halo_plan
from longstride.parallel.zigzag import zigzag
from longstride.recipes.memory.trace import StepProgram, trace_step
from longstride.recipes.run.step import StepSpec


def test_a_windowed_layer_sends_its_halos_not_the_sequence():
    n, length = 2, 1024
    rows = measure(n, length, [16, 64], [512, 256, 256])
    full, w16, w64 = rows
    per_token = 2 * HKV * D * 4  # K and V of one token, fp32
    local = length // n
    # the ring: K/V to the next rank at each of n - 1 steps, again in the backward, and dK/dV at each of n steps
    assert full["bytes"] == (2 * (n - 1) + n) * local * per_token, full
    for r in (w16, w64):
        assert 0 < r["bytes"] <= r["bound_bytes"], r
    assert w16["bytes"] < w64["bytes"] < full["bytes"] / 10


def test_halo_plan_counts_only_what_the_window_reaches_inside_the_document():
    """4 ranks, zig-zag: each rank receives, per chunk, the W - 1 tokens before it of the same document."""
    length, n, window = 64, 4, 5
    docs = np.repeat([0, 1, 2], [20, 1, 43])[None]
    a = zigzag(n)
    c = a.chunk_len(length)
    for rank in range(n):
        plan = halo_plan(docs, 1, length, rank, a, window)
        expect = 0
        for x in a.chunks[rank]:
            start = x * c
            doc_start = int(np.flatnonzero(docs[0] == docs[0, start])[0])
            expect += start - max(start - window + 1, doc_start)
        assert len(plan.ext_src) == c * a.k + expect
        assert sum(plan.recv_splits) <= expect  # a halo held by the rank itself does not travel


def test_balancer_weighs_each_layer_type():
    docs = np.repeat([0, 1, 2], [200, 56, 256])[None]
    full, windowed = ((Pattern(), 1),), ((Pattern(window=16), 1),)
    # a windowed query attends at most 16 keys, a causal one its position + 1
    assert token_work(docs, windowed).max() == 16 and token_work(docs, full).max() == 256
    assert token_work(docs, ((Pattern(chunk=32), 1),)).max() == 32
    mixed = ((Pattern(window=16), 3), (Pattern(), 1))
    assert (token_work(docs, mixed) == 3 * token_work(docs, windowed) + token_work(docs, full)).all()
    # windowed work is nearly uniform: zig-zag kept; causal work is not: rebalanced
    assert balanced_assignment(docs, 2, patterns=windowed) == zigzag(2)
    a = balanced_assignment(docs, 2, patterns=full)
    assert a != zigzag(2)
    work = token_work(docs, full)
    assert rank_work(work, a).max() < rank_work(work, zigzag(2)).max()


def test_chunks_are_document_runs_cut_from_each_document_start():
    docs = np.repeat([0, 1], [5, 7])[None]
    assert chunk_docs(docs, 3, docs.shape).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4]]
    assert chunk_docs(None, 4, (1, 6)).tolist() == [[0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("cp", [1, 2])
def test_the_traced_gpu_step_runs_windowed_layers_as_they_run(cp):
    """`longstride plan`'s trace of a Mistral with a window: every flash call of its layers carries the window
    (held to the CUDA kernel's argument checks), on one device and on the halo under ring CP."""
    cfg = T.MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_cache=False, pad_token_id=0,
                          bos_token_id=0, eos_token_id=0, sliding_window=256)
    prog = StepProgram(cfg, 2048, world=cp, cp=cp, degrees=CPDegrees(ring=cp) if cp > 1 else CPDegrees(),
                       step=StepSpec("full", loss_tile=512), docs=2)
    r = trace_step(prog)
    assert r["flash_calls"] > 0 and r["windowed_flash_calls"] == r["flash_calls"], r
    cfg.sliding_window = None
    assert trace_step(prog)["windowed_flash_calls"] == 0


def _halo_rows_worker(rank: int, n: int, path: str) -> None:
    import torch
    import torch.distributed as dist

    from longstride.parallel.blocks import ring_plan
    from longstride.parallel.config import ParallelDims
    from longstride.parallel.cp import cp_context
    from longstride.parallel.ring import ring_attention
    from longstride.parallel.spawn import gather_cat
    from longstride.parallel.zigzag import shard, unshard
    from tests.test_ring import D, inputs, layouts

    cp = cp_context("ring", ParallelDims(n, 1, n), CPDegrees(ring=n), "cpu", "sdpa")
    out = {}
    for window in (5, 23):
        for lname, doc in layouts().items():
            q, k, v, dout = inputs(8, 2, torch.float64)
            plan = ring_plan(doc, q.shape[0], q.shape[2], n, rank)
            ql, kl, vl = (shard(x, n, rank, dim=2).requires_grad_(True) for x in (q, k, v))
            o = ring_attention(ql, kl, vl, plan, "sdpa", D ** -0.5, cp.ring_comm, Pattern(window=window))
            o.backward(shard(dout, n, rank, dim=2))
            out[window, lname] = [unshard(gather_cat(x), dim=2) for x in (o.detach(), ql.grad, kl.grad, vl.grad)]
    dist.barrier()
    if rank == 0:
        torch.save(out, path)


def test_the_halo_with_several_rows_of_different_documents(tmp_path):
    """Rows with different documents (halos of different lengths per row), 3 ranks, fp64: the ring's halo equals
    the one-device windowed attention, outputs and gradients."""
    import torch

    from longstride.parallel.kernels import doc_attention
    from longstride.parallel.spawn import run_gloo
    from tests.test_ring import D, inputs, layouts

    path = str(tmp_path / "halo.pt")
    run_gloo(_halo_rows_worker, 3, path)
    got = torch.load(path)
    for (window, lname), parts in got.items():
        doc = layouts()[lname]
        q, k, v, dout = (x.requires_grad_(True) for x in inputs(8, 2, torch.float64))
        o = doc_attention(q, k, v, doc, D ** -0.5, kernel="math", pattern=Pattern(window=window))
        o.backward(dout)
        for name, g, r in zip(("out", "dq", "dk", "dv"), parts, (o.detach(), q.grad, k.grad, v.grad)):
            err = ((g - r).abs().max() / r.abs().max()).item()
            assert err <= 1e-9, f"window {window} {lname} {name}: {err:.1e}"
