"""Checkpoint faults on the tiny model: damaged files fall back to an intact checkpoint, a kill inside
a write or a full disk leave nothing that looks complete, and a run resumes on another number of
processes. Each resume is compared with an uninterrupted run."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import crash_after, run_cli
from tests.test_faults import start


# --- damaged checkpoints: stage 2 of the micro recipe killed after step 5, with step checkpoints 2 and 4
S2 = ["recipe.stages.s2_2k.steps=6", "recipe.stages.s2_2k.save_every=2"]


@pytest.fixture(scope="module")
def killed_and_clean(tmp_path_factory, cache_dir):
    """(a run killed after s2's step 5, an uninterrupted run): both output roots."""
    from tests.conftest import micro_overrides

    root = tmp_path_factory.mktemp("faults")
    first = run_cli(micro_overrides(root / "killed", cache_dir) + S2 + ["stage=s1_256"])
    assert first.returncode == 0, first.stderr[-2000:]
    killed = run_cli(micro_overrides(root / "killed", cache_dir) + S2, crash_after(5))  # in s2
    assert killed.returncode == -9, killed.stderr[-2000:]
    s2 = root / "killed" / "tiny" / "s2_2k"
    assert sorted(p.name for p in s2.iterdir() if p.name.startswith("step_")) == ["step_000002", "step_000004"]
    clean = run_cli(micro_overrides(root / "clean", cache_dir) + S2)
    assert clean.returncode == 0, clean.stderr[-2000:]
    return root


def damage(ck, how: str) -> str:
    """Damages one file of checkpoint dir `ck` as a crash, a full disk or bit rot would; returns its name."""
    name = {"truncate": "__0_0.distcp", "empty": ".metadata", "final_weights": "model.safetensors",
            "garble": "trainer.pt", "delete_trainer": "trainer.pt", "delete_rank": "rank0.pt", "config": "config.json",
            "no_manifest": "manifest.json"}[how]
    path = ck / name
    if how in ("truncate", "final_weights"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garble":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif how == "config":
        path.write_text(path.read_text().replace('"hidden_size": 32', '"hidden_size": 48'))
    else:
        path.unlink()
    return name


DAMAGE = ["truncate", "empty", "garble", "delete_trainer", "delete_rank", "config", "no_manifest"]


@pytest.mark.parametrize("how", DAMAGE)
def test_every_kind_of_damage_is_found_naming_the_file_and_the_older_checkpoint_is_picked(killed_and_clean, tmp_path,
                                                                                         how):
    """What a resume checks before it loads anything (recipes/checkpoint/format.py), on the killed run's real
    checkpoints; the next test resumes through it end to end."""
    import shutil

    from longstride.recipes.checkpoint.format import latest_checkpoint

    s2 = tmp_path / "s2_2k"
    shutil.copytree(killed_and_clean / "killed" / "tiny" / "s2_2k", s2)
    assert latest_checkpoint(str(s2)) == str(s2 / "step_000004"), "intact before the damage"
    name = damage(s2 / "step_000004", how)
    warned = []
    assert latest_checkpoint(str(s2), warned.append) == str(s2 / "step_000002")
    assert len(warned) == 1 and f"checkpoint {s2 / 'step_000004'} is damaged" in warned[0] and name in warned[0]


# a shard's bytes, and a write that never finished: the two ways a resume meets a damaged checkpoint in practice
@pytest.mark.parametrize("how", ["truncate", "no_manifest"])
def test_resume_falls_back_past_a_damaged_checkpoint_and_matches_the_clean_run(killed_and_clean, cache_dir, tmp_path,
                                                                                how):
    import shutil

    from tests.conftest import micro_overrides, read_metrics

    root = tmp_path / "run"
    shutil.copytree(killed_and_clean / "killed", root)
    bad = root / "tiny" / "s2_2k" / "step_000004"
    name = damage(bad, how)
    r = run_cli(micro_overrides(root, cache_dir) + S2)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stderr + r.stdout
    assert f"checkpoint {bad} is damaged" in log and name in log and "resuming from" in log
    assert f"{root / 'tiny' / 's2_2k' / 'step_000002'} (step 2)" in log
    for stage in ("s2_2k", "s3_4k"):
        a, b = read_metrics(root / "tiny" / stage), read_metrics(killed_and_clean / "clean" / "tiny" / stage)
        assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)], stage  # bitwise
        raw = [json.loads(line)["step"] for line in (root / "tiny" / stage / "metrics.jsonl").open()]
        clean = [json.loads(line)["step"] for line in (killed_and_clean / "clean" / "tiny" / stage / "metrics.jsonl").open()]
        assert raw == clean, "the killed run's steps after the resumed checkpoint are gone, none twice"


