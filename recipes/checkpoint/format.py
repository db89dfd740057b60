"""Checkpoints: the training state as per-rank shards (a step checkpoint) or an HF model dir (a stage's
final), verified.

Layout of a stage dir (every rank computes the same paths):
  outputs/<recipe>/<stage>/step_000020/   __<r>_0.distcp per rank + .metadata (model and optimizer, DCP:
                                          parallel/shards.py) + trainer.pt + rank<r>.pt + config and tokenizer
                                          + stage.json + manifest.json
  outputs/<recipe>/<stage>/final/         model + tokenizer + stage.json + manifest.json (+ rank<r>.pt: each
                                          rank's stream positions, streamed, for the next stage to go on from)
A step checkpoint becomes an HF dir with `longstride export-hf` (recipes/checkpoint/export.py).
A checkpoint is written under `.tmp-<name>`: every rank writes and fsyncs its files, the ranks hash a share of
them each (shared_digests), then the main rank writes manifest.json last (each file's size and SHA-256, the world
size), fsyncs the directory and renames it into place, so a crash at any point never leaves a directory that looks
complete.
Old step checkpoints beyond `keep_last` are renamed aside before they are deleted. Resume walks the
step checkpoints from newest to oldest and takes the first that verifies against its manifest,
warning about each one it passes over.

train.async_save: the step checkpoint written behind the steps, recipes/checkpoint/background.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import time
from typing import Callable, Optional

import numpy as np
import torch

from longstride.model.manifest import (MANIFEST, check_files, fsync_path, hashed_by, listed_files, sha256,
                                      write_manifest)
from longstride.model.model_dir import STEP_METADATA
from longstride.parallel.collectives import from_main, gathered, raise_if_any, rank_world, together
from longstride.parallel.shards import UnsafeCheckpoint
from longstride.recipes.run.faults import test_kill

STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names it, the file and what to do."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_checkpoints(stage_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(stage_dir):
        return []
    found = [(int(m.group(1)), os.path.join(stage_dir, n)) for n in os.listdir(stage_dir) if (m := STEP_RE.match(n))]
    return sorted(found)


def verify(directory: str, shared: bool = False) -> Optional[str]:
    """None if the checkpoint matches its manifest, else why not (naming the file: model/manifest.py). A step
    checkpoint's manifest must also list what a resume reads: trainer.pt, stage.json, each rank's state, and every
    other file the directory holds (the shards and their .metadata, config.json: a file the manifest leaves out
    could be damaged unseen; a checkpoint from before shards lacks .metadata, and its load says what to do).
    `shared`: a collective, the checksums split between the ranks (each reads its share of the bytes, not rank 0
    all of them while the others wait; rank 0 lists the directory and checks every size, another rank its share's),
    the first problem in rank order the answer on every rank."""
    step = STEP_RE.match(os.path.basename(os.path.normpath(directory)))
    share = rank_world() if shared else (0, 1)
    present = _files(directory) if step and share[0] == 0 else ()

    def required(world: int) -> tuple:
        return ("trainer.pt", "stage.json", *(f"rank{r}.pt" for r in range(world)), *present) if step else ()

    problem = check_files(directory, required, share=share, all_sizes=share[0] == 0)
    return next((p for p in gathered(problem) if p), None) if shared else problem


def _files(directory: str) -> tuple[str, ...]:
    """The files `directory` holds but its manifest (none when it cannot be listed)."""
    try:
        return tuple(listed_files(directory))
    except OSError:
        return ()


def manifest_world(directory: str) -> int:
    with open(os.path.join(directory, MANIFEST)) as f:
        return json.load(f)["world_size"]


DAMAGED: set[str] = set()  # step checkpoints this process found damaged: kept for inspection, not counted by keep_last


def latest_checkpoint(stage_dir: str, warn: Callable[[str], None] = lambda msg: None,
                      shared: bool = False) -> Optional[str]:
    """The newest step checkpoint that verifies; each damaged newer one is reported through `warn` (and noted in
    DAMAGED). Raises CheckpointError (listing each rejected directory and why) when there are some but none
    verifies. `shared`: a collective (verify's), the checkpoints those rank 0 lists."""
    rejected = []
    for _, path in reversed(from_main(lambda: step_checkpoints(stage_dir)) if shared else step_checkpoints(stage_dir)):
        problem = verify(path, shared)
        if problem is None:
            return path
        DAMAGED.add(os.path.normpath(path))
        rejected.append(f"{path}: {problem}")
        warn(f"checkpoint {path} is damaged ({problem}); falling back to an older one")
    if rejected:
        raise CheckpointError("no intact checkpoint to resume from: " + "; ".join(rejected) + ". Move them aside to "
                         "start the stage again, or restore them")
    return None


def verified_final(stage_dir: str, shared: bool = False) -> Optional[str]:
    """The stage's final checkpoint if it exists and verifies; a damaged one raises CheckpointError naming
    the file (it is never loaded or deleted). `shared`: a collective (verify's), whether it exists as rank 0 sees."""
    final = final_dir(stage_dir)
    if not (from_main(lambda: os.path.isdir(final)) if shared else os.path.isdir(final)):
        return None
    problem = verify(final, shared)
    if problem:
        raise damaged_final(final, problem)
    return final


def damaged_final(final: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{final} is damaged ({problem}); move it aside (e.g. to {final}.damaged) to train the "
                           "stage again from its newest intact step checkpoint")


def final_dir(stage_dir: str) -> str:
    return os.path.join(stage_dir, "final")


def remove_partial(stage_dir: str) -> None:
    """Leftovers of a crash mid-save (main rank only)."""
    if os.path.isdir(stage_dir):
        for n in os.listdir(stage_dir):
            if n.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(stage_dir, n), ignore_errors=True)


def rng_state() -> dict:
    """Every generator's state as tensors and plain data (numpy's key array as a tensor), so a checkpoint
    loads with torch.load(weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available():  # this process's GPU only: a resume may see fewer GPUs than the save did
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # saved before: every visible GPU's state; this process's GPU's, if any
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


@contextlib.contextmanager
def disk_errors(path: str):
    """A failed write (a full disk, a lost mount) as a CheckpointError naming the checkpoint."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        raise CheckpointError(f"could not write checkpoint {path} ({e}); the earlier checkpoints are intact: free "
                              "space there and rerun to resume") from e


