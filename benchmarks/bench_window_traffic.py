"""Bytes a CP rank sends for one attention layer's forward and backward: a full (causal) layer on the ring beside
sliding-window layers on the halo exchange (parallel/window.py), counted at torch.distributed itself (every
isend of the ring, every all-to-all's outgoing rows) on gloo processes.

    python -m benchmarks.bench_window_traffic            # cp 4, 8K tokens, windows 128 / 1K / 4K
    python -m benchmarks.bench_window_traffic --quick    # cp 2, 1K tokens (what the test runs)

Writes benchmarks/results/bench_window_traffic.json. Bytes are per rank (the most any rank sends), K/V in fp32
here (bf16 halves every row), H=8 query / 2 K/V heads of 64.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

H, HKV, D = 8, 2, 64


class Counter:
    """Counts the bytes this process hands to torch.distributed to send, while installed."""

    def __init__(self):
        self.sent = 0
        self._orig = {}

    def __enter__(self):
        a2a, p2p = dist.all_to_all_single, dist.batch_isend_irecv

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
            rows = input.shape[0]
            mine = input_split_sizes[dist.get_rank(kw.get("group"))] if input_split_sizes else rows // max(
                dist.get_world_size(kw.get("group")), 1)
            self.sent += (rows - mine) * input[:1].numel() * input.element_size()
            return a2a(output, input, output_split_sizes, input_split_sizes, **kw)

        def batch_isend_irecv(ops):
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return p2p(ops)

        self._orig = {"all_to_all_single": a2a, "batch_isend_irecv": p2p}
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def layer_bytes(rank: int, n: int, length: int, windows: list, docs: list) -> list[dict]:
    """One layer's forward + backward under ring CP for each pattern: the bytes this rank sent."""
    from longstride.parallel.pattern import Pattern
    from longstride.parallel.ring import RingComm, ring_attention
    from longstride.parallel.blocks import ring_plan
    from longstride.parallel.zigzag import shard

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, D, generator=g) for h in (H, HKV, HKV))
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]
    comm = RingComm(dist.group.WORLD)
    plan = ring_plan(doc, 1, length, n, rank)
    rows = []
    for window in [None, *windows]:
        ql, kl, vl = (shard(x, n, rank, dim=2).requires_grad_() for x in (q, k, v))
        with Counter() as c:
            ring_attention(ql, kl, vl, plan, "sdpa", D ** -0.5, comm, Pattern(window)).sum().backward()
        rows.append({"pattern": "full (ring)" if window is None else f"window {window} (halo)",
                     "window": window, "bytes": c.sent})
    return rows


def _worker(rank: int, n: int, init: str, length: int, windows: list, docs: list, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n)
    try:
        rows = layer_bytes(rank, n, length, windows, docs)
        sent = torch.tensor([r["bytes"] for r in rows], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save([dict(r, bytes=int(b)) for r, b in zip(rows, sent.tolist())], out)
    finally:
        dist.destroy_process_group()


def measure(n: int, length: int, windows: list, docs: list, chunks: int = 2) -> list[dict]:
    """Rows of (pattern, window, bytes: the most any rank sent), measured on n gloo processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_worker, args=(n, os.path.join(d, "init"), length, windows, docs, out), nprocs=n, join=True)
        rows = torch.load(out)
    full = rows[0]["bytes"]
    for r in rows:
        r["vs_full"] = round(r["bytes"] / full, 4)
        # the most a rank can send under the halo plan: W - 1 tokens for each of its chunks, three times (K and V
        # forward, again for the backward, dK and dV back), K and V heads in fp32
        r["bound_bytes"] = None if r["window"] is None else chunks * (r["window"] - 1) * 3 * 2 * HKV * D * 4
    return rows


def main() -> None:
    from benchmarks.common import print_table, write_results

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, length, windows = (2, 1024, [16, 64]) if args.quick else (4, 8192, [128, 1024, 4096])
    docs = [length // 2, length // 4, length // 4]  # one document spans chunks: halos cross rank boundaries
    rows = measure(n, length, windows, docs)
    print_table(rows, ["pattern", "bytes", "vs_full", "bound_bytes"])
    if not args.quick:
        print(write_results("bench_window_traffic", rows, {"cp": n, "tokens": length, "docs": docs,
                                                          "heads": H, "kv_heads": HKV, "head_dim": D}))


if __name__ == "__main__":
    main()
