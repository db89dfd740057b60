"""The traced memory of a training step (recipes/memory/trace.py), checked against measured peaks, then used to
estimate published configurations on GPUs nobody here has.

  --validate   the CPU program (CPU kernels, fp32, 1 byte rounding) traced for every point that
               benchmarks/bench_memory.py measured (benchmarks/results/bench_memory_points.json: SmolLM2-135M's
               shape at 1K-8K and the tiny shape at 2K-32K; plain transformers, longstride, longstride cp=2) and
               the error of the trace against the measured peak (resident memory above the process's
               zero), per point. Writes benchmarks/results/plan_validation.json.
  --published  (host_gib_per_rank: the offloaded layer inputs each rank keeps in host memory at that length)
               Llama-3.1-8B's shape on 1 x H100 80GB (plain transformers; longstride with tiling, full
               checkpointing and offload) and on 8 x H100 with cp=8 (ring, Ulysses, UPipe), and Qwen3-8B's
               shape at 1M tokens on 8 x H100: the longest context that fits, or the peak at the peers'
               length, beside the peers' measured figures (ALST, UPipe, TRL). ESTIMATES: traced on CPU, never
               run on a GPU. Writes benchmarks/results/plan_estimates.json.

    python -m benchmarks.bench_plan --validate      # ~5 minutes here
    python -m benchmarks.bench_plan --published     # ~10 minutes here
"""
from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.common import RESULTS, print_table, write_results
from longstride.parallel.config import CPDegrees, ParallelConfig
from longstride.parallel.cp import cp_degrees
from longstride.recipes.memory.memplan import GIB, peak_line
from longstride.recipes.memory.plan_options import Hardware, hardware
from longstride.recipes.memory.trace import StepProgram, trace_step
from longstride.recipes.run.step import StepSpec


def _validation_program(model: str, method: str, length: int) -> StepProgram:
    from benchmarks.bench_memory import LOSS_TILE, MLP_TILE, MODELS
    from longstride.model.build import smollm3_config

    cfg, vocab = MODELS[model]
    config = smollm3_config(cfg, vocab, 0, 1, length, 1e5)
    common = {"kernel": "sdpa", "bf16": False, "gpu": False, "docs": 1}
    if method == "plain":
        return StepProgram(config, length, plain=True, step=StepSpec("none"), **common)
    n = 2 if method == "cp2" else 1
    return StepProgram(config, length, world=n, cp=n, degrees=CPDegrees(ring=n),
                       step=StepSpec("full", mlp_tile=MLP_TILE, loss_tile=LOSS_TILE), **common)


def validate() -> list[dict]:
    with open(os.path.join(RESULTS, "bench_memory_points.json")) as fh:
        measured = json.load(fh)
    rows = []
    for m in measured["rows"]:
        prog = _validation_program(m["model"], m["method"], m["length"])
        t0 = time.perf_counter()
        traced = max(trace_step(prog, rank)["peak"] for rank in range(prog.world))
        meas = m["peak_gib"] * GIB
        rows.append({"model": m["model"], "method": m["method"], "length": m["length"],
                     "measured_gib": round(meas / GIB, 3), "traced_gib": round(traced / GIB, 3),
                     "error": round((traced - meas) / meas, 4), "trace_s": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest error {worst:.1%} over {len(rows)} points")
    print("results:", write_results("plan_validation", rows, {"measured": "bench_memory_points.json",
                                                              "measured_machine": measured["machine"],
                                                              "largest_error": worst}))
    return rows


# ---- published configurations (estimates) ----

def llama31_8b():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_theta=5e5, tie_word_embeddings=False, use_cache=False, pad_token_id=0)


def qwen3_8b():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1e6, tie_word_embeddings=False, use_cache=False)


