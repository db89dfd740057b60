"""One run per output directory (recipes/run/runlock.py): a second run on a directory is refused and the lock
dies with its holder, even while a run moves its directory aside; every rank must see the directory rank 0 locked;
a rerun with another config is refused, moved aside, or continued from a checkpoint (a rewind killed mid-way is
redone); the run's identity reads the same across schema versions and checkouts."""
from __future__ import annotations

import json
import time
import os

import pytest

from tests.conftest import run_cli


def test_second_run_on_one_directory_is_refused_and_the_lock_dies_with_its_holder(micro, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from longstride.recipes.run.runlock import RunLock
    from tests.conftest import REPO

    long_run = micro + ["stage=s1_256", "recipe.stages.s1_256.steps=100000", "recipe.stages.s1_256.save_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    first = subprocess.Popen([sys.executable, "-m", "longstride.recipes.train", *long_run], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        stage_dir = tmp_path / "out" / "tiny" / "s1_256"
        deadline = time.time() + 300
        while not (stage_dir / "metrics.jsonl").exists() and time.time() < deadline:  # training has started
            time.sleep(0.1)
        second = run_cli(micro)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another run ({{\"pid\": {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr and first.poll() is None
        assert not (tmp_path / "out" / "tiny" / "s2_2k").exists(), "the refused run wrote nothing"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    RunLock(str(tmp_path / "out" / "tiny")).acquire().release()  # the kernel dropped the killed run's lock


@pytest.mark.timeout(300)
def test_a_launch_whose_rank_0_is_refused_ends_on_every_rank(micro, tmp_path):
    """Rank 0's own start-up steps (taking the run's lock, the restart decisions) failed on rank 0 alone while the
    other ranks went on to wait for it at their next collective (ended only when the launcher noticed). Every rank
    now ends at that step, exit 2, the others naming rank 0. The fault: the directory locked by another process."""
    import subprocess

    from longstride.recipes.run.runlock import RunLock
    from tests.conftest import REPO, accelerate_launch

    held = RunLock(str(tmp_path / "out" / "tiny")).acquire()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        r = subprocess.run([*accelerate_launch(), "-m", "longstride.recipes.train", *micro, "stage=s1_256"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=240)
    finally:
        held.release()
    assert r.returncode != 0
    assert "is in use by another run" in r.stderr, r.stderr[-3000:]
    # rank 1's own message (before, the launcher's SIGTERM ended it, waiting for rank 0 in a collective)
    assert "longstride: rank 0 could not start the run (its log says why)" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out" / "tiny" / "s1_256").exists(), "the refused run wrote nothing"


def test_a_filesystem_without_file_locks_is_named(tmp_path, monkeypatch):
    """flock failing with ENOSYS (Lustre mounted without -o flock; the call's own errno, as such a mount returns
    it) was a traceback: now a one-line error naming the lock file and the fix; nothing is left open."""
    import errno

    from longstride.recipes.run import runlock

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)
    with pytest.raises(ValueError, match=r"cannot lock .*\.tiny\.lock \(Function not implemented\): its "
                                         r"filesystem takes no file locks"):
        runlock.RunLock(str(tmp_path / "tiny")).acquire()
    monkeypatch.undo()  # locks again: the directory takes a run
    runlock.RunLock(str(tmp_path / "tiny")).acquire().release()


def test_a_run_moving_its_directory_aside_keeps_the_lock_through_the_move(tmp_path, monkeypatch):
    """train.resume=false renames the run directory aside while its run holds the lock. A second run arriving just
    after the rename is refused: with the lock file inside the directory it moved away too, and that run locked a
    new one in the gap, two runs then writing one directory."""
    import longstride.recipes.run.runlock as runlock

    run = tmp_path / "tiny"
    holder = runlock.RunLock(str(run)).acquire()
    runlock.check_identity(str(run), {"optim": {"lr": 1.0}}, resume=True)
    late, rename = [], os.rename

    def rename_then_second_run(src, dst):
        rename(src, dst)
        try:
            late.append(runlock.RunLock(str(run)).acquire())
        except ValueError as e:
            late.append(e)

    monkeypatch.setattr(runlock.os, "rename", rename_then_second_run)
    runlock.check_identity(str(run), {"optim": {"lr": 0.5}}, resume=False)
    assert isinstance(late[0], ValueError) and "is in use by another run" in str(late[0]), late
    assert json.loads((run / "run.json").read_text())["config"] == {"optim.lr": 0.5}
    holder.release()


def _shared_worker(rank, world, dirs):
    from longstride.recipes.run.runlock import RunLock, check_shared

    lock = RunLock(dirs[0]).acquire() if rank == 0 else None
    try:
        check_shared(dirs[0], lock)  # every rank sees rank 0's directory
        try:  # the same path on a node that does not share it: here, another directory for rank 1
            check_shared(dirs[rank], lock, wait_s=1.0)
        except ValueError as e:
            assert "is not the same directory for rank 1 on" in str(e) and "paths.output_root" in str(e), e
        else:
            raise AssertionError("a rank that does not see rank 0's run directory passed")
    finally:
        if lock:
            lock.release()


def test_every_rank_must_see_the_run_directory_rank_0_locked(tmp_path):
    """Several nodes need one shared output directory (each rank writes its shards there); one that another rank
    sees as a different directory fails before any data or model is built, on every rank."""
    from longstride.parallel.spawn import run_gloo

    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    (tmp_path / "node1").mkdir()
    run_gloo(_shared_worker, 2, dirs)


def test_rerun_with_another_config_is_refused_naming_the_keys(micro, tmp_path):
    one = micro + ["stage=s1_256"]
    assert run_cli(one).returncode == 0
    # what is watched, and how often it is saved: the same run
    assert run_cli(one + ["logger.log_every=2", "train.keep_last=5", "recipe.stages.s1_256.save_every=1",
                          "train.trace_memory=true"]).returncode == 0
    r = run_cli(one + ["recipe.stages.s1_256.lr=0.01", "model.nope_interval=0"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "holds a run with another config: model.nope_interval (was 2, now 0); recipe.stages.s1_256.lr " \
           "(was 0.003, now 0.01)" in r.stderr
    before = (tmp_path / "out" / "tiny" / "s1_256" / "final" / "model.safetensors").read_bytes()
    r = run_cli(one + ["recipe.stages.s1_256.lr=0.01", "train.resume=false"])
    assert r.returncode == 0, r.stderr[-2000:]
    (aside,) = [p for p in (tmp_path / "out").iterdir() if p.name.startswith("tiny.prev-")]
    assert (aside / "s1_256" / "final" / "model.safetensors").read_bytes() == before, "the old run is kept"
    new = (tmp_path / "out" / "tiny" / "s1_256" / "final" / "model.safetensors").read_bytes()
    assert new != before, "trained afresh with the new lr"


def test_a_rewind_to_resume_from_killed_before_its_moves_is_done_again_by_the_same_command(tmp_path):
    """train.resume_from moves aside what is newer than the checkpoint, and run.json records it so that a requeued job
    does not go back again. Recorded first, a kill (here a failing move) between the two left it recorded with the
    newer checkpoints in place, and the same command then resumed from the newest under the new config."""
    from longstride.recipes.run.runlock import check_identity

    run = tmp_path / "tiny"
    run.mkdir()
    old, new, back = {"optim": {"lr": 1.0}}, {"optim": {"lr": 0.5}}, str(run / "s1_256" / "step_000002")
    check_identity(str(run), old, resume=True)
    moves = []

    def killed():
        raise OSError("killed mid-move")

    with pytest.raises(OSError):
        check_identity(str(run), new, resume=True, resume_from=back, rewind=killed)
    assert "resumed_from" not in json.loads((run / "run.json").read_text())
    assert check_identity(str(run), new, resume=True, resume_from=back, rewind=lambda: moves.append(1))
    assert moves == [1] and json.loads((run / "run.json").read_text())["resumed_from"] == back
    assert not check_identity(str(run), new, resume=True, resume_from=back, rewind=lambda: moves.append(2))
    assert moves == [1], "a requeued job resumes normally once the rewind is recorded"


def test_resume_false_applies_once_per_slurm_job(tmp_path, monkeypatch, capsys):
    """A job submitted with train.resume=false that SLURM requeues reruns the same command: it moved the old run
    aside and started afresh the first time, and then resumes the run it started (before, every requeue moved the
    partial run aside and trained from step 0). Another job with resume=false starts afresh again; outside SLURM
    resume=false always does."""
    from longstride.recipes.run.runlock import check_identity

    run, config = tmp_path / "tiny", {"optim": {"lr": 1.0}}
    run.mkdir()
    check_identity(str(run), config, resume=True)
    (run / "marker").write_text("the run before the job")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    check_identity(str(run), config, resume=False)
    assert not (run / "marker").exists() and len(list(tmp_path.glob("tiny.prev-*"))) == 1
    (run / "marker").write_text("the job's own run")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    check_identity(str(run), config, resume=False)  # requeued
    assert (run / "marker").read_text() == "the job's own run" and len(list(tmp_path.glob("tiny.prev-*"))) == 1
    assert "train.resume=false was applied when SLURM job 41 first ran" in capsys.readouterr().err
    time.sleep(1.1)  # a second command inside the same allocation (same job, same restart count): afresh, as asked
    check_identity(str(run), config, resume=False)
    assert not (run / "marker").exists() and len(list(tmp_path.glob("tiny.prev-*"))) == 2
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    time.sleep(1.1)  # the moved-aside name has a time to the second
    check_identity(str(run), config, resume=False)
    assert not (run / "marker").exists() and len(list(tmp_path.glob("tiny.prev-*"))) == 3
    monkeypatch.delenv("SLURM_JOB_ID")
    assert json.loads((run / "run.json").read_text())["fresh_start_job"] == ["42", 0]
    time.sleep(1.1)
    check_identity(str(run), config, resume=False)
    assert len(list(tmp_path.glob("tiny.prev-*"))) == 4 and "fresh_start_job" not in (run / "run.json").read_text()


def test_a_run_that_trained_nothing_gives_way_to_the_fixed_command(tmp_path, capsys):
    """A run that recorded its config and then failed on a setting (before any step or checkpoint) does not block
    the corrected command; once a step is logged or a checkpoint saved, another config is refused as before."""
    from longstride.recipes.run.runlock import check_identity

    run = tmp_path / "tiny"
    old, fixed = {"model": {"yarn": {"factor": 0.5}}}, {"model": {"yarn": {"factor": 2.0}}}
    run.mkdir()
    check_identity(str(run), old, resume=True)
    (run / "s1_256").mkdir()
    (run / "s1_256" / "metrics.jsonl").write_text("")  # opened, nothing logged
    check_identity(str(run), fixed, resume=True)
    assert "trained nothing" in capsys.readouterr().err
    assert json.loads((run / "run.json").read_text())["config"] == {"model.yarn.factor": 2.0}
    (run / "s1_256" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=r"holds a run with another config: model.yarn.factor \(was 2.0, now 0.5\)"):
        check_identity(str(run), old, resume=True)
    (run / "s1_256" / "metrics.jsonl").unlink()
    (run / "s1_256" / "step_000002").mkdir()
    with pytest.raises(ValueError, match="holds a run with another config"):
        check_identity(str(run), old, resume=True)


# --- stop signals, stuck ranks, a killed launcher: real signals to real processes


def test_run_identity_ignores_fields_another_version_of_the_schema_has(tmp_path):
    """A run recorded by a longstride whose schema had a field this one lacks (a removed field such as
    model.rope_theta) resumes; a value both versions have and that differs is still refused."""

    from longstride.recipes.run.runlock import check_identity

    resolved = {"model": {"hidden_size": 32}, "recipe": {"name": "tiny"}}
    assert check_identity(str(tmp_path), resolved, resume=True) is False  # first run: recorded
    (tmp_path / "s1_256" / "final").mkdir(parents=True)  # and it trained
    path = tmp_path / "run.json"
    recorded = json.loads(path.read_text())
    recorded["config"]["model.rope_theta"] = 10000.0
    path.write_text(json.dumps(recorded))
    assert check_identity(str(tmp_path), resolved, resume=True) is False
    with pytest.raises(ValueError, match=r"model.hidden_size \(was 32, now 64\)"):
        check_identity(str(tmp_path), {"model": {"hidden_size": 64}, "recipe": {"name": "tiny"}}, resume=True)


def test_a_source_stage_or_weight_added_or_removed_is_a_changed_config(tmp_path):
    """Keys on one side only are another schema's fields, except in dicts whose keys the user names: a source, a
    stage, a mixture weight or a synthetic kind added or removed, or a group set where it was None (a stage's
    long_docs), is refused, named; a new schema field inside a source still resumes."""
    from longstride.recipes.run.runlock import check_identity

    def resolved(**extra):
        sources = {"code": {"kind": "stdlib", "weight": 1.0, **extra.get("code", {})}, **extra.get("sources", {})}
        stage = {"lr": 1e-3, "mixture": extra.get("mixture", {}), "long_docs": extra.get("long_docs")}
        stages = {"s1": stage, **extra.get("stages", {})}
        return {"data": {"sources": sources}, "recipe": {"name": "r", "stages": stages}}

    assert check_identity(str(tmp_path), resolved(), resume=True) is False
    (tmp_path / "s1" / "final").mkdir(parents=True)  # it trained
    for extra, named in [({"sources": {"qa": {"kind": "synthetic", "weight": 2.0}}}, r"data.sources.qa \(added\)"),
                         ({"mixture": {"code": 1.0}}, r"recipe.stages.s1.mixture.code \(added\)"),
                         ({"stages": {"s2": {"lr": 1e-4}}}, r"recipe.stages.s2 \(added\)"),
                         ({"code": {"synthetic": {"kinds": {"copy": 1.0}}}},
                          r"data.sources.code.synthetic.kinds.copy \(added\)"),
                         ({"long_docs": {"min_tokens": 64, "min_share": 0.5}},
                          r"recipe.stages.s1.long_docs \(was None, now min_share=0.5, min_tokens=64\)")]:
        with pytest.raises(ValueError, match=named):
            check_identity(str(tmp_path), resolved(**extra), resume=True)
    assert check_identity(str(tmp_path), resolved(code={"new_field": 3}), resume=True) is False  # schema's
    check_identity(str(tmp_path), resolved(sources={"qa": {"kind": "synthetic"}}), resume=False)  # recorded anew
    with pytest.raises(ValueError, match=r"data.sources.qa \(removed\)"):
        (tmp_path / "s1" / "final").mkdir(parents=True)
        check_identity(str(tmp_path), resolved(), resume=True)


def test_run_identity_names_a_shipped_model_the_same_from_any_checkout(tmp_path):
    """The main job's base, `${shipped:tiny_base_256}`, resolves to this checkout's absolute path; the run records
    it by name, so a run recorded by an older longstride (the relative model/shipped/...) or from another clone
    resumes, and another base is still refused."""

    from longstride.recipes.config.schema import SHIPPED
    from longstride.recipes.run.runlock import check_identity, identity

    def resolved(path):
        return {"model": {"checkpoint": path}, "data": {"tokenizer": path}}

    here = os.path.join(SHIPPED, "tiny_base_256")
    assert check_identity(str(tmp_path), resolved(here), resume=True) is False
    (tmp_path / "s2_2k" / "step_000002").mkdir(parents=True)  # it trained
    recorded = json.loads((tmp_path / "run.json").read_text())["config"]
    assert recorded["model.checkpoint"] == recorded["data.tokenizer"] == "${shipped:tiny_base_256}"
    (tmp_path / "run.json").write_text(json.dumps({"config": {"model.checkpoint": "model/shipped/tiny_base_256",
                                                              "data.tokenizer": "model/shipped/tiny_base_256"}}))
    assert check_identity(str(tmp_path), resolved(here), resume=True) is False
    with pytest.raises(ValueError, match=r"model.checkpoint \(was \$\{shipped:tiny_base_256\}, now "):
        check_identity(str(tmp_path), resolved(str(tmp_path / "mine")), resume=True)
    # a folder of the user's own that only looks like it (relative to another working directory) keeps its path
    assert identity(resolved("model/shipped/tiny_base_256"))["model.checkpoint"] == "model/shipped/tiny_base_256"


def test_an_added_stage_is_named_once_not_with_each_entry_inside_it():
    from longstride.recipes.run.runlock import differences, flatten

    old = flatten({"recipe": {"stages": {"s1": {"lr": 1}}}})
    new = flatten({"recipe": {"stages": {"s1": {"lr": 1}, "s2": {"lr": 1, "mixture": {"a": 1.0, "b": 2.0}}}}})
    assert differences(old, new) == ["recipe.stages.s2 (added)"]


def test_a_trained_directory_without_run_json_is_moved_aside_or_checked_against_its_checkpoints(tmp_path, capsys):
    """A stage folder copied to branch an experiment, without run.json: train.resume=false resumed its checkpoints
    (nothing was moved aside without run.json), and a resume under another config went on silently. Now the first
    is moved aside, and the second is refused by the fingerprint each checkpoint's manifest records."""
    from longstride.recipes.run.runlock import check_identity, fingerprint

    config, other = {"optim": {"lr": 1.0}}, {"optim": {"lr": 0.5}}
    run = tmp_path / "tiny"
    step = run / "s1_256" / "step_000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"world_size": 1, "config": fingerprint(config), "files": {}}))
    with pytest.raises(ValueError, match=rf"{run} has no run.json, and its checkpoint {step} was written under "
                                         "another config"):
        check_identity(str(run), other, resume=True)
    assert not (run / "run.json").exists()
    assert not check_identity(str(run), config, resume=True), "the config it was written under resumes it"
    os.remove(run / "run.json")
    assert not check_identity(str(run), other, resume=False)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("tiny.prev-")]
    assert (aside / "s1_256" / "step_000002").is_dir() and sorted(os.listdir(run)) == ["run.json"]
    assert "train.resume=false: the previous run is now" in capsys.readouterr().err


def test_a_run_recorded_with_the_schedule_defaults_written_out_resumes_with_them_unset():
    """min_lr_ratio and decay_fraction became null (unset) where they held 0.1 and 0.2: a run.json recorded before
    read as a changed config (min_lr_ratio was 0.1, now None) and its resume was refused. Unset compares as the
    value it means; another value still differs."""
    from longstride.recipes.run.runlock import differences, identity

    before = {"recipe": {"stages": {"s1": {"min_lr_ratio": 0.1, "decay_fraction": 0.2, "lr": 3e-4}}}}
    now = {"recipe": {"stages": {"s1": {"min_lr_ratio": None, "decay_fraction": None, "lr": 3e-4}}}}
    assert differences(identity(before), identity(now)) == []
    lower = {"recipe": {"stages": {"s1": {"min_lr_ratio": 0.05, "decay_fraction": None, "lr": 3e-4}}}}
    assert differences(identity(before), identity(lower)) == ["recipe.stages.s1.min_lr_ratio (was 0.1, now 0.05)"]