def failed_on_another_rank(path: str) -> CheckpointError:
    """What the ranks that wrote their part of checkpoint `path` raise when another rank's part failed."""
    return CheckpointError(f"could not write checkpoint {path} on another rank (its log says why); the earlier "
                           "checkpoints are intact: rerun to resume from the newest")


def sealing_failed(path: str) -> CheckpointError:
    """What the other ranks raise when the main rank's seal of checkpoint `path` (manifest, rename, pruning)
    failed: its own error says whether the checkpoint was complete."""
    return CheckpointError(f"the main rank failed to seal checkpoint {path} (its log says why and whether the "
                           "checkpoint is complete); rerun to resume from the newest intact checkpoint")


@contextlib.contextmanager
def writing_checkpoint(
    path: str,
    *,
    rank: int,
    is_main: bool,
    trainer_state: Optional[dict],
    rank_state: Optional[dict],
    meta: dict,
    world_size: int = 1,
    manifest: Optional[dict] = None,
    keep_last: int = 0,
    background=None,  # a BackgroundSave (recipes/checkpoint/background.py)
):
    """Collective: every rank enters it. Yields the directory being written: every rank writes its parts there (its
    shard of the model and optimizer, or its part in gathering the weights; the main rank the model's config and
    tokenizer); then this writes each rank's state, the trainer state and stage.json, the manifest last, and puts
    the directory in place. A failed write (a full disk) raises CheckpointError, on every rank (the rank's own, the
    others' naming another rank; parallel/collectives.raise_if_any); earlier checkpoints are untouched.
    The writes flow one way: the caller writes its files, the format seals them. With `background` (whose shards
    the caller started writing in the block: BackgroundSave.track), the sealing waits for them in a thread of
    its own and this returns at once; `background.wait()` raises what failed."""
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, TMP_PREFIX + name)
    elsewhere, error, rank_bytes = lambda: failed_on_another_rank(path), None, None
    try:  # before any rank starts the caller's writes, whose collectives a rank that failed here would not join
        rank_bytes = None if rank_state is None else loadable_bytes(rank_state, f"rank{rank}.pt")
        if is_main:
            with disk_errors(path):
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
    except Exception as e:
        error = e
    raise_if_any(error, elsewhere)
    try:
        with disk_errors(path), _abandoned_on_error(background):
            yield tmp
            if rank_bytes is not None:
                with open(os.path.join(tmp, f"rank{rank}.pt"), "wb") as f:  # fsynced by its writer: on several
                    f.write(rank_bytes)  # nodes, rank 0's fsync does not reach this node's cache
                    f.flush()
                    os.fsync(f.fileno())
            if is_main:
                if trainer_state is not None:
                    torch.save(trainer_state, os.path.join(tmp, "trainer.pt"))
                with open(os.path.join(tmp, "stage.json"), "w") as f:
                    json.dump(meta, f, indent=2)
    except Exception as e:  # this rank's part failed: every rank learns it at the agreement below
        error = e
    with _abandoned_on_error(background if error is None else None):  # another rank's failure: drop this one's too
        raise_if_any(error, elsewhere)  # every rank's own files are written: left, the shards and the seal
    if background is not None:  # behind the steps: each rank's thread hashes its share, the main rank's seals
        background.finish(path, lambda group: shared_digests(tmp, path, group),
                          (lambda digests: _seal(tmp, path, world_size, manifest, keep_last, digests))
                          if is_main else None)
        return
    save_test_kills(name)
    digests = shared_digests(tmp, path)
    try:
        if is_main:
            _seal(tmp, path, world_size, manifest, keep_last, digests)
    except Exception as e:
        error = e
    raise_if_any(error, lambda: sealing_failed(path))


