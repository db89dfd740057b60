"""optim.implementation: how AdamW's update runs (recipes/run/step.py adamw_implementation). auto is fused on GPUs
(torchtitan's default; the GPU benchmark's step already ran fused) and torch's own choice elsewhere, so a CPU run is
unchanged; a resumed run takes the configured implementation over the checkpoint's, with the same losses."""
from __future__ import annotations

import pytest
import torch

from longstride.recipes.config.schema import OptimConfig
from longstride.recipes.run.schedule import param_groups
from longstride.recipes.run.step import adamw_implementation, build_optimizer
from tests.conftest import rerun_from_step_3


def test_each_implementation_sets_adamw_s_own_options():
    assert adamw_implementation("auto", "cuda") == {"fused": True}
    assert adamw_implementation("auto", "cpu") == adamw_implementation("auto", None) == {}
    assert adamw_implementation("fused", "cpu") == {"fused": True}
    assert adamw_implementation("foreach", "cuda") == {"foreach": True}
    assert adamw_implementation("for_loop", "cuda") == {"foreach": False}
    assert adamw_implementation("fused", None) == {}  # the memory trace: fake or meta tensors have no fused kernel
    with pytest.raises(ValueError, match="optim.implementation='fast': use auto or one of"):
        adamw_implementation("fast", "cuda")
    model = torch.nn.Linear(4, 4)
    groups = build_optimizer(model, OptimConfig(implementation="fused"), 1e-3, "cpu").param_groups
    assert all(g["fused"] is True for g in groups)
    groups = build_optimizer(model, OptimConfig(), 1e-3, "cpu").param_groups
    assert all(not g["fused"] and not g["foreach"] for g in groups)


def test_a_run_resumed_with_the_fused_update_takes_it_and_keeps_the_losses(micro, tmp_path):
    """A checkpoint written by the CPU default (a loop over tensors) resumed with optim.implementation=fused: the
    groups run fused (logged as changed), and the resumed steps' losses equal the first run's (rel 1e-5)."""
    want, got, again = rerun_from_step_3(micro, tmp_path, "loss", [], ["optim.implementation=fused"])
    assert "fused None (now True)" in again.stderr, again.stderr[-3000:]
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in range(4, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_weight_decay_skips_every_embedding_table_whatever_its_name():
    """GPT-2 names its tables wte and wpe: the name rule alone ('embed') decayed them as projections."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= {names[id(p)] for p in no_decay["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(".attn." in n or ".mlp." in n for n in decayed), decayed
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
