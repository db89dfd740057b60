"""Peak memory and time per rank of one attention layer's forward + backward: ring vs Ulysses vs UPipe.

A Llama-3-8B-shaped attention layer (32 query / 8 K/V heads, head dim 128), its sequence scaled to
this CPU machine (default L=4096 over N=2 gloo ranks of 1 thread, fp32, causal), run through the
same autograd functions training uses (parallel/ring.py, parallel/ulysses.py).

Memory, measured on CPU: each method runs in fresh processes whose glibc mmap threshold is fixed at
64 KiB (MALLOC_MMAP_THRESHOLD_), so a freed tensor's pages go back to the OS at once and resident
memory follows the live tensors. After a warm-up call each rank resets its peak-RSS mark
(/proc/self/clear_refs) and reports VmHWM after one forward + backward minus VmRSS before it: the
attention stage's peak on top of its inputs (the local q, k, v and output gradient). The table shows
the largest rank. "working" is that peak minus the layer's own output and input gradients (out, dq,
dk, dv: 2 |q| + 2 |k| local bytes, exact), which every method holds and hands to the rest of the
model: it is the memory of the all-to-alls and attention themselves, the part UPipe scales by U/H.
Figures are also given in head slices (one head over the full sequence, L x D x 4 bytes) so the
accounting can be checked by hand.

Time: every method in one set of processes, the methods alternated within each repetition (paired,
since this shared machine drifts), slowest rank per call, median of `reps` after a warm-up.

    python -m benchmarks.bench_cp_memory [--length 4096] [--n 2] [--reps 3]
writes benchmarks/results/bench_cp_memory.json
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import print_table, proc_status_bytes, reset_peak_rss, write_results
from longstride.parallel.blocks import ring_plan
from longstride.parallel.ring import RingComm, ring_attention
from longstride.parallel.ulysses import HeadComm, ulysses_attention
from longstride.parallel.zigzag import shard, split
from longstride.parallel.spawn import gather_cat, run_gloo

H, HKV, D = 32, 8, 128
SCALE = D ** -0.5


def methods(n: int) -> list[tuple[str, int]]:
    """(cp_impl, U): ring, plain Ulysses, UPipe with U = N and a few larger U that divide H."""
    ups = [u for u in (n, 2 * n, 4 * n, H // 2) if H % u == 0 and u % n == 0 and u < H]
    return [("ring", 0), ("ulysses", 0)] + [("upipe", u) for u in dict.fromkeys(ups)]


class Layer:
    """One rank's inputs and its attention call for one method."""

    def __init__(self, impl: str, U: int, length: int, n: int, rank: int):
        import torch.distributed as dist

        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, length, D, generator=g) for h in (H, HKV, HKV, H)]
        cut = (lambda x: shard(x, n, rank, dim=2)) if impl == "ring" else (lambda x: split(x, n, rank, dim=2))
        self.q, self.k, self.v, self.dout = (cut(x).contiguous() for x in full)
        del full
        if impl == "ring":
            plan, comm = ring_plan(None, 1, length, n, rank), RingComm(dist.group.WORLD)
            self.fn = lambda q, k, v: ring_attention(q, k, v, plan, "sdpa", SCALE, comm)
        else:
            plan, heads = ring_plan(None, 1, length, 1, 0), HeadComm(dist.group.WORLD)
            self.fn = lambda q, k, v: ulysses_attention(q, k, v, plan, "sdpa", SCALE, None, heads, U)

    def step(self) -> None:
        q, k, v = (x.detach().requires_grad_(True) for x in (self.q, self.k, self.v))
        self.fn(q, k, v).backward(self.dout)
        del q, k, v


def _memory_worker(rank, n, impl, U, length, path):
    import torch.distributed as dist

    layer = Layer(impl, U, length, n, rank)
    layer.step()  # warm-up: thread pools, gloo buffers
    gc.collect()
    dist.barrier()
    before = proc_status_bytes("VmRSS")
    reset_peak_rss()
    layer.step()
    peak = torch.tensor(float(proc_status_bytes("VmHWM") - before))
    per_rank = gather_cat(peak)
    if rank == 0:
        torch.save([p.item() for p in per_rank], path)


def _timing_worker(rank, n, length, reps, path):
    import torch.distributed as dist

    layers = {(impl, U): Layer(impl, U, length, n, rank) for impl, U in methods(n)}
    times: dict = {key: [] for key in layers}
    for rep in range(reps + 1):
        for key, layer in layers.items():
            dist.barrier()
            t0 = time.perf_counter()
            layer.step()
            t = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rep:  # the first repetition warms up
                times[key].append(t.item())
    if rank == 0:
        torch.save({key: statistics.median(ts) for key, ts in times.items()}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    L, n = args.length, args.n
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned processes' glibc at start
    head_slice = L * D * 4  # one head's full-sequence slice, fp32
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for impl, U in methods(n):
            path = os.path.join(d, f"{impl}{U}.pt")
            run_gloo(_memory_worker, n, impl, U, L, path)
            per_rank = torch.load(path)
            rows.append({"method": impl if impl != "upipe" else f"upipe U={U}", "impl": impl, "U": U or None,
                         "peak_mib": max(per_rank) / 2 ** 20, "peak_head_slices": max(per_rank) / head_slice,
                         "per_rank_mib": [p / 2 ** 20 for p in per_rank]})
        path = os.path.join(d, "time.pt")
        run_gloo(_timing_worker, n, L, args.reps, path)
        times = torch.load(path)
    for r, key in zip(rows, methods(n)):
        r["time_s"] = times[key]
    own = (2 * H + 2 * HKV) * (L // n) * D * 4 / 2 ** 20  # out, dq, dk, dv of one rank
    for r in rows:
        r["working_mib"] = r["peak_mib"] - own
        r["working_head_slices"] = r["working_mib"] * 2 ** 20 / head_slice
    uly = next(r for r in rows if r["impl"] == "ulysses")
    for r in rows:
        r["cut_total_vs_ulysses"] = 1 - r["peak_mib"] / uly["peak_mib"]
        r["cut_working_vs_ulysses"] = 1 - r["working_mib"] / uly["working_mib"]
        r["time_vs_ulysses"] = r["time_s"] / uly["time_s"]
    print(f"attention forward + backward per rank: L={L}, N={n} gloo ranks x 1 thread, {H}/{HKV} heads, D={D}, "
          f"fp32, causal; peak = VmHWM - VmRSS before (fresh processes, mmap threshold 64 KiB), largest rank; "
          f"one head slice = L x D x 4 B = {head_slice / 2 ** 20:.1f} MiB")
    print(f"own outputs (out, dq, dk, dv) per rank: {own:.1f} MiB")
    print_table(rows, ["method", "peak_mib", "peak_head_slices", "working_mib", "working_head_slices",
                       "cut_total_vs_ulysses", "cut_working_vs_ulysses", "time_s", "time_vs_ulysses"])
    print("results:", write_results("bench_cp_memory", rows, {
        "length": L, "n": n, "heads": [H, HKV], "head_dim": D, "dtype": "fp32", "reps": args.reps,
        "own_outputs_mib": own,
        "memory_method": "per rank VmHWM after one forward+backward minus VmRSS before it, peak mark reset via "
                         "/proc/self/clear_refs after a warm-up call, MALLOC_MMAP_THRESHOLD_=65536; max over ranks",
        "time_method": "methods alternated per repetition, slowest rank per call, median after one warm-up"}))


if __name__ == "__main__":
    main()