def shared_digests(tmp: str, path: str, group=None) -> dict[str, tuple[int, str]]:
    """Collective (over `group`, the default group when None), once every rank's files of checkpoint `path` are in
    `tmp`: each file's (bytes, sha256) for its manifest, every rank hashing its share (hashed_by) of the files rank 0
    lists, instead of the main rank all of them while the others wait. A failure on any rank is raised on every rank
    (a disk's as CheckpointError)."""
    def listing() -> dict[str, int]:
        with disk_errors(path):
            return listed_files(tmp)

    sizes = from_main(listing, group)

    def share() -> dict[str, str]:
        with disk_errors(path):
            return {n: sha256(os.path.join(tmp, n)) for n in hashed_by(sizes, rank_world(group))}

    mine = together(share, lambda: failed_on_another_rank(path), group=group)
    return {n: (sizes[n], digest) for part in gathered(mine, group) for n, digest in part.items()}


@contextlib.contextmanager
def _abandoned_on_error(background):
    try:
        yield
    except BaseException:
        if background is not None:
            background.abandon()
        raise


def save_test_kills(name: str) -> None:
    test_kill("save", name)  # a crash after the files, before the manifest
    test_kill("term_in_save", name, sig=signal.SIGTERM)  # a preemption notice while saving


def _seal(tmp: str, path: str, world_size: int, manifest: Optional[dict], keep_last: int, digests: dict) -> None:
    """The main rank's last part of a save, once every rank's files are in `tmp`: the manifest (of `digests`, the
    ranks' shared_digests), then `tmp` renamed to `path`, then train.keep_last's pruning."""
    parent, name = os.path.split(path)
    with disk_errors(path):
        write_manifest(tmp, world_size, manifest, digests)  # last: its presence means every file is complete
    if os.path.exists(path):  # re-saving the same name: swap, then drop the old one
        old = os.path.join(parent, TMP_PREFIX + "old-" + name)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    DAMAGED.discard(os.path.normpath(path))  # written again: intact, counted by keep_last
    try:
        fsync_path(parent)
        if keep_last > 0:
            _drop_older(parent, name, keep_last)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} is written and complete, but then making its rename durable or "
                              f"removing older checkpoints (train.keep_last) failed ({e}): check the disk and that "
                              "path, and rerun; the run resumes from the newest intact checkpoint") from e


