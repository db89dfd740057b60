"""Shared by the benchmarks: where results go, the table printer, a child process's environment."""
from __future__ import annotations

import json
import os
import platform
import re
import time

import torch
import torch.utils.checkpoint

RESULTS = os.path.join(os.path.dirname(__file__), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
    """The environment for a benchmark's child process: offline, unbuffered, the checkout importable."""
    return dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra,
                PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), REPO) if x))


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d")}


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), **(extra or {}), "rows": rows}, f, indent=2)
    return path


def write_json(path: str, data: dict) -> None:
    """`data` as indented JSON at `path` (a benchmark's --out), its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def print_table(rows: list[dict], columns: list[str]) -> None:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def proc_status_bytes(key: str) -> int:
    """VmRSS, VmHWM, ... of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def deadline_left(default: float) -> float:
    """Seconds to LONGSTRIDE_DEADLINE (the epoch second the device window cuts this step at:
    device_window.run_step), else `default`."""
    at = os.environ.get("LONGSTRIDE_DEADLINE")
    return float(at) - time.time() if at else default


class KeptOutputs:
    """A selective-checkpointing policy that decides as `policy` does and hands on_kept(op, tensors) the output
    tensors of each op it keeps (PREFER_SAVE or MUST_SAVE): what selective's cache holds, for
    bench_checkpointing.py and the tests that measure it. torch >= 2.13 asks a policy after the op, with its output
    (ctx.op_output); torch 2.11 and 2.12 (the GPU machine has 2.11) ask before the op runs, so there the output is
    taken as the op returns, from torch's caching dispatch mode (torch.utils.checkpoint._CachingTorchDispatchMode,
    private), wrapped once per process when the first KeptOutputs is made."""

    def __init__(self, policy, on_kept):
        self.policy, self.on_kept = policy, on_kept
        if not _POLICY_SEES_OUTPUT:
            _wrap_caching_mode()

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        decision = self.policy(ctx, op, *args, **kwargs)
        # torch 2.11 asks the policy again when backward recomputes, where the kept outputs are read, not made
        if decision in (CheckpointPolicy.PREFER_SAVE, CheckpointPolicy.MUST_SAVE) and not ctx.is_recompute:
            if _POLICY_SEES_OUTPUT:
                self.on_kept(op, _tensors(ctx.op_output))
            else:
                _PENDING.append((self, op))
        return decision


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


_POLICY_SEES_OUTPUT = "op_output" in torch.utils.checkpoint.SelectiveCheckpointContext.__init__.__code__.co_varnames
_PENDING: list = []  # (KeptOutputs, op) between a policy's decision and the op's return (torch < 2.13)


def _wrap_caching_mode() -> None:
    mode = torch.utils.checkpoint._CachingTorchDispatchMode
    if getattr(mode.__torch_dispatch__, "hands_kept_outputs", False):
        return
    original = mode.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        _PENDING.clear()
        try:
            out = original(self, func, types, args, kwargs)  # the policy, then the op (dispatching no further here)
        finally:
            pending = list(_PENDING)
            _PENDING.clear()
        for owner, op in pending:
            if op is func:
                owner.on_kept(op, _tensors(out))
        return out

    dispatch.hands_kept_outputs = True
    mode.__torch_dispatch__ = dispatch
