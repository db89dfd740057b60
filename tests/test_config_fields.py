"""Config fields the command line or a recipe sets that would be dropped or merged unseen: a source field its kind
does not read, a new model's sizes beside a checkpoint, a weight dict given whole on the command line."""
from __future__ import annotations

import re

import pytest

from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg
from tests.test_config import expect_error


def test_a_source_field_its_kind_does_not_read_is_refused():
    """stdlib walks its own *.py files and `files` has no exclude: a glob or exclude set there was dropped."""
    expect_error(["data.sources.stdlib.glob=json/*.py"],
                 r"data.sources.stdlib.glob: not read by kind=stdlib \(of path, glob, exclude, name, subset, split, "
                 r"text_column, synthetic it reads exclude\); drop it, or pick the kind that reads it")
    expect_error(["data=files", "data.sources.main.path=x.jsonl", "data.sources.main.exclude=a*",
                  "data.sources.main.name=b"], r"data.sources.main.exclude, data.sources.main.name: not read by "
                                               r"kind=files .* it reads path, text_column\); drop them")


def test_a_new_model_s_sizes_beside_a_checkpoint_are_refused():
    """model=checkpoint keeps the checkpoint's architecture: sizes or NoPE layers set beside it would be dropped."""
    from longstride.recipes.config.schema import SHIPPED

    base = ["model=checkpoint", f"model.checkpoint={SHIPPED}/tiny_base_256", f"data.tokenizer={SHIPPED}/tiny_base_256"]
    expect_error([*base, "model.nope_interval=2", "model.hidden_size=64"],
                 r"model.hidden_size=64, model.nope_interval=2: read only for a new model \(model.arch=smollm3\), "
                 r"and model.arch=checkpoint keeps .*tiny_base_256's architecture \(its sizes and NoPE layers\); "
                 r"drop them")
    validate(compose_cfg(base), 2)


def test_a_weight_dict_on_the_command_line_is_the_whole_dict():
    """recipe.stages.NAME.mixture={...} and a synthetic source's kinds={...} replace the recipe's dict (Hydra merges
    them: {stdlib:1.0} trained on 56% stdlib beside the recipe's other weights); a weight set (or removed: ~) after
    the dict is added to (removed from) it; a single weight still changes only that one."""
    def mixture(*overrides):
        return compose_cfg(["recipe=tiny_extend", *overrides]).recipe.stages["s2_2k"].mixture

    recipe = mixture()
    assert len(recipe) > 1 and mixture("recipe.stages.s2_2k.mixture={stdlib:1.0}") == {"stdlib": 1.0}
    assert mixture("recipe.stages.s2_2k.mixture={stdlib:1.0}", "recipe.stages.s2_2k.mixture.retrieval_mid=0.5") == {
        "stdlib": 1.0, "retrieval_mid": 0.5}
    assert mixture("recipe.stages.s2_2k.mixture.retrieval_mid=0.5") == {**recipe, "retrieval_mid": 0.5}
    assert mixture("recipe.stages.s2_2k.mixture={}") == {}
    removed = mixture("recipe.stages.s2_2k.mixture={stdlib:1.0,retrieval_mid:0.5}",
                      "~recipe.stages.s2_2k.mixture.retrieval_mid")
    assert removed == {"stdlib": 1.0}  # a weight removed after the dict is removed from it
    kinds = compose_cfg(["recipe=tiny_retrieval", "data.sources.retrieval_short.synthetic.kinds={copy:1.0}"])
    assert kinds.data.sources["retrieval_short"].synthetic.kinds == {"copy": 1.0}


def test_parallel_settings_no_stage_reads_are_refused(micro):
    """A stage's own balance where it runs no ring (cp=1, or all Ulysses), and parallel.ulysses / upipe_heads in a
    recipe whose stages all run cp=1, were accepted and did nothing."""
    one = ["recipe.stages.s2_2k.cp=1", "recipe.stages.s3_4k.cp=1"]  # the micro recipe's stages all at cp=1
    cases = [(["recipe.stages.s2_2k.balance=docs"], "recipe.stages.s2_2k.balance=docs deals a ring's chunks, and "
                                                    "stage s2_2k runs no ring (cp 1); drop recipe.stages.s2_2k.balance"),
             ([*one, "parallel.cp_impl=hybrid", "parallel.ulysses=2"],
              "parallel.ulysses=2 splits a stage's cp ranks, and no stage of recipe tiny has cp > 1"),
             ([*one, "parallel.cp_impl=upipe", "parallel.upipe_heads=2"], "parallel.upipe_heads=2 splits")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            validate(compose_cfg(micro + extra), 1)
    cfg = compose_cfg(["recipe=tiny", "parallel.cp_impl=ulysses", "recipe.stages.s2_2k.balance=docs"])
    with pytest.raises(ValueError, match=r"stage s2_2k runs no ring \(cp 2, all ulysses\)"):
        validate(cfg, 2)
    validate(compose_cfg(micro + ["recipe.stages.s3_4k.cp=2", "recipe.stages.s3_4k.balance=docs"]), 2)
