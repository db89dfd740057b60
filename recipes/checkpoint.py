"""Checkpoints: an HF model dir (save_pretrained + tokenizer) plus the training state.

Layout of a stage dir (every rank computes the same paths):
  outputs/<recipe>/<stage>/step_000020/   model + tokenizer + trainer.pt + rank<r>.pt
  outputs/<recipe>/<stage>/final/         model + tokenizer + stage.json
A checkpoint is written under `.tmp-<name>` and renamed when every rank has written its part, so a
crash at any point never leaves a directory that looks complete. Only the last `keep_last` step
checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp-"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_checkpoints(stage_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(stage_dir):
        return []
    found = [(int(m.group(1)), os.path.join(stage_dir, n)) for n in os.listdir(stage_dir) if (m := STEP_RE.match(n))]
    return sorted(found)


def latest_checkpoint(stage_dir: str) -> Optional[str]:
    found = step_checkpoints(stage_dir)
    return found[-1][1] if found else None


def final_dir(stage_dir: str) -> str:
    return os.path.join(stage_dir, "final")


def remove_partial(stage_dir: str) -> None:
    """Leftovers of a crash mid-save (main rank only)."""
    if os.path.isdir(stage_dir):
        for n in os.listdir(stage_dir):
            if n.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(stage_dir, n), ignore_errors=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str,
    *,
    rank: int,
    is_main: bool,
    barrier: Callable[[], None],
    save_model: Callable[[str], None],
    trainer_state: Optional[dict],
    rank_state: Optional[dict],
    meta: dict,
    keep_last: int = 0,
) -> None:
    """Collective: every rank calls it. `save_model(dir)` runs on the main rank only."""
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, TMP_PREFIX + name)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    if rank_state is not None:
        torch.save(rank_state, os.path.join(tmp, f"rank{rank}.pt"))
    if is_main:
        save_model(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, os.path.join(tmp, "trainer.pt"))
        with open(os.path.join(tmp, "stage.json"), "w") as f:
            json.dump(meta, f, indent=2)
    barrier()
    if is_main:
        if os.path.exists(path):  # re-saving the same name: swap, then drop the old one
            old = os.path.join(parent, TMP_PREFIX + "old-" + name)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        if keep_last > 0:
            for _, old_path in step_checkpoints(parent)[:-keep_last]:
                shutil.rmtree(old_path, ignore_errors=True)
    barrier()


def load_training_state(path: str, rank: int, world: int) -> tuple[dict, dict]:
    """(trainer state, this rank's state) of a step checkpoint written by `world` ranks."""
    rank_file = os.path.join(path, f"rank{rank}.pt")
    if not os.path.isfile(rank_file):
        written = len([n for n in os.listdir(path) if n.startswith("rank")])
        raise ValueError(f"checkpoint {path} was written by {written} processes but this launch has {world}; "
                         f"relaunch with {written} processes to resume it")
    trainer = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    return trainer, torch.load(rank_file, weights_only=False)
