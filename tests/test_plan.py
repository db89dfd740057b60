"""`longstride plan` (recipes/memory/memplan.py): per-stage memory on named GPUs from a traced step, the longest
sequence that fits, the smallest change for a stage that does not."""
from __future__ import annotations

import json
import os

from dataclasses import replace

import pytest
from transformers import SmolLM3Config

from longstride.parallel.config import ParallelConfig
from longstride.recipes.config.compose import compose_training
from longstride.recipes.memory import memplan
from longstride.recipes.memory.plan_options import hardware
from longstride.recipes.memory.trace import StepProgram, trace_step
from longstride.recipes.run.step import StepSpec
from tests.conftest import REPO
from tests.forked_cli import run_module

TINY = SmolLM3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, no_rope_layers=[1, 1],
                     use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def test_plan_prints_every_stage_of_a_recipe(tmp_path):
    out = tmp_path / "plan.json"
    r = run_module("longstride.cli", ["plan", "recipe=tiny_extend", "hardware=a100_40g", "gpus_per_node=2",
                                      "search=false", f"out={out}", "model.activation_checkpointing=true",
                                      "recipe.stages.s3_4k.checkpoint_layers=2"],
                   {**os.environ, "HF_HUB_OFFLINE": "1"}, str(REPO), 300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ESTIMATES" in r.stdout and "A100 40GB" in r.stdout
    plan = json.loads(out.read_text())
    assert [s["stage"] for s in plan["stages"]] == ["s2_2k", "s3_4k"]
    lines = r.stdout.splitlines()
    assert {"checkpointing", "kernel"} <= set(next(x for x in lines if x.startswith("stage ")).split())
    for s in plan["stages"]:
        assert s["fits"] and s["cp"] == 2 and s["fsdp"], s
        assert s["peak"] >= s["parameters"] + s["gradients"] + s["optimizer"] + s["activations"] * 0.5
        row = next(x for x in lines if x.startswith(s["stage"] + " "))
        ac = s["checkpointing"] + (" 2/4" if s["stage"] == "s3_4k" else "")  # the first 2 of the 4 layers
        assert s["checkpointing"] != "none" and f"  {ac}  {s['kernel']}  " in row, row


def test_the_plan_names_the_vocabulary_it_traced():
    """A from-scratch recipe without data.tokenizer plans with data.vocab_size's BPE (4,096), which undercounts the
    embeddings and the loss of the tokenizer the recipe means (SmolLM3's 128,256: 15.8 against 9.7 GiB per rank
    analytic at 4K); the header says so and how to plan with another; model.vocab_size and a checkpoint are named."""
    shape = ["model=smollm3_tiny"]
    assert memplan.vocabulary(compose_training(["recipe=tiny", *shape])) == (
        "vocabulary 4,096 (data.vocab_size: the BPE the run trains without data.tokenizer; plan with yours: "
        "data.tokenizer=DIR or model.vocab_size=N)")
    sized = compose_training(["recipe=tiny", *shape, "model.vocab_size=128256"])
    assert memplan.vocabulary(sized) == "vocabulary 128,256 (model.vocab_size)"
    assert memplan.model_config(sized, next(iter(sized.recipe.stages.values()))).vocab_size == 128256
    assert memplan.vocabulary(compose_training(["recipe=tiny_extend"])) == "vocabulary: the checkpoint's"


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(ValueError, match="h100_80g.*h200_141g") as e:
        hardware("h100")
    for name in ("a100_40g", "a100_80g", "b200"):
        assert name in str(e.value)


def test_the_longest_length_is_found_on_the_trace():
    prog = StepProgram(TINY, 1024, step=StepSpec("full", mlp_tile=256, loss_tile=256), docs=1)
    first = trace_step(prog)
    usable = trace_step(prog.at(3 * 1024))["peak"]  # room for three times the stage's length, not more
    length, checked, points = memplan.longest(prog, usable, first)
    assert checked and 0.95 * 3 * 1024 <= length <= 3 * 1024
    assert trace_step(prog.at(length))["peak"] <= usable


def test_the_longest_length_follows_the_phase_that_grows_fastest(monkeypatch):
    """A step's peak is the largest of its phases': one with a large fixed part (a large vocabulary's logits tile)
    can hold it at the stage's length while another, growing faster, takes over further out. Far out the line
    through the traces at 2x and 4x the length is used where it is steeper (before: the first line's 900, here)."""
    class Prog:
        seq_len, cp = 10, 1

        def at(self, length):
            p = Prog()
            p.seq_len = length
            return p

    def trace(prog):  # phase A: 100 + L, phase B: 4 L
        peak = max(100 + prog.seq_len, 4 * prog.seq_len)
        return {"peak": peak, "peak_backward": peak, "peak_optimizer": 0}

    monkeypatch.setattr(memplan, "trace_step", trace)
    length, checked, points = memplan.longest(Prog(), 1000, trace(Prog()))
    assert [p for p, _ in points] == [10, 20, 40] and not checked
    assert length == (1000 - 80) // 2 == 460, "the line through (20, 120) and (40, 160)"
    assert trace(Prog().at(length))["peak"] > 1000 >= trace(Prog().at(250))["peak"], "still an upper bound"


def test_a_stage_that_does_not_fit_gets_the_smallest_change():
    prog = StepProgram(TINY, 4096, world=4, step=StepSpec("none", mlp_tile=0, loss_tile=256), docs=1)
    changes = dict(memplan.fixes(prog, "s2_2k", ParallelConfig()))
    on = "model.activation_checkpointing=true model.checkpoint_mode="
    selective, full = f"{on}selective", f"{on}full"
    half = f"{full} recipe.stages.s2_2k.checkpoint_layers=1"  # the first of TINY's 2 layers
    assert list(changes)[:4] == ["model.mlp_tile_tokens=1024", selective, half, full]
    for what in changes:  # each one the overrides a user types
        compose_training(["recipe=tiny", *what.split()])
    assert "recipe.stages.s2_2k.cp=2" in changes and "recipe.stages.s2_2k.cp=4" in changes
    before = trace_step(prog)["peak"]
    assert trace_step(changes["model.mlp_tile_tokens=1024"])["peak"] < before
    assert trace_step(changes[full])["peak"] < trace_step(changes[selective])["peak"] < before
    assert trace_step(changes[full])["peak"] < trace_step(changes[half])["peak"] < before
    assert changes[half].step.checkpoint_layers == 1
    # from there: every layer, by its count (null would fall back to model.checkpoint_layers); offload only after
    again = dict(memplan.fixes(changes[half], "s2_2k", ParallelConfig()))
    assert f"{full} recipe.stages.s2_2k.checkpoint_layers=2" in again and not any("offload" in w for w in again)
    for what in again:
        compose_training(["recipe=tiny", *what.split()])
    wide = {**TINY.to_dict(), "num_hidden_layers": 4, "no_rope_layers": [1] * 4, "layer_types": None}
    four = replace(prog, config=SmolLM3Config(**wide))
    layered = [(w, p.step.checkpoint_layers) for w, p in memplan.fixes(four, "s2_2k", ParallelConfig())
               if "checkpoint_layers" in w]
    assert layered == [(f"{full} recipe.stages.s2_2k.checkpoint_layers=2", 2),
                       (f"{full} recipe.stages.s2_2k.checkpoint_layers=3", 3)], "half, then three quarters"
    assert trace_step(changes["recipe.stages.s2_2k.cp=2"])["peak"] < before
    # a model whose MLPs cannot be tiled gets no tile; a hybrid run's larger cp keeps its own Ulysses degree (the
    # method alone, ulysses=0, was refused: no cp was ever proposed), a degree it cannot split is passed over
    assert not any("mlp_tile" in w for w, _ in memplan.fixes(prog, "s2_2k", ParallelConfig(), tileable=False))
    hybrid = replace(prog, cp_impl="hybrid")
    grown = dict(memplan.fixes(hybrid, "s2_2k", ParallelConfig(cp_impl="hybrid", ulysses=2)))
    assert [w for w in grown if ".cp=" in w] == ["recipe.stages.s2_2k.cp=2", "recipe.stages.s2_2k.cp=4"]
    assert grown["recipe.stages.s2_2k.cp=4"].degrees.ulysses == 2
    wide_ulysses = dict(memplan.fixes(hybrid, "s2_2k", ParallelConfig(cp_impl="hybrid", ulysses=4)))
    assert [w for w in wide_ulysses if ".cp=" in w] == ["recipe.stages.s2_2k.cp=4"]



def test_a_soft_capped_checkpoint_is_planned_on_a_kernel_that_caps(tmp_path, capsys):
    """A Gemma 2 checkpoint (soft-capped scores): on GPUs the plan picks flash_attn (assumed installed, >= 2.6.2),
    whose stages are traced on torch's flash kernel with the cap left out of the traced copy (flash-attn has no
    fake implementation; the cap moves no bytes): every stage is planned, the table names the kernel; an explicit
    sdpa is refused naming the field."""
    import transformers as T

    from longstride.data.files import list_files, stdlib_root
    from longstride.data.tokenizer import train_bpe

    tok = train_bpe([open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:5]], 300)
    config = T.Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=512,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    T.Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    tok.save_pretrained(tmp_path / "gemma2")
    args = ["recipe=extend_pretrained", f"model.checkpoint={tmp_path / 'gemma2'}",
            f"data.tokenizer={tmp_path / 'gemma2'}", "hardware=h100_80g", "gpus_per_node=1", "search=false"]
    rows = memplan.main(args)
    assert [(r["stage"], r["kernel"], r["fits"]) for r in rows] == [("x2", "flash_attn", True),
                                                                    ("x4", "flash_attn", True)]
    assert all(r["peak"] > r["parameters"] + r["optimizer"] for r in rows)
    assert capsys.readouterr().out.count(" flash_attn ") == 2
    with pytest.raises(ValueError, match=r"parallel.kernel=sdpa has no logit soft-capping.*attn_logit_softcapping"):
        memplan.main([*args, "parallel.kernel=sdpa"])
