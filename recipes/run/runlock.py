"""One run per output directory: an exclusive lock on <output_root>/.<recipe>.lock for a run's life,
and the run's identity (the config that decides what it computes) in <output_root>/<recipe>/run.json.

`fcntl.flock` locks belong to the open file, so the kernel drops the lock when the process dies,
however it dies: a SIGKILLed run leaves nothing to clean up and the next one starts. The file holds
who took the lock (pid, host, start time, command) for the message a second run prints. The lock file sits beside
the run directory, not in it: train.resume=false renames the directory aside while the lock is held, and a lock file
inside it would move too, letting a second run lock a new one in the gap.
"""
from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import socket
import sys
import time
from typing import Callable, Optional

from longstride.model.manifest import fsync_path


def lock_path(directory: str) -> str:
    """The lock file beside the run directory, found through any symlink (two names of one directory: one lock)."""
    parent, name = os.path.split(os.path.realpath(directory))
    return os.path.join(parent, f".{name}.lock")


class RunLock:
    def __init__(self, directory: str):
        self.directory, self.path = directory, lock_path(directory)
        self.fd: Optional[int] = None
        self.info = ""  # what the lock file holds while this run has it

    def acquire(self) -> "RunLock":
        """Takes the lock or raises ValueError naming the run that holds it."""
        os.makedirs(self.directory, exist_ok=True)  # and its parent, where the lock file is
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"{self.directory} is in use by another run ({holder}); wait for it to end or stop it, "
                             "or write this run elsewhere (paths.output_root=... or recipe.name=...)") from None
        except OSError as e:  # a filesystem without file locks (Lustre mounted without flock, some NFS setups)
            os.close(fd)
            raise ValueError(f"cannot lock {self.path} ({e.strerror}): its filesystem takes no file locks, which keep "
                             "a second run off this directory; put paths.output_root on one that does (a Lustre "
                             "mount with -o flock, NFS with its lock service)") from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)}
        self.info = json.dumps(info)
        os.write(fd, self.info.encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# Keys that change how a run is watched, where and how often it writes, not what it computes (fnmatch patterns;
# a key matches its own pattern and everything under it). A resumed run may checkpoint at another interval: the
# loader and the schedule resume from the step, whichever steps were saved.
NOT_IDENTITY = ("logger", "paths", "stage", "profile", "train.keep_last", "train.async_save", "train.compile",
                "optim.implementation", "train.max_nonfinite_steps", "train.trace_memory", "train.resume",
                "train.resume_from", "train.resume_data", "train.collective_timeout_s", "data.num_workers",
                "data.num_proc", "recipe.stages.*.save_every")


def check_shared(directory: str, lock: Optional[RunLock], wait_s: float = 30.0) -> None:
    """Collective in a multi-process run (`lock`: rank 0's, None on the others): every rank must see the run
    directory rank 0 locked, since each writes its checkpoint shards into it and reads rank 0's choices from it.
    On several nodes that means a filesystem they share; a node-local path fails here, naming the ranks and hosts
    that do not see it, before any data or model is built. A rank looks again for up to `wait_s` seconds first: a
    network filesystem may show another node's new directory only once its cached lookups expire."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    held = [lock.info if lock else None]
    dist.broadcast_object_list(held, src=0)
    deadline = time.monotonic() + wait_s
    while not (seen := _holds(directory, held[0])) and time.monotonic() < deadline:
        time.sleep(1.0)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise ValueError(f"paths.output_root: {directory}, which rank 0 ({views[0][1]}) holds, is not the same "
                         f"directory for {', '.join(blind[:8])}{' ...' if len(blind) > 8 else ''}: every rank writes "
                         "its checkpoint shards there, so every node must share it; point paths.output_root at a "
                         "filesystem all nodes mount")


def _holds(directory: str, info: str) -> bool:
    """Whether `directory`'s lock file holds `info` (listing the parent first: on NFS that refreshes the cached
    lookup of a directory another node just made)."""
    try:
        os.listdir(os.path.dirname(os.path.abspath(directory)))
        with open(lock_path(directory)) as f:
            return f.read() == info
    except OSError:
        return False


def flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def identity(resolved: dict) -> dict:
    """The resolved config's keys that decide what a run computes; a stage's unset schedule field as the value it
    means (so a run recorded when the field held its default resumes)."""
    from longstride.recipes.config.schema import STAGE_UNSET

    def effective(key: str, value):
        parts = key.split(".")
        unset = value is None and len(parts) == 4 and parts[:2] == ["recipe", "stages"]
        return STAGE_UNSET.get(parts[-1], value) if unset else value

    return {k: shipped_name(effective(k, v)) for k, v in flatten(resolved).items()
            if not any(fnmatch.fnmatchcase(k, n) or fnmatch.fnmatchcase(k, n + ".*") for n in NOT_IDENTITY)}


def shipped_name(value, recorded: bool = False):
    """A shipped model's folder as `${shipped:NAME}` (the checkout-independent name it is configured by): this
    checkout's absolute path of it, and in a recorded run.json also the relative model/shipped/NAME an older
    longstride recorded (whose runs started from the repository root); any other value unchanged. A run of the main
    job so resumes from another clone or after the configs' change."""
    from longstride.recipes.config.schema import SHIPPED

    if isinstance(value, str):
        for prefix in (SHIPPED + os.sep, *(("model/shipped/",) if recorded else ())):
            name = value[len(prefix):].rstrip("/") if value.startswith(prefix) else ""
            if name and "/" not in name:
                return "${shipped:" + name + "}"
    return value


