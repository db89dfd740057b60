"""The tiny retrieval recipe's ablation on CPU: NoPE layers, RoPE base bumps, document masking, YaRN.

Each variant is recipe=tiny_retrieval plus a few overrides, trained per seed (train.seed: the
model's initialisation) on 2 local processes, then evaluated on its last checkpoint:
  retrieval  RULER's niah_single_1 (transfer: its template was never trained on) and the in-format
             synth_kv task, at the trained length (4K) and 2x / 4x beyond it, YaRN x2 and x4 at eval
             time beside none (past 4K positions without YaRN is plain extrapolation)
  ppl        perplexity of the first 1K / 4K / 16K tokens of long standard-library files (eval.ppl)

    python -m benchmarks.ablation_retrieval [--seeds 0 1 2] [--variants baseline all_rope ...] [--samples 10]
        # trains into outputs/ablation/<variant>/seed<S>/ (a finished run is reused, so an interrupted
        # ablation picks up where it stopped; fixed_base reuses the baseline's stage 1, identical for it),
        # writes benchmarks/results/ablation_retrieval.{json,png}
    python -m benchmarks.ablation_retrieval --report   # the table and plot again from the saved evals
    python -m benchmarks.ablation_retrieval --smoke --seeds 0 --samples 1   # the plumbing, in minutes
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks.common import RESULTS, print_table, write_results

VARIANTS = {
    "baseline": [],  # NoPE every 4th layer, base 1e4 -> 4e5 -> 1e6, document masking on
    "fixed_base": ["recipe.stages.s2_2k.rope_theta=1e4", "recipe.stages.s3_4k.rope_theta=1e4"],
    "all_rope": ["model.nope_interval=0"],
    "no_doc_mask": ["data.doc_masking=false"],
}
# fixed_base differs from baseline only from stage 2 on, so it takes the baseline's finished earlier stages
SHARES_EARLY_STAGES = {"fixed_base": "baseline"}
EARLY_STAGES = ("s0_copy", "s1_256")
TRAINED, LENGTHS, PPL_LENGTHS = 4096, [4096, 8192, 16384], [1024, 4096, 16384]
TASKS = ["niah_single_1", "synth_kv"]
YARN = [0, 2, 4]  # 0 = none
ROOT = os.path.join("outputs", "ablation")
# --smoke: every step of the pipeline on a few training steps (checks the plumbing, measures nothing)
STAGES = ("s0_copy", "s1_256", "s2_2k", "s3_4k")
SMOKE = [*(f"recipe.stages.{s}.{k}={v}" for s in STAGES for k, v in (("steps", 2), ("warmup_steps", 1), ("save_every", 0))),
         *(f"data.sources.{name}.synthetic.num_docs={n}" for name, n in
           (("copy_short", 300), ("retrieval_short", 300), ("retrieval_mid", 60), ("retrieval_long", 60)))]


def train(variant: str, seed: int, extra: list) -> tuple[str, float]:
    """The variant's last checkpoint for this seed (trained now unless a finished run is there) and the
    training wall time in seconds (that of the run that made it)."""
    out = os.path.join(ROOT, variant, f"seed{seed}")
    final = os.path.join(out, "tiny_retrieval", "s3_4k", "final")
    timing = os.path.join(out, "train_seconds.json")
    if not os.path.isfile(timing):
        if variant in SHARES_EARLY_STAGES:
            train(SHARES_EARLY_STAGES[variant], seed, extra)
            for stage in EARLY_STAGES:
                src = os.path.join(ROOT, SHARES_EARLY_STAGES[variant], f"seed{seed}", "tiny_retrieval", stage, "final")
                dst = os.path.join(out, "tiny_retrieval", stage, "final")
                if not os.path.isdir(dst):
                    shutil.copytree(src, dst)
        cmd = ["accelerate", "launch", "--config_file", "configs/accelerate/cpu.yaml", "-m", "longstride.recipes.train",
               "recipe=tiny_retrieval", f"train.seed={seed}", f"paths.output_root={out}", "logger.wandb_mode=disabled",
               "logger.progress_bar=false", *VARIANTS[variant], *extra]
        print(f"[ablation] training {variant} seed {seed}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(os.path.join(ROOT, f"{variant}-seed{seed}.log"), "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
        with open(timing, "w") as f:
            json.dump({"seconds": time.perf_counter() - t0}, f)
    with open(timing) as f:
        return final, json.load(f)["seconds"]


def quiet(fn, argv):
    """Runs an eval entry point with its progress output captured (the summary is what we keep)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(argv)


