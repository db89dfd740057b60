"""Checkpoint verification shared by a run's processes (recipes/checkpoint/format.verify, shared=True): each rank
hashes its share of the files, not rank 0 every byte while the others wait, and every rank reaches the same answer:
damage found by any rank's share, the same fallback checkpoint, the same refusal of a damaged final."""
from __future__ import annotations

import json
import os

import pytest


def _checkpoint(path, sizes: dict, world: int = 2) -> None:
    from longstride.recipes.checkpoint.format import write_manifest

    path.mkdir(parents=True)
    for name, size in sizes.items():
        (path / name).write_bytes(os.urandom(size))
    write_manifest(str(path), world_size=world)


def _damage_in_share(path, share: int, world: int = 2) -> str:
    """Flips a byte (the size kept) of the largest file that rank `share` of `world` hashes; its name."""
    from longstride.model.manifest import hashed_by

    files = {n: f["bytes"] for n, f in json.loads((path / "manifest.json").read_text())["files"].items()}
    name = max(hashed_by(files, (share, world)), key=lambda n: files[n])
    data = bytearray((path / name).read_bytes())
    data[0] ^= 0xFF
    (path / name).write_bytes(bytes(data))
    return name


def _verify_worker(rank: int, world: int, root: str) -> None:
    from longstride.model import manifest
    from longstride.recipes.checkpoint.format import latest_checkpoint, verified_final, verify

    hashed, whole = [], manifest.sha256

    def counted(path):
        hashed.append(os.path.relpath(path, root))
        return whole(path)

    manifest.sha256 = counted
    looked, real = set(), {f: getattr(os.path, f) for f in ("isfile", "getsize", "isdir")}

    def seen(f):  # the files of step_000002 this rank stat-s (a metadata request on a shared filesystem)
        def look(path):
            if os.path.dirname(os.path.relpath(path, root)) == os.path.join("s1", "step_000002"):
                looked.add(os.path.basename(path))
            return real[f](path)
        return look

    for f in real:
        setattr(os.path, f, seen(f))
    stage = os.path.join(root, "s1")
    said = {"latest": os.path.basename(latest_checkpoint(stage, shared=True)),
            "step_000004": verify(os.path.join(stage, "step_000004"), shared=True)}
    said["hashed"], said["looked"] = sorted(hashed), sorted(looked)
    try:
        verified_final(stage, shared=True)
    except ValueError as e:
        said["final"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(said, f)


@pytest.mark.timeout(120)
def test_the_ranks_share_the_hashing_and_agree_on_damage_only_one_of_them_read(tmp_path):
    from longstride.parallel.spawn import run_gloo

    step = {"trainer.pt": 3000, "stage.json": 100, "rank0.pt": 500, "rank1.pt": 500, "__0_0.distcp": 40000,
            "__1_0.distcp": 40000, ".metadata": 800}
    for name in ("step_000002", "step_000004"):
        _checkpoint(tmp_path / "s1" / name, step)
    _checkpoint(tmp_path / "s1" / "final", {"model.safetensors": 50000, "config.json": 400, "stage.json": 100})
    bad = _damage_in_share(tmp_path / "s1" / "step_000004", share=1)
    bad_final = _damage_in_share(tmp_path / "s1" / "final", share=1)
    run_gloo(_verify_worker, 2, str(tmp_path))
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for s in said:  # the damage only rank 1 read, found on both
        assert s["latest"] == "step_000002"
        assert s["step_000004"] == f"{bad} does not match its checksum"
        assert s["final"].startswith(f"CheckpointError: {tmp_path / 's1' / 'final'} is damaged ({bad_final} does not "
                                     "match its checksum)")
    assert not set(said[0]["hashed"]) & set(said[1]["hashed"]), "no file read by both ranks"
    intact = [p for s in said for p in s["hashed"] if p.startswith(os.path.join("s1", "step_000002"))]
    assert sorted(intact) == sorted(os.path.join("s1", "step_000002", n) for n in step), "each file hashed once"
    sizes = [sum(os.path.getsize(tmp_path / p) for p in s["hashed"] if p in intact) for s in said]
    assert min(sizes) > 0.4 * sum(sizes), sizes  # the bytes split about evenly
    # rank 0 stats every file (and lists the directory), rank 1 only those it hashes: not ranks x files requests
    assert said[0]["looked"] == sorted(step), said[0]["looked"]
    assert said[1]["looked"] == sorted(os.path.basename(p) for p in said[1]["hashed"] if p in intact), said[1]


def _problem_worker(rank: int, world: int, root: str) -> None:
    from longstride.recipes.checkpoint.format import verify

    said = {n: verify(os.path.join(root, n), shared=True) for n in sorted(os.listdir(root)) if n.startswith("step")}
    with open(os.path.join(root, f"problems{rank}.json"), "w") as f:
        json.dump(said, f)


@pytest.mark.timeout(120)
def test_a_size_or_file_only_one_rank_checks_is_every_ranks_answer(tmp_path):
    """Rank 0 lists the directory and checks every size; another rank the sizes of its own share: a truncated or
    missing file of rank 1's share, and a file the manifest does not list (rank 0's listing), fail on both ranks."""
    from longstride.model.manifest import hashed_by
    from longstride.parallel.spawn import run_gloo

    step = {"trainer.pt": 3000, "stage.json": 100, "rank0.pt": 500, "rank1.pt": 500, "__0_0.distcp": 40000,
            "__1_0.distcp": 40000, ".metadata": 800}
    theirs = sorted(hashed_by(step, (1, 2)))[0]
    for n in ("step_000002", "step_000004", "step_000006"):
        _checkpoint(tmp_path / n, step)
    (tmp_path / "step_000002" / theirs).write_bytes(b"short")
    (tmp_path / "step_000004" / theirs).unlink()
    (tmp_path / "step_000006" / "__2_0.distcp").write_bytes(b"stray")
    run_gloo(_problem_worker, 2, str(tmp_path))
    said = [json.loads((tmp_path / f"problems{r}.json").read_text()) for r in range(2)]
    assert said[0] == said[1], said
    assert said[0] == {"step_000002": f"{theirs} has 5 bytes, the manifest says {step[theirs]}",
                       "step_000004": f"{theirs} is missing",
                       "step_000006": "manifest.json does not list __2_0.distcp, which this checkpoint has"}, said


def test_the_hashing_split_gives_each_file_to_one_share_balancing_bytes():
    from longstride.model.manifest import hashed_by

    files = {f"f{i}": size for i, size in enumerate([9, 7, 5, 3, 1, 1])}
    assert hashed_by(files, (0, 1)) == set(files)
    shares = [hashed_by(files, (k, 3)) for k in range(3)]
    assert set().union(*shares) == set(files) and sum(map(len, shares)) == len(files)
    assert [sum(files[n] for n in s) for s in shares] == [9, 9, 8]


def _save_worker(rank: int, world: int, root: str, background: bool) -> None:
    from concurrent.futures import Future

    from longstride.recipes.checkpoint import format as fmt
    from longstride.recipes.checkpoint.background import BackgroundSave

    hashed, whole = [], fmt.sha256

    def counted(path):
        hashed.append(os.path.basename(path))
        return whole(path)

    fmt.sha256 = counted
    saves, shards = BackgroundSave() if background else None, Future()
    with fmt.writing_checkpoint(os.path.join(root, "s1", "step_000002"), rank=rank, is_main=rank == 0,
                                trainer_state={"step": 2} if rank == 0 else None, rank_state={"rank": rank},
                                meta={"step": 2}, world_size=world, background=saves) as tmp:
        with open(os.path.join(tmp, f"__{rank}_0.distcp"), "wb") as f:  # each rank's shard, as DCP writes them
            f.write(os.urandom(30000 + 1000 * rank))
        if saves is not None:  # the shards "written in the background": done by the time the save's thread looks
            shards.set_result(None)
            saves.track(shards, 0.0)
    if saves is not None:
        saves.wait()
    with open(os.path.join(root, f"save{rank}.json"), "w") as f:
        json.dump(hashed, f)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True])
def test_the_ranks_share_the_hashing_of_a_checkpoint_they_save(tmp_path, background):
    """A save's manifest, blocking or sealed behind the steps (train.async_save): each rank hashes its share of the
    files rank 0 lists (the main rank hashed all of them, the others waiting, or, in the background, in its thread
    alone); the checkpoint verifies, every file hashed once."""
    from longstride.model.manifest import MANIFEST, sha256
    from longstride.parallel.spawn import run_gloo
    from longstride.recipes.checkpoint.format import verify

    run_gloo(_save_worker, 2, str(tmp_path), background)
    ck = tmp_path / "s1" / "step_000002"
    assert verify(str(ck)) is None
    hashed = [json.loads((tmp_path / f"save{r}.json").read_text()) for r in range(2)]
    files = sorted(p.name for p in ck.iterdir() if p.name != MANIFEST)
    assert sorted(hashed[0] + hashed[1]) == files, hashed
    assert hashed[0] and hashed[1], "both ranks hashed"
    listed = json.loads((ck / MANIFEST).read_text())["files"]
    assert all(listed[n]["sha256"] == sha256(str(ck / n)) for n in files)
