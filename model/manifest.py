"""A checkpoint directory's manifest: every file's size and SHA-256 (with the writer's layout), written last and
checked before the directory is used. A step checkpoint, a stage's final and a shipped model all carry one
(recipes/checkpoint/format.py writes them); evaluation and training check one wherever it is present.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Optional

from longstride.whole_dir import fsync_path

MANIFEST = "manifest.json"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def listed_files(directory: str) -> dict[str, int]:
    """Every file of `directory` but its manifest, with its size."""
    return {n: os.path.getsize(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
            if n != MANIFEST and os.path.isfile(os.path.join(directory, n))}


def write_manifest(directory: str, world_size: int, extra: Optional[dict] = None,
                   digests: Optional[dict[str, tuple[int, str]]] = None) -> None:
    """Lists every file of a written checkpoint (size, SHA-256) with the run's layout (`extra`: dp, cp,
    config fingerprint), then fsyncs it and the directory. `digests` (name: (bytes, sha256)): every file's, computed
    already (the ranks of a run share the hashing: recipes/checkpoint/format.shared_digests); else hashed here."""
    files = {}
    for name, size in listed_files(directory).items():
        path = os.path.join(directory, name)
        fsync_path(path)
        if digests is not None and name not in digests:
            raise OSError(f"{path} appeared after its checkpoint's checksums were taken")
        size, digest = digests[name] if digests is not None else (size, sha256(path))
        files[name] = {"bytes": size, "sha256": digest}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"world_size": world_size, **(extra or {}), "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)


def hashed_by(sizes: dict[str, int], share: tuple[int, int]) -> set[str]:
    """The names of `sizes` (name: bytes) whose checksums share k of n computes, for `share` (k, n): the largest
    file first, each to the share with the fewest bytes so far; the same split for every share."""
    k, n = share
    load, mine = [0] * n, set()
    for name, size in sorted(sizes.items(), key=lambda f: (-f[1], f[0])):
        least = min(range(n), key=lambda i: load[i])
        load[least] += size
        if least == k:
            mine.add(name)
    return mine


def check_files(directory: str, required: Callable[[int], tuple] = lambda world: (),
                hashes: bool = True, only: Callable[[str], bool] = lambda name: True,
                share: tuple[int, int] = (0, 1), all_sizes: bool = True) -> Optional[str]:
    """None if `directory` matches its manifest, else why not, naming the file. `required(world_size)`: names the
    manifest must list (what the directory's reader needs); `hashes`: False compares sizes only; `only`: the files
    checked (every one listed by default); `share` (k, n): of the checksums, only share k of n (hashed_by: the
    processes of a run split the reading); `all_sizes`: False checks the sizes of share k's files alone (one process
    of a run checks every size, not each of them: on a shared filesystem processes x files metadata requests). A
    file that cannot be read counts as damage, as a wrong size or checksum does; a manifest that cannot be parsed is
    damage too: this never raises."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        files = {name: (int(want["bytes"]), str(want["sha256"])) for name, want in manifest["files"].items()}
        world = int(manifest.get("world_size", 1))
    except FileNotFoundError:
        return f"no {MANIFEST} (the write did not finish)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    unlisted = [n for n in required(world) if n not in files]
    if unlisted:
        return f"{MANIFEST} does not list {', '.join(unlisted)}, which this checkpoint has"
    mine = hashed_by({n: size for n, (size, _) in files.items()}, share)
    hashing = mine if hashes else set()
    for name, (size, digest) in files.items():
        if not only(name) or not (all_sizes or name in mine):
            continue
        path = os.path.join(directory, name)
        try:
            if not os.path.isfile(path):
                return f"{name} is missing"
            if os.path.getsize(path) != size:
                return f"{name} has {os.path.getsize(path)} bytes, the manifest says {size}"
            if name in hashing and sha256(path) != digest:
                return f"{name} does not match its checksum"
        except OSError as e:
            return f"{name} cannot be read ({e})"
    return None


def check_manifest(path: str, field_name: str) -> None:
    """A model directory given as `field_name`: when it carries a manifest (longstride wrote it), every file must
    match it; a corrupt or tampered copy fails here, naming the file, before it is loaded. In a launched run every
    process validates its config: the first on each node (LOCAL_RANK 0, which reads that node's copy) reads every
    byte, the others compare sizes."""
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return
    problem = check_files(path, hashes=os.environ.get("LOCAL_RANK", "0") == "0")
    if problem:
        raise ValueError(f"{field_name}={path!r} does not match its {MANIFEST}: {problem}; copy the checkpoint again "
                         "(or, for a directory you changed on purpose, remove its manifest.json)")
