"""The device window: everything a short lease of one GPU should run, in one command under a time budget.

    python -m benchmarks.device_window --out "$OUT" --budget 540     # on the lent GPU machine
    python -m benchmarks.device_window --only env,gpu_recipe --out "$OUT" --deadline $D   # the recipe at scale
    python -m benchmarks.device_window --smoke --out /tmp/window      # the same steps, tiny, on CPU (the suite runs it)

Each step is a child process with its own time cap, cut to what is left of the budget and skipped when less is
left than it needs; a step runs even when an earlier one failed. After every step, and every 30 s while one
runs, the window rewrites three files in --out: window.log (every step's output), summary.json (each step's status and seconds) and results.tgz
(each step's result files: JSON, plots, junit XML), so a window cut short keeps what it measured. The summary
table is printed last.

Results: `python -m benchmarks.device_window --collect FOLDER --tag TAG` turns the returned files into JSON under
benchmarks/results/gpu/, each naming the device and versions.

Preparing the carried files here (ignored folder .whl/, named in the device call's `carry`):
    python -m benchmarks.device_window --prepare
and on the device, before this module: install .whl/*.whl into /tmp/site (no network there), PYTHONPATH=/tmp/site:.
The package is imported from the checkout (longstride/__init__.py maps its subpackages to the top-level folders).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

from benchmarks.common import REPO, child_env
# The wheels the device image lacks (its torch, transformers, accelerate, safetensors, pyarrow... are used as found):
# the versions installed here, which the CPU suite ran with, else these.
WHEEL_DEFAULTS = {"hydra-core": "1.3.8", "omegaconf": "2.3.1", "datasets": "5.2.0", "dill": "0.4.1",
                  "multiprocess": "0.70.19", "torchdata": "0.11.0", "wonderwords": "3.0.1", "gguf": "0.19.0",
                  "xxhash": "4.1.0"}
SDIST_WHEELS = ["antlr4-python3-runtime==4.9.3"]  # no wheel on the registry: built here


@dataclass
class Step:
    name: str
    cap_s: int  # at most this long on the GPU (a --smoke step may take SMOKE_SLACK times as long)
    need_s: int  # skipped when less is left
    gpu_cmd: list[str]
    smoke_cmd: list[str]
    when_named: bool = False  # runs only when --only names it (a window of its own)


def py(*args: str) -> list[str]:
    return [sys.executable, *args]


# A --smoke step runs on a CPU that may be shared (the suite runs it beside another worker): its caps only stop a hung
# step, so they are the GPU caps times this.
SMOKE_SLACK = 3

MAIN_JOB_STAGES = "recipe.stages.s2_2k.cp=1 recipe.stages.s3_4k.cp=1 logger.progress_bar=false"
# a smoke tokenizes a slice of each source: the whole mixture is 22M tokens, half a minute of a CPU's smoke
SMOKE_DATA = "data.sources.stdlib.max_docs=600"  # the filler reads the first 400
SMOKE_STAGES = " ".join([f"recipe.stages.{s}.{k}" for s in ("s2_2k", "s3_4k")
                         for k in ("steps=2", "save_every=2", "warmup_steps=1", "batch_tokens=4096")]
                        + [f"data.sources.{s}.synthetic.num_docs={n}" for s, n in (("retrieval_short", 1000),
                                                                                  ("retrieval_mid", 200),
                                                                                  ("retrieval_long", 100))]
                        + [SMOKE_DATA])

PROBE_SMOKE = ("model.hidden_size=128 model.intermediate_size=256 model.num_hidden_layers=2 model.num_attention_heads=2 "
               "model.num_key_value_heads=1 model.vocab_size=4096 model.loss_tile_tokens=256 train.trace_memory=true "
               f"{SMOKE_DATA} " +
               " ".join(f"recipe.stages.{s}.{k}" for s, n in (("s1_16k", 512), ("s2_32k", 1024))
                        for k in ("steps=2", "warmup_steps=1", f"seq_len={n}", f"batch_tokens={n}")))


def steps(work: str) -> list[Step]:
    env = py("-c", "import torch, transformers, accelerate, hydra, datasets, longstride.recipes.train as t; "
                   "print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', "
                   "transformers.__version__, '| accelerate', accelerate.__version__, '| hydra', hydra.__version__, "
                   "'| datasets', datasets.__version__); print('device', torch.cuda.get_device_name(0) "
                   "if torch.cuda.is_available() else 'cpu')")
    gpu_tests = py("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=200",
                   "tests/gpu/test_kernels_gpu.py", "tests/gpu/test_cp_gpu.py", "tests/gpu/test_patterns_gpu.py",
                   "tests/gpu/test_prefill_gpu.py", f"--junitxml={work}/gpu_tests.xml")
    train_tests = py("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=200",
                     "tests/gpu/test_train_gpu.py", f"--junitxml={work}/gpu_train_tests.xml")
    figures = py("-m", "benchmarks.gpu_kernel_figures", "--out", f"{work}/kernels")
    throughput = py("-m", "benchmarks.gpu_check", "--only", "throughput", "--shapes", "smollm2_135m",
                    "--lengths", "16384,32768", "--compile", "16384", "--out", f"{work}/throughput")
    run = f"{work}/runs"
    launch = py("-m", "accelerate.commands.launch")  # the launcher of this interpreter, PATH or not
    train = [*launch, "--config_file", "configs/accelerate/gpu1.yaml", "-m", "longstride.recipes.train",
             "recipe=tiny_extend", f"paths.output_root={run}", *MAIN_JOB_STAGES.split()]
    compare = py("-m", "longstride.cli", "eval", "compare", f"run={run}/tiny_extend", "tasks=[niah_single_1]",
                 "yarn=[2]", "yarn_lengths=[8192]", f"out={work}/main_job_compare")
    smoke_train = [*py("-m", "longstride.recipes.train"), "recipe=tiny_extend", f"paths.output_root={run}",
                   *MAIN_JOB_STAGES.split(), *SMOKE_STAGES.split()]
    probe = [*launch, "--config_file", "configs/accelerate/gpu1.yaml", "-m", "longstride.recipes.train",
             "recipe=gpu_probe", f"paths.output_root={run}", "logger.progress_bar=false"]
    probe_smoke = [*py("-m", "longstride.recipes.train"), *probe[7:], *PROBE_SMOKE.split()]
    ckpt = py("-m", "benchmarks.bench_checkpointing", "--out", f"{work}/checkpointing/checkpointing.json",
              "--modes", "none,full,full_half,selective,selective_matmuls")
    main_job = ["bash", "-c", f"{shlex.join(train)} && {shlex.join(compare)} num_samples=10"]
    main_smoke = ["bash", "-c", f"{shlex.join(smoke_train)} && {shlex.join(compare)} num_samples=1 lengths=[512]"]
    return [
        Step("env", 60, 10, env, env),
        Step("gpu_tests", 180, 40, gpu_tests, gpu_tests),
        Step("kernel_figures", 90, 30, figures, [*figures, "--smoke"]),
        # none / full / selective (matmuls' and attention's outputs) / selective_matmuls: step time, measured peak, 16K
        Step("checkpointing", 90, 40, ckpt, [*ckpt, "--smoke"]),
        Step("recipe_step", 150, 60, probe, probe_smoke),
        # with the compiled step at 16K (train.compile; its compilation falls in the warm-up steps)
        Step("train_throughput", 180, 60, throughput, [*throughput[:5], "--smoke", "--compile", "1",
                                                       "--out", f"{work}/throughput"]),
        Step("main_job", 170, 60, main_job, main_smoke),
        Step("gpu_train_tests", 200, 40, train_tests, train_tests),
        # the recipe at real scale (benchmarks/gpu_recipe.py): about 9 minutes, a window of its own
        # (--only env,gpu_recipe); the smoke runs its CPU rehearsal
        # RULER: 10 samples a cell of niah_single_1 (the acceptance task, first), 5 of the others (cut first if the
        # window runs short; about 34 PFLOP of prefill in all, counted from the samples: benchmarks/README.md)
        Step("gpu_recipe", 540, 300, py("-m", "benchmarks.gpu_recipe", "--samples", "10", "--rest-samples", "5",
                                        "--out", f"{work}/gpu_recipe"),
             py("-m", "benchmarks.gpu_recipe", "--rehearsal", "--samples", "1", "--rest-samples", "1", "--out",
                f"{work}/gpu_recipe"),
             when_named=True),
    ]


def _size(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:  # removed by a running step since the walk listed it
                pass
    return total


def pack(work: str, out: str, log: list[str], summary: list[dict], started: float, budget: float) -> None:
    """The three files, each written aside and renamed over the last: a kill while packing keeps the previous."""
    def put(name: str, text: str | None = None) -> None:
        tmp = os.path.join(out, f".{name}.tmp")
        if text is None:
            _tar(work, tmp)
        else:
            with open(tmp, "w") as f:
                f.write(text)
        os.replace(tmp, os.path.join(out, name))

    put("window.log", "".join(log))
    put("summary.json", json.dumps({"budget_s": budget, "elapsed_s": round(time.monotonic() - started, 1),
                                    "steps": summary}, indent=1))
    put("results.tgz")


def _tar(work: str, path: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for root, dirs, files in os.walk(work):
            # each run's metrics, configs and logs come back; step checkpoints stay behind, and final ones unless
            # small (the main job's: its scores can then be checked on a CPU)
            dirs[:] = [d for d in dirs if d not in ("wandb", ".hydra") and not d.startswith(("step_", ".tmp-"))
                       and not (d == "final" and _size(os.path.join(root, d)) > 16 << 20)]
            for name in files:
                path = os.path.join(root, name)
                try:
                    if os.path.getsize(path) < 8 << 20:
                        tar.add(path, arcname=os.path.relpath(path, work))
                except FileNotFoundError:  # replaced or removed by a running step since the walk listed it
                    continue


def window(out: str, budget: float, smoke: bool, only: list[str] | None = None) -> list[dict]:
    started = time.monotonic()
    work = os.path.join(out, "work") if smoke else "/tmp/longstride_window"
    shutil.rmtree(work, ignore_errors=True)  # a rerun on a warm machine starts afresh, never resumes old runs
    os.makedirs(work, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    env = child_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    log, summary = [], []
    reserve = 10  # for packing after the last step
    for step in steps(work):
        if (step.name not in only) if only else step.when_named:  # --only runs what it names, nothing else
            continue
        left = budget - (time.monotonic() - started) - reserve
        row = {"step": step.name, "status": "skipped", "seconds": 0.0}
        if left < step.need_s:
            row["why"] = f"{left:.0f} s left, needs {step.need_s}"
        else:
            cmd = step.smoke_cmd if smoke else step.gpu_cmd
            cap = min(step.cap_s * (SMOKE_SLACK if smoke else 1), left)
            log.append(f"\n===== {step.name} (cap {cap:.0f} s): {shlex.join(cmd)}\n")
            t0 = time.monotonic()
            text = run_step(cmd, cap, env, os.path.join(work, f"{step.name}.log"), row,
                            lambda: pack(work, out, log, summary + [row], started, budget))
            row["seconds"] = round(time.monotonic() - t0, 1)
            log.append(text)
            tail = [x for x in text.strip().splitlines() if x.strip()][-1:] or [""]
            row["last_line"] = tail[0][:200]
        summary.append(row)
        print(f"{row['step']:<18} {row['status']:<22} {row['seconds']:>6.1f} s  {row.get('last_line', row.get('why', ''))}",
              flush=True)
        pack(work, out, log, summary, started, budget)
    print(f"window: {sum(r['status'] == 'passed' for r in summary)}/{len(summary)} steps passed in "
          f"{time.monotonic() - started:.0f} s; results in {out}")
    return summary


def run_step(cmd: list[str], cap: float, env: dict, log_path: str, row: dict, checkpoint, every: float = 30.0) -> str:
    """One step as a child process, its output written to `log_path` as it runs, `checkpoint()` (the window's
    pack) called every `every` seconds meanwhile, so a window killed from outside mid-step still returns what the step wrote.
    The child gets LONGSTRIDE_DEADLINE (the epoch second its cap ends) to plan by; at the cap its own process group
    is killed whole (launcher workers never outlive their step on the GPU). Sets row["status"]; returns the
    output."""
    deadline = time.time() + cap
    with open(log_path, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "LONGSTRIDE_DEADLINE": f"{deadline:.0f}"}, stdout=sink,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=max(0.0, min(every, deadline - time.time())))
                    row["status"] = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
                    break
                except subprocess.TimeoutExpired:
                    if time.time() >= deadline:
                        row["status"] = f"timed out at {cap:.0f} s"
                        break
                    row["status"] = "running"
                    try:
                        checkpoint()
                    except OSError as e:  # a file the step replaced mid-pack: the next pack takes it
                        print(f"window: packing while {cmd[-1]} runs failed ({e}); trying again", flush=True)
        finally:  # the group, whatever ended the wait: a launcher's workers may outlive the launcher itself
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    with open(log_path, errors="replace") as f:
        return f.read()


def wheels() -> list[str]:
    """WHEEL_DEFAULTS pinned to the versions installed here, where they are."""
    from importlib.metadata import PackageNotFoundError, version

    def here(name: str, default: str) -> str:
        try:
            v = version(name)
        except PackageNotFoundError:
            return default
        return default if "+" in v or "dev" in v else v  # a local build has no wheel on the registry

    return [f"{name}=={here(name, v)}" for name, v in WHEEL_DEFAULTS.items()]


def prepare(folder: str) -> None:
    """Download the device's missing wheels (Python 3.12, x86-64 manylinux) into `folder`: the versions the CPU
    suite runs with here."""
    plat = [x for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
            for x in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plat, "-d", folder, *wheels()], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", folder, *SDIST_WHEELS], check=True)
    print(f"wheels in {folder}: {sorted(os.listdir(folder))}")


def _junit(xml: bytes) -> list[dict]:
    import xml.etree.ElementTree as ET

    return [{"test": f"{c.get('classname')}::{c.get('name')}", "seconds": float(c.get("time", 0)),
             "status": next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")}
            for c in ET.fromstring(xml).iter("testcase")]


LOGS = {"gpu_probe": "recipe_step.log", "tiny_extend": "main_job.log", "gpu_extend_64k": "gpu_recipe/train.log"}
# Recipes whose GPU run does not trace its stages (gpu_recipe.train_command: the trace would block the timed
# command): their traced peaks are the plan committed here, the same fake-tensor program traced on CPU
PLANS = {"gpu_extend_64k": "benchmarks/results/plan/gpu_extend_64k-h100_80g-1.json"}


def _stage_rows(tar: tarfile.TarFile, names: set[str]) -> list[dict]:
    """Per stage of each recipe run in the window: gpu_recipe.stage_summary of its metrics, and the traced plan's
    and the analytic estimate's peak read from that recipe's own log (or its committed plan, PLANS, at the same
    seq_len), with the trace's error on a GPU."""
    import re

    from benchmarks.gpu_recipe import stage_summary

    rows = []
    for name in sorted(n for n in names if n.endswith("/metrics.jsonl")):
        recipe, stage = name.split("/")[-3:-1]
        summary = stage_summary([json.loads(x) for x in tar.extractfile(name).read().decode().splitlines()
                                 if x.strip()])
        if not summary:
            continue
        row = {"recipe": recipe, "stage": stage, **summary}
        log = tar.extractfile(LOGS[recipe]).read().decode() if LOGS.get(recipe) in names else ""
        traced = re.search(rf"stage {stage}: traced step per rank ([\d.]+) GiB .*? against the analytic ([\d.]+)", log)
        figures = (float(traced[1]), float(traced[2])) if traced else _planned(recipe, stage, row["seq_len"])
        if figures:
            peak = row["peak_gib"] if row["peak_method"] == "cuda_max_allocated" else None
            row.update(peak_gib_traced=figures[0], peak_gib_analytic=figures[1],
                       traced_error=(figures[0] - peak) / peak if peak else None)
            if not traced:
                row["traced_from"] = PLANS[recipe]
        rows.append(row)
    return rows