LEAN = {"step": StepSpec("full", offload=True, mlp_tile=8192, loss_tile=4096)}
# (name, model, GPUs, program settings, the peers' measured figure, the peers' length to report a peak at)
PUBLISHED = [
    ("Llama-3.1-8B, 1 GPU, plain transformers", llama31_8b, 1, {"plain": True, "step": StepSpec("none")},
     "ALST (ZeRO-3 with CPU offload of weights and optimizer): 500K", None),
    ("Llama-3.1-8B, 1 GPU, longstride (tiles, full checkpointing, offload)", llama31_8b, 1, LEAN,
     "ALST: 500K", None),
    ("Llama-3.1-8B, 8 GPUs, longstride ring cp=8", llama31_8b, 8, {**LEAN, "cp_impl": "ring"},
     "ALST: 3.8M; UPipe: 5M", None),
    ("Llama-3.1-8B, 8 GPUs, longstride Ulysses cp=8", llama31_8b, 8, {**LEAN, "cp_impl": "ulysses"},
     "ALST: 3.8M; UPipe: 5M", None),
    ("Llama-3.1-8B, 8 GPUs, longstride UPipe cp=8", llama31_8b, 8, {**LEAN, "cp_impl": "upipe"},
     "ALST: 3.8M; UPipe: 5M", None),
    ("Qwen3-8B, 8 GPUs, longstride ring cp=8, at 1M", qwen3_8b, 8, {**LEAN, "cp_impl": "ring"},
     "TRL: 56.2 GB peak at 1M", 1 << 20),
]


def published_program(model, gpus: int, settings: dict, length: int) -> StepProgram:
    s = dict(settings)
    impl = s.pop("cp_impl", "ring")
    config = model()
    degrees = cp_degrees(ParallelConfig(cp_impl=impl), gpus, config.num_attention_heads) if gpus > 1 else CPDegrees()
    return StepProgram(config, length, world=gpus, cp=gpus, cp_impl=impl, degrees=degrees, fsdp=gpus > 1,
                       docs=1, **s)


def published(hw: Hardware) -> list[dict]:
    usable = hw.usable_gib * GIB
    rows = []
    for name, model, gpus, settings, peer, at in PUBLISHED:
        t0 = time.perf_counter()
        base = 16384 * gpus  # 16K and 32K tokens per rank
        prog = published_program(model, gpus, settings, base)
        first = trace_step(prog)
        fixed, per_token, _ = peak_line(prog, first, 2 * base)
        row = {"configuration": name, "GPUs": f"{gpus} x {hw.name}",
               "fixed_gib": round(fixed / GIB, 2), "kib_per_token": round(per_token / 1024, 2),
               "states_gib": round((first["parameters"] + first["gradients"] + first["optimizer"]) / GIB, 2)}
        row["update_gib"] = round(first["peak_optimizer"] / GIB, 2)
        host_per_token = first["host"] / base  # offloaded layer inputs, host memory per rank
        if at:
            row["peak_gib_at"] = f"{max(fixed + per_token * at, first['peak_optimizer']) / GIB:.1f} GiB at {at // 1024}K"
        fits = fixed < usable and first["peak_optimizer"] <= usable
        longest = int((usable - fixed) / per_token) if fits else 0
        row["longest"] = f"{longest / 1e6:.2f}M" if longest >= 1e6 else (f"{longest // 1024}K" if longest else
                                                                           "none: the states alone exceed")
        row["host_gib_per_rank"] = round(host_per_token * (at or longest) / GIB, 1)
        row["peers_measured"] = peer
        row["trace_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(row, flush=True)
    print(f"ESTIMATES, traced on CPU, not measured on a GPU: {hw.name}, usable {hw.usable_gib:.1f} GiB per GPU")
    print_table(rows, list(rows[0]))
    print("results:", write_results("plan_estimates", rows, {"hardware": vars(hw), "usable_gib": hw.usable_gib,
                                                             "estimate": "traced on CPU, not measured on a GPU"}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--published", action="store_true")
    ap.add_argument("--hardware", default="h100_80g")
    args = ap.parse_args()
    if args.validate or not args.published:
        validate()
    if args.published or not args.validate:
        published(hardware(args.hardware))


if __name__ == "__main__":
    main()