def evaluate(ckpt: str, out: str, samples: int) -> dict:
    """{"ruler": {yarn: {task: {length: score}}}, "ppl": {length: ppl}}; cached in out/ablation_eval.json."""
    path = os.path.join(out, "ablation_eval.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    from longstride.eval import ppl
    from longstride.eval.ruler import run

    res = {"ruler": {}, "ppl": {}}
    for factor in YARN:
        argv = [f"checkpoint={ckpt}", f"lengths=[{','.join(map(str, LENGTHS))}]", f"tasks=[{','.join(TASKS)}]",
                f"num_samples={samples}", "extrapolate=true", "batch_size=5", f"out={out}/ruler", "threads=2"]
        argv += [f"yarn.factor={factor}"] if factor else []
        summary = quiet(run.main, argv)["summary"]
        res["ruler"][str(factor)] = summary["table"]
    rows = quiet(ppl.main, [f"checkpoint={ckpt}", f"lengths=[{','.join(map(str, PPL_LENGTHS))}]", f"out={out}/ppl",
                            "threads=2"])
    res["ppl"] = {str(r["length"]): r["ppl"] for r in rows}
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    return json.loads(json.dumps(res))  # lengths as string keys, as when read back from the file


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(evals: dict) -> list[dict]:
    """One row per variant (and YaRN factor): mean ± sample std over seeds of every cell."""
    rows = []
    for variant, per_seed in evals.items():
        for factor in YARN:
            row = {"variant": variant + (f" + YaRN x{factor}" if factor else ""), "seeds": len(per_seed)}
            for task in TASKS:
                for L in LENGTHS:
                    row[f"{task} {L // 1024}K"] = spread([e["ruler"][str(factor)][task][str(L)]
                                                          for e in per_seed.values()])
            if not factor:
                for L in PPL_LENGTHS:
                    row[f"ppl {L // 1024}K"] = spread([e["ppl"][str(L)] for e in per_seed.values()])
            rows.append(row)
    return rows


def plot(evals: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(5 * len(TASKS), 3.8), sharey=True)
    for ax, task in zip(axes, TASKS):
        for variant, per_seed in evals.items():
            for factor, style in zip(YARN, ("o-", "s--", "^:")):
                if factor and variant != "baseline":
                    continue
                cells = [[e["ruler"][str(factor)][task][str(L)] for e in per_seed.values()] for L in LENGTHS]
                ax.errorbar(LENGTHS, [statistics.mean(c) for c in cells],
                            yerr=[statistics.stdev(c) if len(c) > 1 else 0 for c in cells], fmt=style, capsize=3,
                            label=variant + (f" + YaRN x{factor}" if factor else ""))
        ax.axvline(TRAINED, color="grey", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens); dotted: trained length")
        ax.set_title(task)
    axes[0].set_ylabel("score (%), mean ± std over seeds")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--samples", type=int, default=10, help="samples per task, length and YaRN factor")
    ap.add_argument("--report", action="store_true", help="only rebuild the table from saved evals")
    ap.add_argument("--smoke", action="store_true", help="a few steps per stage into outputs/ablation-smoke: checks "
                    "the pipeline end to end, measures nothing")
    args = ap.parse_args()
    global ROOT
    ROOT = ROOT + "-smoke" if args.smoke else ROOT
    extra, name = (SMOKE, "ablation_retrieval_smoke") if args.smoke else ([], "ablation_retrieval")
    os.makedirs(ROOT, exist_ok=True)
    evals, seconds = {}, {}
    for variant in args.variants:
        for seed in args.seeds:
            out = os.path.join(ROOT, variant, f"seed{seed}")
            if args.report and not os.path.isfile(os.path.join(out, "ablation_eval.json")):
                continue
            ckpt, seconds[f"{variant}/seed{seed}"] = train(variant, seed, extra)
            evals.setdefault(variant, {})[seed] = evaluate(ckpt, out, args.samples)
            print(f"[ablation] {variant} seed {seed}: {json.dumps(evals[variant][seed]['ruler']['0'])}", flush=True)
    if not evals:
        sys.exit(f"no finished run under {ROOT}/; run without --report first")
    rows = table(evals)
    print(f"tiny_retrieval ablation: score (%) and perplexity, mean ± std over seeds {args.seeds}, "
          f"{args.samples} samples per cell and seed; trained length {TRAINED}")
    print_table(rows, list(rows[0]))
    try:
        plot(evals, os.path.join(RESULTS, f"{name}.png"))
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'longstride[eval]')")
    print("results:", write_results(name, rows, {
        "variants": {v: VARIANTS[v] for v in evals}, "seeds": args.seeds, "samples": args.samples,
        "lengths": LENGTHS, "tasks": TASKS, "yarn": YARN, "train_seconds": seconds, "evals": evals}))


if __name__ == "__main__":
    main()
