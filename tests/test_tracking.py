"""recipes/run/tracking.py: a resumed stage's metrics file rewound to its step, one wandb run per run of a stage
(its id kept on resume), and a resumed stage's re-trained steps kept by wandb."""
from __future__ import annotations

import json
import os


def test_metrics_rewind_to_the_resumed_step_and_drop_a_cut_line(tmp_path):
    from longstride.recipes.run.tracking import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) for s in range(6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # killed mid-write
    rewind_metrics(str(path), 4)
    assert path.read_text() == "\n".join(lines[:5]) + "\n"
    rewind_metrics(str(path), 0)  # the stage starts afresh
    assert path.read_text() == ""


def test_wandb_run_id_is_new_per_run_and_kept_on_resume(tmp_path):
    from longstride.recipes.run.tracking import wandb_run_id

    first = wandb_run_id(str(tmp_path), "tiny/s1_256", resuming=False)
    assert first.startswith("tiny-s1_256-") and first == wandb_run_id(str(tmp_path), "tiny/s1_256", resuming=True)
    assert wandb_run_id(str(tmp_path), "tiny/s1_256", resuming=False) != first


def test_a_resume_from_under_a_changed_config_gets_a_new_wandb_run(tmp_path):
    """train.resume_from=<step checkpoint> moves aside the stage's newer checkpoints and its wandb run id, so the
    steps trained again under the new config (a lower lr after a blow-up) go to a new wandb run instead of over the
    old run's curves at the same steps; a crash resume (no resume_from) keeps the run."""
    from longstride.recipes.checkpoint.format import supersede_after
    from longstride.recipes.run.tracking import wandb_run_id

    stage = tmp_path / "tiny" / "s1_256"
    for name in ("step_000002", "step_000004"):
        (stage / name).mkdir(parents=True)
    old = wandb_run_id(str(stage), "tiny-s1_256", resuming=False)
    assert wandb_run_id(str(stage), "tiny-s1_256", resuming=True) == old, "a crash resume continues its run"
    moved = supersede_after(str(stage / "step_000002"), str(tmp_path / "tiny"), ["s1_256", "s2_2k"])
    assert sorted(os.path.basename(m).split(".superseded-")[0] for m in moved) == ["step_000004", "wandb_run_id"]
    new = wandb_run_id(str(stage), "tiny-s1_256", resuming=True)
    assert new != old and new.startswith("tiny-s1_256-")


def test_wandb_takes_a_resumed_stages_steps_again(tmp_path, monkeypatch, capfd):
    """A resumed stage continues its wandb run and logs again the steps after its checkpoint, below the killed
    run's last. Logged at wandb's own step, wandb drops them ("less than the current step"); logged against the
    `step` metric they are kept. A real offline wandb run: steps 1-6, then 4-6 again, as the resumed run sends."""
    from types import SimpleNamespace

    from longstride.recipes.run.tracking import Tracker

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    cfg = SimpleNamespace(logger=SimpleNamespace(wandb_mode="offline", project="t", entity=None, log_every=1,
                                                 progress_bar=False), recipe=SimpleNamespace(name="tiny"))
    tracker = Tracker(True, cfg, str(tmp_path))
    try:
        tracker.start_stage("s1", str(tmp_path / "s1"), 6, 0, {})
        for step in [1, 2, 3, 4, 5, 6, 4, 5, 6]:
            tracker.log(step, {"loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 1.0})
        tracker.log_values(6, {"val_loss": 0.5})
        tracker.log(7, {"loss": float("nan"), "lr": 1e-3, "tokens_per_s": 1.0, "skipped": True})  # a skipped step
        tracker.log_values(7, {"val_loss": float("inf"), "per_source": {"a": float("nan")}})
    finally:
        tracker.close()

    def strict(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    records = [json.loads(line, parse_constant=strict) for line in (tmp_path / "s1" / "metrics.jsonl").open()]
    assert records[-2]["loss"] is None and records[-2]["skipped"] and records[-1] == {
        "step": 7, "val_loss": None, "per_source": {"a": None}}
    assert "less than the current step" not in capfd.readouterr().err


def test_a_stage_s_cpu_peak_is_its_own():
    """On CPU the logged peak is the peak resident memory since the stage's reset, not the process's lifetime peak
    (a 512 MiB array freed before the reset does not count)."""
    import numpy as np
    import torch

    from longstride.recipes.run.tracking import peak_memory_gib, reset_peak_memory

    cpu = torch.device("cpu")
    big = np.ones(2**26)  # 512 MiB, touched
    before = peak_memory_gib(cpu)[1]
    del big
    reset_peak_memory(cpu)
    after = peak_memory_gib(cpu)[1]
    assert before - after > 0.4, (before, after)
