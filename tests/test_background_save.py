"""Step checkpoints written behind the training steps (train.async_save, BackgroundSave in
recipes/checkpoint/background.py): the save returns before its shards are written and nothing looks complete until
it is sealed; a failed write is raised at the next save naming the checkpoint; real runs write the same bytes as
blocking saves, and a kill or a stop signal while a save is in flight leaves a run that resumes to an uninterrupted
run's losses."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import Future

import pytest

from tests.conftest import micro_overrides, read_metrics, run_cli
from tests.test_faults import start

ASYNC = "train.async_save=true"


def _save(stage, step: int, background, shards: Future, keep_last: int = 0) -> str:
    """A step checkpoint of one rank whose shards are `shards`: a future the test completes (after writing the
    shard file with _shard_written, as DCP's thread would) or fails."""
    from longstride.recipes.checkpoint.format import step_name, writing_checkpoint

    path = str(stage / step_name(step))
    with writing_checkpoint(path, rank=0, is_main=True, trainer_state={"step": step},
                            rank_state={}, meta={}, keep_last=keep_last, background=background):
        background.track(shards, time.perf_counter())
    return path


def _shard_written(path: str, shards: Future) -> None:
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(b"shard" * 16)
    shards.set_result(None)


def test_the_save_returns_before_its_shards_are_written_and_is_sealed_after(tmp_path):
    from longstride.recipes.checkpoint.background import BackgroundSave
    from longstride.recipes.checkpoint.format import latest_checkpoint, verify

    stage, background = tmp_path / "s1", BackgroundSave()
    first: Future = Future()
    path = _save(stage, 2, background, first)
    assert background.in_flight == path
    assert not os.path.exists(path) and sorted(os.listdir(stage / ".tmp-step_000002")) == \
        ["rank0.pt", "stage.json", "trainer.pt"], "returned with the shards unwritten; nothing looks complete"
    assert latest_checkpoint(str(stage)) is None
    with pytest.raises(RuntimeError, match="another is in flight"):
        background.track(Future(), 0.0)
    _shard_written(path, first)
    assert background.wait() == path and background.in_flight is None and background.wait() is None
    assert verify(path) is None and "__0_0.distcp" in os.listdir(path) and not (stage / ".tmp-step_000002").exists()
    second: Future = Future()
    later = _save(stage, 4, background, second, keep_last=1)
    assert latest_checkpoint(str(stage)) == path, "step 4 is not sealed yet, and keep_last has not pruned step 2"
    _shard_written(later, second)
    background.wait()
    assert sorted(os.listdir(stage)) == ["step_000004"], "pruned by the seal, after step 4 was in place"


def test_a_failed_background_write_is_raised_at_the_wait_naming_the_checkpoint(tmp_path):
    from longstride.recipes.checkpoint.background import BackgroundSave
    from longstride.recipes.checkpoint.format import CheckpointError, latest_checkpoint

    stage, background = tmp_path / "s1", BackgroundSave()
    done: Future = Future()
    intact = _save(stage, 2, background, done)
    _shard_written(intact, done)
    background.wait()
    failing: Future = Future()
    path = _save(stage, 4, background, failing)
    failing.set_exception(OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {path} .*No space left on device.*the "
                                              "earlier checkpoints are intact"):
        background.wait()
    assert background.in_flight is None and latest_checkpoint(str(stage)) == intact and not os.path.exists(path)


def _ended(background) -> None:
    """Until the save's thread has ended, as a later step would find it."""
    import time

    deadline = time.time() + 30
    while background._thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)


