"""Ring attention on CPU: efficiency, load balance, document masking against its ideal, bf16 error vs N.

N=2 gloo processes of 1 thread each against 1 process of 1 thread; L=16K, 8 query / 2 K/V heads,
head dim 64, forward + backward, fp32 and bf16. Medians of `reps` timed iterations after a warm-up;
each iteration times the single process and then the ring back to back, and the efficiency is the
median of those paired ratios, since this shared machine's speed drifts over minutes.
  ring efficiency   T(single, full sequence) / (N x T(ring, per rank))           target >= 0.90 causal
  load balance      slowest / mean rank kernel time (zig-zag, and contiguous shards)  target <= 1.05
  document masking  T(docs) / T(dense causal) against the ideal sum(len^2) / L^2  target <= 1.25x ideal
                    on sequences best-fit packed from the embedded (stdlib) corpus
  bf16 error        mean |ring - fp64 reference| / mean |reference| for N = 1, 2, 4  target N=4 <= 1.5x N=1
ring_kernel_s is a rank's time inside attention kernels: wall minus kernels is the ring's own cost
(merging, buffers, waiting on the network); single_s / N - ring_kernel_s is what running two
processes on the machine's shared cache and memory costs the kernels.

    python -m benchmarks.bench_ring [--length 16384] [--reps 3]   # writes benchmarks/results/bench_ring.json
    python -m benchmarks.bench_ring --balance docs [--n 3 --length 18432] --no-error
        # the document sequences on parallel/balance.py's chunk assignment: bench_ring_balance_docs[_n3].json
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import print_table, write_results
from longstride.parallel import kernels as kernels_mod
from longstride.parallel.blocks import doc_segments, ring_plan
from longstride.parallel.kernels import block_backward, block_forward
from longstride.parallel.ring import RingComm, ring_backward, ring_forward
from longstride.parallel.balance import balanced_assignment
from longstride.parallel.zigzag import shard, unshard, zigzag
from longstride.parallel.spawn import gather_cat, run_gloo

H, HKV, D = 8, 2, 64
SCALE = D ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(length: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, H, length, D), (1, HKV, length, D), (1, HKV, length, D), (1, H, length, D))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def packed_doc_ids(length: int, count: int, seed: int = 0, min_docs: int = 1) -> list[torch.Tensor]:
    """Document ids of `count` random best-fit packed sequences of the embedded corpus, drawn from those of at least
    `min_docs` documents (a short smoke's sequences are mostly one file)."""
    from longstride.data.config import DataConfig, SourceConfig
    from longstride.data.corpus import build_corpus, build_tokenizer
    from longstride.data.packing import pack

    cfg = DataConfig(sources={"stdlib": SourceConfig(kind="stdlib")})
    tok = build_tokenizer(cfg, ".cache/longstride")
    corpus = build_corpus(cfg, tok, ".cache/longstride")
    plan, _ = pack(corpus.doc_start, corpus.doc_len, length, "best_fit")
    pool = np.arange(len(plan))
    if min_docs > 1:
        pool = pool[np.diff(plan.seq_ptr) >= min_docs]
    pick = pool[np.random.default_rng(seed).choice(len(pool), size=count, replace=False)]
    out = []
    for i in sorted(pick.tolist()):
        lens = plan.seg_len[plan.seq_ptr[i]:plan.seq_ptr[i + 1]].tolist()
        if sum(lens) < length:
            lens.append(length - sum(lens))  # padding is its own document
        out.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None])
    return out


def ideal_ratio(doc: torch.Tensor) -> float:
    """Causal pairs within documents / causal pairs of the whole sequence (~ sum(len^2) / L^2)."""
    lens = torch.unique_consecutive(doc[0], return_counts=True)[1].double()
    n = doc.shape[1]
    return float((lens * (lens + 1) / 2).sum() / (n * (n + 1) / 2))


