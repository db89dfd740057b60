"""model.rope_layer_types: a stage's RoPE base and YaRN reach only the named layer types on models that keep RoPE
per layer type (Gemma 3, OLMo 3), every layer on one-dict models (Llama), and a selection a model cannot express
is refused naming the field. Checked on the rotary embeddings the models build, on tiny random transformers
models saved as checkpoints."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          Llama4TextConfig, Olmo3Config, Olmo3ForCausalLM)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from longstride.eval.cli import parse_ppl
from longstride.model.build import build_model, load_config_with_yarn
from longstride.model.config import ModelConfig, YarnConfig
from longstride.model.rope import rope_placement, rope_targets
from longstride.recipes.config.plan import validate
from tests.conftest import compose_cfg

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=2,
             eos_token_id=1)
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HEAD_DIM, TRAINED = 8, 128


def save_tiny(directory, model_cls, config) -> str:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model_cls(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    """Gemma 3 text: local layers at base 1e4, global ones at 1e6 (transformers' defaults); a window longer
    than any test length, so longstride's attention accepts it."""
    config = Gemma3TextConfig(**SHAPE, layer_types=TYPES, sliding_window=8192)
    return save_tiny(tmp_path_factory.mktemp("gemma3"), Gemma3ForCausalLM, config)


@pytest.fixture(scope="module")
def olmo(tmp_path_factory) -> str:
    """OLMo 3: both layer types at base 5e5 (transformers' default)."""
    config = Olmo3Config(**SHAPE, layer_types=TYPES, sliding_window=8192)
    return save_tiny(tmp_path_factory.mktemp("olmo3"), Olmo3ForCausalLM, config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    config = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return save_tiny(tmp_path_factory.mktemp("llama"), LlamaForCausalLM, config)


def default_inv_freq(theta: float) -> torch.Tensor:
    """RoPE's inverse frequencies, theta^(-2i/d) (arXiv:2104.09864), written out as the reference."""
    return 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)


def yarn_reference(theta: float, factor: float) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention scale for one flat-dict Llama at `theta`: transformers' YaRN on a
    config with one rope_parameters, the path every single-RoPE model takes."""
    flat = LlamaConfig(**{**SHAPE, "max_position_embeddings": int(TRAINED * factor)},
                       rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                        "original_max_position_embeddings": TRAINED})
    return ROPE_INIT_FUNCTIONS["yarn"](flat, "cpu")


def rotary(model, layer_type: str, length: int = 16):
    """The cos/sin that the model's rotary embedding gives `layer_type`'s layers at positions 0..length-1."""
    x = torch.zeros(1, length, SHAPE["hidden_size"])
    positions = torch.arange(length)[None]
    return model.model.rotary_emb(x, positions, layer_type)


def reference_cos(inv_freq: torch.Tensor, scale: float = 1.0, length: int = 16) -> torch.Tensor:
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    return (torch.cat([angles, angles], dim=-1).cos() * scale).float()[None]


def stage(checkpoint: str, rope_theta: float, layer_types=None, yarn: float | None = None, seq_len: int = 256):
    """The model a recipe stage builds from `checkpoint` (model/build.py, as recipes/run/stage.py calls it)."""
    cfg = ModelConfig(arch="checkpoint", checkpoint=checkpoint, rope_layer_types=layer_types,
                      yarn=YarnConfig(factor=yarn))
    return build_model(cfg, rope_theta, seq_len, vocab_size=64, eos_id=1, pad_id=0).eval()


@pytest.mark.parametrize("layer_types, bumped", [(None, {"full_attention"}),
                                                 (["sliding_attention"], {"sliding_attention"}),
                                                 (["full_attention", "sliding_attention"], set(TYPES))])
def test_gemma3_base_bump_reaches_only_the_named_types(gemma, layer_types, bumped):
    before = {"full_attention": 1e6, "sliding_attention": 1e4}
    model = stage(gemma, 5e6, layer_types)
    for layer_type, theta in before.items():
        want = 5e6 if layer_type in bumped else theta
        inv_freq = getattr(model.model.rotary_emb, f"{layer_type}_inv_freq")
        torch.testing.assert_close(inv_freq.double(), default_inv_freq(want), rtol=1e-6, atol=0)
        cos, _ = rotary(model, layer_type)
        torch.testing.assert_close(cos, reference_cos(default_inv_freq(want)), rtol=0, atol=1e-6)
        assert model.config.rope_parameters[layer_type]["rope_theta"] == want, layer_type
    assert model.config.max_position_embeddings == 256


def test_olmo3_yarn_on_full_attention_only_matches_transformers_rope_scaling(olmo):
    """OLMo 3's own way to extend: a legacy `rope_scaling` that transformers writes into the full_attention
    entry only. A stage with YaRN x4 (rope_layer_types=null) must build those very rotary embeddings."""
    model = stage(olmo, 5e5, yarn=4.0, seq_len=TRAINED)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
    native = Olmo3ForCausalLM(Olmo3Config(**{**SHAPE, "max_position_embeddings": 4 * TRAINED}, layer_types=TYPES,
                                          sliding_window=8192, rope_scaling=scaling)).eval()
    assert model.config.rope_parameters == native.config.rope_parameters
    yarn_freq, yarn_scale = yarn_reference(5e5, 4.0)
    assert yarn_scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    want = {"full_attention": (yarn_freq, yarn_scale), "sliding_attention": (default_inv_freq(5e5), 1.0)}
    for layer_type, (inv_freq, scale) in want.items():
        cos, sin = rotary(model, layer_type, length=300)
        native_cos, native_sin = rotary(native, layer_type, length=300)
        torch.testing.assert_close(cos, reference_cos(inv_freq, scale, length=300), rtol=0, atol=1e-5)
        assert torch.equal(cos, native_cos) and torch.equal(sin, native_sin), layer_type
    assert model.config.max_position_embeddings == 4 * TRAINED


@pytest.mark.parametrize("which", ["gemma", "olmo"])
def test_a_stage_saves_and_reloads_with_plain_transformers(which, request, tmp_path):
    checkpoint = request.getfixturevalue(which)
    model = stage(checkpoint, 5e6, yarn=2.0)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(reloaded(ids).logits, logits)
        untouched = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        assert not torch.allclose(untouched(ids).logits, logits), "the bump and YaRN change the model's outputs"
    kept = untouched.config.rope_parameters["sliding_attention"]
    assert reloaded.config.rope_parameters["sliding_attention"] == kept, "sliding layers keep their RoPE"


def test_llama_one_dict_takes_the_bump_on_every_layer(llama):
    model = stage(llama, 5e6)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), default_inv_freq(5e6), rtol=1e-6, atol=0)
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 5e6}
    assert rope_placement(model.config, None) is None, "nothing per type to report"


@pytest.mark.parametrize("layer_types", [["full_attention"], ["sliding_attention"]])
def test_a_per_type_choice_on_a_one_dict_model_is_refused(llama, layer_types):
    with pytest.raises(ValueError, match=r"model.rope_layer_types=.*LlamaConfig keeps one rope_parameters.*"
                                         r"set model.rope_layer_types=null"):
        stage(llama, 5e6, layer_types)


@pytest.mark.parametrize("layer_types, match", [
    (["chunked_attention"], r"model.rope_layer_types=\['chunked_attention'\], but Gemma3TextConfig keeps no RoPE "
                            r"for layer types \['chunked_attention'\]: its rope_parameters are per layer type "
                            r"\['full_attention', 'sliding_attention'\]; set model.rope_layer_types to some"),
    ([], r"model.rope_layer_types=\[\]: name at least one of Gemma3TextConfig's RoPE layer types")])
def test_a_layer_type_the_model_lacks_is_refused(gemma, layer_types, match):
    with pytest.raises(ValueError, match=match):
        stage(gemma, 5e6, layer_types)


def test_a_nope_layer_type_and_a_default_without_full_attention_are_refused():
    config = Gemma3TextConfig(**SHAPE, layer_types=TYPES)
    config.rope_parameters["sliding_attention"] = None  # a NoPE layer type
    with pytest.raises(ValueError, match=r"layer types \['sliding_attention'\] have no RoPE .*NoPE.*"
                                         r"set model.rope_layer_types to layer types with RoPE among "
                                         r"\['full_attention'\]"):
        rope_targets(config, ["sliding_attention"])
    config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"model.rope_layer_types=null means \['full_attention'\], but "
                                         r"Gemma3TextConfig keeps no RoPE"):
        rope_targets(config, None)


def test_llama4_one_dict_beside_nope_layers_takes_no_per_type_choice():
    """Llama 4: chunked RoPE layers beside global NoPE ones (layer_types chunked_attention / full_attention), one
    rope_parameters: a bump reaches the RoPE layers only anyway, and a per-type choice is refused."""
    config = Llama4TextConfig(**SHAPE, num_local_experts=2, intermediate_size_mlp=64, no_rope_layer_interval=2)
    assert config.layer_types == ["chunked_attention", "full_attention"] * 2
    assert rope_targets(config, None) is None
    with pytest.raises(ValueError, match=r"Llama4TextConfig keeps one rope_parameters for every layer that uses "
                                         r"RoPE"):
        rope_targets(config, ["chunked_attention"])


def test_recipe_validation_refuses_before_anything_is_built(gemma, llama):
    with pytest.raises(ValueError, match=r"model.rope_layer_types=\['full_attention'\]: SmolLM3Config keeps one"):
        validate(compose_cfg(["model.rope_layer_types=[full_attention]"]), world=2)
    checkpoint = ["recipe=extend_pretrained", "data.tokenizer=/no/tokenizer"]
    with pytest.raises(ValueError, match=r"Gemma3TextConfig keeps no RoPE for layer types \['local'\]"):
        validate(compose_cfg([*checkpoint, f"model.checkpoint={gemma}", "model.rope_layer_types=[local]"]), world=1)
    with pytest.raises(ValueError, match=r"LlamaConfig keeps one rope_parameters"):
        validate(compose_cfg([*checkpoint, f"model.checkpoint={llama}", "model.rope_layer_types=[full_attention]"]),
                 world=1)
    # a valid choice passes on to the next check
    with pytest.raises(ValueError, match=r"data.tokenizer='/no/tokenizer' is not a directory"):
        validate(compose_cfg([*checkpoint, f"model.checkpoint={gemma}", "model.rope_layer_types=[sliding_attention]"]),
                 world=1)


def test_eval_yarn_goes_to_full_attention_and_names_the_eval_field(gemma):
    config, trained = load_config_with_yarn(gemma, YarnConfig(factor=2.0))
    assert trained == TRAINED and config.max_position_embeddings == 2 * TRAINED
    assert config.rope_parameters["full_attention"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                                                        "original_max_position_embeddings": TRAINED}
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"^rope_layer_types=\['global'\], but Gemma3TextConfig"):
        load_config_with_yarn(gemma, YarnConfig(factor=2.0), ["global"])
    assert parse_ppl([f"checkpoint={gemma}", "rope_layer_types=[sliding_attention]"]).rope_layer_types == \
        ["sliding_attention"]


def test_the_stage_log_says_where_the_default_put_the_base(gemma):
    model = stage(gemma, 5e6)
    line = rope_placement(model.config, None)
    assert "written to ['full_attention'] only (model.rope_layer_types=null" in line
    assert "full_attention default base 5000000.0; sliding_attention default base 10000.0" in line


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> dict:
    """Checkpoints whose RoPE is already scaled, as real ones ship: Llama 3.1's llama3 scaling, a yarn x8 model
    whose saved attention_factor is YaRN's default (OLMo 3's long-context checkpoints), Gemma 3's linear x8 on
    its global layers."""
    long = {**SHAPE, "max_position_embeddings": 8 * TRAINED}
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": TRAINED}
    yarn8 = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": TRAINED,
             "attention_factor": 0.1 * math.log(8.0) + 1.0}
    root = tmp_path_factory.mktemp("scaled")
    return {
        "llama3": save_tiny(root / "llama3", LlamaForCausalLM, LlamaConfig(**long, rope_parameters=llama3)),
        "yarn8": save_tiny(root / "yarn8", LlamaForCausalLM, LlamaConfig(**long, rope_parameters=yarn8)),
        "gemma_linear": save_tiny(root / "gemma", Gemma3ForCausalLM, Gemma3TextConfig(
            **long, layer_types=TYPES, sliding_window=8192, rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    }


@pytest.mark.parametrize("which, kind", [("llama3", "llama3"), ("gemma_linear", "linear")])
def test_yarn_over_another_scaling_is_refused_naming_it(scaled, which, kind):
    """YaRN would replace llama3 or linear scaling (the model then runs RoPE it was never trained with, at every
    length): refused at eval and in a stage, naming the field and the scaling."""
    with pytest.raises(ValueError, match=rf"^yarn.factor=2: .*already scaled \(rope_type={kind}, factor 8.0\)"):
        load_config_with_yarn(scaled[which], YarnConfig(factor=2.0))
    with pytest.raises(ValueError, match=rf"^model.yarn.factor=2: .*rope_type={kind}"):
        stage(scaled[which], 5e5, yarn=2.0, seq_len=8 * TRAINED)
    config, trained = load_config_with_yarn(scaled[which], YarnConfig())  # no YaRN: the checkpoint as it is
    assert trained == config.max_position_embeddings == 8 * TRAINED


def test_eval_yarn_on_a_yarn_checkpoint_stretches_it_further(scaled):
    """Eval's yarn.factor=2 on a yarn x8 checkpoint: YaRN x16 over the same original window, the stale attention
    factor recomputed, max positions doubled (not cut to original x 2). The rotary embedding equals
    transformers' own YaRN x16."""
    config, trained = load_config_with_yarn(scaled["yarn8"], YarnConfig(factor=2.0))
    assert trained == 8 * TRAINED and config.max_position_embeddings == 16 * TRAINED
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 5e5, "factor": 16.0,
                                      "original_max_position_embeddings": TRAINED}
    model = LlamaForCausalLM(config).eval()
    inv_freq, scale = yarn_reference(5e5, 16.0)
    assert scale == pytest.approx(0.1 * math.log(16.0) + 1.0)
    cos, _ = model.model.rotary_emb(torch.zeros(1, 300, SHAPE["hidden_size"]), torch.arange(300)[None])
    torch.testing.assert_close(cos, reference_cos(inv_freq, scale, length=300), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"already yarn over 128 positions, which it keeps"):
        load_config_with_yarn(scaled["yarn8"], YarnConfig(factor=2.0, original_max_position_embeddings=512))


