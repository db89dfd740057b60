"""Attention that longstride does not implement is refused, naming it, never dropped: tiny random models of
transformers' own classes with logit soft-capping (Gemma 2), bidirectional attention (Gemma 3 with
use_bidirectional_attention), a layer type that is not attention longstride computes (linear attention), chunked
layers without a chunk size. Sliding windows, chunks and sinks are computed (tests/test_attention_patterns.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers as T

from longstride.parallel.attention import longstride_attention, unsupported_attention, use_longstride_attention

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
REFUSED = {  # model -> (config, class, what the refusal names)
    "gemma2": (lambda: T.Gemma2Config(**SMALL, sliding_window=16), T.Gemma2ForCausalLM, "attn_logit_softcapping"),
    "gemma3_bidirectional": (lambda: T.Gemma3TextConfig(**SMALL, use_bidirectional_attention=True),
                             T.Gemma3ForCausalLM, "is_causal=False"),
    "qwen2_linear_attention": (lambda: T.Qwen2Config(**SMALL, layer_types=["full_attention", "linear_attention"]),
                               T.Qwen2ForCausalLM, "linear_attention"),
    "llama4_chunks_without_size": (lambda: T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                                              layer_types=["chunked_attention", "full_attention"],
                                                              attention_chunk_size=None),
                                   T.Llama4ForCausalLM, "attention_chunk_size is not set"),
}
COMPUTED = {  # windows, sinks, chunks: accepted
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=16)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, sliding_window=16)),
    "gpt_oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1,
                                                          sliding_window=16)),
    "llama4": lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                                             attention_chunk_size=16)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_with_attention_longstride_does_not_compute_are_refused_naming_it(name):
    make, cls, what = REFUSED[name]
    model = cls(make())
    with pytest.raises(NotImplementedError, match="Refused rather than silently dropped") as e:
        use_longstride_attention(model)
    assert cls.__name__ in str(e.value) and what in str(e.value)
    assert model.config._attn_implementation != "longstride"  # nothing was switched


@pytest.mark.parametrize("name", sorted(COMPUTED))
def test_windows_sinks_and_chunks_are_accepted(name):
    model = COMPUTED[name]()
    assert unsupported_attention(model) == []
    use_longstride_attention(model)
    assert model.config._attn_implementation == "longstride"


def test_what_a_call_asks_for_and_is_not_computed_fails_at_once():
    """Defence in depth: an attention call that carries soft-capping, bidirectional attention or sinks of the wrong
    shape fails at once; a window or chunk of at least the sequence is plain causal."""
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match="softcap"):
        longstride_attention(torch.nn.Module(), q, k, v, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        longstride_attention(torch.nn.Module(), q, k, v, None, is_causal=False)
    with pytest.raises(ValueError, match="s_aux"):
        longstride_attention(torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(3))
    plain, _ = longstride_attention(torch.nn.Module(), q, k, v, None)
    wide, _ = longstride_attention(torch.nn.Module(), q, k, v, None, sliding_window=8)
    narrow, _ = longstride_attention(torch.nn.Module(), q, k, v, None, sliding_window=2)
    assert torch.equal(plain, wide) and not torch.allclose(plain, narrow)


def test_a_recipe_on_a_soft_capped_checkpoint_fails_before_any_data(tmp_path):
    """`longstride train` with model=checkpoint on Gemma 2 (soft-capped attention): exit 2 at validation, naming the
    field, before the data is read or a model is trained."""
    ckpt = tmp_path / "gemma2"
    T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, sliding_window=16)).save_pretrained(ckpt)
    proc = subprocess.run([sys.executable, "-m", "longstride.recipes.train", "recipe=extend_pretrained",
                           f"model.checkpoint={ckpt}", f"data.tokenizer={ckpt}", f"paths.output_root={tmp_path}/out"],
                          capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"model.checkpoint={ckpt}" in proc.stderr and "attn_logit_softcapping" in proc.stderr
    assert not (tmp_path / "out").exists()
