"""The measuring tools of benchmarks/bench_peers.py (no peer needed): its blocked fp64 reference against the dense
definition, and its collective byte counter against what a 2-rank ring exchanges."""
from __future__ import annotations

import os
import tempfile

import torch

from benchmarks.peer_impls import ByteCounter, Shape, doc_starts, make_inputs, reference
from longstride.parallel.spawn import run_gloo


def _dense(q, k, v, doc, scale):
    # q: (1, L, H, D) fp64; the whole L x L mask, fine at test sizes
    L, H = q.shape[1], q.shape[2]
    g = H // k.shape[2]
    qd, kd, vd = q[0].transpose(0, 1), k[0].repeat_interleave(g, 1).transpose(0, 1), v[0].repeat_interleave(g, 1).transpose(0, 1)
    i = torch.arange(L)
    allowed = (i[None] <= i[:, None]) & (doc[None] == doc[:, None])
    s = (qd @ kd.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)[None]


def test_reference_matches_dense_definition():
    shape = Shape("t", 4, 2, 8)
    q, k, v, dout = (x.double() for x in make_inputs(shape, 96, seed=3))
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([10, 40, 30, 16]))
    assert doc_starts(doc, 96)[55].item() == 50
    got = reference(q, k, v, dout, doc, 0.3, budget=4 * 96 * 8 * 16)  # blocks of 16 queries
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = _dense(*leaves, doc, 0.3)
    want.backward(dout)
    for g, w in zip(got, [want.detach()] + [x.grad for x in leaves]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _count_worker(rank, n, path):
    import torch.distributed as dist

    x = torch.ones(1000)
    c = ByteCounter()
    with c.counting():
        buf = torch.empty(1000)
        for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, buf, (rank - 1) % n)]):
            r.wait()
        dist.all_to_all_single(torch.empty(1000), x)
        dist.all_gather([torch.empty(1000) for _ in range(n)], x)
    assert dist.all_to_all_single is not None and "wrapper" not in dist.all_to_all_single.__name__
    if rank == 0:
        torch.save(c.bytes, path)


def test_byte_counter_counts_what_leaves_a_rank():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bytes.pt")
        run_gloo(_count_worker, 2, path)
        # 4000 sent point-to-point, half of the all-to-all's 4000, the all-gather's own piece to the other rank
        assert torch.load(path) == 4000 + 2000 + 4000
