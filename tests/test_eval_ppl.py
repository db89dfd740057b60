"""eval.ppl on a micro checkpoint: lengths, YaRN at eval time, outputs, bad input."""
from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig

from longstride.eval.ppl import main, parse
from longstride.model.build import load_config_with_yarn
from longstride.model.config import YarnConfig
from tests.conftest import micro_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    micro_checkpoint(d, 300, 128)
    return d


def test_yarn_helper_applies_transformers_yarn(checkpoint):
    config, trained = load_config_with_yarn(str(checkpoint), YarnConfig(factor=2.0))
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


@pytest.mark.parametrize("override, message", [
    ("lengths=[4]", r"lengths=\[4\]: give token lengths >= 8"),
    ("tile=0", "tile=0 must be >= 1"),
    ("max_docs=0", "max_docs=0 must be >= 1"),
    ("docs_dir=/no/such/dir", "docs_dir='/no/such/dir' is not a directory"),
])
def test_bad_settings_are_named_before_the_model_loads(checkpoint, override, message):
    with pytest.raises(ValueError, match=message):
        parse([f"checkpoint={checkpoint}", override])


class _Tok:
    """A tokenizer that, like Llama's, puts BOS (id 9) before text unless told not to: one id per character."""

    def __init__(self, bos_first: bool):
        self.bos_token_id, self.bos_first = 9, bos_first

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([9] if add_special_tokens and self.bos_first else []) + [10 + ord(c) % 50 for c in text]}


@pytest.mark.parametrize("bos_first", [True, False])
def test_documents_open_with_bos_where_the_tokenizer_puts_one(tmp_path, bos_first):
    from longstride.eval.ppl import PplConfig, long_documents

    (tmp_path / "a.py").write_text("x = 1\n" * 20)
    cfg = PplConfig(docs_dir=str(tmp_path))
    (doc,) = long_documents(_Tok(bos_first), cfg, 50)
    body = [10 + ord(c) % 50 for c in "x = 1\n" * 20]
    assert doc == ([9] + body if bos_first else body)