def test_a_stage_keeps_a_yarn_checkpoint_s_factor_and_refuses_another(scaled):
    """A stage's model.yarn is written again on each stage's starting checkpoint: the same factor leaves it as it
    is; another factor is refused rather than silently replacing the checkpoint's."""
    model = stage(scaled["yarn8"], 5e5, yarn=8.0, seq_len=4 * TRAINED)
    assert model.config.rope_parameters["factor"] == 8.0 and model.config.max_position_embeddings == 8 * TRAINED
    with pytest.raises(ValueError, match=r"^model.yarn.factor=2: .*already yarn x8 over 128 positions"):
        stage(scaled["yarn8"], 5e5, yarn=2.0, seq_len=4 * TRAINED)


def test_a_stage_records_the_length_it_trained_at_and_yarn_extends_that(tmp_path):
    """A checkpoint whose config declares a longer window (8192, as SmolLM2's) extended by a 4096-token stage: eval
    reads 4096 as its trained length and YaRN x2 at eval extends 4096, not the declared 8192; a stage's own
    model.yarn extends the window before the stage (the source's trained length, the paper's L)."""
    from longstride.model.build import stage_config
    from longstride.model.rope import max_positions, trained_length

    base = tmp_path / "base"
    LlamaConfig(**{**SHAPE, "max_position_embeddings": 8192}).save_pretrained(base)
    cfg = ModelConfig(arch="checkpoint", checkpoint=str(base))
    stage = stage_config(cfg, rope_theta=1e6, seq_len=4096, vocab_size=64, eos_id=1, pad_id=0)
    assert (trained_length(stage), max_positions(stage)) == (4096, 8192)
    stage.save_pretrained(tmp_path / "stage")
    config, trained = load_config_with_yarn(str(tmp_path / "stage"), YarnConfig(factor=2))
    assert trained == 4096 and config.rope_parameters["original_max_position_embeddings"] == 4096
    short = tmp_path / "short"
    LlamaConfig(**{**SHAPE, "max_position_embeddings": 256}).save_pretrained(short)
    yarn = ModelConfig(arch="checkpoint", checkpoint=str(short), yarn=YarnConfig(factor=4))
    stage = stage_config(yarn, rope_theta=1e4, seq_len=1024, vocab_size=64, eos_id=1, pad_id=0)
    assert stage.rope_parameters["original_max_position_embeddings"] == 256 and max_positions(stage) == 1024


