"""train.compile: torch.compile of each decoder layer's parts (model/compile.py), longstride's attention left out of
the graphs. The compiled step computes the eager step's loss and gradients (fp32, up to Inductor's reassociation),
really runs compiled graphs (dynamo gives up silently on a region it cannot compile whole: a checkpointed layer
compiled as one), keeps the parameter names, and trains a ring of 2 FSDP2 processes with full checkpointing to the
one-process eager run's losses. Selective checkpointing with compile is refused before anything is built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longstride.data.batch import collate, packed_item
from longstride.model.build import build_model
from longstride.model.config import ModelConfig
from longstride.model.loss import decoder_layers
from longstride.recipes.config.plan import validate
from longstride.recipes.run.step import StepSpec, build_step, loss_sum
from tests.conftest import compose_cfg


def _step(compile_: bool, checkpointing: str, tile: int = 0):
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2)
    lm = build_model(cfg, rope_theta=1e4, seq_len=256, vocab_size=512, eos_id=0, pad_id=1, seed=0)
    return build_step(lm, StepSpec(checkpointing, mlp_tile=tile, loss_tile=100, compile=compile_))


def _loss_and_grads(step, local):
    step.lm.zero_grad()
    loss = loss_sum(step.module, local, "cpu")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in step.lm.named_parameters()}


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(20, 236), 2, replace=False))
    return collate([packed_item([rng.integers(2, 512, n) for n in np.diff([0, *cuts, 256])], 256, pad_id=1)])


@pytest.mark.parametrize("checkpointing, tile", [("none", 0), ("full", 0), ("full", 100)])
def test_the_compiled_step_runs_compiled_graphs_and_matches_the_eager_step(checkpointing, tile):
    """Two steps on batches of three documents each (100-token tiles: two full tiles and a shorter one)."""
    from torch._dynamo.utils import counters

    from longstride.model.compile import compile_status, fresh_start

    eager, compiled = _step(False, checkpointing, tile), _step(True, checkpointing, tile)
    # 2 layers x (attention block, MLP, two norms); tiled, the MLP and the norms run tiled and their tiles compile
    assert compiled.compiled == (8 if not tile else 2)
    fresh_start()
    graphs = []
    for seed in range(2):
        batch = _batch(seed)
        want = _loss_and_grads(eager, eager.prep(batch))
        assert seed or not counters["stats"], "the eager step compiles nothing"
        loss, grads = _loss_and_grads(compiled, compiled.prep(batch))
        graphs.append(compile_status()[0])
        assert loss == pytest.approx(want[0], rel=1e-5)
        assert grads.keys() == want[1].keys()  # plain transformers names, no _orig_mod
        for name, g in grads.items():  # to fp32 reassociation (measured: under 1e-6 of the largest entry)
            err = ((g - want[1][name]).abs().max() / want[1][name].abs().max()).item()
            assert err < 2e-5, (name, err)
    # the graphs are real (a part dynamo gave up on would run eagerly and compile nothing), the second step on
    # another batch reused them, nothing ran eagerly, and dynamo broke graphs only where compile does on purpose
    assert graphs[0] >= 4 and graphs[1] == graphs[0], graphs
    assert compile_status()[1:] == (0, [], 0)
    assert any("longstride_attention" in reason for reason in counters["graph_break"])


def test_tiles_and_the_loss_tile_are_compiled(monkeypatch):
    """With tiles, each tile's function is what compiles (model/compile.compile_tile): dynamo traces the MLP's tile
    (its SiLU gating) both where the tiles run without gradients (forward, validation) and in backward's recompute.
    The chunked loss's tile compiles too (compiled_loss_tile): the head's matmul and the cross-entropy, one graph."""
    import operator

    import torch.nn.functional as F

    from longstride.model import prepare
    from longstride.model.compile import fresh_start
    from longstride.model.loss import tile_loss_sum
    from longstride.recipes.run import step as step_module

    seen = []

    def spying(gm, inputs):  # a dynamo backend that records each graph and runs it as traced
        ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        if F.silu in ops and operator.mul in ops:
            seen.append(("mlp tile", torch.is_grad_enabled()))
        if F.linear in ops and F.cross_entropy in ops:
            seen.append(("loss tile", torch.is_grad_enabled()))
        return gm.forward

    monkeypatch.setattr(prepare, "compile_tile", lambda fn: torch.compile(fn, dynamic=True, backend=spying))
    monkeypatch.setattr(step_module, "compiled_loss_tile", lambda: torch.compile(tile_loss_sum, backend=spying))
    fresh_start()
    step = _step(True, "full", 100)
    _loss_and_grads(step, step.prep(_batch(0)))
    assert set(seen) == {("mlp tile", False), ("mlp tile", True), ("loss tile", True)}, seen


def test_compile_with_selective_checkpointing_is_refused_before_anything_is_built():
    cfg = compose_cfg(["recipe=tiny_extend", "train.compile=true", "model.activation_checkpointing=true",
                       "model.checkpoint_mode=selective"])
    with pytest.raises(NotImplementedError, match=r"train.compile=true with model.checkpoint_mode=selective.*"
                                                  r"model.checkpoint_mode=full"):
        validate(cfg, world=2, check_data=False)
    with pytest.raises(NotImplementedError, match="train.compile=true with model.checkpoint_mode=selective"):
        _step(True, "selective")
    plans = validate(compose_cfg(["recipe=tiny_extend", "train.compile=true"]), world=2, check_data=False)
    assert all(p.step.compile for p in plans.values())


@pytest.mark.parametrize("fsdp", [True, False])
def test_a_compiled_ring_of_two_trains_to_the_eager_one_process_losses(tmp_path, cache_dir, s1_reference, fsdp):
    """cp=2 ring, compiled, under FSDP2 (full activation checkpointing, 24-token MLP tiles: two full tiles and a
    shorter one of a rank's 64 tokens) and under DDP (whose gradient buckets dynamo splits its graphs for): the
    losses, validation losses and gradient norms of 6 AdamW steps equal the eager one-process run's (rel 1e-5)."""
    from tests.test_train import _one_vs_two_processes

    extra = ["train.compile=true", f"parallel.fsdp={str(fsdp).lower()}"] + (
        ["model.activation_checkpointing=true", "model.mlp_tile_tokens=24"] if fsdp else [])
    # tiled: the attention blocks compile (their q/k/v run tiled), the MLPs and norms run tiled with compiled tiles
    parts, model = ("2 parts", "FSDPChunkedLossLM") if fsdp else ("8 parts", "DistributedDataParallel")
    _one_vs_two_processes(tmp_path, cache_dir, lambda two: [f"recipe.stages.s1_256.cp={2 if two else 1}",
                                                            *(extra if two else [])],
                          [f"model {model}", f"torch.compile on {parts} of the decoder layers", "dp 1, cp 2",
                           "graphs compiled for this stage (the first step ran at"],
                          absent=("ran eagerly", "graph breaks in the layers' parts"),
                          one=s1_reference)
    from tests.conftest import read_metrics

    m = read_metrics(tmp_path / "two" / "tiny" / "s1_256")  # the first step's rates include compiling: flagged
    assert m[1].get("compiling") == 1 and all("compiling" not in m[s] for s in range(2, 7))


def test_a_compiled_step_that_compiled_nothing_is_reported():
    """The real fall-back: whole checkpointed layers compiled as one (torchtitan's granularity) give dynamo a
    checkpoint region with longstride's attention inside, which it cannot compile whole, so it runs the layers eagerly
    without an error. The stage's first-step report says so instead of claiming compiled graphs."""
    from longstride.model.compile import fresh_start, report_compiled

    step = _step(False, "full")
    for layer in decoder_layers(step.lm):
        layer.compile()
    fresh_start()
    batch = collate([packed_item([np.arange(2, 200), np.arange(2, 58)], 256, pad_id=1)])
    _loss_and_grads(step, step.prep(batch))
    log = _Log()
    report_compiled(log, {"tokens_per_s": 100.0})
    from transformers.modeling_layers import GradientCheckpointingLayer

    if "__call__" not in vars(GradientCheckpointingLayer):  # transformers 5.24 checkpoints the layer's forward
        assert log.lines[0][0] == "warning" and "compiled no graph" in log.lines[0][1]
    else:  # 5.17 (the GPU machine's) checkpoints its __call__, inside which the compiled whole compiles: no fall-back
        assert log.lines[0][0] == "info" and "graphs compiled for this stage" in log.lines[0][1]
    fresh_start()
    compiled = _step(True, "full")
    _loss_and_grads(compiled, compiled.prep(batch))
    report_compiled(log, {"tokens_per_s": 100.0})
    assert log.lines[1][0] == "info" and "graphs compiled for this stage" in log.lines[1][1]


def test_parts_that_hit_the_recompile_limit_are_reported():
    """The other silent fall-back: past dynamo's recompile limit a function runs eagerly, with a log line of torch's
    own. Three micro stages in one process reached the limit of 8 (hence a fresh start per stage); here the limit is
    1, and the RoPE and NoPE layers' attention blocks need two graphs."""
    from longstride.model.compile import fresh_start, report_compiled

    batch = collate([packed_item([np.arange(2, 200), np.arange(2, 58)], 256, pad_id=1)])
    fresh_start()
    with torch._dynamo.config.patch(recompile_limit=1):  # fresh_start raised it: lowered here
        compiled = _step(True, "none")
        _loss_and_grads(compiled, compiled.prep(batch))
    log = _Log()
    report_compiled(log, {"tokens_per_s": 100.0})
    assert log.lines[0][0] == "warning" and "ran eagerly (Dynamo recompile limit exceeded)" in log.lines[0][1]
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default: a stage raises it (RECOMPILE_LIMIT)
        fresh_start()
        assert torch._dynamo.config.recompile_limit == 64


def test_a_graph_break_in_a_layer_part_is_reported(monkeypatch):
    """A part whose code dynamo cannot trace whole (here the MLP breaks its graph itself, as an untraceable op in a
    model's own code would) compiles in pieces: the report says so rather than claiming compiled layers."""
    from longstride.model.compile import fresh_start, report_compiled

    step = _step(True, "none")
    for layer in decoder_layers(step.lm):
        mlp_forward = layer.mlp.forward

        def breaking(x, forward=mlp_forward):
            y = forward(x)
            torch._dynamo.graph_break()
            return y * 1.0

        monkeypatch.setattr(layer.mlp, "forward", breaking)
    fresh_start()
    _loss_and_grads(step, step.prep(_batch(0)))
    log = _Log()
    report_compiled(log, {"tokens_per_s": 100.0})
    assert [kind for kind, _ in log.lines] == ["info", "warning"], log.lines
    assert "graph breaks in the layers' parts beyond longstride's own" in log.lines[1][1]


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(("info", msg % args))

    def warning(self, msg, *args):
        self.lines.append(("warning", msg % args))


def test_the_compile_benchmark_runs(tmp_path):
    """benchmarks/bench_compile.py --smoke: every build measured, the compiled ones compiling in their first step."""
    from benchmarks import bench_compile

    result = bench_compile.main(["--smoke", "--out", str(tmp_path / "compile.json")])
    assert [r["build"] for r in result["rows"]] == ["none", "none compiled", "full", "full compiled"]
    assert all(r["step_s_median"] > 0 and r["vs_eager_paired"] > 0 for r in result["rows"])
    assert [r["new_graphs"] > 0 for r in result["rows"][:2]] == [False, True]  # the first compiled build compiled
    assert not any(r["eager_frames"] for r in result["rows"])
    assert (tmp_path / "compile.json").exists()
