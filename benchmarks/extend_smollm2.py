"""Before / after a context extension (recipe=extend_smollm2_32k): RULER and perplexity vs length, one command.

    python -m benchmarks.extend_smollm2 --before checkpoints/smollm2-135m-instruct \
        --after outputs/extend_smollm2_32k/s2_32k/final

For each checkpoint: RULER niah_single_1/2/3, niah_multikey_1 and vt at 4K, 8K, 16K and 32K without YaRN
(lengths past a model's positions run anyway: extrapolation is what "before" is measured on), plus 64K with
YaRN x2 on the extended model; and `eval ppl` at the same lengths on long standard-library files that the
recipe's data holds out of training (configs/data/extend_mix.yaml `exclude`). Writes per-run folders, a
summary JSON, a markdown table and a plot under --out (default benchmarks/results/extend_smollm2).
`--smoke` runs short lengths with one sample (any device, a tiny stand-in model): it checks the script.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "vt"]
LENGTHS = [4096, 8192, 16384, 32768]


def held_out_files() -> list[str]:
    """The long stdlib files the extension mixture leaves out of training, as they exist on this machine."""
    from omegaconf import OmegaConf

    from longstride.data.files import list_files, stdlib_root

    data = OmegaConf.load(os.path.join(REPO, "configs", "data", "extend_mix.yaml"))
    patterns = ",".join(p for p in data.sources.stdlib.exclude.split(",") if "pydoc_data" not in p)
    return list_files(stdlib_root(), patterns)


def run_eval(args: list[str], out: str) -> float:
    """Runs `longstride eval ruler|ppl` with key=value args in this process; returns its seconds."""
    from longstride.eval import ppl as ppl_eval
    from longstride.eval.ruler import run as ruler_run

    os.makedirs(out, exist_ok=True)
    entry = {"ruler": ruler_run.main, "ppl": ppl_eval.main}[args[0]]
    t0 = time.perf_counter()
    entry(args[1:])
    return time.perf_counter() - t0


def ruler(ckpt: str, lengths: list[int], samples: int, out: str, yarn: float | None = None) -> dict:
    from longstride.eval.cli import results_stem

    args = ["ruler", f"checkpoint={ckpt}", f"lengths=[{','.join(map(str, lengths))}]",
            f"tasks=[{','.join(TASKS)}]", f"num_samples={samples}", "dtype=bfloat16", "extrapolate=true", f"out={out}"]
    if yarn:
        args.append(f"yarn.factor={yarn:g}")
    seconds = run_eval(args, out)
    with open(os.path.join(out, results_stem("ruler", yarn, "bfloat16") + ".json")) as f:
        summary = json.load(f)["summary"]
    return {"table": summary["table"], "mean": summary["mean"], "seconds": seconds}


def ppl(ckpt: str, lengths: list[int], docs_dir: str, out: str, yarn: float | None = None) -> list[dict]:
    args = ["ppl", f"checkpoint={ckpt}", f"lengths=[{','.join(map(str, lengths))}]",
            f"docs_dir={docs_dir}", "glob=**/*.py", f"out={out}"]
    if yarn:
        args.append(f"yarn.factor={yarn:g}")
    run_eval(args, out)
    with open(os.path.join(out, f"ppl{f'_yarn{yarn:g}' if yarn else ''}.json")) as f:
        return json.load(f)["results"]


def evaluate(label: str, ckpt: str, lengths: list[int], yarn_length: int | None, samples: int, docs_dir: str,
             out: str) -> dict:
    res = {"checkpoint": ckpt, "ruler": ruler(ckpt, lengths, samples, os.path.join(out, label, "ruler")),
           "ppl": ppl(ckpt, lengths, docs_dir, os.path.join(out, label, "ppl"))}
    if yarn_length:
        res["ruler_yarn2"] = ruler(ckpt, [yarn_length], samples, os.path.join(out, label, "ruler_yarn2"), 2.0)
    print(f"{label}: done", flush=True)
    return res


def markdown(results: dict, lengths: list[int]) -> str:
    """One row per task (and the niah mean, and perplexity), one column per (model, length)."""
    cols = [(label, str(L), None) for label in results for L in lengths]
    cols += [(label, k, "ruler_yarn2") for label, r in results.items() if "ruler_yarn2" in r for k in r["ruler_yarn2"]["mean"]]
    head = "| task | " + " | ".join(f"{lab} {int(L) // 1024}K{' YaRN x2' if y else ''}" for lab, L, y in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for task in TASKS + ["niah mean"]:
        cells = []
        for label, L, y in cols:
            table = results[label][y or "ruler"]["table"]  # a task that did not fit a length has no cell
            names = [t for t in TASKS if t.startswith("niah")] if task == "niah mean" else [task]
            vals = [table[t][L] for t in names if L in table.get(t, {})]
            cells.append(f"{sum(vals) / len(vals):.0f}" if vals else "-")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    ppl_row = []
    for label, L, y in cols:
        row = next((r for r in results[label]["ppl"] if str(r["length"]) == L), None) if not y else None
        ppl_row.append(f"{row['ppl']:.2f}" if row and row["docs"] else "-")
    lines.append("| perplexity (held-out) | " + " | ".join(ppl_row) + " |")
    return "\n".join(lines)


def plot(results: dict, lengths: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label, r in results.items():
        niah = [t for t in TASKS if t.startswith("niah")]
        means = [[r["ruler"]["table"].get(t, {}).get(str(L)) for t in niah] for L in lengths]
        a.plot(lengths, [sum(v for v in m if v is not None) / max(1, sum(v is not None for v in m)) for m in means],
               "o-", label=label)
        pts = [(p["length"], p["ppl"]) for p in r["ppl"] if p["docs"]]
        b.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label)
    for ax, title in ((a, "RULER niah mean (%)"), (b, "perplexity, held-out stdlib files")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the original checkpoint (HF dir)")
    p.add_argument("--after", required=True, help="the extended checkpoint (HF dir)")
    p.add_argument("--samples", type=int, default=10, help="RULER samples per task and length")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "extend_smollm2"))
    p.add_argument("--smoke", action="store_true", help="lengths 2K/4K (YaRN at 8K), one sample")
    args = p.parse_args(argv)
    for flag, path in (("--before", args.before), ("--after", args.after)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"{flag} {path}: not an HF checkpoint directory (no config.json)")
    lengths, yarn_length, samples = ([2048, 4096], 8192, 1) if args.smoke else (LENGTHS, 65536, args.samples)
    docs_dir = os.path.join(args.out, "held_out_docs")
    shutil.rmtree(docs_dir, ignore_errors=True)
    os.makedirs(docs_dir)
    held = held_out_files()
    for i, f in enumerate(held):  # flat copies: eval ppl reads a folder
        shutil.copy(f, os.path.join(docs_dir, f"{i:02d}_{os.path.basename(os.path.dirname(f))}_{os.path.basename(f)}"))
    results = {"before": evaluate("before", args.before, lengths, None, samples, docs_dir, args.out),
               "after": evaluate("after", args.after, lengths, yarn_length, samples, docs_dir, args.out)}
    from benchmarks.common import machine

    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"machine": machine(), "samples_per_cell": samples, "tasks": TASKS, "lengths": lengths,
                   "held_out_files": [os.path.basename(h) for h in held], "results": results}, f, indent=2)
    table = markdown(results, lengths)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    plot(results, lengths, os.path.join(args.out, "before_after.png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
