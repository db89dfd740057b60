"""eval.ppl on a micro checkpoint: lengths, YaRN at eval time, outputs, bad input."""
from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig

from data.sources import list_files, stdlib_root
from data.tokenizer import train_bpe
from eval.ppl import main, parse
from model.build import build_model, load_config_with_yarn
from model.config import ModelConfig, YarnConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    texts = [open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:30]]
    tok = train_bpe(texts, 300)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2, initializer_range=0.3)
    model = build_model(cfg, rope_theta=1e4, seq_len=128, vocab_size=len(tok), eos_id=tok.eos_token_id,
                        pad_id=tok.pad_token_id)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_yarn_helper_applies_transformers_yarn(checkpoint):
    config = load_config_with_yarn(str(checkpoint), YarnConfig(factor=2.0))
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == 128
    assert config.rope_parameters["rope_theta"] == 1e4
    assert config.max_position_embeddings == 256
    assert AutoConfig.from_pretrained(checkpoint).rope_parameters["rope_type"] == "default", "saved dir untouched"


def test_ppl_with_and_without_yarn(checkpoint, tmp_path):
    plain = main([f"checkpoint={checkpoint}", "lengths=[64,256]", "max_docs=2", f"out={tmp_path}"])
    yarn = main([f"checkpoint={checkpoint}", "lengths=[64,256]", "max_docs=2", "yarn.factor=2", f"out={tmp_path}"])
    assert [r["length"] for r in plain] == [64, 256]
    assert all(math.isfinite(r["ppl"]) and r["docs"] == 2 for r in plain + yarn)
    assert plain[0]["yarn_factor"] == 1.0 and yarn[0]["yarn_factor"] == 2.0
    assert abs(plain[1]["tail_ppl"] - yarn[1]["tail_ppl"]) > 1e-3, "YaRN changes the rotary frequencies"
    saved = json.loads((tmp_path / "ppl_yarn2.json").read_text())
    assert saved["results"] == yarn
    assert (tmp_path / "ppl.csv").is_file() and (tmp_path / "ppl.png").stat().st_size > 0


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="checkpoint=<dir> is required"):
        parse([])
    with pytest.raises(ValueError, match="has no config.json"):
        parse([f"checkpoint={tmp_path}"])
