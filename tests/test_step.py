"""One training step, built in one place (recipes/run/step.py): the step `longstride plan` traces is the step a stage
trains, with the same batch keys and the same optimizer parameter groups."""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from longstride.data.batch import BATCH_KEYS, collate, packed_item
from longstride.recipes.memory.memplan import model_config
from longstride.recipes.config.plan import validate
from longstride.recipes.run.step import build_optimizer, build_step, group_summary
from longstride.recipes.memory.trace import stage_program, trace_step
from tests.conftest import REPO, compose_cfg


@pytest.mark.parametrize("weight_decay", [0.1, 0.03])
def test_the_traced_step_is_the_stage_step(weight_decay):
    cfg = compose_cfg(["recipe=tiny_extend", f"optim.weight_decay={weight_decay}"])
    plan = validate(cfg, world=2, check_data=False)["s2_2k"]
    prog = stage_program(cfg, plan, world=2, docs=3, config=model_config(cfg, plan.stage), gpu=False, bf16=False)
    traced = trace_step(prog)
    # the stage's own step: recipes/run/stage.build_stage's calls on the model the stage trains
    lm = AutoModelForCausalLM.from_config(model_config(cfg, plan.stage))
    step = build_step(lm, plan.step)
    real = group_summary(build_optimizer(step.lm, cfg.optim, plan.stage.lr))
    assert traced["optimizer_groups"] == real
    assert real[0]["weight_decay"] == weight_decay and real[1]["weight_decay"] == 0.0
    batch = collate([packed_item([np.arange(2, 40), np.arange(2, 20)], 64, pad_id=0)])
    assert traced["batch_keys"] == sorted(step.prep(batch)[0]) == sorted(BATCH_KEYS)


# benchmarks that are not longstride's step on purpose
OUTSIDE = {"retrieval_bare_loop.py": "a bare transformers loop, outside the recipe on purpose (its docstring)"}


def test_no_training_step_is_assembled_outside_the_builder():
    """The step's assembly (patch_model, ChunkedLossLM, AdamW, with use_longstride_attention) appears only in
    recipes/run/step.py among the recipes and benchmarks. Switching a model to longstride's attention alone is not a
    step (eval and `longstride check` compare attention that way)."""
    assembly = {"patch_model", "ChunkedLossLM", "AdamW"}
    found, read = [], set()
    for path in [*(REPO / "recipes").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        if path == REPO / "recipes" / "run" / "step.py" or path.name in OUTSIDE:
            continue
        read.add(path.relative_to(REPO).as_posix())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in assembly:
                    found.append(f"{pathlib.Path(path).relative_to(REPO)}:{node.lineno} {name}")
    # the places a second step would grow: the stage loop, the tracer, the HF Trainer's integration, the benchmarks
    assert {"recipes/run/stage.py", "recipes/memory/trace.py", "recipes/hf/trainer.py",
            "benchmarks/gpu_recipe.py"} <= read, sorted(read)
    assert not found, found
