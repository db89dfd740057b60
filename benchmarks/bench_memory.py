"""Memory of one training step against context length, and the longest context that fits here.

For a small SmolLM3-style model and for SmolLM2-135M's shape (30 layers, 576 hidden, 9/3 heads,
49K vocabulary), one training step (forward + backward + AdamW) on one sequence of L tokens:
  plain       a plain transformers step: SDPA attention, loss from full logits (labels=), no checkpointing
  longstride  longstride's attention, chunked loss, tiled MLP (post-attention norm inside the tiles), lean
              RMSNorm backward, full activation checkpointing, 1 process
  cp2         the same with ring CP over 2 gloo processes (per-rank figure, the larger rank)
Memory, measured on CPU: every (method, length) runs in fresh processes whose glibc mmap threshold is
fixed at 64 KiB (freed tensors leave resident memory at once). The zero is the process's resident
memory after imports; after a first step (which creates the optimizer state) the peak-RSS mark is
reset and the figure is VmHWM after a second, timed step minus the zero: parameters, gradients,
optimizer state and the step's activations. A quadratic a + b L + c L^2 is fitted per method and
model; bytes per token is b and the fixed cost a of the straight-line fit, which predicts the longest
context (where it reaches this machine's 24 GiB minus the zero); the quadratic's c is reported with
the share of the peak it would explain at the longest fitted length. The prediction is then checked by one real step at a
longer length. The marginal bytes per token, between the two longest lengths measured (the last fitted one and the
check), is the slope where activations set the peak: at short lengths the peak of a lean step is the AdamW update's
transient buffers (about the size of the parameters), so the shortest points sit on that floor.

    python -m benchmarks.bench_memory [--quick]   # writes benchmarks/results/bench_memory.{json,png}
    python -m benchmarks.bench_memory --from-json # refits and replots bench_memory_points.json (written as
                                                  # each point is measured, so a cut-short run keeps them)
    python -m benchmarks.bench_memory --model smollm2_135m_shape --method cp2
                                                  # re-measures only those points, keeping the others in the file
    python -m benchmarks.bench_memory --time-pair 2048 --model smollm2_135m_shape
                                                  # step time of longstride vs plain: the two alternate in
                                                  # fresh processes, median of the paired ratios
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import RESULTS, print_table, proc_status_bytes, write_results
from longstride.recipes.run.tracking import reset_peak_rss
from longstride.model.config import ModelConfig
from longstride.parallel.spawn import gather_cat, run_gloo

MACHINE_BYTES = 24 * 2 ** 30
MODELS = {
    "smollm3_tiny": (ModelConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, nope_interval=4), 4096),
    "smollm2_135m_shape": (ModelConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, nope_interval=0), 49152),
}
METHODS = {"plain": 1, "longstride": 1, "cp2": 2}  # processes
MLP_TILE, LOSS_TILE = 1024, 1024


def _worker(rank, n, model_name, method, length, path):
    from longstride.data.batch import collate, packed_item
    from longstride.model.build import build_model
    from longstride.parallel.config import CPDegrees, ParallelDims
    from longstride.parallel.cp import cp_context
    from longstride.recipes.config.schema import OptimConfig
    from longstride.recipes.run.step import StepSpec, build_optimizer, build_step, loss_sum

    zero = proc_status_bytes("VmRSS")
    cfg, vocab = MODELS[model_name]
    lm = build_model(cfg, rope_theta=1e5, seq_len=length, vocab_size=vocab, eos_id=0, pad_id=1, seed=0)
    ids = torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    if method == "plain":
        lm.set_attn_implementation("sdpa")

        def loss_fn():
            return lm(input_ids=ids, labels=ids).loss
    else:  # as a training stage builds its step (recipes/run/step.py)
        cp = cp_context("ring", ParallelDims(n, 1, n), CPDegrees(ring=n), "cpu", "sdpa")
        step = build_step(lm, StepSpec("full", mlp_tile=MLP_TILE, loss_tile=LOSS_TILE), cp)
        local = step.prep(collate([packed_item([ids[0].numpy()], length, pad_id=1)]))

        def loss_fn():
            return loss_sum(step.module, local, "cpu") / length
    opt = build_optimizer(lm, OptimConfig(), lr=1e-4)

    def step():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    reset_peak_rss()
    t0 = time.perf_counter()
    step()
    elapsed = time.perf_counter() - t0
    peak = gather_cat(torch.tensor([float(proc_status_bytes("VmHWM") - zero), float(zero), elapsed]))
    if rank == 0:
        torch.save([p.tolist() for p in peak], path)


def measure(model_name: str, method: str, length: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.pt")
        run_gloo(_worker, METHODS[method], model_name, method, length, path)
        ranks = torch.load(path)
    worst = max(ranks, key=lambda r: r[0])
    return {"model": model_name, "method": method, "length": length, "peak_gib": worst[0] / 2 ** 30,
            "zero_gib": worst[1] / 2 ** 30, "step_s": max(r[2] for r in ranks)}


def fit(rows: list[dict]) -> dict:
    """Least squares over the fitted lengths. The prediction uses the straight line a + b L; the quadratic
    fit's c is reported beside it with the share of the peak it would explain at the longest fitted
    length, so a real L^2 term shows twice: a large share, and a check point above the line."""
    L = np.array([r["length"] for r in rows], dtype=np.float64)
    y = np.array([r["peak_gib"] * 2 ** 30 for r in rows])
    b, a = np.polyfit(L, y, 1)
    c = np.polyfit(L, y, 2)[0] if len(L) >= 3 else 0.0
    budget = MACHINE_BYTES - max(r["zero_gib"] for r in rows) * 2 ** 30
    return {"fixed_gib": a / 2 ** 30, "bytes_per_token": b, "l2_bytes": c,
            "l2_share": c * L.max() ** 2 / y.max(), "predicted_max_len": float((budget - a) / b)}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2))
    for ax, model_name in zip(np.atleast_1d(axes), models):
        for method in METHODS:
            fitted = [r for r in rows if r["model"] == model_name and r["method"] == method and r["use"] == "fit"]
            if not fitted:
                continue
            pts = sorted((r["length"], r["peak_gib"]) for r in fitted)
            f = fit(fitted)
            xs = np.linspace(0, max(p[0] for p in pts) * 2, 50)
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"{method}: "
                           f"{f['bytes_per_token'] / 1024:.0f} KiB/token, fits ~{f['predicted_max_len'] / 1024:.0f}K")
            ax.plot(xs, (f["fixed_gib"] * 2 ** 30 + f["bytes_per_token"] * xs) / 2 ** 30,
                    "--", color=line[0].get_color(), alpha=0.6)
            checks = [(r["length"], r["peak_gib"]) for r in rows if r["model"] == model_name and r["method"] == method
                      and r["use"] == "check"]
            for x, y in checks:
                ax.plot([x], [y], "*", ms=12, color=line[0].get_color())
        ax.set_title(f"{model_name}: peak memory of one training step")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("GiB (CPU peak RSS over the process zero)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for model_name in dict.fromkeys(r["model"] for r in rows):
        fits = {}
        for method in METHODS:
            pts = [r for r in rows if r["model"] == model_name and r["method"] == method]
            f = fits[method] = fit([r for r in pts if r["use"] == "fit"])
            chk = next(r for r in pts if r["use"] == "check")
            longest = max(r["length"] for r in pts if r["use"] == "fit")
            (l1, g1), (l2, g2) = sorted((r["length"], r["peak_gib"]) for r in pts)[-2:]
            out.append({"model": model_name, "method": method, "fixed_gib": f["fixed_gib"],
                        "KiB_per_token": f["bytes_per_token"] / 1024,
                        "marginal_KiB_per_token": (g2 - g1) * 2 ** 30 / (l2 - l1) / 1024, "L2_bytes": f["l2_bytes"],
                        "L2_share": f["l2_share"], "pred_max_len": f["predicted_max_len"], "check_len": chk["length"],
                        "check_gib": chk["peak_gib"],
                        "check_pred_gib": f["fixed_gib"] + f["bytes_per_token"] * chk["length"] / 2 ** 30,
                        "step_len": longest,
                        "step_s": next(r["step_s"] for r in pts if r["length"] == longest)})
        mine = [o for o in out if o["model"] == model_name]
        plain, lean = (next(o for o in mine if o["method"] == m) for m in ("plain", "longstride"))
        for o in mine:
            o["max_len_vs_plain"] = o["pred_max_len"] / plain["pred_max_len"]
            o["KiB_per_token_vs_longstride"] = o["KiB_per_token"] / lean["KiB_per_token"]
            o["marginal_vs_longstride"] = o["marginal_KiB_per_token"] / lean["marginal_KiB_per_token"]
            o["step_time_vs_plain"] = o["step_s"] / plain["step_s"]
    return out


def time_pair(model_name: str, length: int, reps: int) -> None:
    """The step-time cost of longstride's recomputation on a noisy shared machine: plain and longstride
    alternate, each in fresh processes (one warm-up step, one timed step), and the ratio is taken per
    pair; the median pair is reported."""
    pairs = []
    for rep in range(reps):
        plain, lean = measure(model_name, "plain", length), measure(model_name, "longstride", length)
        pairs.append({"rep": rep, "plain_s": plain["step_s"], "longstride_s": lean["step_s"],
                      "ratio": lean["step_s"] / plain["step_s"]})
        print(pairs[-1], flush=True)
    out = {"model": model_name, "length": length, "median_ratio": float(np.median([p["ratio"] for p in pairs])),
           "median_plain_s": float(np.median([p["plain_s"] for p in pairs])),
           "median_longstride_s": float(np.median([p["longstride_s"] for p in pairs]))}
    print_table([out], list(out))
    print("results:", write_results("bench_memory_time", [out], {"pairs": pairs}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the tiny model only, short lengths")
    ap.add_argument("--from-json", action="store_true", help="refit and replot the points already in the JSON")
    ap.add_argument("--model", action="append", choices=list(MODELS), help="measure only this model (repeatable); "
                    "the points file keeps the other models' and methods' points")
    ap.add_argument("--method", action="append", choices=list(METHODS), help="measure only this method (repeatable)")
    ap.add_argument("--time-pair", type=int, metavar="L", help="only time plain vs longstride at length L")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.time_pair:
        return time_pair(args.model[0] if args.model else "smollm2_135m_shape", args.time_pair, args.reps)
    points_path = os.path.join(RESULTS, "bench_memory_points.json")
    if args.from_json:
        with open(points_path) as f:
            rows = json.load(f)["rows"]
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned processes' glibc at start
        plan = {"smollm3_tiny": ([2048, 4096, 8192, 16384], 32768),
                "smollm2_135m_shape": ([1024, 2048, 4096], 8192)}
        if args.quick:
            plan = {"smollm3_tiny": ([1024, 2048, 4096], 8192)}
        models, methods = args.model or list(plan), args.method or list(METHODS)
        rows = []
        if args.model or args.method:
            with open(points_path) as f:
                rows = [r for r in json.load(f)["rows"] if not (r["model"] in models and r["method"] in methods)]
        for model_name, (lengths, check) in plan.items():
            if model_name not in models:
                continue
            for method in methods:
                for L, use in [*((L, "fit") for L in lengths), (check, "check")]:
                    rows.append({**measure(model_name, method, L), "use": use})
                    print(rows[-1], flush=True)
                    write_results("bench_memory_points", rows)  # a run cut short keeps what it measured
    out = summarize(rows)
    print_table(out, ["model", "method", "fixed_gib", "KiB_per_token", "L2_share", "pred_max_len", "max_len_vs_plain",
                      "KiB_per_token_vs_longstride", "marginal_KiB_per_token", "marginal_vs_longstride", "check_len", "check_gib", "check_pred_gib", "step_len",
                      "step_time_vs_plain"])
    png = os.path.join(RESULTS, "bench_memory.png")
    plot(rows, png)
    print("plot:", png)
    print("results:", write_results("bench_memory", out, {
        "points": rows, "machine_bytes": MACHINE_BYTES, "mlp_tile": MLP_TILE, "loss_tile": LOSS_TILE,
        "memory_method": "per process VmHWM during a second training step (peak mark reset after the first) minus "
                         "VmRSS after imports; MALLOC_MMAP_THRESHOLD_=65536; cp2: the larger rank"}))


if __name__ == "__main__":
    main()