def test_a_resume_from_a_step_checkpoint_without_a_recorded_length_records_the_stages(tmp_path):
    """A step checkpoint written before stages recorded their length: the resumed stage's model (and so its final)
    records the stage's seq_len."""
    from longstride.model.rope import trained_length

    LlamaConfig(**{**SHAPE, "max_position_embeddings": 8192}).save_pretrained(tmp_path / "step")
    model = build_model(ModelConfig(arch="checkpoint", checkpoint=str(tmp_path)), rope_theta=1e6, seq_len=4096,
                        vocab_size=64, eos_id=1, pad_id=0, resume=str(tmp_path / "step"))
    assert trained_length(model.config) == 4096


def test_multimodal_gemma3_configs_give_their_text_models_positions_and_base():
    from transformers import Gemma3Config

    from longstride.model.rope import max_positions, rope_base, trained_length

    config = Gemma3Config(text_config={**SHAPE, "layer_types": TYPES, "max_position_embeddings": 2048})
    assert not hasattr(config, "max_position_embeddings") or config.max_position_embeddings is None
    assert max_positions(config) == trained_length(config) == 2048
    assert rope_base(config) == config.text_config.rope_parameters["full_attention"]["rope_theta"]


def test_checkpoints_with_another_chat_template_do_not_share_prompts(tmp_path):
    from longstride.eval.ruler.compare import tokenizer_digest

    for name, template in (("a", "{{ messages }}"), ("b", "{% for m in messages %}{{ m }}{% endfor %}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text("{}")
        (tmp_path / name / "chat_template.jinja").write_text(template)
    assert tokenizer_digest(str(tmp_path / "a")) != tokenizer_digest(str(tmp_path / "b"))


def test_the_base_a_bump_writes_over_is_read_from_the_entries_it_writes(gemma, llama):
    from transformers import AutoConfig

    from longstride.model.rope import written_base

    assert written_base(AutoConfig.from_pretrained(llama)) == 1e4
    assert written_base(AutoConfig.from_pretrained(gemma)) == 1e6  # full_attention only, by default
    assert written_base(AutoConfig.from_pretrained(gemma), ["sliding_attention"]) == 1e4
    assert written_base(AutoConfig.from_pretrained(gemma), ["full_attention", "sliding_attention"]) == 1e6  # 1e5 lowers


def test_a_stage_that_lowers_the_rope_base_it_starts_from_says_so(micro):
    """A recipe copied for a checkpoint trained at a higher base (Llama 3's 5e5 under a from-scratch recipe's 5e4)
    would lower it without a word: the stage warns, naming the field and both bases; a bump stays silent."""
    from tests.conftest import run_cli

    r = run_cli(micro + ["recipe.stages.s2_2k.rope_theta=5000"])  # s1_256 trained at 1e4, s3_4k bumps to 1e6
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stage s2_2k: recipe.stages.s2_2k.rope_theta=5000 is below the RoPE base of the model it starts from " \
           "(10000, " in r.stderr and "set recipe.stages.s2_2k.rope_theta to 10000 or more" in r.stderr, r.stderr
    assert "stage s3_4k: recipe.stages.s3_4k.rope_theta" not in r.stderr and \
        "stage s1_256: recipe.stages.s1_256.rope_theta" not in r.stderr
