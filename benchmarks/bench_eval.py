"""RULER eval speed on the tiny model, before and after batching by tokens and one command for every checkpoint.

before  one `longstride eval ruler` command per checkpoint, one prompt per generate call, prompts prefilled 2,048
        tokens at a time, every answer run to EOS or the task's budget (batch_size=1 prefill_chunk=2048
        stop_when_scored=false): the old behaviour, the imports paid per command
after   one `longstride eval compare` command over the same checkpoints with the defaults: prompts up to 8,192
        tokens prefilled in one pass (a later chunk attends through a mask, which takes CPU attention off its
        flash kernel), each answer ended once its score is decided (stop_when_scored), the imports paid once

Both score the same samples (same seed, tasks and lengths); the benchmark checks that every sample's score is
the same, counts identical predictions, and reports the wall times of the commands (process start and imports
included) and their ratio, measured in one run.

    python -m benchmarks.bench_eval --run outputs/tiny_extend [--samples 10] [--lengths 512 2048 4096 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import print_table, write_results
from longstride.eval.ruler.compare import run_checkpoints


def timed(cmd: list[str]) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="outputs/tiny_extend", help="a finished training run (its base and stages)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    ap.add_argument("--tasks", nargs="+", default=["niah_single_1", "synth_kv"])
    args = ap.parse_args()
    named = run_checkpoints(args.run)
    common = [f"tasks=[{','.join(args.tasks)}]", f"lengths=[{','.join(map(str, args.lengths))}]",
              f"num_samples={args.samples}", "threads=2"]
    tmp = tempfile.mkdtemp(prefix="bench_eval-")
    before_s, before = 0.0, {}
    for i, (label, ckpt) in enumerate(named):
        out = os.path.join(tmp, f"before{i}")
        before_s += timed([sys.executable, "-m", "longstride.cli", "eval", "ruler", f"checkpoint={ckpt}", *common,
                           "extrapolate=true", "batch_size=1", "stop_when_scored=false", "prefill_chunk=2048", f"out={out}"])
        with open(os.path.join(out, "ruler.json")) as f:
            before.update({(label, r["task"], r["length"], r["index"]): r for r in json.load(f)["samples"]})
    out = os.path.join(tmp, "after")
    after_s = timed([sys.executable, "-m", "longstride.cli", "eval", "compare", f"run={args.run}", *common, "yarn=[]",
                     f"out={out}"])
    with open(os.path.join(out, "compare.json")) as f:
        after = {(r["checkpoint"], r["task"], r["length"], r["index"]): r for r in json.load(f)["records"]}
    if set(after) != set(before):
        sys.exit(f"the two runs scored different samples: {len(before)} vs {len(after)}")
    same_score = sum(before[k]["score"] == after[k]["score"] for k in before)
    same_pred = sum(before[k]["prediction"] == after[k]["prediction"] for k in before)
    rows = [{"way": "before: eval ruler per checkpoint, answers to the budget", "commands": len(named),
             "samples": len(before), "seconds": round(before_s, 1), "s/sample": round(before_s / len(before), 3),
             "speed-up": "1.00"},
            {"way": "after: one eval compare, answers end when scored", "commands": 1, "samples": len(after),
             "seconds": round(after_s, 1), "s/sample": round(after_s / len(after), 3),
             "speed-up": f"{before_s / after_s:.2f}"}]
    print(f"RULER eval of {args.run}'s {len(named)} checkpoints, tasks {args.tasks}, lengths {args.lengths}, "
          f"{args.samples} samples per cell (wall time per command, process start and imports included)")
    print_table(rows, list(rows[0]))
    print(f"same score on {same_score}/{len(before)} samples; same prediction on {same_pred}/{len(before)}")
    print("results:", write_results("bench_eval", rows, {"run": args.run, "tasks": args.tasks,
                                                          "lengths": args.lengths, "samples": args.samples,
                                                          "same_score": same_score, "same_prediction": same_pred,
                                                          "total": len(before)}))
    if same_score != len(before):
        sys.exit("scores differ between the two ways (see above)")


if __name__ == "__main__":
    main()
