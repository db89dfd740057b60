"""Faults on the tiny model: bad numerical state is skipped, never saved, and stops the run with a
message naming the last good checkpoint; non-finite config values fail before compute."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from longstride.recipes.run.faults import NonFiniteError, NonFiniteGuard, check_finite_parameters
from tests.conftest import report, rerun_from_step_3, run_cli


def test_guard_skips_non_finite_steps_and_stops_after_the_limit():
    guard = NonFiniteGuard(limit=2)
    assert guard.step_ok(1, 2.0, 1.0, None)
    assert not guard.step_ok(2, math.nan, 1.0, None)
    assert guard.step_ok(3, 2.0, 0.5, None) and guard.in_row == 0  # a good step resets the count
    assert not guard.step_ok(4, 2.0, math.inf, "ck/step_000003")
    with pytest.raises(NonFiniteError, match=r"step 5: .* 2 steps in a row .* Last good checkpoint: ck/step_000003"):
        guard.step_ok(5, math.inf, math.nan, "ck/step_000003")
    assert guard.skipped == 3


def test_parameters_with_nan_are_not_saved():
    layer = torch.nn.Linear(3, 3)
    check_finite_parameters(layer.parameters(), "x")
    with torch.no_grad():
        layer.weight[1, 2] = math.nan
    with pytest.raises(NonFiniteError, match="not saving out/step_000004"):
        check_finite_parameters(layer.parameters(), "out/step_000004")


def test_exploding_stage_stops_naming_the_last_good_checkpoint_and_saves_nothing(micro, tmp_path):
    """lr=1e6 in stage 2 (a real blow-up: the first update makes the gradients NaN)."""
    r = run_cli(micro + ["recipe.stages.s2_2k.lr=1e6"])
    assert r.returncode == 3, r.stderr[-3000:]
    s1_final = tmp_path / "out" / "tiny" / "s1_256" / "final"
    assert "non-finite for 3 steps in a row" in r.stderr and f"Last good checkpoint: {s1_final}" in r.stderr
    assert "Traceback" not in r.stderr
    s2 = tmp_path / "out" / "tiny" / "s2_2k"
    assert sorted(os.listdir(s2)) == ["metrics.jsonl"], "no checkpoint of the blown-up stage"
    assert not (tmp_path / "out" / "tiny" / "s3_4k").exists()
    weights = load_file(str(s1_final / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert "update skipped" in r.stderr
    assert f"train.resume_from={s1_final}" in r.stderr
    # as the message says: a lower lr, continuing from the last good checkpoint (a changed config, allowed)
    again = run_cli(micro + ["recipe.stages.s2_2k.lr=1e-3", f"train.resume_from={s1_final}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing from" in again.stderr and "recipe.stages.s2_2k.lr (was 1000000.0, now 0.001)" in again.stderr
    assert (tmp_path / "out" / "tiny" / "s3_4k" / "final").is_dir()
    (aside,) = [p for p in (tmp_path / "out" / "tiny").iterdir() if p.name.startswith("s2_2k.superseded-")]
    assert (aside / "metrics.jsonl").exists(), "the blown-up stage's record is kept, moved aside"
    requeued = run_cli(micro + ["recipe.stages.s2_2k.lr=1e-3", f"train.resume_from={s1_final}"])  # the same command
    assert requeued.returncode == 0 and "stage s3_4k already complete" in requeued.stderr, requeued.stderr[-2000:]
    assert len([p for p in (tmp_path / "out" / "tiny").iterdir() if ".superseded-" in p.name]) == 1
    bad = run_cli(micro + [f"train.resume_from={tmp_path}"])
    assert bad.returncode == 2 and "is not a step_NNNNNN or final checkpoint" in bad.stderr


def test_a_stage_ending_inside_a_run_of_skipped_steps_says_so(micro):
    """lr=1e6 blows up at the first update; with a limit above the stage's steps it ends inside the run of skipped
    steps and its final (finite weights) is written, with a warning naming the run (it went on silently)."""
    r = run_cli(micro + ["stage=s1_256", "recipe.stages.s1_256.lr=1e6", "train.max_nonfinite_steps=100"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"stage s1_256 ended inside a run of [1-5] skipped non-finite steps: its final checkpoint holds "
                     r"the weights of the last update applied", r.stderr), r.stderr[-3000:]


KEEP_ONE = ["recipe.stages.s1_256.lr=1e-3", "recipe.stages.s1_256.save_every=1", "train.keep_last=1"]


def test_a_resume_from_a_step_checkpoint_trains_at_the_configs_lr_not_the_checkpoints(micro, tmp_path):
    """The rerun NonFiniteError advises, from a step checkpoint: a lower lr. The optimizer's shards and the
    schedule's state carry the checkpoint's peak lr; the resumed steps apply the new one on the same schedule."""
    logged, resumed, again = rerun_from_step_3(micro, tmp_path, "lr", ["recipe.stages.s1_256.lr=2e-3"],
                                               KEEP_ONE)
    assert "the checkpoint's peak lr 0.002 (now 0.001)" in again.stderr, again.stderr[-3000:]
    assert sorted(resumed) == sorted(logged) == list(range(1, 7))
    for step in range(1, 7):  # steps 1-3 kept from the first run, 4-6 trained again at half the peak
        assert resumed[step] == pytest.approx(logged[step] * (0.5 if step > 3 else 1.0), rel=1e-9), step
    # SLURM requeues the same command once keep_last has deleted step_000003: the rewind was applied, so the run
    # resumes its newest checkpoint (it was refused: "is not a step_NNNNNN or final checkpoint")
    s1 = tmp_path / "out" / "tiny" / "s1_256"
    assert not (s1 / "step_000003").exists()
    requeued = run_cli(micro + ["stage=s1_256", *KEEP_ONE, f"train.resume_from={s1}/step_000003"])
    assert requeued.returncode == 0 and "already complete" in requeued.stderr, requeued.stderr[-2000:]


@pytest.mark.parametrize("override, field", [("recipe.stages.s1_256.rope_theta=nan", "recipe.stages.s1_256.rope_theta"),
                                             ("optim.eps=inf", "optim.eps"),
                                             ("recipe.stages.s2_2k.lr=-inf", "recipe.stages.s2_2k.lr")])
def test_non_finite_config_values_fail_before_compute(micro, override, field):
    r = run_cli(micro + [override])
    assert r.returncode == 2
    assert f"config fields {field}=" in r.stderr and "not finite" in r.stderr
    assert "tokenizing" not in r.stderr  # before any data work


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def start(args: list, launcher: bool = False, env_extra: dict | None = None):
    import subprocess
    import sys

    from tests.conftest import REPO, accelerate_launch

    head = accelerate_launch() if launcher else [sys.executable]
    return subprocess.Popen([*head, "-m", "longstride.recipes.train", *args], cwd=REPO, env={**ENV, **(env_extra or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(stage_dir, step: int, proc, timeout: float = 300) -> None:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = stage_dir / "metrics.jsonl"
        if path.exists() and any(json.loads(line).get("step", 0) >= step for line in path.read_text().splitlines()
                                 if line.endswith("}")):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached: {proc.poll()}")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_a_checkpoint_and_after_sigterm_the_rerun_matches_an_unstopped_run(micro, tmp_path, sig):
    import signal

    from tests.conftest import micro_overrides, read_metrics

    long = ["stage=s1_256", "recipe.stages.s1_256.steps=60", "recipe.stages.s1_256.save_every=0"]
    proc = start(micro + long)
    stage_dir = tmp_path / "out" / "tiny" / "s1_256"
    wait_for_step(stage_dir, 10, proc)
    proc.send_signal(getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), out[-2000:]
    (stopped,) = [p for p in stage_dir.iterdir() if p.name.startswith("step_")]
    assert f"stopped by {sig} after step {int(stopped.name[5:])}" in out and "Traceback" not in out
    assert int(stopped.name[5:]) < 60, "stopped mid-stage: the rerun has steps left to match"
    if sig == "SIGINT":  # the same handler and save as SIGTERM's: the rerun is checked for SIGTERM only
        return
    resumed = run_cli(micro + long)
    assert resumed.returncode == 0 and f"resuming from {stopped}" in resumed.stderr, resumed.stderr[-2000:]
    clean = run_cli(micro_overrides(tmp_path / "clean", tmp_path / "cache2") + long)
    assert clean.returncode == 0
    a, b = read_metrics(stage_dir), read_metrics(tmp_path / "clean" / "tiny" / "s1_256")
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]  # bitwise


def test_a_stop_signal_during_a_stages_final_save_stops_before_the_next_stage(micro, tmp_path):
    """SIGTERM (a real one, sent by the test hook) while a stage saves its final checkpoint: the save completes,
    the run exits 128 + SIGTERM naming that final instead of going on into the next stage, and the rerun goes on
    from it; during the last stage's final save the run is complete and ends normally."""
    import signal

    from tests.conftest import read_metrics

    term = {"LONGSTRIDE_TEST_TERM_IN_SAVE": "final"}  # in every final save; a complete stage saves none again
    out = tmp_path / "out" / "tiny"
    for stage in ("s1_256", "s2_2k"):
        r = run_cli(micro, env_extra=term)
        assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
        assert f"stopped by SIGTERM at the end of stage {stage}, its final checkpoint {out / stage / 'final'}" \
            in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert (out / stage / "final" / "model.safetensors").exists() and not (out / "s3_4k").exists()
    last = run_cli(micro, env_extra=term)
    assert last.returncode == 0 and "stage s2_2k already complete" in last.stderr, last.stderr[-3000:]
    assert "s3_4k: SIGTERM arrived during its final save; the run is complete" in last.stderr, last.stderr[-3000:]
    assert max(read_metrics(out / "s3_4k")) == 4


