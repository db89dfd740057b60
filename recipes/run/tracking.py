"""Every rank-aware side effect in one place: console logging, progress bar, metrics file, wandb.

Only the main process prints, writes metrics or talks to wandb; other ranks get a Tracker whose
methods do nothing. One wandb run per stage, grouped by recipe, closed in `finally` by the caller.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import resource
import uuid
from typing import Optional

import torch
from tqdm import tqdm

log = logging.getLogger("longstride")


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    """(method, GiB): CUDA allocator peak on GPU; this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return "cuda_max_allocated", torch.cuda.max_memory_allocated(device) / 2**30
    return "cpu_peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak_rss() -> None:
    """Sets this process's peak resident memory (VmHWM, which ru_maxrss reads) to its current one (Linux's
    /proc/self/clear_refs; elsewhere the peak stays the process's lifetime one)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def reset_peak_memory(device: torch.device) -> None:
    """At a stage's start: the previous stage's model and optimizer freed (accelerate's prepared module is in a
    reference cycle, which only the collector breaks) and the peak reset (CUDA's allocator peak; on CPU the peak
    resident memory), so that each stage's logged peak is its own, not the largest of the stages before it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def rewind_metrics(path: str, first_step: int) -> None:
    """Keeps the records of steps <= first_step when a stage resumes there (none when it starts afresh):
    a killed run's later steps, and a last line cut mid-write, would otherwise stay beside the rerun's."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if first_step > 0 and isinstance(record, dict) and record.get("step", first_step + 1) <= first_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def wandb_run_id(stage_dir: str, prefix: str, resuming: bool) -> str:
    """One wandb run per run of a stage: a new id when the stage starts afresh, the stored one when it
    resumes (so a resumed run continues its wandb run and a new run never merges into an old one)."""
    path = os.path.join(stage_dir, "wandb_run_id")
    if resuming and os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = f"{prefix.replace('/', '-')}-{uuid.uuid4().hex[:8]}"
    with open(path, "w") as f:
        f.write(run_id)
    return run_id


def finite(value):
    """`value` with every non-finite float (a skipped step's loss) as None: metrics.jsonl holds null there, since
    NaN is not JSON and strict readers (jq, JavaScript) reject the line."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Tracker:
    def __init__(self, is_main: bool, cfg, recipe_dir: str):
        self.is_main, self.cfg, self.recipe_dir = is_main, cfg, recipe_dir
        self.run = None
        self.bar: Optional[tqdm] = None
        self.metrics_file = None
        from transformers.utils import logging as hf_logging

        # for the run only (close() restores them): per-shard save/load bars would drown the training bar
        self.hf_bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        self.handler, self.log_state = None, (log.level, log.propagate)
        if is_main:  # longstride's own logger only; the root logger and other libraries' logging stay as they are
            self.handler = logging.StreamHandler()
            self.handler.setFormatter(logging.Formatter("[%(asctime)s longstride] %(message)s"))
            log.addHandler(self.handler)
            log.setLevel(logging.INFO)
            log.propagate = False

    def info(self, msg: str, *args) -> None:
        if self.is_main:
            log.info(msg, *args)

    def warning(self, msg: str, *args) -> None:
        if self.is_main:
            log.warning(msg, *args)

    def start_stage(self, stage: str, stage_dir: str, total_steps: int, first_step: int, config: dict) -> None:
        if not self.is_main:
            return
        os.makedirs(stage_dir, exist_ok=True)
        path = os.path.join(stage_dir, "metrics.jsonl")
        rewind_metrics(path, first_step)
        self.metrics_file = open(path, "a")
        lc = self.cfg.logger
        wandb = None
        if lc.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                log.warning("wandb is not installed: this run is tracked in %s only (pip install wandb, or "
                            "logger.wandb_mode=disabled to silence this)", path)
        if wandb is not None:
            recipe = self.cfg.recipe.name
            self.run = wandb.init(
                project=lc.project, entity=lc.entity, group=recipe, name=f"{recipe}/{stage}",
                id=wandb_run_id(stage_dir, f"{recipe}-{stage}", first_step > 0), resume="allow", mode=lc.wandb_mode,
                dir=self.recipe_dir, config=config, reinit="finish_previous",
            )
            # every chart against the training step, a metric of its own: a resumed stage logs again the steps
            # after its checkpoint, which wandb's own monotonic step would drop as lower than the killed run's last
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
        if lc.progress_bar:
            self.bar = tqdm(total=total_steps, initial=first_step, desc=stage, dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        self._record(step, metrics, to_wandb=step % self.cfg.logger.log_every == 0)
        if self.bar is not None:
            rate = {"tflops": f"{metrics['tflops']:.3g}"} if "tflops" in metrics else {}
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}", **rate,
                                 refresh=False)
            self.bar.update(1)
        elif step % self.cfg.logger.log_every == 0:
            rate = "" if "tflops" not in metrics else f" TFLOP/s {metrics['tflops']:.3g}" + (
                f" MFU {100 * metrics['mfu']:.1f}%" if "mfu" in metrics else "")
            log.info("step %d loss %.4f lr %.2e tok/s %.0f%s", step, metrics["loss"], metrics["lr"],
                     metrics["tokens_per_s"], rate)

    def log_values(self, step: int, values: dict) -> None:
        """Metrics outside the step loop (validation loss): file and wandb, no progress update."""
        if self.is_main:
            self._record(step, values, to_wandb=True)

    def _record(self, step: int, values: dict, to_wandb: bool) -> None:
        self.metrics_file.write(json.dumps(finite({"step": step, **values}), allow_nan=False) + "\n")
        self.metrics_file.flush()
        if self.run is not None and to_wandb:
            self.run.log({"step": step, **values})

    def finish_stage(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        if self.run is not None:
            self.run.finish()
            self.run = None

    def close(self) -> None:
        """Ends the run's tracking: the stage's files and wandb run, the log handler, and the HF progress
        bars as they were before."""
        self.finish_stage()
        if self.handler is not None:
            log.removeHandler(self.handler)
            log.setLevel(self.log_state[0])
            log.propagate = self.log_state[1]
            self.handler = None
        if self.hf_bars:
            from transformers.utils import logging as hf_logging

            hf_logging.enable_progress_bar()
