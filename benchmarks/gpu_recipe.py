"""The recipe at real scale on one GPU, in one command: train `recipe=gpu_extend_64k` (a base from scratch at 4K,
then 32K and 64K), then score the base and every stage on the same RULER samples (niah_single_1, niah_single_2,
niah_multikey_1, vt at 4K-64K; the last stage with YaRN x2 at 128K) and held-out perplexity by length.

    python -m benchmarks.gpu_recipe --out DIR               # one GPU; the device window's step `gpu_recipe`
    python -m benchmarks.gpu_recipe --rehearsal --out DIR   # the same recipe and commands, lengths / 16, tiny, on CPU

Writes DIR/gpu_recipe.json (each stage's wall time, tokens and tokens/s, the RULER table, perplexity, the device),
DIR/compare/compare.png and the stage logs; checkpoints stay under DIR/runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime

from benchmarks.common import REPO, child_env
RECIPE = "gpu_extend_64k"
TASKS = "[niah_single_1,niah_single_2,niah_multikey_1,vt]"
LENGTHS = [4096, 8192, 16384, 32768, 65536]
PPL_LENGTHS = [4096, 16384, 32768]
HELD_OUT = "test/test_[t-z]*.py"  # the recipe's data.sources.stdlib.exclude
# The rehearsal: lengths / 16 (256 -> 2K -> 4K), a tiny model, a few steps, fewer synthetic documents.
REHEARSAL = [
    "model.hidden_size=128", "model.intermediate_size=384", "model.num_hidden_layers=4", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.head_dim=32", "model.loss_tile_tokens=1024", "data.num_proc=1",
    *(f"data.sources.{s}.synthetic.num_docs={n}" for s, n in (("copy_short", 400), ("retrieval_short", 400),
                                                               ("retrieval_mid", 100), ("retrieval_long", 60),
                                                               ("retrieval_32k", 20), ("retrieval_64k", 10))),
    "data.sources.retrieval_32k.synthetic.min_words=300", "data.sources.retrieval_32k.synthetic.max_words=1200",
    "data.sources.retrieval_64k.synthetic.min_words=1250", "data.sources.retrieval_64k.synthetic.max_words=2400",
    *(f"recipe.stages.{s}.{k}" for s, L, steps in (("s1_4k", 256, 4), ("s2_32k", 2048, 2), ("s3_64k", 4096, 2))
      for k in (f"seq_len={L}", f"batch_tokens={4 * L if L == 256 else L}", f"steps={steps}", "warmup_steps=1",
                "save_every=0", f"micro_batch_size={4 if L == 256 else 1}")),
]


def stage_times(log: str) -> dict[str, float]:
    """Seconds from each stage's start line to its `done` line in the training log."""
    stamp = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) longstride\] stage (\w+)"
    start, out = {}, {}
    for m in re.finditer(stamp + r"(: model| done)", log):
        t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if m[3] == ": model":
            start[m[2]] = t
        elif m[2] in start:
            out[m[2]] = round(t - start[m[2]], 1)
    return out


def stage_summary(records: list[dict]) -> dict | None:
    """One stage's metrics.jsonl records -> its length, base, steps, tokens, median tokens/s of the steps after
    the first (the first carries warm-up), last loss, validation losses (before, after) and peak memory with how
    it was measured; None for a stage cut short before its first step. The device window's --collect reads its
    runs' stages with it too."""
    steps = [r for r in records if "loss" in r]
    if not steps:
        return None
    peaks = {k.removeprefix("peak_mem_gib_"): v for r in steps for k, v in r.items() if k.startswith("peak_mem_gib")}
    method = next(iter(peaks), None)
    return {"seq_len": steps[-1]["seq_len"], "rope_theta": steps[-1]["rope_theta"], "steps": len(steps),
            "tokens": steps[-1]["tokens_seen"],
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steps[1:] or steps),
            "final_loss": steps[-1]["loss"], "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-2:],
            "peak_gib": max(r[f"peak_mem_gib_{method}"] for r in steps) if method else None, "peak_method": method}