def test_no_intact_checkpoint_exits_2_listing_each(killed_and_clean, cache_dir, tmp_path):
    import shutil

    from tests.conftest import micro_overrides

    root = tmp_path / "run"
    shutil.copytree(killed_and_clean / "killed", root)
    s2 = root / "tiny" / "s2_2k"
    damage(s2 / "step_000004", "truncate")
    damage(s2 / "step_000002", "delete_rank")
    r = run_cli(micro_overrides(root, cache_dir) + S2)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no intact checkpoint to resume from" in r.stderr and "Traceback" not in r.stderr
    assert f"{s2 / 'step_000004'}: __0_0.distcp has" in r.stderr
    assert f"{s2 / 'step_000002'}: rank0.pt is missing" in r.stderr
    assert (s2 / "step_000004").is_dir() and (s2 / "step_000002").is_dir(), "nothing deleted"


def test_a_resume_from_a_step_checkpoint_under_another_rope_base_is_refused(killed_and_clean, cache_dir, tmp_path):
    """train.resume_from continues a stage under a changed config, but not under another RoPE: the step checkpoint's
    config (its RoPE) is what the stage trains with, so a changed rope_theta would be logged as applied while the
    checkpoint's base goes on. Refused before any step, naming both; the unchanged base resumes."""
    import shutil

    from tests.conftest import micro_overrides

    root = tmp_path / "run"
    shutil.copytree(killed_and_clean / "killed", root)
    step4 = root / "tiny" / "s2_2k" / "step_000004"
    saved = json.loads((step4 / "config.json").read_text())["rope_parameters"]["rope_theta"]
    r = run_cli(micro_overrides(root, cache_dir) + S2 + [f"recipe.stages.s2_2k.rope_theta={saved * 3}",
                                                          f"train.resume_from={step4}", "recipe.stages.s2_2k.steps=5"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"stage s2_2k: the step checkpoint {step4} was trained with RoPE" in r.stderr, r.stderr[-3000:]
    assert f"'rope_theta': {saved * 3}" in r.stderr and "cannot change mid-stage" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (root / "tiny" / "s2_2k" / "step_000005").exists(), "nothing trained"
    r = run_cli(micro_overrides(root, cache_dir) + S2 + [f"train.resume_from={step4}", "recipe.stages.s2_2k.steps=5"])
    assert r.returncode == 0, r.stderr[-3000:]


def test_keep_last_never_deletes_the_checkpoint_it_wrote_nor_counts_a_newer_damaged_one(tmp_path):
    """Steps 20, 40, 60 written, 60 damaged: a resume falls back to 40, then saves 50 with train.keep_last=1 (a
    resumed run may lower it). Counting 60, the save deleted 40 and the 50 it had just written, leaving only the
    damaged 60 and no checkpoint to resume from; now 50 is kept (40 is dropped), and 60 stays for inspection. At 70
    with keep_last=2, 60 counted as one of the two kept deleted the intact 50; now 50 and 70 are kept."""
    from longstride.recipes.checkpoint.format import latest_checkpoint, step_name, verify, writing_checkpoint

    stage = tmp_path / "s2"

    def save(step: int, keep_last: int) -> None:
        with writing_checkpoint(str(stage / step_name(step)), rank=0, is_main=True,
                                trainer_state={"step": step}, rank_state={}, meta={}, keep_last=keep_last) as d:
            with open(os.path.join(d, "weights.bin"), "wb") as f:
                f.write(bytes([step]) * 64)

    for step in (20, 40, 60):
        save(step, keep_last=0)
    damage(stage / "step_000060", "garble")
    assert latest_checkpoint(str(stage)).endswith("step_000040")
    save(50, keep_last=1)
    assert sorted(p.name for p in stage.iterdir()) == ["step_000050", "step_000060"]
    assert latest_checkpoint(str(stage)).endswith("step_000050") and verify(str(stage / "step_000050")) is None
    save(70, keep_last=2)  # past the damaged one: it is older now, and the newest keep_last intact ones are kept
    assert sorted(p.name for p in stage.iterdir()) == ["step_000050", "step_000060", "step_000070"]
    save(60, keep_last=2)  # the run writes the damaged one's step again: it takes its place, and counts again
    assert verify(str(stage / "step_000060")) is None
    save(80, keep_last=2)
    assert sorted(p.name for p in stage.iterdir()) == ["step_000070", "step_000080"]


def test_a_manifest_that_lists_too_little_or_cannot_be_read_is_damage_naming_it(tmp_path, monkeypatch):
    """verify() never raises: a manifest entry without its size, a file it cannot read, and a step checkpoint whose
    manifest leaves out what a resume reads (trainer.pt, stage.json, a rank's state: the file removed with its entry)
    are each reported as damage naming the file, so a resume falls back past them."""
    from longstride.model import manifest as files
    from longstride.recipes.checkpoint.format import verify, write_manifest

    ck = tmp_path / "step_000004"
    ck.mkdir()
    for name in ("trainer.pt", "stage.json", "rank0.pt", "rank1.pt"):
        (ck / name).write_bytes(name.encode())
    write_manifest(str(ck), world_size=2)
    assert verify(str(ck)) is None
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["files"]["rank1.pt"]
    (ck / "rank1.pt").unlink()
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert verify(str(ck)) == "manifest.json does not list rank1.pt, which this checkpoint has"
    del manifest["files"]["stage.json"]["bytes"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert verify(str(ck)).startswith("manifest.json is unreadable (KeyError: 'bytes')")
    write_manifest(str(ck), world_size=1)

    def bad_sector(path):  # EIO from the disk (a permission test cannot fail here: the suite may run as root)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files, "sha256", bad_sector)
    assert verify(str(ck)) == "rank0.pt cannot be read ([Errno 5] Input/output error)"


def test_damaged_final_is_never_loaded(killed_and_clean, cache_dir, tmp_path):
    import shutil

    from tests.conftest import micro_overrides

    root = tmp_path / "run"
    shutil.copytree(killed_and_clean / "killed", root)
    final = root / "tiny" / "s1_256" / "final"
    damage(final, "final_weights")
    for extra in ([], ["stage=s2_2k"]):  # the stage itself, and the next stage that starts from it
        r = run_cli(micro_overrides(root, cache_dir) + S2 + extra)
        assert r.returncode == 2, r.stderr[-3000:]
        assert f"{final} is damaged (model.safetensors has" in r.stderr and "Traceback" not in r.stderr


# both directions, each with and without FSDP2 once (the four pairs took 86 s of CI time; the re-split and
# the DCP re-sharding are the same code for both directions)
@pytest.mark.parametrize("first, second, fsdp", [(1, 2, False), (2, 1, True)])
def test_resume_on_another_process_count_re_splits_the_data(tmp_path, cache_dir, s1_reference, first, second, fsdp):
    """Killed after step 4 on `first` processes, resumed from step 3 on `second`: the rest of the epoch
    is shared out from where the killed run stopped, so every step sees the sequences of an uninterrupted
    run and the losses agree up to reduction order. With fsdp, the 2-process side shards parameters and
    optimizer state (FSDP2), the 1-process side has none to shard."""
    from tests.conftest import micro_overrides, read_metrics

    def launch(root, n, env=None):
        args = micro_overrides(root, cache_dir) + ["stage=s1_256", "recipe.stages.s1_256.micro_batch_size=4",
                                                   f"parallel.fsdp={str(fsdp).lower()}"]
        if n == 1:
            return run_cli(args, env)
        proc = start(args, launcher=True, env_extra=env)
        out, _ = proc.communicate(timeout=600)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, out)

    import subprocess

    killed = launch(tmp_path / "x", first, crash_after(4))
    assert killed.returncode != 0 and (tmp_path / "x" / "tiny" / "s1_256" / "step_000003").is_dir()
    resumed = launch(tmp_path / "x", second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step 3); its data position re-split from {first} to {second} data-parallel ranks" in resumed.stderr
    a, b = read_metrics(tmp_path / "x" / "tiny" / "s1_256"), read_metrics(s1_reference)
    assert sorted(a) == sorted(b) == list(range(7))
    for s in range(1, 7):
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5), s


def test_resume_on_another_dp_cp_split_re_shards_the_state(tmp_path, cache_dir, s1_reference):
    """Killed after step 4 on 2 processes as cp=2 x dp=1, continued from step 3 (train.resume_from, the
    config changed) as cp=1 x dp=2: the shards and the data position are re-split, and the losses equal an
    uninterrupted one-process run's up to reduction order."""
    import subprocess

    from tests.conftest import micro_overrides, read_metrics

    def launch(root, cp, extra=(), env=None):
        proc = start(micro_overrides(root, cache_dir) + ["stage=s1_256", f"recipe.stages.s1_256.cp={cp}", *extra],
                     launcher=True, env_extra=env)
        out, _ = proc.communicate(timeout=900)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, out)

    killed = launch(tmp_path / "x", 2, env=crash_after(4))
    s1 = tmp_path / "x" / "tiny" / "s1_256"
    assert killed.returncode != 0 and sorted(p.name for p in s1.glob("step_000003/__*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"], "each rank wrote its own shard"
    resumed = launch(tmp_path / "x", 1, [f"train.resume_from={s1 / 'step_000003'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 3); its data position re-split from 1 to 2 data-parallel ranks" in resumed.stderr
    a, b = read_metrics(s1), read_metrics(s1_reference)
    assert sorted(a) == sorted(b) == list(range(7))
    for s in range(1, 7):
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5), s


def test_kill_inside_a_checkpoint_write_leaves_nothing_that_looks_complete(killed_and_clean, cache_dir, tmp_path):
    from tests.conftest import micro_overrides, read_metrics

    root = tmp_path / "run"
    first = run_cli(micro_overrides(root, cache_dir) + S2 + ["stage=s1_256"])
    assert first.returncode == 0
    r = run_cli(micro_overrides(root, cache_dir) + S2, env_extra={"LONGSTRIDE_TEST_KILL_IN_SAVE": "step_000004"})
    assert r.returncode == -9, r.stderr[-2000:]
    s2 = root / "tiny" / "s2_2k"
    assert (s2 / ".tmp-step_000004" / "__0_0.distcp").exists() and not (s2 / "step_000004").exists()
    resumed = run_cli(micro_overrides(root, cache_dir) + S2 + ["stage=s2_2k"])
    assert resumed.returncode == 0 and f"resuming from {s2 / 'step_000002'}" in resumed.stderr, resumed.stderr[-2000:]
    assert not (s2 / ".tmp-step_000004").exists()
    a, b = read_metrics(s2), read_metrics(killed_and_clean / "clean" / "tiny" / "s2_2k")
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]  # bitwise


@pytest.mark.parametrize("background", [False, True])
def test_disk_full_fails_cleanly_and_the_rerun_resumes(micro, tmp_path, s1_reference, background):
    """With train.async_save the shards, written behind the steps, or the rank's own small files, written at once,
    fail first (either way the same error, exit 2 naming the checkpoint; test_background_save.py checks each path
    alone)."""
    import subprocess

    from tests.conftest import read_metrics

    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=240k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"a small tmpfs needs mount privileges (CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        one = [o for o in micro if not o.startswith("paths.output_root")] + [f"paths.output_root={mnt}",
                                                                             "stage=s1_256"]
        one += [f"train.async_save={str(background).lower()}"]
        r = run_cli(one)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"could not write checkpoint {mnt}/tiny/s1_256/step_000003" in r.stderr and "Traceback" not in r.stderr
        assert not (mnt / "tiny" / "s1_256" / "step_000003").exists()
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)  # space freed
        again = run_cli(one)
        assert again.returncode == 0, again.stderr[-2000:]
        a, b = read_metrics(mnt / "tiny" / "s1_256"), read_metrics(s1_reference)
        assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