def test_a_dcp_failure_is_flagged_without_blocking_then_raised_naming_the_rank_and_checkpoint(tmp_path):
    """DCP's own CheckpointException (a BaseException, raised on every rank) becomes the OSError a blocking save
    raises; failed() sees it without blocking (the loop all-reduces it at the step's end, StopSignals.requested),
    and wait() raises it as the disk error naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    from longstride.parallel.shards import _failures_as_oserror
    from longstride.recipes.checkpoint.background import BackgroundSave
    from longstride.recipes.checkpoint.format import CheckpointError
    from longstride.recipes.run.faults import StopSignals

    stage, background, dcp = tmp_path / "s1", BackgroundSave(), Future()
    path = _save(stage, 2, background, _failures_as_oserror(dcp))
    assert not background.failed() and StopSignals().requested(background.failed()) == (0, False)
    dcp.set_exception(CheckpointException("write", {1: (OSError(28, "No space left on device"), None)}))
    _ended(background)
    assert background.failed() and StopSignals().requested(background.failed()) == (0, True)
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {path} \\(rank 1: \\[Errno 28\\] No space"):
        background.wait()


def test_a_failure_that_is_not_a_write_is_named_as_such_and_a_failed_save_frees_the_next(tmp_path):
    from longstride.recipes.checkpoint.background import BackgroundSave
    from longstride.recipes.checkpoint.format import CheckpointError, writing_checkpoint

    stage, background, shards = tmp_path / "s1", BackgroundSave(), Future()
    path = _save(stage, 2, background, shards)
    shards.set_exception(RuntimeError("a collective timed out"))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} was not completed \\(RuntimeError: a collective "
                                              "timed out\\); the earlier checkpoints are intact"):
        background.wait()
    done: Future = Future()
    done.set_result(None)
    with pytest.raises(CheckpointError, match="No space left"):  # this rank's own files fail after the shards began
        with writing_checkpoint(str(stage / "step_000004"), rank=0, is_main=True,
                                trainer_state={}, rank_state={}, meta={}, background=background):
            background.track(done, 0.0)
            raise OSError(28, "No space left on device")
    assert background.in_flight is None
    background.track(Future(), 0.0)  # the failed save is not in flight: the next one starts


def _launch(args, env=None) -> subprocess.CompletedProcess:
    proc = start(args, launcher=True, env_extra=env)
    out, _ = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, out)


def test_two_fsdp_processes_write_the_same_checkpoints_in_the_background_as_blocking(tmp_path, cache_dir):
    """2 processes, FSDP2, a step checkpoint after every step (each save waits for the one before): every file of
    each kept checkpoint equals a blocking run's byte for byte but the ranks' RNG states (Python's and numpy's
    generators are not seeded), the manifest (their hashes) and DCP's metadata (which names the save's own id and
    path: its tensor records are compared), and the losses are the same."""
    from longstride.parallel.shards import SafeReader
    from longstride.recipes.checkpoint.format import verify

    each = ["stage=s1_256", "recipe.stages.s1_256.save_every=1", "parallel.fsdp=true"]
    runs = {mode: tmp_path / mode for mode in ("background", "blocking")}
    logs = {}
    for mode, root in runs.items():
        r = _launch(micro_overrides(root, cache_dir) + each + [f"train.async_save={str(mode == 'background').lower()}"])
        assert r.returncode == 0, r.stderr[-3000:]
        logs[mode] = r.stderr
    a, b = (runs[m] / "tiny" / "s1_256" for m in ("background", "blocking"))
    assert f"step checkpoint {a / 'step_000005'} written in the background" in logs["background"]
    assert "written in the background" not in logs["blocking"]
    kept = sorted(p.name for p in a.iterdir() if p.name.startswith("step_"))
    assert kept == sorted(p.name for p in b.iterdir() if p.name.startswith("step_")) == ["step_000004", "step_000005"]
    for name in kept:
        assert verify(str(a / name)) is None
        files = sorted(os.listdir(a / name))
        assert files == sorted(os.listdir(b / name)) and {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
        for f in set(files) - {"rank0.pt", "rank1.pt", "manifest.json", ".metadata"}:
            assert (a / name / f).read_bytes() == (b / name / f).read_bytes(), (name, f)
        ra, rb = (SafeReader(str(d / name)).read_metadata() for d in (a, b))  # each save's id and path differ
        assert (ra.state_dict_metadata, ra.storage_data) == (rb.state_dict_metadata, rb.storage_data)
    ma, mb = read_metrics(a), read_metrics(b)
    assert [ma[s].get("loss") for s in sorted(ma)] == [mb[s].get("loss") for s in sorted(mb)]


S2 = ["recipe.stages.s2_2k.steps=6", "recipe.stages.s2_2k.save_every=2"]


@pytest.fixture(scope="module")
def s1_done(tmp_path_factory, cache_dir):
    """The micro recipe's first stage, and stage 2 uninterrupted with blocking saves (its losses, the reference)."""
    root = tmp_path_factory.mktemp("background")
    for name in ("run", "clean"):
        r = run_cli(micro_overrides(root / name, cache_dir) + S2 + (["stage=s1_256"] if name == "run" else []))
        assert r.returncode == 0, r.stderr[-2000:]
    return root


