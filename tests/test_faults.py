"""Faults on the tiny model: bad numerical state is skipped, never saved, and stops the run with a
message naming the last good checkpoint; non-finite config values fail before compute."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from longstride.recipes.faults import NonFiniteError, NonFiniteGuard, check_finite_parameters
from tests.conftest import run_cli


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


@pytest.mark.parametrize("override, field", [("recipe.stages.s1_256.rope_theta=nan", "recipe.stages.s1_256.rope_theta"),
                                             ("optim.eps=inf", "optim.eps"),
                                             ("recipe.stages.s2_2k.lr=-inf", "recipe.stages.s2_2k.lr")])
def test_non_finite_config_values_fail_before_compute(micro, override, field):
    r = run_cli(micro + [override])
    assert r.returncode == 2
    assert f"config fields {field}=" in r.stderr and "not finite" in r.stderr
    assert "tokenizing" not in r.stderr  # before any data work


def test_second_run_on_one_directory_is_refused_and_the_lock_dies_with_its_holder(micro, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from longstride.recipes.runlock import RunLock
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
