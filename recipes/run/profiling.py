"""Traces of chosen training steps (profile.*): torch.profiler over steps start_step..end_step of each stage (its
own count, 1-based), on the chosen ranks.

Each traced rank writes, under `<stage>/profile/`:
  rank<r>-steps<a>-<b>.json.gz   the Chrome trace (https://ui.perfetto.dev or chrome://tracing), each step a
                                 `step N` range; CUDA kernels too on a GPU
  rank<r>-steps<a>-<b>.txt       the ops by their own time (self CUDA time on a GPU, else self CPU time)
  rank<r>-steps<a>-<b>-memory.pickle   with profile.memory_snapshot (CUDA only): the caching allocator's history
                                 over the steps, for https://pytorch.org/memory_viz
and logs the five ops that took longest. A stage resumed inside the window traces the steps it has left of it;
a run stopped inside it (a stop signal, an error) writes what it traced, named by the steps it entered. The
window's settings are checked before anything is built (check_profile).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from longstride.recipes.config.schema import ProfileConfig


def window(p: ProfileConfig) -> Optional[tuple[int, int]]:
    """(first, last) step traced, or None when profiling is off."""
    return (p.start_step, p.end_step or p.start_step) if p.start_step else None


def check_profile(p: ProfileConfig, stages: dict[str, int], world: int, device_type: str) -> None:
    """Raises ValueError naming the profile field and the fix; `stages`: each stage's step count."""
    if p.start_step < 0 or p.end_step < 0:
        raise ValueError(f"profile.start_step={p.start_step}, profile.end_step={p.end_step} must be >= 0 (steps of "
                         "each stage, from 1; start_step=0 = off)")
    if not p.start_step:
        if p.end_step or p.stages or p.ranks or p.memory_snapshot or p.record_shapes or p.with_stack:
            raise ValueError("profile.* is set but profile.start_step=0 (off); set profile.start_step to the first "
                             "step to trace (e.g. profile.start_step=5 profile.end_step=6)")
        return
    first, last = window(p)
    if last < first:
        raise ValueError(f"profile.end_step={p.end_step} is before profile.start_step={p.start_step}; give an end "
                         "step >= the start (or 0 for the start step alone)")
    unknown = [s for s in p.stages or [] if s not in stages]
    if unknown:
        raise ValueError(f"profile.stages names {unknown}, not stages of this recipe ({list(stages)})")
    bad = [r for r in p.ranks or [] if not 0 <= r < world]
    if bad:
        raise ValueError(f"profile.ranks={list(p.ranks)}: ranks {bad} are not in this run of {world} process(es) "
                         f"(0..{world - 1})")
    traced = {name: steps for name, steps in stages.items() if not p.stages or name in p.stages}
    if all(first > steps for steps in traced.values()):
        raise ValueError(f"profile.start_step={first} is past the last step of every stage it traces "
                         f"({traced}); pick a step within them")
    if p.memory_snapshot and device_type != "cuda":
        raise ValueError(f"profile.memory_snapshot=true records CUDA's caching allocator, and this run is on "
                         f"{device_type}; set profile.memory_snapshot=false (the Chrome trace is still written)")


class StepProfiler:
    """One stage's traced steps on this rank: `step(n)` wraps optimizer step n; `close()` ends a window cut short."""

    def __init__(self, p: ProfileConfig, stage: str, stage_dir: str, rank: int, device: torch.device, log):
        span = window(p)
        on = span is not None and (not p.stages or stage in p.stages) and (p.ranks is None or rank in p.ranks)
        self.first, self.last = span if on else (0, -1)
        self.p, self.out, self.rank, self.cuda, self.log = p, os.path.join(stage_dir, "profile"), rank, \
            device.type == "cuda", log
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
        with torch.profiler.record_function(f"step {n}"):
            yield
        self.done = n
        if n == self.last:
            self.close()

    def _start(self, n: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.p.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=self.p.record_shapes,
                                           with_stack=self.p.with_stack)
        self.prof.start()
        self.started = n

    def close(self) -> None:
        """Stops the trace (if one runs) and writes it, named by the steps it covered."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        os.makedirs(self.out, exist_ok=True)
        stem = os.path.join(self.out, f"rank{self.rank}-steps{self.started}-{self.entered}")
        prof.export_chrome_trace(stem + ".json.gz")
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        ops = sorted((e for e in prof.key_averages() if not e.key.startswith("step ")), key=lambda e: getattr(e, key),
                     reverse=True)  # ops and the model's own ranges, not the step ranges around them
        with open(stem + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        self._stop_memory(stem + "-memory.pickle")
        top = ", ".join(f"{e.key} {getattr(e, key) / 1000:.1f} ms" for e in ops[:5])
        cut = f" (step {self.entered} cut short)" if self.done != self.entered else ""
        self.log(f"profile: steps {self.started}-{self.entered}{cut} of rank {self.rank} traced to {stem}.json.gz; "
                 f"longest ops by own {'GPU' if self.cuda else 'CPU'} time: {top}")

    def _stop_memory(self, path: str) -> None:
        if self.cuda and self.p.memory_snapshot:
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)