def workers_of(launcher_pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(launcher_pid).children(recursive=True)
            if "longstride.recipes.train" in " ".join(p.cmdline())]


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def all_gone(pids: list[int], timeout: float) -> bool:
    """Whether every process in `pids` has ended (or is a zombie) within `timeout` seconds."""
    import time

    deadline = time.time() + timeout
    while not all(gone(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return all(gone(p) for p in pids)


def test_a_stuck_rank_fails_the_run_after_the_collective_timeout(micro, tmp_path):
    import signal

    long = ["stage=s1_256", "recipe.stages.s1_256.steps=100000", "recipe.stages.s1_256.save_every=0",
            "recipe.stages.s1_256.batch_tokens=1024", "train.collective_timeout_s=10"]
    proc, workers = start(micro + long, launcher=True), []
    try:
        wait_for_step(tmp_path / "out" / "tiny" / "s1_256", 3, proc)
        workers = workers_of(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)  # a hung rank: alive, never reaching the next collective
        # the healthy rank gives up long before the default 1800 s timeout (the 10 s one plus its exit; generous
        # for a loaded machine), and the launcher then stops the run
        assert all_gone([workers[0]], 150), "the healthy rank still waits on the stopped one"
        # torch elastic now sends the hung rank SIGTERM, which a stopped process holds, and SIGKILLs it 30 s later
        # (a fixed wait: TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not reach it); waking it lets the run end sooner
        os.kill(workers[1], signal.SIGCONT)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-2000:]
        assert all(gone(w) for w in workers)
    finally:
        for p in [*workers, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_killing_the_launcher_kills_its_workers(micro, tmp_path):
    import signal

    long = ["stage=s1_256", "recipe.stages.s1_256.steps=100000", "recipe.stages.s1_256.save_every=0",
            "recipe.stages.s1_256.batch_tokens=1024"]
    proc = start(micro + long, launcher=True)
    wait_for_step(tmp_path / "out" / "tiny" / "s1_256", 3, proc)
    workers = workers_of(proc.pid)
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert all_gone(workers, 60), "workers outlived their launcher"


def test_eval_sequences_beyond_the_stage_data_is_a_message(micro):
    r = run_cli(micro + ["data.eval_sequences=100000", "stage=s1_256"])
    assert r.returncode == 2 and "stage s1_256: data.eval_sequences=100000: validating on " in r.stderr
    assert "lower data.eval_sequences or give data.sources." in r.stderr
    assert "Traceback" not in r.stderr


def test_sigkill_of_one_rank_ends_the_run_and_the_rerun_resumes(micro, tmp_path):
    import signal

    from tests.conftest import read_metrics

    # killed at step 25 or a little past (the poll's latency) of 80: resumed from step 20's checkpoint or a later one
    two = micro + ["stage=s1_256", "recipe.stages.s1_256.steps=80", "recipe.stages.s1_256.save_every=10",
                   "recipe.stages.s1_256.batch_tokens=1024", "recipe.stages.s1_256.micro_batch_size=4"]
    proc = start(two, launcher=True)
    stage_dir = tmp_path / "out" / "tiny" / "s1_256"
    wait_for_step(stage_dir, 25, proc)
    workers = workers_of(proc.pid)
    os.kill(workers[1], signal.SIGKILL)
    # the survivor sees its peer's socket close: the run ends well within 300 s (communicate raises past it), not at
    # the 1800 s collective timeout
    proc.communicate(timeout=300)
    assert proc.returncode != 0 and all(gone(w) for w in workers)
    # resumed at another checkpoint interval (not part of the run's identity): the same losses, saved every 7
    resumed = start([o.replace("save_every=10", "save_every=7") for o in two], launcher=True)
    out, _ = resumed.communicate(timeout=600)
    resumed_at = re.search(r"resuming from \S*step_(\d+)", out)
    assert resumed.returncode == 0 and resumed_at and 20 <= int(resumed_at.group(1)) < 80, out[-2000:]
    assert (stage_dir / "step_000077").is_dir(), sorted(p.name for p in stage_dir.iterdir())
    # the uninterrupted run's metrics only: it saves no checkpoint
    clean = start([o.replace(str(tmp_path / "out"), str(tmp_path / "clean")).replace("save_every=10", "save_every=0")
                   for o in two], launcher=True)
    assert clean.communicate(timeout=600) and clean.returncode == 0
    a, b = read_metrics(stage_dir), read_metrics(tmp_path / "clean" / "tiny" / "s1_256")
    assert [a[s].get("loss") for s in sorted(a)] == [b[s].get("loss") for s in sorted(b)]  # bitwise, same layout


def _stage_data_worker(rank: int, world: int, root: str, case: str) -> None:
    from types import SimpleNamespace

    from longstride.recipes.run import stage

    def read(ctx, plan, pad_id):  # what each rank's stage_data read: in `case`, rank 1 read otherwise
        if case == "fails" and rank == 1:
            raise OSError("data.sources.a.path: /data/a.jsonl: No such file or directory")
        held = 3 if case == "held" and rank == 1 else 2
        return "loader", ["sequence"] * held, {}, "f" * 64 if case == "data" and rank == 1 else "0" * 64

    stage.stage_data = read
    ctx, plan = SimpleNamespace(tokenizer_id="v2:" + "a" * 64), SimpleNamespace(name="s1")
    report(os.path.join(root, f"{case}{rank}.txt"), lambda: stage.agreed_stage_data(ctx, plan, 0),
           lambda data: f"read {len(data[1])}")


@pytest.mark.timeout(120)  # before, a rank whose data failed left the others waiting in the next collective
@pytest.mark.parametrize("case", ["same", "held", "data", "fails"])
def test_processes_that_read_different_data_fail_together_before_training(tmp_path, case):
    """Processes whose stage data differ (a file that differs between nodes) trained on: different held-out counts
    ran different numbers of validation forwards (a hang under FSDP2 and CP), different data silently broke a CP
    group's shared sequence. Every rank now fails before the first step, naming what differs; one rank's failure
    to read fails every rank."""
    from longstride.parallel.spawn import run_gloo

    run_gloo(_stage_data_worker, 2, str(tmp_path), case)
    said = [(tmp_path / f"{case}{r}.txt").read_text() for r in range(2)]
    apart = {"held": "held-out sequences: rank 0 has 2, rank 1 3",
             "data": f"data: rank 0 has '{'0' * 16}', rank 1 '{'f' * 16}'"}
    if case == "same":
        assert said == ["read 2", "read 2"], said
    elif case == "fails":
        assert said == ["StageInputError: stage s1: another process could not read the stage's data (its log says "
                        "why)", "OSError: data.sources.a.path: /data/a.jsonl: No such file or directory"], said
    else:
        assert said[0] == said[1] == f"StageInputError: stage s1: the processes did not read the same tokenizer and " \
            f"data ({apart[case]}); every process must see the same files: the same paths on a filesystem every " \
            "node shares, not changed while the run starts", said


def _unplanned_worker(rank: int, world: int, root: str) -> None:
    from types import SimpleNamespace

    from longstride.recipes.config.plan import Unplanned
    from longstride.recipes.run.stage import train_stage

    # rank 1 planned s2 otherwise (its node plans for another device) and, its final written, left it Unplanned
    plan = Unplanned("s2", 1, None, "cp=4 needs 4 processes") if rank == 1 else SimpleNamespace(name="s2")
    report(os.path.join(root, f"said{rank}.txt"),
           lambda: train_stage(SimpleNamespace(recipe_dir=root, accelerator=None, tracker=None), plan, None))


@pytest.mark.timeout(120)  # before, rank 0 went on into the stage and waited at its first collective
def test_a_stage_one_rank_cannot_plan_ends_every_rank(tmp_path):
    """A stage whose layout does not fit the launch is left unplanned where its final is written; found damaged, it
    trains again. Where the ranks plan differently (a node that plans for another device), the rank holding no plan
    for it raised alone and the others went on into the stage; now every rank ends there, exit 2."""
    from longstride.parallel.spawn import run_gloo

    run_gloo(_unplanned_worker, 2, str(tmp_path))
    said = [(tmp_path / f"said{r}.txt").read_text() for r in range(2)]
    assert said == ["StageInputError: stage s2 trains again, and another rank's plan for it does not fit this "
                    "launch (its log says why)", "StageInputError: stage s2 has no intact final checkpoint, so it "
                    "trains again, and its layout does not fit this launch: cp=4 needs 4 processes"], said


@pytest.mark.timeout(300)
def test_rank_0_failing_to_start_a_stages_tracking_ends_every_rank(micro, tmp_path):
    """Rank 0 alone opens the stage's metrics.jsonl and starts wandb; when that failed, the other rank went on into
    the stage's first step, to wait there until the launcher's SIGTERM (or, across nodes, the collective timeout).
    The fault: metrics.jsonl is a directory. Every rank now ends there, the other naming rank 0."""
    (tmp_path / "out" / "tiny" / "s1_256" / "metrics.jsonl").mkdir(parents=True)
    proc = start(micro + ["stage=s1_256"], launcher=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "IsADirectoryError" in out, out[-3000:]
    assert "RuntimeError: stage s1_256: rank 0 could not start tracking it (its log says why)" in out, out[-3000:]
    assert not (tmp_path / "out" / "tiny" / "s1_256" / "final").exists()
