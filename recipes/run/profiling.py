"""Traces of chosen training steps (profile.*): torch.profiler over steps start_step..end_step of each stage (its
own count, 1-based), on the chosen ranks; or, profile.tool=nsys, those steps as Nsight Systems' capture range
(cudaProfilerStart/Stop, an NVTX range per step: `nsys profile --capture-range=cudaProfilerApi ...`), as
Megatron-LM's --profile marks them.

Each traced rank writes, under `<stage>/profile/`:
  rank<r>-steps<a>-<b>.json.gz   the Chrome trace (https://ui.perfetto.dev or chrome://tracing), each step a
                                 `step N` range; CUDA kernels too on a GPU
  rank<r>-steps<a>-<b>.txt       the ops by their own time (self CUDA time on a GPU, else self CPU time)
  rank<r>-steps<a>-<b>-memory.pickle   with profile.memory_snapshot (CUDA only; with nsys too): the caching
                                 allocator's history over the steps, for https://pytorch.org/memory_viz
and logs the five ops that took longest (each traced rank: rank 0 in the run's log, the others on their stderr). A
stage resumed inside the window traces the steps it has left of it (a trace of the same steps already there is
kept: the new one gets a -2, -3 suffix); a run stopped inside it (a stop signal, an error) writes what it traced,
named by the steps it entered. A trace that cannot be written is a warning, never the run's end. The
window's settings are checked before anything is built (check_profile).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import torch

from longstride.recipes.config.schema import ProfileConfig


def window(p: ProfileConfig) -> Optional[tuple[int, int]]:
    """(first, last) step traced, or None when profiling is off."""
    return (p.start_step, p.end_step or p.start_step) if p.start_step else None


def check_profile(p: ProfileConfig, stages: dict[str, int], runs: list[str], world: int, device_type: str) -> None:
    """Raises ValueError naming the profile field and the fix; `stages`: each of the recipe's stages' step count,
    `runs`: the stages this command runs."""
    if p.start_step < 0 or p.end_step < 0:
        raise ValueError(f"profile.start_step={p.start_step}, profile.end_step={p.end_step} must be >= 0 (steps of "
                         "each stage, from 1; start_step=0 = off)")
    if not p.start_step:
        if p.end_step or p.stages is not None or p.ranks is not None or p.memory_snapshot or p.record_shapes \
                or p.with_stack or str(p.tool) != "torch":
            raise ValueError("profile.* is set but profile.start_step=0 (off); set profile.start_step to the first "
                             "step to trace (e.g. profile.start_step=5 profile.end_step=6)")
        return
    first, last = window(p)
    if last < first:
        raise ValueError(f"profile.end_step={p.end_step} is before profile.start_step={p.start_step}; give an end "
                         "step >= the start (or 0 for the start step alone)")
    for name, value in (("stages", p.stages), ("ranks", p.ranks)):
        if value is not None and not list(value):
            raise ValueError(f"profile.{name}=[] traces nothing; drop it (null = every one of them) or list some")
    unknown = [s for s in p.stages or [] if s not in stages]
    if unknown:
        raise ValueError(f"profile.stages names {unknown}, not stages of this recipe ({list(stages)})")
    bad = [r for r in p.ranks or [] if not 0 <= r < world]
    if bad:
        raise ValueError(f"profile.ranks={list(p.ranks)}: ranks {bad} are not in this run of {world} process(es) "
                         f"(0..{world - 1})")
    traced = {name: stages[name] for name in runs if p.stages is None or name in p.stages}
    if not traced:
        raise ValueError(f"profile.stages={list(p.stages)} names none of the stages this command runs ({runs})")
    if all(first > steps for steps in traced.values()):
        raise ValueError(f"profile.start_step={first} is past the last step of every stage it traces "
                         f"({traced}); pick a step within them")
    if str(p.tool) == "nsys" and (device_type != "cuda" or p.record_shapes or p.with_stack):
        raise ValueError("profile.tool=nsys marks the window for Nsight Systems on CUDA (launch under `nsys profile "
                         "--capture-range=cudaProfilerApi`); " + (f"this run is on {device_type}: use profile.tool="
                         "torch" if device_type != "cuda" else "profile.record_shapes and profile.with_stack are "
                         "torch.profiler's: drop them or use profile.tool=torch"))
    if p.memory_snapshot and device_type != "cuda":
        raise ValueError(f"profile.memory_snapshot=true records CUDA's caching allocator, and this run is on "
                         f"{device_type}; set profile.memory_snapshot=false (the Chrome trace is still written)")


class StepProfiler:
    """One stage's traced steps on this rank: `step(n)` wraps optimizer step n; `close()` ends a window cut short."""

    def __init__(self, p: ProfileConfig, stage: str, stage_dir: str, rank: int, device: torch.device, log,
                 total_steps: int = 0):
        span = window(p)
        on = span is not None and (p.stages is None or stage in p.stages) and (p.ranks is None or rank in p.ranks)
        self.first, self.last = span if on else (0, -1)
        if on and total_steps and self.first > total_steps:
            log(f"profile: stage {stage} has {total_steps} steps; profile.start_step={self.first} is not reached in it")
        self.p, self.out, self.rank, self.cuda, self.log = p, os.path.join(stage_dir, "profile"), rank, \
            device.type == "cuda", log
        self.nsys = str(p.tool) == "nsys"
        self.prof: Optional[torch.profiler.profile] = None
        self.started, self.entered, self.done = 0, 0, 0

    @contextlib.contextmanager
    def step(self, n: int):
        if not self.first <= n <= self.last:
            yield
            return
        if self.prof is None:
            self._start(n)
        self.entered = n
        with torch.cuda.nvtx.range(f"step {n}") if self.nsys else torch.profiler.record_function(f"step {n}"):
            yield
        self.done = n
        if n == self.last:
            self.close()

    def _start(self, n: int) -> None:
        self.started = n
        if self.cuda and self.p.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        if self.nsys:
            torch.cuda.profiler.start()
            self.prof = _NsysWindow()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=self.p.record_shapes,
                                           with_stack=self.p.with_stack)
        self.prof.start()

    def close(self) -> None:
        """Stops the trace (if one runs) and writes it, named by the steps it covered. A trace that cannot be
        written (a full disk, a GPU error) is a warning: it never ends a run, nor replaces the error ending one."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        try:
            if self.cuda:
                torch.cuda.synchronize()
            if self.nsys:
                torch.cuda.profiler.stop()
            else:
                prof.stop()
            self._write(prof)
        except Exception as e:  # noqa: BLE001 - a diagnostic's failure
            self.log(f"profile: steps {self.started}-{self.entered} of rank {self.rank} not written ({e})")
        finally:
            if self.cuda and self.p.memory_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)

    def _write(self, prof) -> None:
        os.makedirs(self.out, exist_ok=True)
        stem = base = os.path.join(self.out, f"rank{self.rank}-steps{self.started}-{self.entered}")
        again = 1
        while any(os.path.exists(stem + end) for end in (".json.gz", "-memory.pickle")):  # a resumed stage tracing
            again += 1  # its window again keeps the first trace
            stem = f"{base}-{again}"
        if self.cuda and self.p.memory_snapshot:
            torch.cuda.memory._dump_snapshot(stem + "-memory.pickle")
        cut = f" (step {self.entered} cut short)" if self.done != self.entered else ""
        what = f"profile: steps {self.started}-{self.entered}{cut} of rank {self.rank}"
        if self.nsys:
            self.log(f"{what} were nsys's capture range" + (f"; memory snapshot {stem}-memory.pickle"
                                                             if self.p.memory_snapshot else ""))
            return
        prof.export_chrome_trace(stem + ".json.gz")
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        with open(stem + ".txt", "w") as f:
            f.write(averages.table(sort_by=key, row_limit=40))
        ops = sorted((e for e in averages if not e.key.startswith("step ")), key=lambda e: getattr(e, key),
                     reverse=True)  # ops and the model's own ranges, not the step ranges around them
        top = ", ".join(f"{e.key} {getattr(e, key) / 1000:.1f} ms" for e in ops[:5])
        self.log(f"{what} traced to {stem}.json.gz; longest ops by own {'GPU' if self.cuda else 'CPU'} time: {top}")


class _NsysWindow:
    """Stands for the running profiler while nsys captures: the capture is stopped by cudaProfilerStop."""


def rank_log(info, is_main: bool, rank: int):
    """The main rank's log (the tracker's `info`), or a line on this rank's stderr: a traced rank other than 0
    reports its trace too."""
    if is_main:
        return info
    return lambda msg: print(f"[rank {rank} longstride] {msg}", file=sys.stderr, flush=True)
