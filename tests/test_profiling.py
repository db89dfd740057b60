"""profile.*: chosen steps of a stage traced by torch.profiler on chosen ranks (recipes/run/profiling.py): the
Chrome trace and the op table of exactly those steps, a window cut short written as far as it got, and bad
settings refused before anything is built."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from tests.conftest import micro_overrides
from tests.test_config import expect_error
from tests.test_faults import start


def _events(path) -> list[str]:
    return [e.get("name", "") for e in json.load(gzip.open(path))["traceEvents"]]


def test_two_processes_trace_the_chosen_steps_on_the_chosen_rank(tmp_path, cache_dir):
    args = micro_overrides(tmp_path, cache_dir) + ["stage=s1_256", "profile.start_step=2", "profile.end_step=3",
                                                   "profile.ranks=[1]", "profile.record_shapes=true"]
    proc = start(args, launcher=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    folder = tmp_path / "tiny" / "s1_256" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank1-steps2-3.json.gz", "rank1-steps2-3.txt"]
    assert f"[rank 1 longstride] profile: steps 2-3 of rank 1 traced to {folder / 'rank1-steps2-3.json.gz'}; " \
           "longest ops by own CPU time: " in out, "the traced rank reports it, though it is not the main one"
    names = _events(folder / "rank1-steps2-3.json.gz")
    assert [n for n in names if n.startswith("step ")] == ["step 2", "step 3"], "exactly the window's steps"
    assert [n for n in names if n.startswith("micro-batch ")] == ["micro-batch 1"] * 2 and \
        names.count("gradient norm") == 2, "each step's micro-batch (accumulation 1 on 2 ranks) and gradient norm"
    assert names.count("aten::mm") > 0 and any("scaled_dot_product" in n for n in names)
    table = (folder / "rank1-steps2-3.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table
    assert any(e.get("args", {}).get("Input Dims") for e in json.load(gzip.open(folder / "rank1-steps2-3.json.gz"))[
        "traceEvents"]), "profile.record_shapes: the ops' input shapes are in the trace"


def test_a_window_cut_short_is_written_as_far_as_it_got(tmp_path):
    from longstride.recipes.config.schema import ProfileConfig
    from longstride.recipes.run.profiling import StepProfiler

    logged = []
    prof = StepProfiler(ProfileConfig(start_step=2, end_step=4), "s1", str(tmp_path), 0, torch.device("cpu"),
                        logged.append)
    a = torch.randn(64, 64)
    for n in (1, 2):
        with prof.step(n):
            a = a @ a.T / 64
    with pytest.raises(RuntimeError, match="a failing step"):
        with prof.step(3):
            raise RuntimeError("a failing step")
    prof.close()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0-steps2-3.json.gz",
                                                                       "rank0-steps2-3.txt"]
    assert [n for n in _events(tmp_path / "profile" / "rank0-steps2-3.json.gz") if n.startswith("step ")] == \
        ["step 2", "step 3"], "the failing step's range as far as it ran; step 1 is not in the window"
    assert len(logged) == 1 and "steps 2-3 (step 3 cut short) of rank 0" in logged[0] and "aten::mm" in logged[0]
    prof.close()  # once written, closing again writes nothing
    again = StepProfiler(ProfileConfig(start_step=2, end_step=3), "s1", str(tmp_path), 0, torch.device("cpu"),
                         logged.append)
    for n in (2, 3):  # a resumed stage tracing the same steps again: the first trace is kept
        with again.step(n):
            a = a @ a.T / 64
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank0-steps2-3-2.json.gz", "rank0-steps2-3-2.txt", "rank0-steps2-3.json.gz", "rank0-steps2-3.txt"]


def test_a_trace_that_cannot_be_written_is_a_warning_never_the_runs_end(tmp_path):
    from longstride.recipes.config.schema import ProfileConfig
    from longstride.recipes.run.profiling import StepProfiler

    (tmp_path / "profile").write_text("a file where the folder would go")
    logged = []
    prof = StepProfiler(ProfileConfig(start_step=1), "s1", str(tmp_path), 0, torch.device("cpu"), logged.append)
    with prof.step(1):
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert len(logged) == 1 and logged[0].startswith("profile: steps 1-1 of rank 0 not written (")


@pytest.mark.parametrize("overrides, message", [
    (["profile.start_step=3", "profile.end_step=2"], r"profile.end_step=2 is before profile.start_step=3"),
    (["profile.start_step=2", "profile.stages=[s9]"], r"profile.stages names \['s9'\], not stages of this recipe"),
    (["profile.start_step=2", "profile.ranks=[2]"], r"profile.ranks=\[2\]: ranks \[2\] are not in this run of 2"),
    (["profile.start_step=100000"], r"profile.start_step=100000 is past the last step of every stage"),
    (["profile.start_step=2", "profile.memory_snapshot=true"],
     r"profile.memory_snapshot=true records CUDA's caching allocator, and this run is on cpu"),
    (["profile.ranks=[0]"], r"profile.\* is set but profile.start_step=0 \(off\)"),
    (["profile.tool=nsys"], r"profile.\* is set but profile.start_step=0 \(off\)"),
    (["profile.start_step=-1"], r"profile.start_step=-1, profile.end_step=.* must be >= 0"),
    (["profile.start_step=2", "profile.ranks=[]"], r"profile.ranks=\[\] traces nothing"),
    (["profile.start_step=2", "profile.stages=[]"], r"profile.stages=\[\] traces nothing"),
    (["profile.start_step=2", "profile.tool=nsys"], r"profile.tool=nsys marks the window for Nsight Systems on CUDA "
                                                    r".*this run is on cpu: use profile.tool=torch"),
    (["profile.start_step=2", "profile.stages=[s2_2k]", "stage=s1_256"],
     r"profile.stages=\['s2_2k'\] names none of the stages this command runs \(\['s1_256'\]\)"),
])
def test_bad_profile_settings_are_refused_naming_the_field(overrides, message):
    expect_error(overrides, message)


def test_profile_settings_and_async_save_may_change_on_a_resume():
    """They watch or save the run, not what it computes: a rerun with other values resumes instead of exiting 2."""
    from longstride.recipes.run.runlock import identity

    base = {"profile": {"start_step": 0, "ranks": None}, "train": {"async_save": False, "seed": 0}}
    changed = {"profile": {"start_step": 5, "ranks": [0]}, "train": {"async_save": True, "seed": 0}}
    assert identity(base) == identity(changed) == {"train.seed": 0}


def test_nsys_takes_none_of_torch_profilers_options_on_a_gpu():
    from longstride.recipes.config.schema import ProfileConfig
    from longstride.recipes.run.profiling import check_profile

    check_profile(ProfileConfig(tool="nsys", start_step=2, memory_snapshot=True), {"s1": 4}, ["s1"], 1, "cuda")
    with pytest.raises(ValueError, match="profile.record_shapes and profile.with_stack are torch.profiler's"):
        check_profile(ProfileConfig(tool="nsys", start_step=2, with_stack=True), {"s1": 4}, ["s1"], 1, "cuda")
