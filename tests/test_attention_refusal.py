"""Attention that longstride does not implement is refused, naming it, never dropped: tiny random models of
transformers' own classes with sliding windows (Mistral, Qwen2, OLMo 3, Gemma 2/3), attention sinks (GPT-OSS) and
chunked attention (Llama 4), where each of those models would otherwise train with plain causal attention."""
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
    "mistral": (lambda: T.MistralConfig(**SMALL, sliding_window=16), T.MistralForCausalLM, "sliding_window=16"),
    "qwen2": (lambda: T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=0),
              T.Qwen2ForCausalLM, "sliding_attention"),
    "gemma2": (lambda: T.Gemma2Config(**SMALL, sliding_window=16), T.Gemma2ForCausalLM, "attn_logit_softcapping"),
    "gemma3": (lambda: T.Gemma3TextConfig(**SMALL, sliding_window=16), T.Gemma3ForCausalLM, "sliding_window=16"),
    "gpt_oss": (lambda: T.GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=16),
                T.GptOssForCausalLM, "sinks"),
    "llama4": (lambda: T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                          attention_chunk_size=16), T.Llama4ForCausalLM, "attention_chunk_size=16"),
    "olmo3": (lambda: T.Olmo3Config(**{k: v for k, v in SMALL.items() if k != "head_dim"}, sliding_window=16),
              T.Olmo3ForCausalLM, "sliding_window=16"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_with_attention_beyond_causal_are_refused_naming_it(name):
    make, cls, what = REFUSED[name]
    model = cls(make())
    with pytest.raises(NotImplementedError, match="Refused rather than silently dropped") as e:
        use_longstride_attention(model)
    assert cls.__name__ in str(e.value) and what in str(e.value)
    assert model.config._attn_implementation != "longstride"  # nothing was switched


@pytest.mark.parametrize("cls, config", [(T.LlamaForCausalLM, T.LlamaConfig), (T.Qwen3ForCausalLM, T.Qwen3Config),
                                         (T.Qwen2ForCausalLM, T.Qwen2Config), (T.MistralForCausalLM, T.MistralConfig)])
def test_plain_causal_models_pass(cls, config):
    extra = {"sliding_window": None} if config is T.MistralConfig else {}
    model = cls(config(**SMALL, **extra))
    assert unsupported_attention(model) == []
    use_longstride_attention(model)


def test_a_window_that_spans_every_sequence_cuts_nothing_and_passes():
    """Phi-3.5-style configs carry a window as long as the model's positions: it never cuts; a shorter one does."""
    long_window = T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=4096, max_position_embeddings=4096))
    assert unsupported_attention(long_window) == [] and unsupported_attention(long_window, longest=8192)
    gemma = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, sliding_window=512, max_position_embeddings=512))
    assert unsupported_attention(gemma) == []
    q = k = v = torch.randn(1, 2, 8, 4)
    longstride_attention(torch.nn.Module(), q, k, v, None, sliding_window=8)  # 8 tokens, a window of 8: passes
    with pytest.raises(NotImplementedError, match="bidirectional"):
        longstride_attention(torch.nn.Module(), q, k, v, None, is_causal=False)


def test_a_window_passed_at_call_time_is_refused():
    """Defence in depth: an attention call that carries a window, sinks or soft-capping fails at once."""
    q = k = v = torch.randn(1, 2, 8, 4)
    for kw in ({"sliding_window": 4}, {"s_aux": torch.zeros(2)}, {"softcap": 30.0}):
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            longstride_attention(torch.nn.Module(), q, k, v, None, **kw)
    out, _ = longstride_attention(torch.nn.Module(), q, k, v, None, sliding_window=None)  # None is no window
    assert out.shape == (1, 8, 2, 4)


def test_a_recipe_on_a_windowed_checkpoint_fails_before_any_data(tmp_path):
    """`longstride train` with model=checkpoint on a sliding-window Mistral: exit 2 at validation, naming the field
    and the window, before the data is read or a model is trained."""
    ckpt = tmp_path / "mistral"
    T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=16)).save_pretrained(ckpt)
    proc = subprocess.run([sys.executable, "-m", "longstride.recipes.train", "recipe=extend_pretrained",
                           f"model.checkpoint={ckpt}", f"data.tokenizer={ckpt}", f"paths.output_root={tmp_path}/out"],
                          capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"model.checkpoint={ckpt}" in proc.stderr and "sliding_window=16" in proc.stderr
    assert not (tmp_path / "out").exists()