def fingerprint(resolved: dict) -> str:
    """SHA-256 of the identity keys, recorded in every checkpoint's manifest."""
    return hashlib.sha256(json.dumps(identity(resolved), sort_keys=True, default=str).encode()).hexdigest()


def trained_nothing(directory: str) -> bool:
    """Whether a run directory holds no trace of training: no stage with a checkpoint (final, step_NNNNNN) or a
    logged step (metrics.jsonl), as a run leaves that failed on a bad setting after recording its config."""
    from longstride.recipes.checkpoint.format import STEP_RE

    for stage in os.scandir(directory):
        if not stage.is_dir():
            continue
        for entry in os.scandir(stage.path):
            if entry.name == "final" or STEP_RE.match(entry.name) or (
                    entry.name == "metrics.jsonl" and entry.stat().st_size > 0):
                return False
    return True


# Dicts whose keys the user names (a source, a stage, a mixture weight, a synthetic kind): an entry on one side only
# is a change of the config, not of the schema
USER_KEYED = ("data.sources.*", "data.sources.*.synthetic.kinds.*", "recipe.stages.*", "recipe.stages.*.mixture.*")


def _entry(key: str) -> Optional[str]:
    """The longest prefix of `key` that names an entry of a USER_KEYED dict, or None."""
    from longstride.recipes.config.schema import dotted_match

    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if any(dotted_match(".".join(parts[:n]), pattern) for pattern in USER_KEYED):
            return ".".join(parts[:n])
    return None


def differences(theirs: dict, mine: dict) -> list[str]:
    """What differs between a recorded identity and this run's, one line per key: a value both sides have and that
    differs; an entry of a USER_KEYED dict on one side only (a source or mixture weight added or removed); a group
    on one side where the other has one value (a stage's long_docs set where it was None; also a field another
    schema version turned into a group). Other keys on one side
    only come from another longstride version's schema (a field added or removed), which this run's code cannot read
    differently."""
    lines = {k: f"{k} (was {theirs[k]}, now {mine[k]})" for k in set(theirs) & set(mine) if theirs[k] != mine[k]}
    for side, other, what in ((theirs, mine, "removed"), (mine, theirs, "added")):
        for key in sorted(set(side) - set(other)):
            entry = _entry(key)
            if entry and not any(k == entry or k.startswith(entry + ".") for k in other):
                lines[entry] = f"{entry} ({what})"
                continue
            parts = key.split(".")
            value = next((p for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p in other), None)
            if value is not None:
                group = ", ".join(f"{k[len(value) + 1:]}={side[k]}" for k in sorted(side) if k.startswith(value + "."))
                lines[value] = (f"{value} (was {other[value]}, now {group})" if what == "added"
                                else f"{value} (was {group}, now {other[value]})")
    whole = [k for k, line in lines.items() if line.endswith(("(added)", "(removed)"))]
    return [lines[k] for k in sorted(lines) if not any(k.startswith(w + ".") for w in whole)]  # once per entry


