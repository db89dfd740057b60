"""Fault policy of the training loop: non-finite steps are skipped, never trained on or saved; stop
signals save a checkpoint first; workers die with their launcher.

Every rank sees the same all-reduced loss and global gradient norm, so every rank makes the same
decision and no collective is left waiting. A step whose loss or gradient norm is NaN or inf skips
the optimizer and LR-scheduler updates (the data is consumed and the step counted, as Megatron-LM
counts a skipped iteration); after `limit` such steps in a row the run stops with a message naming
the step and the newest checkpoint to go back to.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from typing import Optional

import torch

from longstride.bad_input import is_bad_input
from longstride.parallel.collectives import all_reduce


# Test hooks: the fault tests set one of these to a value and the process SIGKILLs itself at that point
TEST_KILLS = {"step": "LONGSTRIDE_TEST_CRASH_AT_STEP",  # after optimizer step N of every stage
              "save": "LONGSTRIDE_TEST_KILL_IN_SAVE",  # inside the save of the checkpoint of this name, after
              #                                          its files and before its manifest
              "term_in_save": "LONGSTRIDE_TEST_TERM_IN_SAVE"}  # there too, SIGTERM (a preemption notice)


def test_kill(point: str, value, before=None, sig: int = signal.SIGKILL) -> None:
    """The one place a test fault is injected: send this process `sig` (SIGKILL unless told; after calling
    `before`, if given) when the environment asks for `point` (a key of TEST_KILLS) at `value`. An environment
    lookup otherwise."""
    want = os.environ.get(TEST_KILLS[point])
    if want is not None and want == str(value):
        if before is not None:
            before()
        os.kill(os.getpid(), sig)


class NonFiniteError(RuntimeError):
    """The run stopped on bad numerical state; the message says where to resume from."""


class NonFiniteGuard:
    def __init__(self, limit: int):
        self.limit, self.in_row, self.skipped = limit, 0, 0

    def step_ok(self, step: int, loss: float, grad_norm: float, last_good: Optional[str]) -> bool:
        """True: apply this step's update. False: skip it. Raises after `limit` skips in a row."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_row = 0
            return True
        self.in_row += 1
        self.skipped += 1
        if self.in_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: loss {loss} and gradient norm {grad_norm}, non-finite for {self.in_row} steps in a row "
                f"(train.max_nonfinite_steps={self.limit}); nothing was trained on them or saved. Last good checkpoint: "
                f"{last_good or 'none (the stage starts from the initial model)'}; rerun with a lower lr (or a "
                f"stricter optim.grad_clip) and train.resume_from=" + (last_good or "... once one exists"))
        return False


def check_finite_parameters(params, where: str) -> None:
    """Raises NonFiniteError if any parameter (this rank's shard, for FSDP) is NaN or inf; all ranks
    must call it, and with several processes they agree through an all-reduce."""
    params = list(params)
    bad = torch.zeros((), device=params[0].device if params else "cpu")  # counted on the device, read once
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        bad += (~torch.isfinite(local.detach()).all()).to(bad.device)
    if all_reduce(bad).item():
        raise NonFiniteError(f"not saving {where}: the model has NaN or inf parameters; the previous checkpoints are "
                             "kept as they were")


class StageInputError(ValueError):
    """Input that only a stage's own data preparation can find wrong; the message names the stage."""


@contextlib.contextmanager
def stage_input(stage: str):
    try:
        yield
    except ValueError as e:
        if not is_bad_input(e):  # a fault in longstride's own code: raised as it is, with its traceback
            raise
        raise StageInputError(f"stage {stage}: {e}") from e


class Stopped(Exception):
    """The run was asked to stop (SIGTERM / SIGINT) and saved a checkpoint first."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """SIGTERM and SIGINT (a cluster's preemption notice, Ctrl-C) only set a flag; the training loop asks
    `requested()` after each step, which all-reduces the flag so every rank stops at the same step, saves
    a checkpoint and exits. Use as a context manager around the loop (the main thread's handlers are
    restored on exit)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum, self.previous = 0, {}

    def __enter__(self) -> "StopSignals":
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def requested(self, save_failed: bool = False) -> tuple[int, bool]:
        """(the signal number if any rank got one, else 0; whether any rank's background save failed: `save_failed`
        on any rank). A collective: every rank calls it each step (on the host: one process copies nothing to a
        GPU and waits for none)."""
        flags = all_reduce(torch.tensor([float(self.signum), float(save_failed)]),
                           torch.distributed.ReduceOp.MAX).tolist()
        return int(flags[0]), bool(flags[1])


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the launcher) dies, so a killed `accelerate launch`
    or torchrun leaves no worker training and writing on its own; the rerun resumes from the last checkpoint."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
