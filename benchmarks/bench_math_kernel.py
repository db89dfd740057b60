"""The math kernel (parallel/dense.py) in query tiles of BAND_TILE rows against the same kernel with one tile for
the whole document (what it ran before): one document's attention forward + backward, plain and soft-capped
(Gemma 2's cap of 50), its median time and the most bytes alive at once (recipes/memory/trace.LiveBytes: every
tensor the call allocates, inputs excluded).

    python -m benchmarks.bench_math_kernel              # 1K, 2K, 4K tokens, 5 reps
    python -m benchmarks.bench_math_kernel --quick      # 512 and 1K tokens, 2 reps

Writes benchmarks/results/bench_math_kernel.json. H=8 query / 2 K/V heads of 64, fp32.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import print_table, write_results

H, HKV, D = 8, 2, 64


def measure(length: int, softcap, tile: int, reps: int) -> dict:
    from longstride.parallel import dense
    from longstride.parallel.kernels import doc_attention
    from longstride.parallel.pattern import Pattern
    from longstride.recipes.memory.trace import LiveBytes

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, length, D, generator=g) for h in (H, HKV, HKV, H))
    old, dense.BAND_TILE = dense.BAND_TILE, tile
    try:
        times, peak = [], 0
        for _ in range(reps):
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            with LiveBytes() as live:
                start = time.perf_counter()
                doc_attention(*x, None, D ** -0.5, "math", pattern=Pattern(softcap=softcap)).backward(dout)
                times.append(time.perf_counter() - start)
            peak = max(peak, live.peak)
    finally:
        dense.BAND_TILE = old
    return {"length": length, "softcap": softcap or "-", "tile": tile, "seconds": statistics.median(times),
            "peak_mib": peak / 2 ** 20}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    lengths, reps = ([512, 1024], 2) if args.quick else ([1024, 2048, 4096], args.reps)
    from longstride.parallel.dense import BAND_TILE

    rows = []
    for length in lengths:
        for softcap in (None, 50.0):
            tiled, whole = (measure(length, softcap, tile, reps) for tile in (BAND_TILE, length))
            whole["tile"] = "whole"
            tiled["time_vs_whole"] = tiled["seconds"] / whole["seconds"]
            tiled["peak_vs_whole"] = tiled["peak_mib"] / whole["peak_mib"]
            rows += [tiled, whole]
    print_table(rows, ["length", "softcap", "tile", "seconds", "peak_mib", "time_vs_whole", "peak_vs_whole"])
    if not args.quick:
        print(write_results("bench_math_kernel", rows, {"heads": [H, HKV], "head_dim": D, "reps": reps}))
    return rows


if __name__ == "__main__":
    main()
