"""A recipe's later stages launched on another number of processes (recipes/train.stages_to_train, plan.Unplanned):
only the stages a launch trains must fit its processes."""
from __future__ import annotations

import pytest

from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg


def test_stages_this_launch_skips_need_not_fit_its_processes(micro, tmp_path, monkeypatch):
    """Stage s1 ran on one process; the later stages go on over two, on which s1's batch does not split (its
    batch_tokens over 2 data-parallel ranks). stage=s2_2k, or a run whose s1 final is written, plans s1 as
    Unplanned (it was refused: only train.resume_from could get past it); a launch that trains s1 still refuses it,
    and train_stage an Unplanned stage that must train after all."""
    from longstride.recipes.config.plan import Unplanned
    from longstride.recipes.train import stages_to_train

    cfg = compose_cfg(micro + ["recipe.stages.s1_256.batch_tokens=256"])
    with pytest.raises(ValueError, match="recipe.stages.s1_256.batch_tokens=256 is not a multiple of dp 2"):
        validate(cfg, 2)
    recipe_dir = tmp_path / "out" / "tiny"
    assert stages_to_train(cfg, str(recipe_dir)) == ["s1_256", "s2_2k", "s3_4k"]
    (recipe_dir / "s1_256" / "final").mkdir(parents=True)
    runs = stages_to_train(cfg, str(recipe_dir))
    assert runs == ["s2_2k", "s3_4k"]
    plans = validate(cfg, 2, runs=runs)
    assert isinstance(plans["s1_256"], Unplanned) and "is not a multiple of dp 2" in plans["s1_256"].error
    assert plans["s2_2k"].dims.dp == 2
    # the restart options decide too: train.resume=false trains every stage again, train.resume_from its own and on
    assert stages_to_train(compose_cfg(micro + ["recipe.stages.s1_256.batch_tokens=256", "train.resume=false"]),
                           str(recipe_dir)) == ["s1_256", "s2_2k", "s3_4k"]
    back = compose_cfg(micro + ["recipe.stages.s1_256.batch_tokens=256",
                                f"train.resume_from={recipe_dir}/s1_256/step_000003"])
    assert stages_to_train(back, str(recipe_dir)) == ["s1_256", "s2_2k", "s3_4k"]
    only = compose_cfg(micro + ["recipe.stages.s1_256.batch_tokens=256", "stage=s3_4k"])
    assert stages_to_train(only, str(tmp_path / "elsewhere")) == ["s3_4k"]
    assert isinstance(validate(only, 2, runs=["s3_4k"])["s1_256"], Unplanned)
    from types import SimpleNamespace

    from longstride.recipes.checkpoint.format import CheckpointError
    from longstride.recipes.run import stage

    ctx = SimpleNamespace(accelerator=None, tracker=None, recipe_dir=str(recipe_dir))
    with pytest.raises(CheckpointError, match="s1_256/final is damaged"):  # s1's final (an empty folder) comes up
        stage.train_stage(ctx, plans["s1_256"], None)
    # were it to pass for gone as the stage comes up
    monkeypatch.setattr(stage, "verified_final", lambda d, shared=False: None)
    with pytest.raises(ValueError, match="stage s1_256 has no intact final checkpoint, so it trains again, and its "
                                         "layout does not fit this launch: recipe.stages.s1_256.batch_tokens=256"):
        stage.train_stage(ctx, plans["s1_256"], None)
    (recipe_dir / "s1_256" / "final").rename(recipe_dir / "s1_256" / "final.damaged")  # as the message says
    with pytest.raises(ValueError, match="recipe.stages.s1_256.batch_tokens=256 is not a multiple of dp 2"):
        validate(cfg, 2, runs=stages_to_train(cfg, str(recipe_dir)))
