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


def _tiny_step():
    import torch

    from longstride.parallel.parallelize import OneDevice
    from longstride.recipes.run.step import StepSpec
    from tests.test_cp_model import tiny_model

    torch.manual_seed(0)
    step = build_step(tiny_model().lm, StepSpec())
    micro = [step.prep(collate([packed_item([np.arange(2, 30 + 7 * i), np.arange(3, 20)], 64, pad_id=0)]))
             for i in range(2)]
    return step, OneDevice(step.module), micro


@pytest.mark.parametrize("allowed", [True, False])
def test_optimizer_step_updates_by_the_mean_token_loss_over_every_micro_batch(allowed):
    """recipes/run/step.optimizer_step (the stage loop's update and the GPU benchmark's): with SGD at lr 1 the update
    is minus the gradient of (sum of every micro-batch's token losses) / (their labelled-token count); a step the
    guard refuses leaves the weights as they were; the gradients are cleared either way."""
    import torch

    from longstride.recipes.run.step import label_count, loss_sum, optimizer_step

    step, model, micro = _tiny_step()
    count = sum(label_count(m) for m in micro)
    assert count > 0 and label_count(micro[0]) != label_count(micro[1])  # unequal: a per-micro-batch mean is wrong
    params = dict(step.module.named_parameters())
    want_loss = sum(loss_sum(step.module, m, "cpu") for m in micro) / count
    want_loss.backward()
    grads = {n: p.grad.clone() for n, p in params.items()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    step.module.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in params.items()}
    seen = []
    opt = torch.optim.SGD(step.module.parameters(), lr=1.0)
    done = optimizer_step(model, opt, micro, torch.tensor(float(count)), "cpu", grad_clip=0.0,
                          allow=lambda loss, grad_norm: seen.append((loss, grad_norm)) or allowed)
    assert done.applied == allowed and done.lr == 1.0
    assert done.loss == pytest.approx(want_loss.item(), rel=1e-6) and seen == [(done.loss, done.grad_norm)]
    assert done.grad_norm == pytest.approx(norm, rel=1e-5)
    for n, p in params.items():
        assert p.grad is None, n
        want = before[n] - grads[n] if allowed else before[n]
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=n)