def _planned(recipe: str, stage: str, seq_len: int) -> tuple[float, float] | None:
    """(traced peak, analytic) GiB of a stage in its recipe's committed plan (PLANS), if it plans that length."""
    s = _plan_stages(recipe).get(stage)
    return (round(s["peak"] / 2 ** 30, 2), round(s["analytic"] / 2 ** 30, 2)) if s and s["seq_len"] == seq_len else None


@functools.lru_cache(maxsize=None)
def _plan_stages(recipe: str) -> dict:
    """stage -> its row in the recipe's committed plan (read once), {} for a recipe without one."""
    if recipe not in PLANS:
        return {}
    with open(os.path.join(REPO, PLANS[recipe])) as f:
        return {s["stage"]: s for s in json.load(f)["stages"]}


def _gpu_recipe(read, step: dict | None) -> dict | None:
    """The GPU recipe's gpu_recipe.json with the rows every RULER pass saved merged in (a run cut short: the rows
    its passes had saved, also under ruler_partial when gpu_recipe.json has none), and the acceptance and in-format
    diagnosis judged on them; step: the window's summary row of the gpu_recipe step (cut_at_s when it was killed at
    its cap)."""
    from benchmarks.gpu_recipe import merge_rows
    from benchmarks.gpu_recipe_acceptance import judge

    recipe = json.loads(read("gpu_recipe/gpu_recipe.json") or "null")
    passes = {n: json.loads(text) for n in ("compare", "compare_rest", "compare_in_format")
              if (text := read(f"gpu_recipe/{n}/compare.json"))}
    if recipe is None and not passes:
        return None
    recipe = recipe or {"cut_short": "before gpu_recipe.json was written"}
    if "ruler" not in recipe and passes:
        recipe["ruler_partial"] = {n: {"complete": c.get("complete"), "rows": c["rows"]} for n, c in passes.items()}
    recipe["ruler"] = merge_rows(recipe.get("ruler") or [], *(c["rows"] for c in passes.values()))
    if step and str(step.get("status", "")).startswith("timed out") and "total_seconds" not in recipe:
        recipe["cut_at_s"] = step.get("seconds")
    return judge(recipe)