def test_a_kill_after_the_shards_before_the_seal_leaves_nothing_complete_and_resumes(s1_done, cache_dir, tmp_path):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(s1_done / "run", root)
    r = run_cli(micro_overrides(root, cache_dir) + S2 + [ASYNC], env_extra={"LONGSTRIDE_TEST_KILL_IN_SAVE":
                                                                             "step_000004"})
    assert r.returncode == -9, r.stderr[-2000:]
    s2 = root / "tiny" / "s2_2k"
    assert f"step checkpoint {s2 / 'step_000002'} written in the background" in r.stderr, "the background path ran"
    assert (s2 / ".tmp-step_000004" / "__0_0.distcp").exists() and not (s2 / "step_000004").exists()
    resumed = run_cli(micro_overrides(root, cache_dir) + S2 + [ASYNC])
    assert resumed.returncode == 0 and f"resuming from {s2 / 'step_000002'}" in resumed.stderr, resumed.stderr[-2000:]
    assert not (s2 / ".tmp-step_000004").exists()
    a, b = read_metrics(s2), read_metrics(s1_done / "clean" / "tiny" / "s2_2k")
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]  # bitwise


def test_a_stop_signal_while_a_save_is_in_flight_seals_it_and_the_rerun_matches(s1_done, cache_dir, tmp_path):
    """SIGTERM (sent by the test hook from the save's own thread, its shards written, its manifest not): training
    goes on to the step's end, where the run waits for that save (logged as sealed), saves the step it stopped at,
    and exits 128 + SIGTERM; the checkpoints are intact and the rerun's losses equal an uninterrupted run's. (Should
    the signal come only after the stage's last step, the stage's final save waits for it instead, and the run stops
    at the end of the stage.)"""
    import shutil

    from longstride.recipes.checkpoint.format import verify

    root = tmp_path / "run"
    shutil.copytree(s1_done / "run", root)
    r = run_cli(micro_overrides(root, cache_dir) + S2 + [ASYNC, "train.keep_last=0"],
                env_extra={"LONGSTRIDE_TEST_TERM_IN_SAVE": "step_000004"})
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    s2 = root / "tiny" / "s2_2k"
    assert f"step checkpoint {s2 / 'step_000004'} written in the background" in r.stderr, r.stderr[-3000:]
    steps = sorted(p.name for p in s2.iterdir() if p.name.startswith("step_"))
    assert steps[:2] == ["step_000002", "step_000004"] and all(verify(str(s2 / n)) is None for n in steps), steps
    if "at the end of stage s2_2k" not in r.stderr:
        stopped = steps[-1]
        assert f"stopped by SIGTERM after step {int(stopped[5:])}" in r.stderr and "Traceback" not in r.stderr
        resumed = run_cli(micro_overrides(root, cache_dir) + S2 + [ASYNC])
        assert resumed.returncode == 0 and f"resuming from {s2 / stopped}" in resumed.stderr, resumed.stderr[-2000:]
    a, b = read_metrics(s2), read_metrics(s1_done / "clean" / "tiny" / "s2_2k")
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]  # bitwise


def test_an_error_after_the_last_step_waits_for_the_save_in_flight_before_the_run_lets_go(micro, tmp_path,
                                                                                          monkeypatch):
    """The final validation failed (here raised) with step 5's checkpoint still sealing behind the steps: the error
    left the stage and the run released its lock while the seal ran on, so a rerun could take the half-sealed
    directory. The save in flight is now finished first."""
    import threading

    from longstride.recipes.checkpoint import background
    from longstride.recipes.checkpoint.format import verify
    from longstride.recipes.run import stage
    from longstride.recipes.train import run
    from tests.conftest import compose_cfg

    slow = background.save_test_kills
    monkeypatch.setattr(background, "save_test_kills", lambda name: (time.sleep(2), slow(name)))
    calls = []

    def validation(ctx, run_):
        calls.append(run_.step)
        if len(calls) > 1:
            raise RuntimeError("validation failed")
        return 1.0

    monkeypatch.setattr(stage, "validation_loss", validation)
    with pytest.raises(RuntimeError, match="validation failed"):
        run(compose_cfg(micro + [ASYNC, "stage=s1_256", "recipe.stages.s1_256.save_every=5"]))
    assert calls == [0, 6]
    assert not [t for t in threading.enumerate() if t.name.startswith("save ")], "the seal outlived the run"
    assert verify(str(tmp_path / "out" / "tiny" / "s1_256" / "step_000005")) is None