def _drop_older(stage_dir: str, written: str, keep_last: int) -> None:
    """train.keep_last: the step checkpoints older than the one just `written` beyond the newest keep_last - 1 of
    them. Never the one written, nor a newer one, nor one the resume found damaged (DAMAGED: kept for inspection
    until the run writes its step again): counting them, a save could delete every intact checkpoint. Each is
    renamed aside first: a kill mid-delete leaves no half directory under a step name."""
    m = STEP_RE.match(written)
    if not m:
        return
    older = [p for s, p in step_checkpoints(stage_dir) if s < int(m.group(1)) and os.path.normpath(p) not in DAMAGED]
    for old_path in older[:max(0, len(older) - (keep_last - 1))]:
        doomed = os.path.join(stage_dir, TMP_PREFIX + "old-" + os.path.basename(old_path))
        os.replace(old_path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def load_training_state(path: str, rank: int) -> tuple[dict, dict]:
    """(trainer state, this rank's state) of a verified step checkpoint (the model and optimizer shards are
    read by parallel/shards.py, re-sharded to any layout). Written by fewer processes, a rank the old run did not
    have takes rank 0's state (the loader re-splits its position; a streamed one reads every rank's,
    load_rank_state)."""
    trainer = load_state_file(os.path.join(path, "trainer.pt"))
    return trainer, load_rank_state(path, rank if rank < manifest_world(path) else 0)


def load_rank_state(path: str, rank: int) -> dict:
    """What rank `rank` of the run that wrote the step checkpoint `path` saved of its own (data position, RNG)."""
    return load_state_file(os.path.join(path, f"rank{rank}.pt"))


def loadable_bytes(state, name: str) -> bytes:
    """`state` serialised once, as the file `name` will hold it, after checking that a resume can load those
    bytes with weights_only=True (a data loader or packer keeping numpy arrays or objects is refused here, at
    the save, not at the resume)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{name} would hold {_refused(e)}, not tensors and plain data, so no resume could "
                              "load it: a bug in whatever state_dict made it (store arrays as tensors)") from None
    return buf.getvalue()


def _refused(e: pickle.UnpicklingError) -> str:
    """The type a weights_only load refused, from torch's message."""
    found = re.search(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)", str(e))
    return f"a {found.group(1)!r} object" if found else "an object"


def load_state_file(path: str):
    """torch.load with weights_only=True: tensors and plain data only, so a checkpoint from a shared
    filesystem or a colleague cannot run code when it is read (a manifest cannot vouch for that: whoever
    writes the directory writes the manifest). A file holding anything else is refused, naming the type."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        what = _refused(e)
        old = " (a checkpoint from before 2026-11-25 keeps numpy's RNG state as an array: resume it with the " \
              "longstride that wrote it)" if "numpy" in what else ""
        raise CheckpointError(f"checkpoint file {path} holds {what}, not tensors and plain data; it was not loaded "
                              f"(loading it could run code){old}. Resume from a checkpoint longstride wrote, or start "
                              "the stage over") from None


def load_shards_checked(path: str, model, optimizer) -> None:
    """Collective: `model` (Parallelized) and `optimizer` filled from the shards of step checkpoint `path`; a
    shard file holding anything but DCP's records and tensors is refused (CheckpointError naming it), and so
    is a checkpoint whose shards do not fit this run's model, or one in the format before shards."""
    if not os.path.isfile(os.path.join(path, STEP_METADATA)):
        raise CheckpointError(f"checkpoint {path} has no {STEP_METADATA}: it was written by a longstride from before "
                              "sharded checkpoints (whole weights in model.safetensors, the optimizer in trainer.pt). "
                              "Resume it with the longstride that wrote it, or start the stage over from its weights "
                              f"(model=checkpoint model.checkpoint={path} data.tokenizer={path})")
    try:
        model.load_state(path, optimizer)
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"{e}. Resume from a checkpoint longstride wrote, or start the stage over") from None
    except OSError as e:
        raise CheckpointError(f"could not load the shards of {path} into this run's model ({e}); was it written for "
                              "another model shape? Resume from a checkpoint of this configuration") from None


def resume_from_stage(path: str, recipe_dir: str, stages: list[str]) -> str:
    """The stage of `path` (a step checkpoint or a final of this run, intact), for train.resume_from."""
    path = os.path.normpath(path)
    stage_dir, name = os.path.split(path)
    stage = os.path.basename(stage_dir)
    inside = os.path.isdir(path) and os.path.samefile(os.path.dirname(stage_dir), recipe_dir)
    if not (inside and stage in stages and (STEP_RE.match(name) or name == "final")):
        raise ValueError(f"train.resume_from={path!r} is not a step_NNNNNN or final checkpoint of a stage under "
                         f"{recipe_dir} (stages {stages})")
    problem = verify(path)
    if problem:
        raise ValueError(f"train.resume_from={path!r} is damaged ({problem}); pick an intact checkpoint")
    return stage


def supersede_after(path: str, recipe_dir: str, stages: list[str]) -> list[str]:
    """Moves aside (never deletes) what a run resumed from `path` would otherwise pick up instead: the
    stage's newer step checkpoints, its final (not `path` itself) and its wandb run id (the steps trained again
    under the new config go to a new wandb run, not over the old curves), and every later stage's directory.
    Returns the new names."""
    path = os.path.normpath(path)
    stage_dir, name = os.path.split(path)
    stage = os.path.basename(stage_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doomed = []
    if name != "final":
        step = int(STEP_RE.match(name).group(1))
        doomed += [p for s, p in step_checkpoints(stage_dir) if s > step]
        doomed += [final_dir(stage_dir)] if os.path.isdir(final_dir(stage_dir)) else []
        wandb_id = os.path.join(stage_dir, "wandb_run_id")  # recipes/run/tracking.wandb_run_id
        doomed += [wandb_id] if os.path.isfile(wandb_id) else []
    later = stages[stages.index(stage) + 1:]
    doomed += [d for d in (os.path.join(recipe_dir, s) for s in later) if os.path.isdir(d)]
    moved = []
    for d in doomed:
        os.replace(d, f"{d}.superseded-{stamp}")
        moved.append(f"{d}.superseded-{stamp}")
    return moved
