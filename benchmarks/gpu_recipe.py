"""The recipe at real scale on one GPU, in one command: train `recipe=gpu_extend_64k` (a base from scratch at 4K,
then 32K and 64K), then score the base and every stage on the same RULER samples (niah_single_1, niah_single_2,
niah_multikey_1, vt, and synth_kv in the training documents' format, at 4K-64K; the last stage with YaRN x2 at
128K) and held-out perplexity by length.

    python -m benchmarks.gpu_recipe --out DIR               # one GPU; the device window's step `gpu_recipe`
    python -m benchmarks.gpu_recipe --rehearsal --out DIR   # the same recipe and commands, lengths / 16, tiny, on CPU
    python -m benchmarks.gpu_recipe --tiny --out DIR        # the recipe's lengths and token budgets, a tiny model
    python -m benchmarks.gpu_recipe --cost --out DIR        # RULER's prefill tokens and FLOPs, counted on CPU

Writes DIR/gpu_recipe.json (each stage's wall time, tokens, tokens/s and loss curve, the RULER table, perplexity,
the device, and issue 44's acceptance checks judged on them), DIR/ruler.png and the stage logs; checkpoints stay
under DIR/runs. RULER runs niah_single_1 first, then the other tasks, perplexity, and last synth_kv, the
diagnosis (DIR/compare/, DIR/compare_rest/, DIR/compare_in_format/, each saved row by row), so a run cut short
keeps the acceptance task; `--samples` (niah_single_1) and `--rest-samples` (the others) set the samples a cell.
synth_kv is skipped (`in_format_skipped` says why) when it would take the command past `--limit-s` (on a GPU, the
issue's 9 minutes).
A stage that fails (out of memory, NaN) ends training there: the stages that finished are still scored, the error
kept, and the exit code is 1.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime

from benchmarks.common import REPO, child_env, deadline_left
from benchmarks.gpu_recipe_acceptance import (IN_FORMAT, LENGTHS, LIMIT_S, RECIPE, REHEARSAL_SCALE, SCORED, TASKS,
                                              judge, recipe_yaml, scaled, stages)

PPL_LENGTHS = [4096, 16384, 32768]
HELD_OUT = "test/test_[t-z]*.py"  # the recipe's data.sources.stdlib.exclude
# RULER's decode batch (KV cache tokens): 11 rows of 128K, so each length's samples (10 and fewer) are one batch and
# every prompt is prefilled from the prefix it shares with the one before (prefix sharing is within a batch; at the
# default 131072 a 64K or 128K prompt is a batch of its own). The 110M model's bf16 KV cache: 33 GB at most.
BATCH_TOKENS = 11 * 131072


def tiny_model() -> list[str]:
    """Overrides that put configs/model/smollm3_tiny.yaml's widths in place of the recipe's 110M model (whose own
    model: block, head_dim included, would otherwise win over a model=smollm3_tiny choice)."""
    from omegaconf import OmegaConf

    tiny = OmegaConf.load(os.path.join(REPO, "configs", "model", "smollm3_tiny.yaml"))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "loss_tile_tokens")
    return [f"model.{k}={tiny[k]}" for k in keys] + [f"model.head_dim={tiny.hidden_size // tiny.num_attention_heads}"]


TINY = tiny_model()
# The rehearsal: the tiny model, lengths / 16 (256 -> 2K -> 4K), a few steps, fewer synthetic documents.
REHEARSAL = [
    *TINY, "data.num_proc=1",
    *(f"data.sources.{s}.synthetic.num_docs={n}" for s, n in (("copy_short", 400), ("retrieval_short", 400),
                                                               ("retrieval_mid", 100), ("retrieval_long", 60),
                                                               ("retrieval_32k", 20), ("retrieval_64k", 20))),
    "data.sources.retrieval_32k.synthetic.min_words=210", "data.sources.retrieval_32k.synthetic.max_words=750",
    "data.sources.retrieval_64k.synthetic.min_words=780", "data.sources.retrieval_64k.synthetic.max_words=1500",
    *(f"recipe.stages.{s}.{k}" for s, L, steps in (("s0_copy", 256, 4), ("s1_4k", 256, 4), ("s2_32k", 2048, 2),
                                                    ("s3_64k", 4096, 2))
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


def loss_curve(steps: list[dict], points: int = 24) -> list[list]:
    """[step, mean training loss] over at most `points` equal runs of steps (the last may be shorter): where a
    stage's loss fell (in-context copying forms as a sudden drop) at a glance, without the whole log."""
    width = -(-len(steps) // points)
    runs = [steps[i:i + width] for i in range(0, len(steps), width)]
    def mean(run):  # a skipped step's loss is null
        losses = [r["loss"] for r in run if r["loss"] is not None]
        return round(statistics.fmean(losses), 3) if losses else None

    return [[run[-1]["step"], mean(run)] for run in runs]


def stage_summary(records: list[dict]) -> dict | None:
    """One stage's metrics.jsonl records -> its length, base, steps, tokens, median tokens/s of the steps after
    the first (the first carries warm-up; also counting only the tokens that carry a loss: no padding), and their
    median model TFLOP/s per rank and MFU (recipes/run/flops.py; None where not logged), last loss
    and the loss curve, validation losses (before, after) and peak memory with how it was measured; None for a stage
    cut short before its first step. The device window's --collect reads its runs' stages with it too."""
    steps = [r for r in records if "loss" in r]
    if not steps:
        return None
    peaks = {k.removeprefix("peak_mem_gib_"): v for r in steps for k, v in r.items() if k.startswith("peak_mem_gib")}
    method = next(iter(peaks), None)
    return {"seq_len": steps[-1]["seq_len"], "rope_theta": steps[-1]["rope_theta"], "steps": len(steps),
            "tokens": steps[-1]["tokens_seen"],
            "tokens_per_s_median": _median(steps, "tokens_per_s"),
            "loss_tokens_per_s_median": _median(steps, "loss_tokens_per_s"),
            "tflops_median": _median(steps, "tflops"), "mfu_median": _median(steps, "mfu"),
            "final_loss": steps[-1]["loss"], "loss_curve": loss_curve(steps),
            "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-2:],
            "peak_gib": max(r[f"peak_mem_gib_{method}"] for r in steps) if method else None, "peak_method": method}


def _median(steps: list[dict], key: str):
    """The median of `key` over the steps after the first (all of them if there is one), None where not logged."""
    values = [r[key] for r in steps[1:] or steps if key in r]
    return statistics.median(values) if values else None


def stage_rows(run: str, log: str) -> list[dict]:
    times, rows = stage_times(log), []
    if not os.path.isdir(run):  # training failed before its first stage
        return rows
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
    """gpu_recipe.json, judged, written aside and renamed: the device window packs it while this runs."""
    judge(result)
    path = os.path.join(out, "gpu_recipe.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def run(cmd: list[str], log_path: str, env: dict) -> str:
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    text = open(log_path).read()
    if proc.returncode:
        raise RuntimeError(f"{cmd[:6]}... exited {proc.returncode}; the end of {log_path}:\n{text[-3000:]}")
    return text


def call(command: str, main, argv: list[str], log_path: str):
    """An eval command's main(argv) in this process, its output written to log_path -> what main returned. Every
    RULER pass and perplexity share one interpreter (and one CUDA context): each child process of its own spent
    about 5 s importing before any work (measured on this CPU machine), six times a run. transformers' log goes to
    the same file (its handler holds the stderr it was created with), and its verbosity and progress bar are put
    back after each call, as a fresh process would have them. An error raises RuntimeError with the end of the
    log, as a child that failed did."""
    import torch
    from transformers.utils import logging as hf_logging

    print("$ longstride eval", command, " ".join(argv), flush=True)
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    handlers = [h for h in logging.getLogger("transformers").handlers if isinstance(h, logging.StreamHandler)]
    with open(log_path, "w", buffering=1) as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        streams = [h.setStream(f) for h in handlers]
        try:
            return main(argv)
        except Exception:
            traceback.print_exc()
        finally:
            for h, stream in zip(handlers, streams):
                h.setStream(stream)
            hf_logging.set_verbosity(verbosity)
            (hf_logging.enable_progress_bar if bar else hf_logging.disable_progress_bar)()
            gc.collect()  # the pass's model and cache, before the next pass loads its own
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    with open(log_path) as f:
        raise RuntimeError(f"longstride eval {command} failed; the end of {log_path}:\n{f.read()[-3000:]}")


def phase(result: dict, name: str, work, empty):
    """work() for one eval phase; a failure (out of memory, a pass with nothing to run) is kept in
    result["errors"][name] and `empty` returned, so the phases after it still run in the time left."""
    try:
        return work()
    except (RuntimeError, ValueError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
        result.setdefault("errors", {})[name] = str(e)[-3000:]
        print(f"{name} failed, going on with the next phase:\n{e}", flush=True)
        return empty


def train_command(args, cuda: bool) -> list[str]:
    """The training command: on a GPU through accelerate (configs/accelerate/gpu1.yaml) and without step
    checkpoints: a window's machine is fresh each time, so nothing could resume from them, and each costs seconds
    (the 110M model's 1.3 GB of weights and AdamW state written and hashed: 5.6 s on this CPU machine's disk).
    Each stage's final (weights, 0.4 GB) is still written: the next stage and RULER load it. Nor is each stage's
    step traced for memory at its start (train.trace_memory's auto on a GPU): the trace blocks training for a
    child process's start and the trace, about 6.5 s a stage on this CPU (4.5 s of imports), and it is the same
    fake-tensor program `longstride plan recipe=gpu_extend_64k hardware=h100_80g gpus_per_node=1` traces on any
    machine, so the measured peaks are compared with the plan's figures without it."""
    gpu = cuda and not args.rehearsal
    launch = ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/gpu1.yaml"] if gpu else []
    return [sys.executable, *launch, "-m", "longstride.recipes.train", f"recipe={RECIPE}",
            f"paths.output_root={args.out}/runs", "logger.progress_bar=false",
            *(REHEARSAL if args.rehearsal else TINY if args.tiny else []),
            *([] if args.rehearsal else [f"data.num_proc={min(8, os.cpu_count() or 1)}"]),
            *([f"recipe.stages.{s}.save_every=0" for s in stages()] + ["train.trace_memory=false"] if gpu else []),
            *args.overrides]


def ruler_lengths(scale: int) -> tuple[list[int], int]:
    """RULER's lengths for every checkpoint and the YaRN x2 row's length (the rehearsal's: / 16, at least 512)."""
    return sorted({scaled(L, scale) for L in LENGTHS}), scaled(2 * LENGTHS[-1], scale)


def passes(args) -> list[tuple[str, list[str], int]]:
    """RULER's passes in the order they run, (folder, tasks, samples a cell), each on the same samples for every
    checkpoint: niah_single_1 first (the acceptance task: a window cut short keeps it), then RULER's other tasks,
    then, after perplexity, the in-format diagnosis."""
    return [("compare", TASKS[:1], args.samples), ("compare_rest", TASKS[1:], args.rest_samples),
            ("compare_in_format", [IN_FORMAT], args.rest_samples)]


def merge_rows(*passes_rows: list[dict]) -> list[dict]:
    """compare.json rows of several passes (or rows merged before) -> one row a label with every task's scores
    and samples (JSON's string lengths back to ints)."""
    rows: dict[str, dict] = {}
    for r in (r for pass_rows in passes_rows for r in pass_rows):
        row = rows.setdefault(r["label"], {k: r[k] for k in ("label", "checkpoint", "yarn", "trained", "rope_theta",
                                                              "lengths") if k in r})
        for k in ("scores", "samples"):
            row.setdefault(k, {}).update({t: {int(L): v for L, v in c.items()} for t, c in r.get(k, {}).items()})
    return list(rows.values())


def ruler(args, scale: int, dtype: str, chosen: list[tuple[str, list[str], int]]) -> list[dict]:
    """The `chosen` passes (passes()) on the base and each stage's final checkpoint (SCORED) that exists (a
    training run that failed partway: the stages it finished); YaRN x2 on s3_64k only -> their rows, merged."""
    lengths, yarn_length = ruler_lengths(scale)
    finals = [f for f in (os.path.join(args.out, "runs", RECIPE, stage, "final") for stage in SCORED)
              if os.path.isdir(f)]
    if not finals:
        return []
    yarn = "yarn=[2]" if finals[-1].endswith(os.path.join(SCORED[-1], "final")) else "yarn=[]"
    from longstride.eval.ruler.compare import main as compare

    found = []
    for name, tasks, samples in chosen:
        found.append(call("compare", compare, [
            f"checkpoints=[{','.join(finals)}]", f"tasks=[{','.join(tasks)}]",
            f"lengths=[{','.join(map(str, lengths))}]", yarn, f"yarn_lengths=[{yarn_length}]",
            f"num_samples={samples}", f"dtype={dtype}", f"batch_tokens={BATCH_TOKENS}", f"out={args.out}/{name}"],
            os.path.join(args.out, f"{name}.log"))["rows"])
    return merge_rows(*found)


def ruler_cost(args) -> dict:
    """RULER's prefill as the GPU run does it, counted without a model: the real samples (the shipped tokenizer,
    every pass, row and length), batched and prefix-shared as eval/ruler/generate.py does (BATCH_TOKENS), ->
    tokens prefilled and FLOPs per pass (2 a weight per token, 4 x heads x head_dim a cached key per token and
    layer; the last-token LM head left out, and the last layer counted in full though it computes one row: the
    attention is over-counted by one layer in 30)."""
    from transformers import AutoTokenizer

    from longstride.eval.cli import CompareConfig
    from longstride.eval.ruler.generate import prefill_batches, shared_prefix
    from longstride.eval.ruler.run import make_groups

    m = recipe_yaml().model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    per_token = 2 * m.num_hidden_layers * (2 * m.hidden_size * (q + kv) + 3 * m.hidden_size * m.intermediate_size)
    per_key = 4 * q * m.num_hidden_layers
    tok = AutoTokenizer.from_pretrained(os.path.join(REPO, "model", "shipped", "tiny_base_256"))
    lengths, yarn_length = ruler_lengths(1)
    # compare's rows: each checkpoint at `lengths`, then the last with YaRN x2: how many rows score each length
    rows_at = {L: len(SCORED) for L in lengths} | {yarn_length: 1}
    decode = CompareConfig()  # compare's decode settings: answer room max_new_tokens x (1 + draft), batch_size
    out = {"batch_tokens": BATCH_TOKENS, "flop_per_token": per_token, "flop_per_token_per_key": per_key}
    for name, tasks, n in passes(args):
        tokens = flop = 0
        for _, L, samples in make_groups(CompareConfig(num_samples=n), tasks, sorted(rows_at), tok, range(n), {}, []):
            prompts, room = [x.prompt_ids for x in samples], samples[0].max_new_tokens * (1 + decode.draft)
            for batch in prefill_batches(prompts, room, decode.batch_size, BATCH_TOKENS):
                before = None
                for p in (prompts[i] for i in batch):
                    shared = shared_prefix(before, p) if before else 0
                    tokens += rows_at[L] * (len(p) - shared)
                    flop += rows_at[L] * (per_token * (len(p) - shared) + per_key * (len(p) ** 2 - shared ** 2) / 2)
                    before = p
        out[name] = {"tasks": tasks, "samples": n, "tokens": tokens, "pflop": round(flop / 1e15, 2)}
    return out


def plot_ruler(out: str, rows: list[dict], samples: int, rest_samples: int) -> None:
    """One figure of every task scored (compare's plot) from the merged rows."""
    from longstride.eval.ruler.compare import Row, plot

    tasks = [t for t in TASKS + [IN_FORMAT] if any(t in r["scores"] for r in rows)]
    plot(os.path.join(out, "ruler.png"), [Row(**{k: r[k] for k in Row.__dataclass_fields__ if k in r}) for r in rows],
         {i: r["scores"] for i, r in enumerate(rows)}, tasks, f"{RECIPE}: RULER score vs context length, "
         f"{samples} samples per cell ({TASKS[0]}), {rest_samples} (the others)")


def perplexity(args, rows: list[dict], scale: int) -> list[dict]:
    from longstride.data.files import stdlib_root
    from longstride.eval.ppl import main as ppl

    found = []
    for row in rows:
        if row["yarn"]:
            continue
        ppl_out = os.path.join(args.out, "ppl", row["label"].split(" ")[0])
        os.makedirs(os.path.dirname(ppl_out), exist_ok=True)
        call("ppl", ppl, [f"checkpoint={row['checkpoint']}", f"lengths=[{','.join(str(L // scale) for L in PPL_LENGTHS)}]",
                          f"docs_dir={stdlib_root()}", f"glob='{HELD_OUT}'", "max_docs=4", f"out={ppl_out}"],
             f"{ppl_out}.log")
        with open(os.path.join(ppl_out, "ppl.json")) as f:
            found.append({"checkpoint": row["label"], **json.load(f)})
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rehearsal", action="store_true", help="lengths / 16, a tiny model, a few steps, on CPU")
    p.add_argument("--tiny", action="store_true", help="the recipe's lengths, steps and tokens with a tiny model "
                   "(smollm3_tiny's widths; on CPU: whether the token budget teaches retrieval stage by stage)")
    p.add_argument("--samples", type=int, default=10, help="RULER samples per length of niah_single_1")
    p.add_argument("--rest-samples", type=int, default=5, help="RULER samples per length of the other tasks")
    p.add_argument("--cost", action="store_true", help="count RULER's prefill tokens and FLOPs from the samples "
                   "(no model, CPU) into DIR/ruler_cost.json")
    p.add_argument("--limit-s", type=float, default=None, help="skip the in-format diagnosis when it would take "
                   f"the command past this many seconds (default: {LIMIT_S}, the issue's 9 minutes, on a GPU; none "
                   "on CPU; 0: never skip)")
    p.add_argument("overrides", nargs="*", help="more training overrides, e.g. train.resume_from=s1_4k")
    args = p.parse_args(argv)
    if args.cost and (args.rehearsal or args.tiny):
        p.error("--cost counts the GPU run's RULER (the recipe's tokenizer and lengths); drop --rehearsal/--tiny")
    import torch

    args.out, t0, cuda = os.path.abspath(args.out), time.perf_counter(), torch.cuda.is_available()
    args.limit_s = (LIMIT_S if cuda else 0) if args.limit_s is None else args.limit_s
    if args.limit_s:  # inside the device window: its cut, less a margin to save the results, when that is sooner
        args.limit_s = min(args.limit_s, deadline_left(args.limit_s + 10) - 10)
    os.makedirs(args.out, exist_ok=True)
    env, scale = child_env(), REHEARSAL_SCALE if args.rehearsal else 1
    # the eval runs in this process: offline here as in the children (huggingface_hub reads these when first
    # imported, which under `python -m` is after this line)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if args.cost:
        cost = ruler_cost(args)
        with open(os.path.join(args.out, "ruler_cost.json"), "w") as f:
            json.dump(cost, f, indent=1)
        print(json.dumps(cost))
        return 0
    result = {"recipe": RECIPE, "rehearsal": args.rehearsal, "tiny": args.tiny, "device": torch.cuda.get_device_name(0)
              if cuda else "cpu", "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        log = run(train_command(args, cuda), os.path.join(args.out, "train.log"), env)
    except RuntimeError as e:  # a stage failed (out of memory, NaN, ...): score the stages that finished
        result["train_error"] = str(e)
        print(f"training failed; RULER and perplexity on the stages that finished:\n{e}", flush=True)
        with open(os.path.join(args.out, "train.log")) as f:
            log = f.read()
    result["train_seconds"] = round(time.perf_counter() - t0, 1)
    result["stages"] = stage_rows(os.path.join(args.out, "runs", RECIPE), log)
    save(args.out, result)  # after each phase: a window cut short keeps what was measured
    t, dtype = time.perf_counter(), "bfloat16" if cuda else "float32"
    result["ruler"] = phase(result, "ruler_acceptance", lambda: ruler(args, scale, dtype, passes(args)[:1]), [])
    save(args.out, result)  # the acceptance task's scores, before the other tasks
    t_rest = time.perf_counter()
    result["ruler"] = merge_rows(result["ruler"], phase(
        result, "ruler_tasks", lambda: ruler(args, scale, dtype, passes(args)[1:2]), []))
    rest_s = time.perf_counter() - t_rest
    result["ruler_seconds"] = round(time.perf_counter() - t, 1)
    if result["ruler"]:
        plot_ruler(args.out, result["ruler"], args.samples, args.rest_samples)
    save(args.out, result)
    t = time.perf_counter()
    result["ppl"] = phase(result, "ppl", lambda: perplexity(args, result["ruler"], scale), [])
    result["ppl_seconds"] = round(time.perf_counter() - t, 1)
    save(args.out, result)
    t = time.perf_counter()  # the diagnosis last: a window cut short loses it first
    # ... and it is not part of the command: skipped when it would take the command past --limit-s, its
    # time estimated from the pass before it (the same samples and lengths): 6.5 of that pass's 18.1 PFLOP (--cost),
    # 0.36 of its time; 0.45 with a margin for the pass's fixed costs
    need, left = 0.45 * rest_s, args.limit_s - (t - t0)
    if args.limit_s and need > left:
        result["in_format_skipped"] = f"an estimated {need:.0f} s with {left:.0f} s left of --limit-s {args.limit_s}"
        print(f"{IN_FORMAT} skipped: {result['in_format_skipped']}", flush=True)
    else:
        result["ruler"] = merge_rows(result["ruler"], phase(
            result, "in_format", lambda: ruler(args, scale, dtype, passes(args)[2:]), []))
    result["in_format_seconds"] = round(time.perf_counter() - t, 1)
    if result["ruler"]:
        plot_ruler(args.out, result["ruler"], args.samples, args.rest_samples)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    save(args.out, result)
    for r in result["stages"]:
        print(f"{r['stage']:<8} {r['seq_len']:>6} tokens {r['tokens']:>10,} in {r['seconds']} s "
              f"({r['tokens_per_s_median']:,.0f} tokens/s median), val loss {r['val_loss']}")
    for c in result["acceptance"]:
        mark = {True: "pass", False: "FAIL", None: "not measured"}[c["ok"]]
        print(f"{mark:<12} {c['check']}: {c['value']} (needs {c['need']}{'' if c['required'] else ', a goal'})")
    print(f"{IN_FORMAT} (the training format, not the acceptance): {result['in_format']}")
    print(f"total {result['total_seconds']} s (train {result['train_seconds']}, RULER {result['ruler_seconds']}, "
          f"ppl {result['ppl_seconds']}, {IN_FORMAT} {result['in_format_seconds']}); {args.out}/gpu_recipe.json")
    for name, error in result.get("errors", {}).items():
        print(f"{name} failed: {error.splitlines()[0]}")
    return 1 if "train_error" in result or result.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