def stage_rows(run: str, log: str) -> list[dict]:
    times, rows = stage_times(log), []
    for stage in sorted(d for d in os.listdir(run) if os.path.isdir(os.path.join(run, d))):  # s1_, s2_, ...
        path = os.path.join(run, stage, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            summary = stage_summary([json.loads(line) for line in f if line.strip()])
        if summary:
            rows.append({"stage": stage, **summary, "seconds": times.get(stage)})
    return rows


def save(out: str, result: dict) -> None:
    with open(os.path.join(out, "gpu_recipe.json"), "w") as f:
        json.dump(result, f, indent=1)


def run(cmd: list[str], log_path: str, env: dict) -> str:
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    text = open(log_path).read()
    if proc.returncode:
        raise RuntimeError(f"{cmd[:6]}... exited {proc.returncode}; the end of {log_path}:\n{text[-3000:]}")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rehearsal", action="store_true", help="lengths / 16, a tiny model, a few steps, on CPU")
    p.add_argument("--samples", type=int, default=10, help="RULER samples per task and length")
    args = p.parse_args(argv)
    import torch

    from longstride.data.files import stdlib_root

    out, t0 = os.path.abspath(args.out), time.perf_counter()
    os.makedirs(out, exist_ok=True)
    env = child_env()
    scale = 16 if args.rehearsal else 1
    train = [sys.executable, "-m", "longstride.recipes.train", f"recipe={RECIPE}", f"paths.output_root={out}/runs",
             "logger.progress_bar=false", *(REHEARSAL if args.rehearsal else [])]
    if torch.cuda.is_available() and not args.rehearsal:
        train[1:3] = ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/gpu1.yaml", "-m",
                      "longstride.recipes.train"]
    result = {"recipe": RECIPE, "rehearsal": args.rehearsal, "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "cuda": torch.version.cuda}
    log = run(train, os.path.join(out, "train.log"), env)
    result["train_seconds"] = round(time.perf_counter() - t0, 1)
    result["stages"] = stage_rows(os.path.join(out, "runs", RECIPE), log)
    save(out, result)  # after each phase: a window cut short keeps what was measured
    lengths = [max(L // scale, 512) for L in LENGTHS] if args.rehearsal else LENGTHS
    t = time.perf_counter()
    run([sys.executable, "-m", "longstride.cli", "eval", "compare", f"run={out}/runs/{RECIPE}", f"tasks={TASKS}",
         f"lengths=[{','.join(map(str, sorted(set(lengths))))}]", "yarn=[2]",
         f"yarn_lengths=[{2 * LENGTHS[-1] // scale}]", f"num_samples={args.samples}",
         f"dtype={'bfloat16' if torch.cuda.is_available() else 'float32'}", f"out={out}/compare"],
        os.path.join(out, "eval.log"), env)
    with open(os.path.join(out, "compare", "compare.json")) as f:
        cmp = json.load(f)
    result["ruler"] = [{k: r[k] for k in ("label", "yarn", "trained", "rope_theta", "scores", "samples")}
                       for r in cmp["rows"]]
    result["ruler_seconds"] = round(time.perf_counter() - t, 1)
    save(out, result)
    t, result["ppl"] = time.perf_counter(), []
    for row in cmp["rows"]:
        if row["yarn"]:
            continue
        ppl_out = os.path.join(out, "ppl", row["label"].split(" ")[0])
        os.makedirs(os.path.dirname(ppl_out), exist_ok=True)
        run([sys.executable, "-m", "longstride.cli", "eval", "ppl", f"checkpoint={row['checkpoint']}",
             f"lengths=[{','.join(str(L // scale) for L in PPL_LENGTHS)}]", f"docs_dir={stdlib_root()}",
             f"glob='{HELD_OUT}'", "max_docs=4", f"out={ppl_out}"], f"{ppl_out}.log", env)
        with open(os.path.join(ppl_out, "ppl.json")) as f:
            result["ppl"].append({"checkpoint": row["label"], **json.load(f)})
    result["ppl_seconds"] = round(time.perf_counter() - t, 1)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    save(out, result)
    for r in result["stages"]:
        print(f"{r['stage']:<8} {r['seq_len']:>6} tokens {r['tokens']:>10,} in {r['seconds']} s "
              f"({r['tokens_per_s_median']:,.0f} tokens/s median), val loss {r['val_loss']}")
    print(f"total {result['total_seconds']} s (train {result['train_seconds']}, RULER {result['ruler_seconds']}, "
          f"ppl {result['ppl_seconds']}); {out}/gpu_recipe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
