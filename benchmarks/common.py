"""Shared by the benchmarks: where results go, the table printer, a child process's environment."""
from __future__ import annotations

import json
import os
import platform
import re
import time

import torch

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