class _Payload:
    """Unpickled, it would create the file `marker`: the shape of a malicious training state."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.mark.parametrize("victim", ["trainer.pt", "rank0.pt"])
def test_checkpoint_with_a_pickled_payload_is_refused_and_never_runs(tmp_path, victim):
    from longstride.recipes.checkpoint.format import (CheckpointError, load_training_state, rng_state, verify, write_manifest,
                                                      writing_checkpoint)

    marker = tmp_path / "payload-ran"
    trainer = {"step": 3, "optimizer": {"state": {}}}
    rank = {"data": {"epoch": 0}, "rng": rng_state()}
    path = str(tmp_path / "s1" / "step_000003")
    os.makedirs(os.path.dirname(path))
    with writing_checkpoint(path, rank=0, is_main=True, trainer_state=trainer, rank_state=rank,
                            meta={"step": 3}):
        pass
    # someone with write access to the directory swaps a file for one carrying a payload and rewrites the manifest
    (trainer if victim == "trainer.pt" else rank)["extra"] = _Payload(str(marker))
    torch.save(trainer if victim == "trainer.pt" else rank, os.path.join(path, victim))
    write_manifest(path, 1)
    assert verify(path) is None, "the manifest vouches for the files: whoever wrote them wrote it"
    with pytest.raises(CheckpointError, match=rf"{victim} holds a '.*' object, not tensors and plain data"):
        load_training_state(path, rank=0)
    assert not marker.exists(), "the payload ran"


def test_training_state_round_trips_with_weights_only(tmp_path):
    import random

    import numpy as np

    from longstride.recipes.checkpoint.format import load_training_state, rng_state, set_rng_state, writing_checkpoint

    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    state = rng_state()
    expect = (torch.rand(3), np.random.rand(3), random.random(), np.random.standard_normal())
    path = str(tmp_path / "s1" / "step_000001")
    os.makedirs(os.path.dirname(path))
    with writing_checkpoint(path, rank=0, is_main=True, trainer_state={"step": 1},
                            rank_state={"rng": state}, meta={}):
        pass
    _, mine = load_training_state(path, rank=0)
    set_rng_state(mine["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random(), np.random.standard_normal())
    assert torch.equal(got[0], expect[0]) and np.array_equal(got[1], expect[1]) and got[2:] == expect[2:]


def test_a_gpu_rng_state_is_this_process_gpus_so_a_resume_may_see_fewer_gpus(monkeypatch):
    """A rank saves its own GPU's generator, not every visible GPU's (torch.cuda.set_rng_state_all on a machine with
    fewer GPUs than the save's raised IndexError); a state saved the old way restores this GPU's entry. torch.cuda is
    stood in for here (no GPU on CPU CI); tests/gpu round-trips the real generator."""
    from longstride.recipes.checkpoint.format import rng_state, set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([9], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("every GPU's state restored"))
    state = rng_state()
    assert torch.equal(state["cuda"], torch.tensor([9], dtype=torch.uint8))
    set_rng_state(state)
    old = [torch.tensor([n], dtype=torch.uint8) for n in range(8)]  # saved on 8 GPUs, resumed on GPU 1 of 2
    set_rng_state({**state, "cuda": old})
    set_rng_state({**state, "cuda": old[:1]})  # a state with no entry for this GPU leaves its generator be
    assert [t.item() for t in restored] == [9, 1]  # this GPU's own state, then GPU 1's entry of the old list


def test_a_rank_state_a_resume_could_not_load_is_refused_at_the_save(tmp_path):
    import numpy as np

    from longstride.recipes.checkpoint.format import CheckpointError, writing_checkpoint

    path = str(tmp_path / "s1" / "step_000002")
    os.makedirs(os.path.dirname(path))
    with pytest.raises(CheckpointError, match=r"rank0.pt would hold a '.*numpy.*' object"):
        with writing_checkpoint(path, rank=0, is_main=True, trainer_state={"step": 2},
                                rank_state={"data": {"pending": np.arange(3)}}, meta={}):
            pass
    assert not os.path.exists(path), "nothing that looks like a checkpoint is left"


def test_streaming_packer_state_loads_with_weights_only():
    import io

    import numpy as np

    from longstride.data.packing import OnlinePacker

    packer = OnlinePacker(8)
    for n in (5, 3, 6, 7):  # one sequence made ready (5 + 3), two still open
        packer.add(np.arange(n, dtype=np.int32))
    assert packer.ready and len(packer.open) == 2
    buf = io.BytesIO()
    torch.save(packer.state_dict(), buf)
    buf.seek(0)
    again = OnlinePacker(8)
    again.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in ((again.open, packer.open), (again.ready, packer.ready)):
        assert [[p.tolist() for p in seq] for seq in a] == [[p.tolist() for p in seq] for seq in b]
    assert all(p.dtype == np.int32 for seq in again.open for p in seq) and again.used == packer.used
