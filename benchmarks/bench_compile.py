"""train.compile against the eager step: one forward + backward of SmolLM2-135M's layer shape (576 hidden, 1536 MLP,
9/3 heads; 8 layers on CPU, 30 on a GPU), built as a stage builds its step (recipes/run/step.py, through
benchmarks/bench_checkpointing.build), without and with full activation checkpointing, eager and compiled
(model/compile.py: each layer's parts through torch.compile, attention outside the graphs).

The first step of a compiled build compiles it (its time is reported apart; the second compiled build reuses the
first's graphs, where its shapes are the same, and Inductor's cache on disk shortens a later process's
compiling; each row gives the graphs its first step compiled and the functions dynamo ran eagerly in it: none, or
the row is no compiled figure); then the builds run in interleaved rounds, and each row gives its
median step time and the median of its per-round ratio to the eager build of the same checkpointing (steadier on a
shared machine). On a GPU the step runs under bf16 autocast on torch's flash kernel.

    python -m benchmarks.bench_compile [--length 2048 --layers 8 --reps 7]   # CPU, fp32
    python -m benchmarks.bench_compile --out DIR/compile.json                  # on a GPU: 16K, 30 layers
    # writes benchmarks/results/bench_compile.json (CPU) unless --out; --smoke: 256 tokens, 2 layers, 1 round
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from benchmarks.bench_checkpointing import build, run_step
from benchmarks.common import machine, print_table, write_json
from longstride.model.compile import compile_status, fresh_start

OUT = os.path.join(os.path.dirname(__file__), "results", "bench_compile.json")
BUILDS = [(ac, compiled) for ac in ("none", "full") for compiled in (False, True)]


def name(ac: str, compiled: bool) -> str:
    return f"{ac}{' compiled' if compiled else ''}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, help="default 16384 on a GPU, 2048 on CPU")
    ap.add_argument("--layers", type=int, help="default 30 on a GPU, 8 on CPU")
    ap.add_argument("--reps", type=int, help="default 5 on a GPU, 7 on CPU")
    ap.add_argument("--smoke", action="store_true", help="256 tokens, 2 layers, 1 round")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    for field, on_gpu, on_cpu, smoke in (("length", 16384, 2048, 256), ("layers", 30, 8, 2), ("reps", 5, 7, 1)):
        if getattr(args, field) is None:
            setattr(args, field, smoke if args.smoke else on_gpu if gpu else on_cpu)
    built, first, status = {}, {}, {}
    fresh_start()  # as a stage starts (model/compile.py)
    for ac, compiled in BUILDS:
        before = compile_status()  # since fresh_start: this build's first step compiles the difference
        step, local, lm = built[name(ac, compiled)] = build(ac, args.layers, args.length, device, compile_=compiled)
        first[name(ac, compiled)] = run_step(step, local, ac, device)[0]
        after = compile_status()
        status[name(ac, compiled)] = (after.graphs - before.graphs, after.eager_frames - before.eager_frames)
        lm.zero_grad(set_to_none=False)
    times = {k: [] for k in built}
    for _ in range(args.reps):
        for ac, compiled in BUILDS:
            step, local, lm = built[name(ac, compiled)]
            times[name(ac, compiled)].append(run_step(step, local, ac, device)[0])
            lm.zero_grad(set_to_none=False)
    rows = []
    for ac, compiled in BUILDS:
        t, eager = times[name(ac, compiled)], times[name(ac, False)]
        rows.append({"build": name(ac, compiled), "first_step_s": round(first[name(ac, compiled)], 2),
                     "step_s_median": round(statistics.median(t), 3),
                     "vs_eager_paired": round(statistics.median(a / b for a, b in zip(t, eager)), 3),
                     "new_graphs": status[name(ac, compiled)][0], "eager_frames": status[name(ac, compiled)][1],
                     "step_s": [round(x, 3) for x in t]})
    result = {"what": "one forward + backward (no optimizer) of SmolLM2-135M's layer shape, eager against "
                      "train.compile, medians of interleaved rounds; first_step_s includes compiling",
              "machine": machine(), "python": platform.python_version(), "length": args.length,
              "layers": args.layers, "reps": args.reps, "precision": "bf16 autocast" if gpu else "fp32",
              "rows": rows}
    print_table(rows, ["build", "first_step_s", "step_s_median", "vs_eager_paired", "new_graphs", "eager_frames"])
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
