"""RULER eval speed on the tiny model: the code as it was when the eval was slow, against today's, on the same samples.

before  the eval at git revision --before (default d027d39, the tree when issue 32 measured 2-4 s a sample):
        one `longstride eval ruler` command per checkpoint (and one for the YaRN row), one prompt per
        `generate` call, prompts prefilled 2,048 tokens at a time, every answer run to EOS or the budget
after   today's `longstride eval compare` over the same checkpoints in one command: each prompt prefilled
        alone in one pass from the cached prefix it shares with the prompt before it (prefix caching), the
        answers of a (task, length) decoded together from a KV cache that is written in place, each answer
        ended once its score is decided

The old code runs from a copy of that revision (`git archive`, laid out as the installed package), so
"before" is the code itself, not today's code with flags. Both score the same samples (same seed, tasks,
lengths); the benchmark checks that every sample's prompt length and score are the same, counts identical
predictions, and reports wall time per command (process start and imports included) and the ratio, one run.
Full prefill: the prompts' own forward pass, one whole forward each (timed here in-process), the prefill
without prefix caching.

    python -m benchmarks.bench_eval --run outputs/tiny_extend [--samples 10] [--lengths 512 1024 2048 4096 8192]
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
from longstride.eval.cli import run_checkpoints

PACKAGES = ("recipes", "model", "data", "parallel", "eval", "configs")


def old_tree(rev: str, tmp: str) -> str:
    """A directory importing `longstride` as revision `rev` laid it out (the package dirs under longstride/)."""
    src, pkg = os.path.join(tmp, "src"), os.path.join(tmp, "pkg")
    os.makedirs(src)
    archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    os.makedirs(pkg)
    os.symlink(os.path.join(src, "longstride"), os.path.join(pkg, "longstride"))
    for name in PACKAGES:
        os.symlink(os.path.join(src, name), os.path.join(src, "longstride", name))
    return pkg


def timed(cmd: list[str], cwd=None, pythonpath=None) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def full_prefill(named: list[tuple[str, str]], records: dict, yarn: float) -> float:
    """Seconds of one whole forward over every scored prompt (the prefill without prefix caching)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longstride.eval.ruler.fit import make_sample
    from longstride.eval.ruler.tasks import ALL_TASKS
    from longstride.model.build import load_config_with_yarn
    from longstride.model.config import YarnConfig

    torch.set_num_threads(2)
    total, tok = 0.0, AutoTokenizer.from_pretrained(named[0][1])
    for label, ckpt in named:
        config, _ = load_config_with_yarn(ckpt, YarnConfig(factor=yarn) if label.endswith("YaRN") else YarnConfig())
        model = AutoModelForCausalLM.from_pretrained(ckpt, config=config).eval()
        for (row, task, length, index) in sorted(k for k in records if k[0] == label):
            ids = torch.tensor([make_sample(ALL_TASKS[task], length, index, tok, seed=42, chat=True).prompt_ids])
            t0 = time.perf_counter()
            with torch.no_grad():
                model(ids, logits_to_keep=1)
            total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="outputs/tiny_extend", help="a finished training run (its base and stages)")
    ap.add_argument("--before", default="d027d39", help="git revision whose eval is 'before'")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--tasks", nargs="+", default=["niah_single_1"])
    ap.add_argument("--yarn", type=float, default=2.0, help="YaRN factor of the last checkpoint's extra row")
    ap.add_argument("--yarn-length", type=int, default=8192, help="the YaRN row's length (the main command's: 8192)")
    args = ap.parse_args()
    named = run_checkpoints(args.run)
    yarn_len = [args.yarn_length]
    common = [f"tasks=[{','.join(args.tasks)}]", f"num_samples={args.samples}", "threads=2"]
    lengths = f"lengths=[{','.join(map(str, args.lengths))}]"
    tmp = tempfile.mkdtemp(prefix="bench_eval-")
    pkg = old_tree(args.before, tmp)
    jobs = [(label, ckpt, [lengths], []) for label, ckpt in named]
    jobs.append((f"{named[-1][0]} + YaRN", named[-1][1], [f"lengths=[{yarn_len[0]}]"], [f"yarn.factor={args.yarn:g}"]))
    before_s, before = 0.0, {}
    for i, (label, ckpt, lens, extra) in enumerate(jobs):
        out = os.path.join(tmp, f"before{i}")
        before_s += timed([sys.executable, "-m", "longstride.cli", "eval", "ruler", f"checkpoint={os.path.abspath(ckpt)}",
                           *common, *lens, *extra, "extrapolate=true", f"out={out}"], cwd=pkg, pythonpath=pkg)
        with open(os.path.join(out, f"ruler_yarn{args.yarn:g}.json" if extra else "ruler.json")) as f:
            before.update({(label, r["task"], r["length"], r["index"]): r for r in json.load(f)["samples"]})
    out = os.path.join(tmp, "after")
    after_s = timed([sys.executable, "-m", "longstride.cli", "eval", "compare", f"run={args.run}", *common, lengths,
                     f"yarn=[{args.yarn:g}]", f"yarn_lengths=[{yarn_len[0]}]", f"out={out}"])
    with open(os.path.join(out, "compare.json")) as f:
        after = {}
        for r in json.load(f)["records"]:
            label = r["checkpoint"] if not r.get("yarn") else f"{named[-1][0]} + YaRN"
            after[(label, r["task"], r["length"], r["index"])] = r
    if set(after) != set(before):
        sys.exit(f"the two runs scored different samples: {sorted(set(before) ^ set(after))[:5]}")
    same_prompt = sum(before[k]["prompt_tokens"] == after[k]["prompt_tokens"] for k in before)
    same_score = sum(before[k]["score"] == after[k]["score"] for k in before)
    same_pred = sum(before[k]["prediction"] == after[k]["prediction"] for k in before)
    full = full_prefill(named + [(f"{named[-1][0]} + YaRN", named[-1][1])], before, args.yarn)
    n = len(before)
    rows = [{"way": f"before ({args.before}): eval ruler per checkpoint, one prompt per generate, answers to the budget",
             "commands": len(jobs), "samples": n, "seconds": round(before_s, 1), "s/sample": round(before_s / n, 3),
             "speed-up": "1.00"},
            {"way": "after: one eval compare, prefix caching, batched decoding, answers end when scored", "commands": 1,
             "samples": n, "seconds": round(after_s, 1), "s/sample": round(after_s / n, 3),
             "speed-up": f"{before_s / after_s:.2f}"},
            {"way": "full prefill: one whole forward per prompt (in-process, no imports)", "commands": 0, "samples": n,
             "seconds": round(full, 1), "s/sample": round(full / n, 3), "speed-up": f"{before_s / full:.2f}"}]
    print(f"RULER eval of {args.run}'s {len(named)} checkpoints + YaRN x{args.yarn:g} at {yarn_len[0]}, tasks "
          f"{args.tasks}, lengths {args.lengths}, {args.samples} samples per cell (wall time per command, process "
          f"start and imports included)")
    print_table(rows, list(rows[0]))
    print(f"same prompt length on {same_prompt}/{n}, same score on {same_score}/{n}, same prediction on {same_pred}/{n}")
    print("results:", write_results("bench_eval", rows, {"run": args.run, "before": args.before, "tasks": args.tasks,
                                                          "lengths": args.lengths, "yarn": [args.yarn, yarn_len[0]],
                                                          "samples": args.samples, "same_prompt": same_prompt,
                                                          "same_score": same_score, "same_prediction": same_pred,
                                                          "total": n}))
    if same_score != n or same_prompt != n:
        sys.exit("prompts or scores differ between the two ways (see above)")


if __name__ == "__main__":
    main()
