"""The GPU check: one command that runs the GPU tests and the GPU benchmarks on one GPU and writes
benchmarks/results/gpu/*.json, each naming the device, the torch version and the attention kernel.

    python -m benchmarks.gpu_check                          # everything (planned for < 9 minutes on one H100; not yet run on one)
    python -m benchmarks.gpu_check --only tests,attention   # a subset: tests, throughput, longest, attention, ruler
    python -m benchmarks.gpu_check --smoke                  # tiny shapes and lengths, any device: checks the script

It downloads nothing. The environment must hold the package with its dev extra (pytest, hydra-core, datasets,
...) and, for the RULER part, a converted SmolLM2-135M-Instruct (`--checkpoint`, by default
checkpoints/smollm2-135m-instruct: `longstride convert-gguf out=...`); without one that part is reported as
skipped. Each part runs even when an earlier one failed; the exit status is 1 when any failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

PARTS = ("tests", "throughput", "longest", "attention", "ruler")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "gpu")


def write(name: str, rows, extra: dict, out: str) -> str:
    import torch

    from benchmarks.common import machine

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    from longstride.parallel.kernels import resolve_kernel

    kernel = resolve_kernel("auto", "cuda" if torch.cuda.is_available() else "cpu", ring=False, half=True)
    with open(path, "w") as f:
        json.dump({"machine": machine(), "cuda": torch.version.cuda, "kernel": kernel, "flash_impl": "FA2",
                   **extra, "rows": rows}, f, indent=2)
    print(f"wrote {path}", flush=True)
    return path


def run_tests(args) -> dict:
    """pytest on tests/gpu in a child process; the pass / fail / skip counts and the failures' names."""
    report = os.path.join(args.out, "gpu_tests.xml")
    os.makedirs(args.out, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", f"--junitxml={report}", "-p",
           "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-3000:], flush=True)
    import xml.etree.ElementTree as ET

    cases = []
    if os.path.exists(report):
        for case in ET.parse(report).getroot().iter("testcase"):
            status = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                          "seconds": float(case.get("time", 0))})
    counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failure", "error", "skipped")}
    write("gpu_tests", cases, {"returncode": proc.returncode, "counts": counts,
                               "seconds": time.perf_counter() - t0}, args.out)
    if proc.returncode != 0 or counts["passed"] == 0:
        raise RuntimeError(f"GPU tests: {counts}, exit {proc.returncode}")
    return counts


def run_throughput(args, device) -> None:
    from benchmarks.common import print_table
    from benchmarks.gpu_bench import throughput

    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    lengths = [256, 512] if args.smoke else [int(x) for x in args.lengths.split(",")]
    compiled = tuple(int(x) for x in args.compile.split(",") if x)
    if args.smoke and compiled:
        compiled = (lengths[0],)
    rows = throughput(shapes, lengths, device, *((1, 1) if args.smoke else (2, 5)), flex=args.flex,
                      compile_lengths=compiled)
    print_table(rows, ["shape", "seq_len", "system", "docs", "tokens_per_s", "mfu", "tflops", "peak_gib", "error"])
    write("throughput", rows, {"what": "one bf16 AdamW training step on one packed sequence; median of 5 after 2 "
                                       "warm-up steps; MFU from model FLOPs (3x forward, no recompute) over "
                                       "the causal pairs each system's mask allows"}, args.out)


def run_longest(args, device) -> None:
    from benchmarks.common import print_table
    from benchmarks.gpu_bench import longest_context

    if args.smoke:
        rows = longest_context("smoke", device, 256, 1024, 60)
    else:
        # capped at 512K: the offloaded layer inputs take 16 x L x 2048 x 4 B of pinned host memory (64 GiB there)
        rows = longest_context("llama_1b", device, 16384, 1 << 19, args.longest_budget_s)
    print_table(rows, ["shape", "system", "longest_fit", "first_failure", "stopped_by"])
    write("longest_context", rows, {"what": "the longest packed sequence (documents masked) for which two real "
                                            "bf16 AdamW steps fit on this GPU; doubled, then bisected"}, args.out)


