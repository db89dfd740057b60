"""What reads a token's position from the tokens one process holds is refused under context parallelism past the
point where it acts, never computed on a rank's share: Phi-3's longrope past its original window, Llama 4's query
temperature from floor_scale on (the fault itself caused here); dynamic NTK RoPE passes; the recipe check refuses a
stage that splits longrope past its window."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from longstride.parallel.attention import unsupported_attention
from tests.test_attention_refusal import SMALL


def _phi3_longrope():
    factors = [1.0] * 2  # head_dim 8, partial rotary 0.5: 2 frequencies
    return T.Phi3Config(**SMALL, max_position_embeddings=256, original_max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2,
                        partial_rotary_factor=0.5, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                    "short_factor": factors, "long_factor": factors,
                                                                    "original_max_position_embeddings": 64})


@pytest.mark.parametrize("name, make, cls, threshold, what", [
    ("phi3_longrope", _phi3_longrope, T.Phi3ForCausalLM, 65, "rope_type=longrope"),
    ("llama4_temperature", lambda: T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                                      attention_chunk_size=16, floor_scale=32,
                                                      attn_temperature_tuning=True),
     T.Llama4ForCausalLM, 32, "attn_temperature_tuning=True")])
def test_what_reads_positions_from_a_rank_s_own_tokens_is_refused_under_cp_past_its_threshold(
        name, make, cls, threshold, what):
    """longrope RoPE picks its frequencies from the largest position in the batch, and Llama 4's
    query temperature counts the tokens a process holds: under context parallelism each rank sees only its share,
    so a stage that splits sequences past the point where these start to act is refused; shorter split stages,
    and any unsplit stage, pass."""
    model = cls(make())
    assert unsupported_attention(model) == [] and unsupported_attention(model, threshold - 1) == []
    found = unsupported_attention(model, threshold)
    assert len(found) == 1 and what in found[0] and "with cp > 1" in found[0], found


def test_dynamic_rope_and_flat_entries_holding_none_pass():
    """Dynamic NTK acts only past max positions, which a stage raises to its own length: not refused. A flat
    rope_parameters with a None value (longrope's optional mscales) is read as flat, not per layer type."""
    dynamic = T.LlamaForCausalLM(T.LlamaConfig(**SMALL, max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    assert unsupported_attention(dynamic, 4096) == []
    config = _phi3_longrope()
    config.rope_parameters = {**config.rope_parameters, "long_mscale": None, "short_mscale": None}
    found = unsupported_attention(T.Phi3ForCausalLM(config), 4096)
    assert len(found) == 1 and "rope_type=longrope" in found[0] and "past 64 positions" in found[0]


def test_llama4_temperature_under_cp_really_differs():
    """The fault the refusal above guards against, caused: the queries Llama 4's NoPE layer hands attention, with
    transformers' temperature computed on the tokens it is given, differ between a whole sequence's second half
    and that half given alone (what a second CP rank holds) once positions pass floor_scale."""
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                                   attention_chunk_size=64, floor_scale=8,
                                                   attn_temperature_tuning=True, no_rope_layers=[0, 0])).eval()
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(query)
        return query.transpose(1, 2), None

    T.AttentionInterface.register("query_spy", spy)
    model.set_attn_implementation("query_spy")
    attn, hidden = model.model.layers[0].self_attn, torch.randn(1, 32, SMALL["hidden_size"])
    assert not attn.use_rope
    with torch.no_grad():
        attn(hidden, None, None)
        attn(hidden[:, 16:], None, None)
        attn.attn_temperature_tuning = False  # the control: without the temperature the halves agree
        attn(hidden, None, None)
        attn(hidden[:, 16:], None, None)
    whole, half, plain_whole, plain_half = seen
    assert not torch.allclose(whole[:, :, 16:], half, atol=1e-4)
    torch.testing.assert_close(plain_whole[:, :, 16:], plain_half)


def test_a_recipe_splitting_longrope_past_its_window_is_refused_at_validation(tmp_path):
    """The recipe check sees the stages: Phi-3's longrope is refused for a stage split over 2 CP ranks past its
    original window, naming the checkpoint, and accepted when that stage runs on one rank."""
    from longstride.recipes.config.plan import validate
    from tests.conftest import compose_cfg

    _phi3 = T.Phi3ForCausalLM(_phi3_longrope())
    _phi3.save_pretrained(tmp_path / "phi3")
    base = ["recipe=extend_pretrained", f"model.checkpoint={tmp_path / 'phi3'}", "data.tokenizer=/no/tokenizer"]
    with pytest.raises(ValueError, match=rf"model.checkpoint={tmp_path / 'phi3'}: .*rope_type=longrope .*a 4096-tok"):
        validate(compose_cfg([*base, "recipe.stages.x4.cp=2"]), world=2)
    # one rank per sequence: passes on to the next check
    with pytest.raises(ValueError, match=r"data.tokenizer='/no/tokenizer' is not a directory"):
        validate(compose_cfg(base), world=1)
