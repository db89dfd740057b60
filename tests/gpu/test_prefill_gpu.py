"""RULER's prefill on a GPU: a prompt prefilled in chunks from the cache of a prefix it shares with another prompt,
through `prefill_attention`'s GPU path (one SDPA call a layer with torch's lower-right causal bias, no mask tensor),
gives in bf16 the last-token logits and KV cache of one fp32 forward of the whole prompt to within 1.5x the error of
transformers' own bf16 SDPA forward (with its mask); and its attention calls over the cache ran the flash kernel.
Windowed, soft-capped, sink and chunked layers (Gemma 3, Gemma 2, GPT-OSS, Llama 4) through its patterned path
against the models' own eager attention."""
from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from longstride.eval.hf_adapter import buffer_cache, cache_kw, put_row, row_prefix
from longstride.eval.ruler.generate import _prefill
from longstride.model.build import build_model
from longstride.model.config import ModelConfig, YarnConfig

CUDA = torch.device("cuda")
LAYERS, CHUNK = 4, 1024


def _model(dtype):
    cfg = ModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, nope_interval=2, yarn=YarnConfig(factor=2.0))
    torch.manual_seed(0)
    model = build_model(cfg, rope_theta=1e4, seq_len=2048, vocab_size=1000, eos_id=0, pad_id=1).eval()
    model.set_attn_implementation("sdpa")
    return model.to(device=CUDA, dtype=dtype)


@torch.no_grad()
def _full(model, ids):
    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([ids], device=CUDA), use_cache=True, **{cache_kw(model): cache})
    return out.logits[0, -1].float(), out.past_key_values


def _errors(got: DynamicCache, ref: DynamicCache) -> list[float]:
    return [(mine.float() - theirs.float()).abs().mean().item() for a, b in zip(got.layers, ref.layers, strict=True)
            for mine, theirs in ((a.keys, b.keys), (a.values, b.values))]


@torch.no_grad()
def test_lower_right_prefill_from_a_shared_prefix_matches_the_full_forward_in_bf16():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, 1000, (3000,), generator=g).tolist()  # past the 2048 positions YaRN stretches
    b = a[:1500] + torch.randint(2, 1000, (1500,), generator=g).tolist()
    b[1500] = a[1500] + 1  # b shares a's first 1500 tokens
    ref_logits, ref_cache = _full(_model(torch.float32), b)
    model = _model(torch.bfloat16)
    sdpa_logits, sdpa_cache = _full(model, b)
    kw = cache_kw(model)
    cache_a, _ = _prefill(model, a, CHUNK, CUDA, kw)
    batch = buffer_cache(model, cache_a, 1, len(a), len(a))
    put_row(batch, 0, cache_a, len(a))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cache, logits = _prefill(model, b, CHUNK, CUDA, kw, row_prefix(model, batch, 0, 0, 1500))
    names = [e.name for e in prof.events()]
    flash = sum(n == "aten::_scaled_dot_product_flash_attention" for n in names)
    # 1500 tokens from the cache in 2 chunks: each layer but the last (one query row, plain SDPA, whichever kernel
    # torch picks) calls flash through the lower-right bias, and no call falls back to the memory-efficient kernel
    # or the math one
    assert flash >= (LAYERS - 1) * 2, f"{flash} flash calls for {LAYERS - 1} layers x 2 chunks"
    assert not [n for n in names if "efficient_attention" in n or "attention_math" in n], "a non-flash kernel ran"
    err, sdpa_err = ((x - ref_logits).abs().mean().item() for x in (logits.float(), sdpa_logits))
    print(f"logits: mean error {err:.3g}, transformers' bf16 SDPA {sdpa_err:.3g}")
    assert err <= 1.5 * sdpa_err, (err, sdpa_err)
    for mine, theirs in zip(_errors(cache, ref_cache), _errors(sdpa_cache, ref_cache), strict=True):
        assert mine <= 1.5 * theirs + 1e-3, (mine, theirs)  # the first layer's keys are exact in both


SHAPE = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
PATTERNED = {  # name -> (model on the CPU in fp32, the kernel the patterned prefill runs in bf16 on CUDA)
    "gemma3 window 512": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **SHAPE, sliding_window=512, layer_types=["sliding_attention", "full_attention"] * 2)), "torch_flash"),
    "gemma2 soft-cap 2, window 512": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **SHAPE, sliding_window=512, attn_logit_softcapping=2.0, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"] * 2)), "math"),
    "gpt_oss sinks, window 128": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
        **SHAPE, sliding_window=128, num_local_experts=2, num_experts_per_tok=1)), "torch_flash"),
    "llama4 chunks 512": (lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
        **SHAPE, intermediate_size_mlp=512, num_local_experts=1, attention_chunk_size=512, no_rope_layer_interval=2,
        attn_temperature_tuning=False)), "torch_flash"),
}


@pytest.mark.parametrize("name", list(PATTERNED))
@torch.no_grad()
def test_patterned_prefill_in_bf16_matches_the_model_s_own_attention(name):
    """Windows (torch's flash kernel with its window), soft-capped scores (the CUDA math kernel in query tiles) and
    sinks through `prefill_attention` on CUDA in bf16: a 3,000-token prompt in 1,024-token forwards gives the
    last-token logits of one fp32 eager forward on the CPU to within 1.5x the error of the model's own bf16 eager
    attention on CUDA over the same forwards; every patterned call picked the kernel named, and torch's
    flash op ran where that is torch_flash."""
    from tests.test_attention_patterns import make_matter

    from longstride.eval.ruler import attention, generate
    from longstride.parallel.varlen import flash_attn_available, flash_attn_softcap_problem

    make, kernel = PATTERNED[name]
    torch.manual_seed(0)
    model = make_matter(make().float()).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(2, 1000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model(torch.tensor([ids])).logits[0, -1].double()
    model = model.to(device=CUDA, dtype=torch.bfloat16)
    kw = cache_kw(model)
    picked, pick = [], attention.prefill_kernel
    attention.prefill_kernel = lambda *a: picked.append(pick(*a)) or picked[-1]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _, logits = _prefill(model, ids, CHUNK, CUDA, kw)
    finally:
        attention.prefill_kernel = pick
    varlen = any(e.name == "aten::_flash_attention_forward" for e in prof.events())  # torch_flash's varlen op ran
    assert varlen or kernel != "torch_flash", name
    if kernel == "math" and flash_attn_available() and flash_attn_softcap_problem() is None:
        kernel = "flash_attn"  # soft-capped scores on a flash-attn build that caps them
    assert set(picked) == {kernel}, (name, set(picked))
    old, generate.prefill_computes = generate.prefill_computes, lambda m: False
    try:
        _, own = _prefill(model, ids, CHUNK, CUDA, kw)
    finally:
        generate.prefill_computes = old
    err, own_err = ((x.double().cpu() - ref).abs().mean().item() for x in (logits, own))
    print(f"{name}: logits mean error {err:.3g}, the model's own bf16 eager {own_err:.3g}")
    assert err <= 1.5 * own_err + 1e-3, (err, own_err)
