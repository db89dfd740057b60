"""A saved directory as readers outside longstride take it: plain transformers 5 gets the same model, readers older
than transformers 5 find the stage's RoPE base under the key they know, and readers that rebuild the
NoPE layers from `no_rope_layer_interval` get the same layers or are warned (model/build.py save_config,
pattern_interval, scratch_notes)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch


def _saved(tmp_path, **model_fields):
    from longstride.model.build import build_model, save_config
    from longstride.model.config import ModelConfig, YarnConfig

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300)
    fields.update(model_fields)
    if "yarn" in fields:
        fields["yarn"] = YarnConfig(factor=fields["yarn"])
    cfg = ModelConfig(**fields)
    lm = build_model(cfg, 5e5, 256, 300, 0, 1, seed=3)
    lm.save_pretrained(tmp_path)
    save_config(lm, str(tmp_path))
    return cfg, lm, json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("fields, interval", [
    ({"nope_interval": 2}, 2), ({"nope_interval": 0}, 5), ({"nope_layers": [1, 3]}, 2), ({"nope_layers": [0, 2]}, None),
])
def test_a_saved_stage_loads_as_the_same_model_and_says_its_rope_and_nope_layers_to_older_readers(
        tmp_path, fields, interval):
    """config.json held only transformers 5's rope_parameters and no_rope_layer_interval = max(nope_interval, 1):
    RoPE everywhere saved interval 1 (every layer NoPE to a reader rebuilding the layers from it), and a transformers
    4 reader took its class's default base instead of the stage's 5e5. The base is mirrored, the scaling not (a
    stale rope_scaling would override rope_parameters in transformers 5)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longstride.model.build import nope_pattern, scratch_notes

    cfg, lm, saved = _saved(tmp_path, yarn=2.0, **fields)
    assert saved["rope_theta"] == 5e5 and saved["rope_parameters"]["factor"] == 2.0
    assert "rope_scaling" not in saved, "transformers 5 would read a stale copy over rope_parameters"
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == lm.config.rope_parameters
    edited = {**saved, "rope_parameters": {**saved["rope_parameters"], "rope_theta": 1e6}}  # a later hand edit
    (tmp_path / "config.json").write_text(json.dumps(edited))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"] == 1e6, "rope_parameters wins"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    if interval is not None:  # the interval rebuilds the saved list
        assert saved["no_rope_layer_interval"] == interval
        assert nope_pattern(4, interval, None) == saved["no_rope_layers"]
    notes = scratch_notes(cfg, 300)
    assert (saved["no_rope_layers"] != [1, 1, 1, 0]) == any("NoPE layers" in n for n in notes), notes
    if interval is None:
        assert "[0, 2] has no interval form" in notes[0]
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, lm.eval()(ids).logits)


def test_a_stage_without_scaling_writes_no_rope_scaling_and_every_4th_layer_says_nothing(tmp_path):
    from longstride.model.build import scratch_notes

    cfg, _, saved = _saved(tmp_path, num_hidden_layers=8)
    assert saved["rope_theta"] == 5e5
    assert saved["no_rope_layer_interval"] == 4 and saved["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0]
    assert scratch_notes(dataclasses.replace(cfg, vocab_size=None), 300) == []


def test_a_stage_continued_from_an_older_base_saves_a_consistent_interval_and_gpt2_s_eval_records_no_rope(tmp_path):
    """A base saved before the interval was derived (all-RoPE with interval 1) kept it through every later stage;
    an eval of a model without RoPE (GPT-2's learned positions) failed writing what RoPE it ran with."""
    from transformers import GPT2Config

    from longstride.eval.load import applied_rope
    from longstride.model.build import build_model, save_config
    from longstride.model.config import ModelConfig

    lm = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=300, nope_interval=0), 1e4, 256, 300, 0, 1)
    lm.config.no_rope_layer_interval = 1  # as the shipped all-RoPE base said
    save_config(lm, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["no_rope_layer_interval"] == 5
    assert applied_rope(GPT2Config(n_positions=128)) == {"rope_parameters": None, "max_position_embeddings": 128}
