"""RULER's prefill on a GPU: a prompt prefilled in chunks from a shared prefix's cache through `prefill_attention`'s
GPU path (one SDPA call with torch's lower-right causal bias, no mask tensor) gives, in bf16, the last-token
logits and KV cache of one forward of the whole prompt in fp32 to within 1.5x the error of transformers' own bf16
SDPA forward (with its mask) on the same prompt; and the flash kernel is what ran."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from longstride.eval.hf_adapter import cache_kw
from longstride.eval.ruler.generate import _prefill
from longstride.model.build import build_model
from longstride.model.config import ModelConfig, YarnConfig

CUDA = torch.device("cuda")


def _model(dtype):
    cfg = ModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2, yarn=YarnConfig(factor=2.0))
    torch.manual_seed(0)
    model = build_model(cfg, rope_theta=1e4, seq_len=2048, vocab_size=1000, eos_id=0, pad_id=1).eval()
    model.set_attn_implementation("sdpa")
    return model.to(device=CUDA, dtype=dtype)


def _full(model, ids):
    kw = cache_kw(model)
    with torch.no_grad():
        out = model(torch.tensor([ids], device=CUDA), use_cache=True, **{kw: DynamicCache(config=model.config)})
    return out.logits[0, -1].float(), [layer.keys.float() for layer in out.past_key_values.layers]


def test_lower_right_prefill_matches_the_full_forward_in_bf16():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 1000, (3000,), generator=g).tolist()  # past the 2048 positions YaRN stretches
    ref_logits, ref_keys = _full(_model(torch.float32), ids)
    model = _model(torch.bfloat16)
    sdpa_logits, sdpa_keys = _full(model, ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cache, logits = _prefill(model, ids, 1024, CUDA, cache_kw(model))
    assert any("flash" in e.name for e in prof.events()), "the prefill did not run the flash kernel"
    err, sdpa_err = ((x.float() - ref_logits).abs().mean().item() for x in (logits, sdpa_logits))
    print(f"logits: mean error {err:.3g}, transformers' bf16 SDPA {sdpa_err:.3g}")
    assert err <= 1.5 * sdpa_err, (err, sdpa_err)
    for mine, theirs, ref in zip(cache.layers, sdpa_keys, ref_keys, strict=True):
        assert mine.keys.shape == ref.shape
        err, sdpa_err = ((x.float() - ref).abs().mean().item() for x in (mine.keys, theirs))
        assert err <= 1.5 * sdpa_err + 1e-3, (err, sdpa_err)  # the first layer's keys are exact in both
