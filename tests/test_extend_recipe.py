"""recipe=extend_smollm2_32k: it composes and validates (stages, RoPE bases from the 2405.14591 bound, budget,
mixture), and a dry run of a few steps on a tiny stand-in checkpoint trains both stages on CPU; then the
before/after evaluation script runs end to end on its output (--smoke: short lengths, one sample)."""
from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig

from benchmarks import extend_smollm2
from longstride.recipes.config.plan import validate
from longstride.recipes.train import run
from tests.conftest import compose_cfg, micro_checkpoint


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    d = tmp_path_factory.mktemp("stand_in")
    micro_checkpoint(d, 384, 2048)
    return d


def recipe(ckpt, out, cache) -> list[str]:
    return ["recipe=extend_smollm2_32k", f"model.checkpoint={ckpt}", f"data.tokenizer={ckpt}",
            f"paths.output_root={out}", f"paths.cache_dir={cache}", "logger.wandb_mode=disabled",
            "logger.progress_bar=false"]


def test_recipe_composes_and_validates(stand_in, tmp_path, monkeypatch):
    cfg = compose_cfg(recipe(stand_in, tmp_path / "out", tmp_path / "cache"))
    plans = validate(cfg, 1, "cpu")
    assert list(plans) == ["s1_16k", "s2_32k"]
    for plan, length in zip(plans.values(), (16384, 32768)):
        s = plan.stage
        assert s.seq_len == length and s.batch_tokens == 2 ** 19 and s.total_steps == 48
        assert s.rope_theta >= 0.0424 * length ** 1.628, "the base lower bound of arXiv 2405.14591"
    assert cfg.data.doc_masking and cfg.data.tokenizer == str(stand_in)
    kinds = {name: src.kind for name, src in cfg.data.sources.items()}
    assert kinds == {"stdlib": "stdlib", "pymanual": "pymanual", "retrieval": "synthetic"}
    assert cfg.data.sources["retrieval"].weight <= 0.2, "a small synthetic share"
    overrides = recipe(stand_in, tmp_path, tmp_path)[:1] + recipe(stand_in, tmp_path, tmp_path)[2:]
    monkeypatch.chdir(tmp_path)  # the default path is relative: here it is not converted, whatever the clone holds
    # the default path, before conversion
    with pytest.raises(ValueError, match=r"model.checkpoint='checkpoints/smollm2-135m-instruct' does not exist"):
        validate(compose_cfg(overrides), 1)


def test_dry_run_on_a_stand_in_then_before_after_eval(stand_in, tmp_path, cache_dir):
    small = ["recipe.stages.s1_16k.seq_len=256", "recipe.stages.s1_16k.steps=2", "recipe.stages.s1_16k.warmup_steps=1",
             "recipe.stages.s2_32k.warmup_steps=1",
             "recipe.stages.s1_16k.batch_tokens=512", "recipe.stages.s1_16k.save_every=0",
             "recipe.stages.s2_32k.seq_len=512", "recipe.stages.s2_32k.steps=2",
             "recipe.stages.s2_32k.batch_tokens=1024", "recipe.stages.s2_32k.save_every=0",
             "data.sources.stdlib.max_docs=30", "data.sources.pymanual.max_docs=10",
             "data.sources.retrieval.synthetic.num_docs=8", "data.sources.retrieval.synthetic.min_words=100",
             "data.sources.retrieval.synthetic.max_words=400", "data.long_docs.min_tokens=128",
             "data.eval_sequences=2"]
    finals = run(compose_cfg(recipe(stand_in, tmp_path / "out", cache_dir) + small))
    assert [AutoConfig.from_pretrained(f).rope_parameters["rope_theta"] for f in finals] == [3.2e5, 1.0e6]
    for stage in ("s1_16k", "s2_32k"):  # both stages trained: two steps each, finite losses
        rows = [json.loads(line) for line in (tmp_path / "out" / "extend_smollm2_32k" / stage / "metrics.jsonl")
                .read_text().splitlines() if line.strip()]
        losses = [r["loss"] for r in rows if "loss" in r]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (stage, rows)
    out = tmp_path / "eval"
    assert extend_smollm2.main(["--before", str(stand_in), "--after", finals[-1], "--out", str(out), "--smoke"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_out_files"], "held-out stdlib files found"
    for label in ("before", "after"):
        table = summary["results"][label]["ruler"]["table"]
        assert set(table) == set(extend_smollm2.TASKS) and table["niah_single_1"].keys() == {"2048", "4096"}
        assert [r["length"] for r in summary["results"][label]["ppl"]] == [2048, 4096]
        assert all(r["docs"] > 0 and r["ppl"] > 1 for r in summary["results"][label]["ppl"])
    assert "8192" in summary["results"]["after"]["ruler_yarn2"]["mean"]
    assert (out / "table.md").read_text().count("\n") == len(extend_smollm2.TASKS) + 4
    assert (out / "before_after.png").stat().st_size > 0