def fwd_bwd(q, k, v, dout, segments):
    out, lse = block_forward("sdpa", q, k, v, SCALE, segments)
    return block_backward("sdpa", dout, q, k, v, out, lse, SCALE, segments)


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def single_segments(doc, length):
    """The cp=1 kernel path over the whole sequence: one causal call per document."""
    return ((0, length),) if doc is None else doc_segments(doc[0].numpy(), 0, length)


def contiguous_balance(length: int, n: int, reps: int) -> float:
    """Kernel time of each rank under contiguous sharding (rank r: its causal chunk plus r full chunks
    before it), measured block by block in this process; slowest / mean."""
    c = length // n
    q, k, v, dout = make_inputs(c, torch.float32)
    diag = timed(lambda: fwd_bwd(q, k, v, dout, ((0, c),)), reps)
    rect = timed(lambda: fwd_bwd(q, k, v, dout, None), reps)
    per_rank = [diag + r * rect for r in range(n)]
    return max(per_rank) / statistics.mean(per_rank)


def _timed_kernels(log: list):
    def wrap(fn):
        def inner(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            log.append(time.perf_counter() - t0)
            return out
        return inner
    # the ring's steps call the block kernels through the kernels module (parallel/kernels.step_forward)
    kernels_mod.block_forward, kernels_mod.block_backward = wrap(block_forward), wrap(block_backward)


def _timing_worker(rank, n, length, reps, docs, path, balance="zigzag", causal=tuple(DTYPES)):
    """Per repetition, paired on this noisy shared machine: rank 0 first runs the whole sequence alone
    (the other ranks wait at a barrier, idle), then all ranks run the ring."""
    import torch.distributed as dist

    comm = RingComm(dist.group.WORLD)
    kernel_log: list = []
    _timed_kernels(kernel_log)
    res = {}
    cases = [("causal", name, None) for name in causal] + [("docs", "fp32", d) for d in docs]
    for i, (layout, name, doc) in enumerate(cases):
        full = make_inputs(length, DTYPES[name])
        a = balanced_assignment(doc.numpy(), n) if balance == "docs" and doc is not None else zigzag(n)
        q, k, v, dout = (shard(x, n, rank, dim=2, assignment=a) for x in full)
        plan = ring_plan(doc, 1, length, n, rank, a)
        singles, walls, kernels = [], [], []
        for rep in range(reps + 1):
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                fwd_bwd(*full, single_segments(doc, length))
                singles.append(time.perf_counter() - t0)
            dist.barrier()
            kernel_log.clear()
            t0 = time.perf_counter()
            out, lse = ring_forward(q, k, v, plan, "sdpa", SCALE, comm)
            ring_backward(dout, q, k, v, out, lse, plan, "sdpa", SCALE, comm)
            wall = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            walls.append(wall.item())
            kernels.append(sum(kernel_log))
        walls, kernels, singles = walls[1:], kernels[1:], singles[1:]  # the first repetition warms up
        per_rank = gather_cat(torch.tensor(statistics.median(kernels)))
        if rank == 0:
            res[layout, name, i] = {"wall": statistics.median(walls), "kernel": [t.item() for t in per_rank],
                                    "single": statistics.median(singles),
                                    "efficiency": statistics.median(s / (n * w) for s, w in zip(singles, walls))}
    if rank == 0:
        torch.save(res, path)


def _error_worker(rank, n, length, path):
    import torch.distributed as dist

    comm = RingComm(dist.group.WORLD) if n > 1 else None
    q, k, v, dout = (shard(x, n, rank, dim=2) for x in make_inputs(length, torch.bfloat16, seed=1))
    plan = ring_plan(None, 1, length, n, rank)
    out, lse = ring_forward(q, k, v, plan, "sdpa", SCALE, comm)
    grads = ring_backward(dout, q, k, v, out, lse, plan, "sdpa", SCALE, comm)
    full = [unshard(gather_cat(x), dim=2) if n > 1 else x for x in (out, *grads)]
    if rank == 0:
        torch.save(full, path)


def bf16_errors(length: int, ns=(1, 2, 4)) -> dict:
    q, k, v, dout = make_inputs(length, torch.float64, seed=1)
    ref_out, ref_lse = block_forward("sdpa", q, k, v, SCALE, ((0, length),))
    ref = [ref_out, *block_backward("sdpa", dout, q, k, v, ref_out, ref_lse, SCALE, ((0, length),))]
    errors = {}
    with tempfile.TemporaryDirectory() as d:
        for n in ns:
            path = os.path.join(d, f"err{n}.pt")
            run_gloo(_error_worker, n, length, path)
            got = torch.load(path)
            errors[n] = {name: (g.double() - r).abs().mean().item() / r.abs().mean().item()
                         for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    return errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--docs", type=int, default=3, help="packed sequences timed with document masking")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--error-n", type=int, nargs="+", default=[1, 2, 4], help="ring sizes for the bf16 error")
    ap.add_argument("--no-error", action="store_true", help="skip the bf16 error part")
    ap.add_argument("--causal", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="dense causal cases")
    ap.add_argument("--balance", choices=["zigzag", "docs"], default="zigzag",
                    help="the document sequences' chunk assignment (causal cases stay zig-zag, exact for them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L, n, reps = args.length, args.n, args.reps
    docs = packed_doc_ids(L, args.docs)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "timing.pt")
        run_gloo(_timing_worker, n, L, reps, docs, path, args.balance, tuple(args.causal))
        ring = torch.load(path)
    causal = {nm: v for (lay, nm, _), v in ring.items() if lay == "causal"}
    bal = f"balance_{args.balance}"  # slowest / mean rank kernel time (documents on that assignment)
    rows = []
    for name, r in causal.items():
        rows.append({"case": f"causal {name}", "single_s": r["single"], "ring_wall_s": r["wall"],
                     "ring_kernel_s": statistics.mean(r["kernel"]), "efficiency": r["efficiency"],
                     bal: max(r["kernel"]) / statistics.mean(r["kernel"])})
    rows[0]["balance_contiguous"] = contiguous_balance(L, n, reps)
    for i, doc in enumerate(docs):
        r = ring[next(key for key in ring if key[0] == "docs" and key[2] == len(causal) + i)]
        ideal = ideal_ratio(doc)
        rows.append({"case": f"docs fp32 seq{i} ({int(doc.max()) + 1} docs)", "single_s": r["single"],
                     "ring_wall_s": r["wall"], "ring_kernel_s": statistics.mean(r["kernel"]),
                     "efficiency": r["efficiency"], bal: max(r["kernel"]) / statistics.mean(r["kernel"]),
                     "ideal_ratio": ideal, "single_ratio": r["single"] / causal["fp32"]["single"],
                     "ring_ratio": r["wall"] / causal["fp32"]["wall"],
                     "ring_vs_ideal": r["wall"] / causal["fp32"]["wall"] / ideal})
    print(f"L={L}, N={n} ranks x 1 thread vs 1 process x 1 thread, H={H}/{HKV}, D={D}, forward+backward")
    print_table(rows, ["case", "single_s", "ring_wall_s", "ring_kernel_s", "efficiency", bal, "balance_contiguous",
                       "ideal_ratio", "single_ratio", "ring_ratio", "ring_vs_ideal"])
    name = "bench_ring" + ("" if args.balance == "zigzag" else "_balance_docs") + ("" if n == 2 else f"_n{n}")
    extra = {"length": L, "n": n, "heads": [H, HKV], "head_dim": D, "reps": reps, "balance": args.balance}
    if not args.no_error:
        errors = bf16_errors(L, ns=tuple(args.error_n))
        err_rows = [{"N": k, **v} for k, v in errors.items()]
        print("bf16 mean |error| / mean |fp64 reference|, causal:")
        print_table(err_rows, ["N", "out", "dq", "dk", "dv"])
        worst = max(errors[max(errors)][k] / errors[1][k] for k in errors[1])
        print(f"bf16 error N={max(errors)} / N=1: at most {worst:.3f}x (over out, dq, dk, dv)")
        extra.update(bf16_errors=err_rows, bf16_error_ratio_max=worst)
    print("results:", write_results(name, rows, extra))


if __name__ == "__main__":
    main()
