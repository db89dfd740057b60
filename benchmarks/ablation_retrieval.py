"""The extension ablation on CPU, in pieces: what each choice of recipe=tiny_extend is worth.

Every variant starts from the shipped base model (model/shipped/tiny_base_256: trained at 256 tokens,
RoPE base 1e4) and runs the main job's two extension stages (256 -> 2K -> 4K, cp=2 ring on 2 local
processes) with a few overrides, per seed (train.seed and data.seed: the data order; the base is shared):

  baseline     RoPE base bumped per stage (4e5 at 2K, 1e6 at 4K), NoPE on layer 4 of 4, document masking
  fixed_base   RoPE base kept at the base model's 1e4 in both stages
  yarn_train   RoPE base kept at 1e4, YaRN x16 (from 256 positions) during both stages instead of a bump
  no_doc_mask  attention across the packed documents of a sequence (data.doc_masking=false)
  all_rope     RoPE on every layer (no NoPE layer): its own base, trained once by recipe=tiny_base with
               model.nope_interval=0 (about 18 minutes) and shipped as model/shipped/tiny_base_256_allrope
               (made by the first all_rope piece when missing), then the same two stages from it
  yarn_eval    no training: the baseline's checkpoint with YaRN x2 and x4 applied at eval time

Measured per piece on the 4K checkpoint: RULER niah_single_1 (a template never trained on) and the in-format
synth_kv at 4K (the trained length), 8K and 16K (2x and 4x beyond), and perplexity on the first 1K / 4K / 16K tokens
of 8 long standard-library files (eval ppl's default: the training corpus's own domain, not held out).

Each finished (variant, seed) writes benchmarks/results/ablation/<variant>-seed<S>.json at once (commit it);
a piece already there is skipped, so the command resumes where it stopped. The report is built from whatever
pieces exist, with n (seeds) per cell.

    python -m benchmarks.ablation_retrieval --variants baseline fixed_base --seeds 0 1 2
    python -m benchmarks.ablation_retrieval --report        # table and plot from the pieces
    python -m benchmarks.ablation_retrieval --smoke         # the plumbing in a few minutes, measures nothing

Time on this 2-core machine (2026-11-25): a training piece takes about 10 minutes (6.7 training the two stages,
about 3 evaluating on an idle machine, mostly the 16K prompts' prefill), 15-20 beside other work; a yarn_eval
piece about 5; all_rope's base once about 18. The grid (5 trained variants x 3 seeds + 3 yarn_eval pieces + that
base) is about 3 hours, so one 180-minute session, with its other work, lands several pieces and the next
sessions go on from them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

from benchmarks.common import RESULTS, print_table, write_results

BASE = "model/shipped/tiny_base_256"
VARIANTS = {
    "baseline": [],
    "fixed_base": ["recipe.stages.s2_2k.rope_theta=1e4", "recipe.stages.s3_4k.rope_theta=1e4"],
    "yarn_train": ["recipe.stages.s2_2k.rope_theta=1e4", "recipe.stages.s3_4k.rope_theta=1e4",
                   "model.yarn.factor=16", "model.yarn.original_max_position_embeddings=256"],
    "no_doc_mask": ["data.doc_masking=false"],
}
ALL_ROPE_BASE = "model/shipped/tiny_base_256_allrope"
VARIANTS["all_rope"] = [f"model.checkpoint={ALL_ROPE_BASE}", f"data.tokenizer={ALL_ROPE_BASE}"]
OWN_BASE = {"all_rope": (ALL_ROPE_BASE, ["model.nope_interval=0"])}  # variant -> (its base, recipe=tiny_base overrides)
BASE_SMOKE = [f"recipe.stages.{s}.{k}={v}" for s in ("s0_copy", "s1_256") for k, v in
              (("steps", 2), ("warmup_steps", 1), ("save_every", 0))]
EVAL_ONLY = {"yarn_eval": ("baseline", [2.0, 4.0])}  # variant -> (trained variant it reads, YaRN factors)
TRAINED, LENGTHS, PPL_LENGTHS = 4096, [4096, 8192, 16384], [1024, 4096, 16384]
TASKS = ["niah_single_1", "synth_kv"]
SAMPLES = 10  # per cell and seed: 3 seeds give 30 samples per variant and cell
PIECES = os.path.join(RESULTS, "ablation")
ROOT = os.path.join("outputs", "ablation")
SMOKE = [*(f"recipe.stages.{s}.{k}={v}" for s in ("s2_2k", "s3_4k") for k, v in
           (("steps", 2), ("warmup_steps", 1), ("save_every", 0))),
         *(f"data.sources.{name}.synthetic.num_docs={n}" for name, n in
           (("retrieval_short", 300), ("retrieval_mid", 60), ("retrieval_long", 60)))]


def piece_path(variant: str, seed: int, smoke: bool) -> str:
    return os.path.join(PIECES + ("-smoke" if smoke else ""), f"{variant}-seed{seed}.json")


def seed_overrides(seed: int) -> list[str]:
    return [f"train.seed={seed}", f"data.seed={1234 + seed}"]


def own_base(variant: str, smoke: bool) -> list[str]:
    """A variant with its own base model (OWN_BASE): trained by recipe=tiny_base and shipped when missing
    (smoke: trained for 2 steps a stage and used from outputs/, never shipped); the overrides that point
    the extension at it."""
    if variant not in OWN_BASE:
        return []
    shipped, base_overrides = OWN_BASE[variant]
    out = os.path.join(ROOT + ("-smoke" if smoke else ""), f"{variant}_base")
    final = os.path.join(out, "tiny_base", "s1_256", "final")
    path = final if smoke else shipped
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        cmd = ["accelerate", "launch", "--config_file", "configs/accelerate/cpu.yaml", "-m", "longstride.recipes.train",
               "recipe=tiny_base", f"paths.output_root={out}", "logger.wandb_mode=disabled", "logger.progress_bar=false",
               *base_overrides, *(BASE_SMOKE if smoke else [])]
        print(f"[ablation] training {variant}'s base: {' '.join(cmd)}", flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "train.log"), "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
        if not smoke:
            subprocess.run([sys.executable, "-m", "longstride.recipes.checkpoint.ship", final, shipped], check=True)
    return [f"model.checkpoint={path}", f"data.tokenizer={path}"]


def train(variant: str, seed: int, smoke: bool) -> tuple[str, Optional[float], list[str]]:
    """The variant's 4K checkpoint for this seed (trained now unless finished), the seconds its training took here
    (None: it was trained before, for another piece or by an earlier invocation), and its overrides."""
    out = os.path.join(ROOT + ("-smoke" if smoke else ""), variant, f"seed{seed}")
    final = os.path.join(out, "tiny_extend", "s3_4k", "final")
    base = own_base(variant, smoke)
    overrides = [*(base or VARIANTS[variant]), *seed_overrides(seed), *(SMOKE if smoke else [])]
    t0 = time.perf_counter()
    if os.path.isfile(os.path.join(final, "manifest.json")):
        return final, None, overrides
    cmd = ["accelerate", "launch", "--config_file", "configs/accelerate/cpu.yaml", "-m", "longstride.recipes.train",
           "recipe=tiny_extend", f"paths.output_root={out}", "logger.wandb_mode=disabled",
           "logger.progress_bar=false", *overrides]
    print(f"[ablation] training {variant} seed {seed}: {' '.join(cmd)}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train.log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return final, time.perf_counter() - t0, overrides


def evaluate(ckpt: str, yarn: list[float], samples: int, out: str) -> dict:
    """{"ruler": {yarn factor ("0" = none): {task: {length: score}}}, "ppl": {length: ppl}} of one checkpoint."""
    from longstride.eval import ppl
    from longstride.eval.ruler.compare import main as compare

    res = compare([f"checkpoints=[{ckpt}]", f"tasks=[{','.join(TASKS)}]", f"lengths=[{','.join(map(str, LENGTHS))}]",
                   f"yarn=[{','.join(map(str, yarn))}]", f"yarn_lengths=[{','.join(map(str, LENGTHS))}]",
                   f"num_samples={samples}", f"out={out}", "threads=2", f"plain_rows={not yarn}",
                   "prefill_chunk=16384"])  # the tiny model prefills 16K at once; chunks only add passes
    rows = res["rows"]  # a YaRN piece has only its YaRN rows (the plain one is its baseline's piece)
    ruler = {f"{r['yarn'] or 0:g}": {t: {str(L): s for L, s in cells.items()} for t, cells in r["scores"].items()}
             for r in rows}
    result = {"ruler": ruler}
    if not yarn:
        lines = ppl.main([f"checkpoint={ckpt}", f"lengths=[{','.join(map(str, PPL_LENGTHS))}]", f"out={out}/ppl",
                          "threads=2"])
        result["ppl"] = {str(r["length"]): r["ppl"] for r in lines}
    return result


def run_piece(variant: str, seed: int, samples: int, smoke: bool) -> dict:
    t0 = time.perf_counter()
    if variant in EVAL_ONLY:
        source, factors = EVAL_ONLY[variant]
        ckpt, train_s, overrides = train(source, seed, smoke)
    else:
        ckpt, train_s, overrides = train(variant, seed, smoke)
        factors = []
    t1 = time.perf_counter()
    result = evaluate(ckpt, factors, samples, os.path.join(os.path.dirname(ckpt), "eval"))
    piece = {"variant": variant, "seed": seed, "overrides": overrides, "yarn_at_eval": factors,
             "samples": samples, "tasks": TASKS, "lengths": LENGTHS, "trained_length": TRAINED,
             "train_seconds": None if train_s is None else round(train_s, 1),  # None: trained for another piece
             "eval_seconds": round(time.perf_counter() - t1, 1),
             "seconds": round(time.perf_counter() - t0, 1), "base": OWN_BASE.get(variant, (BASE,))[0],
             "date": datetime.date.today().isoformat(), **result}
    path = piece_path(variant, seed, smoke)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(piece, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"[ablation] {variant} seed {seed}: {json.dumps(result['ruler'])} -> {path}", flush=True)
    return piece


def load_pieces(smoke: bool) -> list[dict]:
    folder = PIECES + ("-smoke" if smoke else "")
    if not os.path.isdir(folder):
        return []
    return [json.load(open(os.path.join(folder, n))) for n in sorted(os.listdir(folder)) if n.endswith(".json")]


def spread(values: list[float], fmt: str = ".0f") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}} (n=1)"
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}} (n={len(values)})"


def rows_of(pieces: list[dict]) -> list[dict]:
    """One row per variant and YaRN factor: mean ± sample std over seeds (n = seeds) of every cell."""
    order = [*VARIANTS, *EVAL_ONLY]
    grouped: dict[tuple, list[dict]] = {}
    for p in pieces:
        for factor, cells in p["ruler"].items():
            grouped.setdefault((p["variant"], factor), []).append({"ruler": cells, "ppl": p.get("ppl")})
    rows = []
    for (variant, factor), runs in sorted(grouped.items(), key=lambda kv: (order.index(kv[0][0]), float(kv[0][1]))):
        row = {"variant": variant + (f" (YaRN x{factor})" if factor != "0" else "")}
        for task in TASKS:
            for L in LENGTHS:
                row[f"{task} {L // 1024}K"] = spread([r["ruler"][task][str(L)] for r in runs
                                                      if str(L) in r["ruler"].get(task, {})])
        for L in PPL_LENGTHS:
            row[f"ppl {L // 1024}K"] = spread([r["ppl"][str(L)] for r in runs if r["ppl"]], ".1f")
        rows.append(row)
    return rows


def plot(pieces: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(5.5 * len(TASKS), 4), sharey=True)
    series: dict[str, list[dict]] = {}
    for p in pieces:
        for factor, cells in p["ruler"].items():
            series.setdefault(p["variant"] + (f" (YaRN x{factor})" if factor != "0" else ""), []).append(cells)
    for ax, task in zip(axes, TASKS):
        for name, runs in series.items():
            vals = [[r[task][str(L)] for r in runs] for L in LENGTHS]
            ax.errorbar(LENGTHS, [statistics.mean(v) for v in vals],
                        yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in vals], fmt="o-", capsize=3,
                        label=f"{name} (n={len(runs)})")
        ax.axvline(TRAINED, color="grey", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [f"{L // 1024}K" for L in LENGTHS])
        ax.set_xlabel("context length (tokens); dotted: trained length")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("score (%), mean ± std over seeds")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(smoke: bool) -> None:
    pieces = load_pieces(smoke)
    if not pieces:
        sys.exit(f"no pieces under {PIECES}/; run some first (see --help)")
    rows = rows_of(pieces)
    name = "ablation_retrieval_smoke" if smoke else "ablation_retrieval"
    samples = sorted({p["samples"] for p in pieces})
    print(f"tiny_extend ablation from {len(pieces)} pieces: score (%) mean ± std over seeds (n seeds per cell), "
          f"{'/'.join(map(str, samples))} samples per cell and seed; trained length {TRAINED}")
    print_table(rows, list(rows[0]))
    try:
        plot(pieces, os.path.join(RESULTS, f"{name}.png"))
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'longstride[eval]')")
    print("results:", write_results(name, rows, {"pieces": [f"{p['variant']}-seed{p['seed']}" for p in pieces],
                                                  "samples": samples, "lengths": LENGTHS, "tasks": TASKS,
                                                  "ppl_lengths": PPL_LENGTHS}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", choices=[*VARIANTS, *EVAL_ONLY], default=[*VARIANTS, *EVAL_ONLY])
    ap.add_argument("--samples", type=int, default=SAMPLES, help="RULER samples per task, length and piece")
    ap.add_argument("--report", action="store_true", help="only build the table and plot from the pieces")
    ap.add_argument("--smoke", action="store_true", help="2 steps per stage, 1 sample, into *-smoke folders: "
                    "checks the pipeline end to end, measures nothing")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(BASE, "manifest.json")):
        sys.exit(f"{BASE} is missing: the ablation starts from the shipped base model")
    if not args.report:
        samples = 1 if args.smoke else args.samples
        for seed in args.seeds:
            for variant in args.variants:
                if os.path.isfile(piece_path(variant, seed, args.smoke)):
                    print(f"[ablation] {variant} seed {seed}: piece exists, skipped", flush=True)
                    continue
                run_piece(variant, seed, samples, args.smoke)
    report(args.smoke)


if __name__ == "__main__":
    main()