def run_attention(args, device) -> None:
    from benchmarks.common import print_table
    from benchmarks.gpu_bench import doc_attention_timing

    # the smoke's short sequences are mostly one file: it draws from those of several documents
    rows = doc_attention_timing(512 if args.smoke else 32768, device, 2 if args.smoke else 10, 3 if args.smoke else 1)
    print_table(rows, ["seq_len", "sequence", "docs", "masked_ms", "causal_ms", "time_ratio", "ideal_ratio",
                       "vs_ideal"])
    write("doc_attention", rows, {"what": "document-masked attention forward+backward (32:8 heads, dim 64) vs one "
                                          "causal sequence; ideal = within-document causal pairs / all causal "
                                          "pairs"}, args.out)


def run_ruler(args, device) -> None:
    """RULER niah_single_1/2 at 4K, 8K and 16K with YaRN x2 (original window 8K), bf16: one eval per length, so
    that the time per sample is measured per length."""
    from longstride.eval.cli import results_stem

    if not os.path.isdir(args.checkpoint):
        write("ruler", [], {"skipped": f"no checkpoint at {args.checkpoint} (longstride convert-gguf out=...)"},
              args.out)
        return
    rows = []
    lengths = [512] if args.smoke else [4096, 8192, 16384]
    for length in lengths:
        out = os.path.join(args.out, "ruler", str(length))
        cmd = [sys.executable, "-m", "longstride.eval.ruler", f"checkpoint={args.checkpoint}", f"lengths=[{length}]",
               "tasks=[niah_single_1,niah_single_2]", f"num_samples={args.samples}", "dtype=bfloat16",
               "yarn.factor=2", f"out={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"eval ruler at {length} failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, results_stem("ruler", 2, "bfloat16") + ".json")) as f:
            table = json.load(f)["summary"]["table"]
        per_sample = seconds / (2 * args.samples)  # includes loading the model once
        rows.append({"seq_len": length, **{t: v[str(length)] for t, v in table.items()},
                     "seconds_per_sample": per_sample})
        print(rows[-1], flush=True)
    write("ruler", rows, {"checkpoint": args.checkpoint, "samples_per_cell": args.samples, "yarn_factor": 2},
          args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and lengths: checks the script on any device")
    p.add_argument("--checkpoint", default=os.path.join(REPO, "checkpoints", "smollm2-135m-instruct"))
    p.add_argument("--samples", type=int, default=10, help="RULER samples per task and length")
    p.add_argument("--longest-budget-s", type=float, default=120.0, help="search time per system")
    p.add_argument("--flex", action="store_true", help="throughput: also transformers' FlexAttention on the packed "
                                                        "sequence (compiled per shape: minutes more)")
    p.add_argument("--compile", default="", help="throughput: also the compiled longstride step (train.compile) at "
                   "these lengths (comma list; each compiles anew); --smoke: at its first length")
    p.add_argument("--shapes", default="smollm2_135m,llama_1b", help="throughput: model shapes (gpu_bench.SHAPES)")
    p.add_argument("--lengths", default="8192,32768", help="throughput: sequence lengths")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: the GPU check needs one (use --smoke to check the script on CPU)")
        return 2
    print(f"device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}",
          flush=True)
    parts = [x for x in args.only.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"--only: unknown parts {sorted(unknown)}; choose from {PARTS}")
    runners = {"tests": lambda: run_tests(args), "throughput": lambda: run_throughput(args, device),
               "longest": lambda: run_longest(args, device), "attention": lambda: run_attention(args, device),
               "ruler": lambda: run_ruler(args, device)}
    failed, t0 = [], time.perf_counter()
    for part in parts:
        t = time.perf_counter()
        try:
            runners[part]()
        except Exception:  # report it and go on with the other parts
            traceback.print_exc()
            failed.append(part)
        print(f"== {part}: {'FAILED' if part in failed else 'done'} in {time.perf_counter() - t:.0f} s", flush=True)
    print(f"GPU check: {len(parts) - len(failed)}/{len(parts)} parts done in {time.perf_counter() - t0:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
