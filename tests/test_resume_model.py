"""A resumed stage keeps the model its step checkpoint was trained with: another RoPE, or another architecture
(sizes, NoPE layers), that the config now gives it is refused (model/build.py check_resumed_rope,
check_resumed_architecture)."""
from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import run_cli


def test_a_resume_compares_the_rope_and_the_max_positions_it_reads(tmp_path):
    """The resume check compares rope_parameters, and max positions only where the RoPE reads them: under plain
    RoPE a stage resumed at another seq_len (train.resume_from with train.resume_data=false, say after an
    out-of-memory) keeps its RoPE, resumes, and has its max positions raised; another base is refused, and so is a
    dynamic NTK RoPE over other max positions, and other NoPE layers (the architecture is compared too)."""
    from longstride.model.build import build_model, stage_config
    from tests.conftest import compose_cfg

    import transformers as T

    from longstride.model.build import check_resumed_rope

    model = compose_cfg(["recipe=tiny"]).model
    stage_config(model, 1e4, 256, 300, 0, 1).save_pretrained(tmp_path)  # the step checkpoint's config
    lm = build_model(model, 1e4, 512, 300, 0, 1, resume=str(tmp_path))
    assert lm.config.rope_parameters["rope_theta"] == 1e4 and lm.config.max_position_embeddings == 512
    with pytest.raises(ValueError, match="cannot change mid-stage"):
        build_model(model, 2e4, 256, 300, 0, 1, resume=str(tmp_path))
    other = dataclasses.replace(model, nope_interval=model.nope_interval + 1)  # NoPE layers changed
    with pytest.raises(ValueError, match=r"another architecture .*no_rope_layers \(was \[.*\], now \[.*\]\)"):
        build_model(other, 1e4, 256, 300, 0, 1, resume=str(tmp_path))
    # dynamic NTK reads max positions: resumed at another length it would compute other frequencies
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    at = [T.LlamaConfig(max_position_embeddings=n, rope_parameters=dict(dynamic)) for n in (16, 32)]
    with pytest.raises(ValueError, match=r"over 16 positions, and this config gives the stage .* over 32 positions"):
        check_resumed_rope(at[0], at[1], "ck")
    check_resumed_rope(at[0], T.LlamaConfig(max_position_embeddings=16, rope_parameters=dict(dynamic)), "ck")


def test_a_stage_refuses_sizes_other_than_the_model_it_continues(tmp_path):
    """model.* sizes given beside train.resume_from (or changed between runs) were logged as a changed config and
    dropped: the stage built its predecessor's architecture. They are refused, naming each."""
    from longstride.model.build import stage_config
    from tests.conftest import compose_cfg

    model = compose_cfg(["recipe=tiny"]).model
    stage_config(model, 1e4, 256, 300, 0, 1).save_pretrained(tmp_path)  # the previous stage's final
    stage_config(model, 4e5, 512, 300, 0, 1, init_from=str(tmp_path))  # the same sizes: continued
    wider = dataclasses.replace(model, hidden_size=2 * model.hidden_size)
    with pytest.raises(ValueError, match=rf"model.hidden_size gives {2 * model.hidden_size} where it has "
                                         rf"{model.hidden_size}"):
        stage_config(wider, 4e5, 512, 300, 0, 1, init_from=str(tmp_path))


def test_a_resumed_or_exported_model_keeps_its_saved_generation_config(tmp_path):
    """from_config derives a new generation config from config.json: a resumed stage's final (and an export) lost
    the saved one's eos list and sampling settings. The saved one is kept."""
    from transformers import GenerationConfig

    from longstride.model.build import build_model, stage_config
    from tests.conftest import compose_cfg

    model = compose_cfg(["recipe=tiny"]).model
    stage_config(model, 1e4, 256, 300, 0, 1).save_pretrained(tmp_path)  # the step checkpoint's config
    GenerationConfig(eos_token_id=[0, 7], do_sample=True, temperature=0.6).save_pretrained(tmp_path)
    lm = build_model(model, 1e4, 256, 300, 0, 1, resume=str(tmp_path))
    assert lm.generation_config.eos_token_id == [0, 7] and lm.generation_config.temperature == 0.6


def test_one_run_directory_named_through_a_symlink_takes_the_same_lock(tmp_path):
    from longstride.recipes.run.runlock import RunLock

    (tmp_path / "real" / "run").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "name").symlink_to(tmp_path / "real" / "run")  # the run directory under another name
    held = RunLock(str(tmp_path / "real" / "run")).acquire()
    try:
        with pytest.raises(ValueError, match="is in use by another run"):
            RunLock(str(tmp_path / "other" / "name")).acquire()
    finally:
        held.release()


def test_saved_configs_turn_the_kv_cache_on_and_a_resumed_stage_trains_without(tmp_path):
    """A stage trains without a KV cache (stage_config), and its configs were saved so: a user's generate() on a
    final recomputed the whole sequence for every new token. Saved directories say use_cache true; a stage resumed
    from one trains without it again."""
    import json

    from longstride.model.build import build_model, save_config
    from tests.conftest import compose_cfg

    model = compose_cfg(["recipe=tiny"]).model
    lm = build_model(model, 1e4, 256, 300, 0, 1)
    assert lm.config.use_cache is False
    save_config(lm, str(tmp_path))
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / name).read_text())["use_cache"] is True, name
    assert lm.config.use_cache is False, "the training model's own config is left as it was"
    assert build_model(model, 1e4, 256, 300, 0, 1, resume=str(tmp_path)).config.use_cache is False


def test_from_scratch_sizes_a_user_may_not_mean_are_said_at_the_stage_start(micro):
    """A model.vocab_size far past the trained tokenizer's ids (45K unused rows for a 50K size over a 4K BPE) and a
    model.head_dim kept from a copied config (attention 2048 wide in a 1536-wide model) built silently."""
    from longstride.model.build import scratch_notes
    from longstride.model.config import ModelConfig

    notes = scratch_notes(ModelConfig(vocab_size=50000, hidden_size=1536, num_attention_heads=16, head_dim=128), 4096)
    assert len(notes) == 2 and notes[0].startswith("model.vocab_size=50000 embeds 45904 rows that the tokenizer's "
                                                   "4096 ids never use")
    assert notes[1].startswith("attention is 2048 wide (model.num_attention_heads=16 x model.head_dim=128), not "
                               "model.hidden_size=1536")
    assert scratch_notes(ModelConfig(vocab_size=4096 + 64, hidden_size=1536, num_attention_heads=12, head_dim=128),
                         4096) == [], "a size rounded up past the ids, and a head_dim that fits, say nothing"
    r = run_cli(micro + ["stage=s1_256", "recipe.stages.s1_256.steps=2", "model.vocab_size=1024"])
    assert r.returncode == 0 and "stage s1_256: model.vocab_size=1024 embeds 640 rows that the tokenizer's 384 ids " \
        "never use" in r.stderr, r.stderr[-3000:]