def collect(folder: str, dest: str, tag: str) -> list[str]:
    """A window's returned files (summary.json, results.tgz, window.log in `folder`) -> JSON results under
    `dest` named `<tag>_<what>.json`, each naming the device, torch and CUDA (read from the env step's log)."""
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    written = []
    with tarfile.open(os.path.join(folder, "results.tgz")) as tar:
        names = set(tar.getnames())
        read = lambda n: tar.extractfile(n).read() if n in names else None  # noqa: E731
        env = (read("env.log") or b"").decode().strip().splitlines()
        device = {"versions": env[0] if env else None, "device": env[-1].removeprefix("device ") if env else None}

        def write(what: str, payload: dict) -> None:
            path = os.path.join(dest, f"{tag}_{what}.json")
            with open(path, "w") as f:
                json.dump({**device, **payload}, f, indent=1)
            written.append(path)

        os.makedirs(dest, exist_ok=True)
        write("window", {"summary": summary})
        tests = [t for n in ("gpu_tests.xml", "gpu_train_tests.xml") if read(n) for t in _junit(read(n))]
        write("tests", {"rows": tests})
        for name, what in (("kernels/kernel_figures.json", "kernel_figures"), ("throughput/throughput.json",
                                                                                "throughput"),
                           ("checkpointing/checkpointing.json", "checkpointing")):
            if read(name):
                write(what, json.loads(read(name)))
        write("recipe_stages", {"what": "each stage of the window's recipe runs (gpu_probe: SmolLM2-135M's shape at "
                                        "16K/32K; tiny_extend: the main job): median tokens/s after the first "
                                        "step, CUDA max_memory_allocated, the traced plan's peak",
                                "rows": _stage_rows(tar, names)})
        step = next((r for r in summary.get("steps", []) if r.get("step") == "gpu_recipe"), None)
        recipe = _gpu_recipe(read, step)
        if recipe:
            write("gpu_recipe", recipe)
        for name, what in (("main_job_compare/compare.png", "main_job_compare"), ("gpu_recipe/ruler.png",
                                                                                 "gpu_recipe_ruler")):
            if read(name):
                path = os.path.join(dest, f"{tag}_{what}.png")
                with open(path, "wb") as f:
                    f.write(read(name))
                written.append(path)
        if read("main_job_compare/compare.json"):
            cmp = json.loads(read("main_job_compare/compare.json"))
            cmp.pop("records", None)
            write("main_job_compare", cmp)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(REPO, "outputs", "window")))
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole window")
    p.add_argument("--deadline", type=float, default=None, help="an epoch second the window must end by (taken at "
                   "the device command's start, before installing: D=$(($(date +%%s) + 565))); cuts --budget to it")
    p.add_argument("--smoke", action="store_true", help="the same steps at tiny sizes on CPU")
    p.add_argument("--only", default="", help="comma-separated step names")
    p.add_argument("--prepare", action="store_true", help="download the wheels the device lacks into .whl/")
    p.add_argument("--collect", metavar="FOLDER", help="a window's returned files -> JSON under benchmarks/results/gpu/")
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"), help="--collect: the results' file prefix")
    args = p.parse_args(argv)
    if args.collect:
        for path in collect(args.collect, os.path.join(REPO, "benchmarks", "results", "gpu"), args.tag):
            print("wrote", path)
        return 0
    if args.prepare:
        prepare(os.path.join(REPO, ".whl"))
        return 0
    budget = min(args.budget, args.deadline - time.time()) if args.deadline else args.budget
    summary = window(args.out, budget, args.smoke, [x for x in args.only.split(",") if x] or None)
    return 0 if all(r["status"] == "passed" for r in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