def slurm_start() -> Optional[list]:
    """[SLURM job id, its restart count] of this process's job, None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return [job, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)] if job else None


def requeued(recorded: Optional[list]) -> bool:
    """Whether this process is a requeue of the SLURM job start `recorded` (slurm_start's): the same job, restarted
    since (a second command inside one allocation has the same restart count: not a requeue)."""
    now = slurm_start()
    return bool(now and isinstance(recorded, list) and recorded[0] == now[0] and now[1] > recorded[1])


def check_identity(directory: str, resolved: dict, resume: bool, resume_from: Optional[str] = None,
                   rewind: Callable[[], None] = lambda: None) -> bool:
    """Main process, under the lock, before anything is written. The first run of a directory records its
    config in run.json; a later run with another config is refused, naming each differing key, unless
    train.resume=false, which moves the old run aside (nothing is deleted) and starts afresh, or
    train.resume_from names the checkpoint to continue from under the new config (recorded as the run's), or the
    recorded run trained nothing (trained_nothing: it failed on a setting, and the fixed command takes its place).
    train.resume=false applies once per SLURM job: run.json records the job (and its restart count) that started
    afresh, and the same job requeued (its SLURM_JOB_ID, a higher SLURM_RESTART_COUNT, the same command) resumes that
    run instead of moving it aside again; another command inside the same allocation starts afresh as asked.
    A directory that holds training but no run.json (copied without it, or deleted) is moved aside by
    train.resume=false too (its checkpoints were resumed), and a resume is refused where a checkpoint's manifest
    records another config (unrecorded_checkpoint). Returns whether resume_from was applied now: `rewind` (moving
    aside what is newer than it) runs before run.json records it, so the same command run again (a requeued job)
    finds it recorded only once the rewind is done, and then resumes normally instead of going back to that
    checkpoint again."""
    path = os.path.join(directory, "run.json")
    mine = json.loads(json.dumps(identity(resolved), default=str))  # as it reads back from run.json
    if os.path.isfile(path):
        with open(path) as f:
            recorded = json.load(f)
        theirs = {k: shipped_name(v, recorded=True) for k, v in recorded["config"].items()}
        diff = differences(theirs, mine)
        if resume_from and not diff and recorded.get("resumed_from") == os.path.normpath(resume_from):
            return False
        if not resume and not diff and requeued(recorded.get("fresh_start_job")):
            print(f"longstride: train.resume=false was applied when SLURM job {os.environ['SLURM_JOB_ID']} first ran; "
                  "resuming the run it started (a requeued job reruns the same command)", file=sys.stderr)
            _write_json(path, {**recorded, "fresh_start_job": slurm_start()})  # a later command of this start: afresh
            return False
        if not resume:
            _move_aside(directory)
        elif diff:
            if resume_from:  # asked for: continue from that checkpoint under the new config
                print(f"longstride: continuing from {resume_from} with a changed config: {'; '.join(diff)}",
                      file=sys.stderr)
            elif trained_nothing(directory):  # a run that failed before its first step: the fixed command goes on
                print(f"longstride: {directory} holds a run that trained nothing (no step logged, no checkpoint); "
                      f"recording this config in its place: {'; '.join(diff)}", file=sys.stderr)
            else:
                raise ValueError(f"{directory} holds a run with another config: {'; '.join(diff)}. Rerun with its "
                                 "config to resume it, write this one elsewhere (paths.output_root=... or "
                                 "recipe.name=...), continue from one of its checkpoints under this config with "
                                 "train.resume_from=DIR, or set train.resume=false to move the old run aside and "
                                 "start afresh")
        elif not resume_from:
            return False
    elif os.path.isdir(directory) and not trained_nothing(directory):  # trained, but unrecorded (copied, or older)
        if not resume:
            _move_aside(directory)
        elif not resume_from and (other := unrecorded_checkpoint(directory, resolved)):
            raise ValueError(f"{directory} has no run.json, and its checkpoint {other} was written under another "
                             "config (its manifest's fingerprint differs, as it does after a longstride upgrade too; "
                             "run.json would name the keys): rerun with that config to resume it, continue from the "
                             f"checkpoint under this config with train.resume_from={other}, or set "
                             "train.resume=false to move it aside and start afresh")
    if resume_from:
        rewind()
    start = None if resume else slurm_start()
    fresh = {"fresh_start_job": start} if start else {}
    _write_json(path, {"config": mine, **({"resumed_from": os.path.normpath(resume_from)} if resume_from else {}),
                       **fresh})
    return bool(resume_from)


def _move_aside(directory: str) -> None:
    """train.resume=false: the previous run renamed aside (nothing is deleted), an empty directory in its place."""
    aside = f"{directory}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(directory, aside)
    os.makedirs(directory, exist_ok=True)  # a second run refused in between may have made it (empty)
    print(f"longstride: train.resume=false: the previous run is now {aside}", file=sys.stderr)


def unrecorded_checkpoint(directory: str, resolved: dict) -> Optional[str]:
    """The newest step checkpoint of a stage without a final (what a resume reads) whose manifest records another
    config's fingerprint than `resolved`'s, or None: what a run directory without run.json can still tell of the
    config it was trained under (a finished stage is not trained again, whatever its config)."""
    from longstride.recipes.checkpoint.format import step_checkpoints

    mine = fingerprint(resolved)
    for stage in sorted(e.path for e in os.scandir(directory) if e.is_dir()):
        steps = step_checkpoints(stage)
        if not steps or os.path.isdir(os.path.join(stage, "final")):
            continue
        try:
            with open(os.path.join(steps[-1][1], "manifest.json")) as f:
                recorded = json.load(f).get("config")
        except (OSError, ValueError, AttributeError):
            continue  # unwritten or damaged: the resume passes over it
        if recorded and recorded != mine:
            return steps[-1][1]
    return None


def _write_json(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # on disk before it replaces the old record, which a crash never leaves half-written
    os.replace(path + ".tmp", path)
    fsync_path(os.path.dirname(path))
