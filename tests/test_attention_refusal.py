"""Attention that longstride does not implement is refused, naming it, never dropped: tiny random models of
transformers' own classes with bidirectional attention (Gemma 3 with
use_bidirectional_attention; BERT's encoder loaded as a causal LM; config.is_causal=False), a layer type that is not
attention longstride computes (linear attention), chunked layers without a chunk size, Doge's dynamic mask (a per-head
mask from the values), settings that vary by layer (Gemma 4's per_layer_config), and a model that computes attention
in its own code (Bloom), whose switch to longstride's
attention transformers only warns about. Sliding windows, chunks, soft-capped scores (Gemma 2) and sinks are
computed (tests/test_attention_patterns.py); soft-capped scores on a kernel without a soft-cap are refused, and a
recipe trains a Gemma 2 checkpoint on the kernel auto picks."""
from __future__ import annotations

import os
import re

import pytest
import torch
import transformers as T

from longstride.parallel.attention import MaskNote, longstride_attention, unsupported_attention, use_longstride_attention
from longstride.parallel.cp import CPContext, DocLayout
from tests.forked_cli import run_module
from tests.test_attention import _capped_reference
from tests.test_attention_patterns import make_matter

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
REFUSED = {  # model -> (config, class, what the refusal names)
    "gemma3_bidirectional": (lambda: T.Gemma3TextConfig(**SMALL, use_bidirectional_attention=True),
                             T.Gemma3ForCausalLM, "is_causal=False"),
    "qwen2_linear_attention": (lambda: T.Qwen2Config(**SMALL, layer_types=["full_attention", "linear_attention"]),
                               T.Qwen2ForCausalLM, "linear_attention"),
    "doge_dynamic_mask": (lambda: T.DogeConfig(**SMALL), T.DogeForCausalLM, "dynamic mask attention"),
    # attention in the model's own code, not transformers' interface: switching only warns, and it kept its own
    "bloom_own_attention": (lambda: T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4),
                            T.BloomForCausalLM, "computes attention in its own code"),
    # an encoder's attention (at bert.encoder.layer.N.attention.self) loaded as a causal LM
    "bert_encoder": (lambda: T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, is_decoder=False),
                     T.BertLMHeadModel, "attention.self.is_causal=False"),
    "llama_config_not_causal": (lambda: T.LlamaConfig(**SMALL, is_causal=False), T.LlamaForCausalLM,
                                "config.is_causal=False"),
    # per-layer settings (transformers' heterogeneous configs): reading config.head_dim raised deep inside
    "gemma4_per_layer_config": (lambda: T.Gemma4TextConfig(**SMALL), T.Gemma4ForCausalLM,
                                "sets head_dim per layer"),
    # a decoder layer calling its attention without **kwargs: the document layout never arrived, and a CP rank
    # whose share held no document start attended causally to its own tokens alone, without a word
    "stablelm_drops_doc_layout": (lambda: T.StableLmConfig(**{**SMALL, "head_dim": None}), T.StableLmForCausalLM,
                                  "StableLmDecoderLayer calls its attention without passing on"),
    "llama4_chunks_without_size": (lambda: T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                                              layer_types=["chunked_attention", "full_attention"],
                                                              attention_chunk_size=None),
                                   T.Llama4ForCausalLM, "attention_chunk_size is not set"),
}
COMPUTED = {  # windows, soft-caps, sinks, chunks: accepted
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=16)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, sliding_window=16)),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, sliding_window=16)),
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


def test_a_model_that_keeps_its_own_attention_after_the_switch_is_refused(monkeypatch):
    """Behind the source test (dispatches): whatever a model's source looks like, a switch that did not take is
    refused, not trained on."""
    from longstride.parallel import attention

    monkeypatch.setattr(attention, "dispatches", lambda model: True)  # a model the source test misjudges
    make, cls, _ = REFUSED["bloom_own_attention"]
    with pytest.raises(NotImplementedError, match="kept attn_implementation='eager'"):
        use_longstride_attention(cls(make()))


@pytest.mark.parametrize("name", sorted(COMPUTED))
def test_windows_sinks_and_chunks_are_accepted(name):
    model = COMPUTED[name]()
    assert unsupported_attention(model) == []
    use_longstride_attention(model)
    assert model.config._attn_implementation == "longstride"


def test_what_a_call_asks_for_and_is_not_computed_fails_at_once():
    """Defence in depth: an attention call that carries soft-capping on a kernel without it (the batch's default,
    sdpa), bidirectional attention, sinks of the wrong shape or documents as flash-attention sequence lengths
    (DataCollatorWithFlattening's cu_seq_lens_q/k, which longstride would have computed as one causal row) fails at
    once; a window or chunk of at least the sequence is plain causal."""
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match=r"\(softcap=30.0\) and parallel.kernel=sdpa does not"):
        longstride_attention(torch.nn.Module(), q, k, v, None, softcap=30.0, doc_layout=DocLayout(None))
    # no layout: a kernel that caps, against the fp64 capped reference, with scores far past the cap's bend
    capped, _ = longstride_attention(torch.nn.Module(), 20 * q, k, v, None, softcap=1.0)
    plain, _ = longstride_attention(torch.nn.Module(), 20 * q, k, v, None)
    want = _capped_reference(20 * q, k, v, torch.zeros(1, 8, dtype=torch.long), 4 ** -0.5, None, 1.0)
    torch.testing.assert_close(capped, want.transpose(1, 2).float(), atol=1e-5, rtol=1e-5)
    assert (plain - want.transpose(1, 2)).abs().max() > 0.1  # the cap matters here
    with pytest.raises(NotImplementedError, match="bidirectional"):
        longstride_attention(torch.nn.Module(), q, k, v, None, is_causal=False)
    bidirectional = torch.nn.Module()
    bidirectional.is_causal = False  # BERT's self-attention module, which passes no is_causal keyword
    with pytest.raises(NotImplementedError, match="bidirectional"):
        longstride_attention(bidirectional, q, k, v, None)
    for name in ("position_bias", "sinks", "block_indices", "indices", "cu_seq_lens_q", "cu_seq_lens_k"):
        with pytest.raises(NotImplementedError, match=name):
            longstride_attention(torch.nn.Module(), q, k, v, None, **{name: torch.zeros(1)})
    with pytest.raises(ValueError, match="s_aux"):
        longstride_attention(torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(3))
    plain, _ = longstride_attention(torch.nn.Module(), q, k, v, None)
    # each with the mask note transformers' sliding-window mask call gives it (MaskNote: no_mask)
    wide, _ = longstride_attention(torch.nn.Module(), q, k, v, MaskNote(local=8), sliding_window=8)
    narrow, _ = longstride_attention(torch.nn.Module(), q, k, v, MaskNote(local=2), sliding_window=2)
    assert torch.equal(plain, wide) and not torch.allclose(plain, narrow)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_a_cached_decoding_step_is_refused_and_the_model_s_own_attention_decodes_it(name):
    """A forward with a KV cache hands attention fewer queries than keys; longstride's attention, which takes
    document and window bounds from one sequence, would compute the step wrongly (a Mistral window of 4 gave
    logits off by 0.2), so it refuses, naming the switch back to the model's own attention, which then decodes the
    step as the full forward scores it ('eager' for Gemma 2, which has no SDPA: 'sdpa' raised there). The uncached
    forward, and the prefill that fills the cache, are computed (Gemma 2's soft-capped scores without a doc_layout
    on the kernel auto picks for them: before, refused naming a parallel.kernel no such call has)."""
    torch.manual_seed(0)
    model = {"mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=4)),
             "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, sliding_window=4,
                                                                  attn_logit_softcapping=2.0)),
             "llama": COMPUTED["llama"]}[name]().eval()
    own = "eager" if name == "gemma2" else "sdpa"
    if name == "gemma2":  # q and k scaled so that the scores reach the cap's bend, which the control shows
        model.set_attn_implementation("eager")
        with torch.no_grad():
            make_matter(model)
            reference = model(torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))).logits
            model.config.attn_logit_softcapping = None
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            uncapped = model(torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))).logits
            assert (uncapped - reference).abs().max() > 1e-3  # 100x the tolerance the layout is held to below
            model.config.attn_logit_softcapping = 2.0
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = 2.0
    use_longstride_attention(model)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        if name == "gemma2":
            got = model(torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))).logits
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
        prefill = model(ids[:, :-1], use_cache=True)
        torch.testing.assert_close(prefill.logits, full[:, :-1])
        with pytest.raises(NotImplementedError, match=re.escape(
                "model.set_attn_implementation('sdpa'), or 'eager' for a model without SDPA (Gemma 2, GPT-OSS)")):
            model(ids[:, -1:], past_key_values=prefill.past_key_values)
        model.set_attn_implementation(own)
        step = model(ids[:, -1:], past_key_values=model(ids[:, :-1], use_cache=True).past_key_values).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


def test_what_transformers_mask_would_hold_without_a_doc_layout_is_refused():
    """longstride's attention reads documents only from doc_layout. Called as a plain attention implementation, a
    left-padded batch (zeros in attention_mask before a real token), packed rows (position_ids restarting at 0,
    which transformers' own mask turns into documents) or a caller's own 4D mask are refused; they were computed as
    one causal sequence, 0.2 away from eager. The same rows with a doc_layout, a plain batch, and an all-ones mask
    run."""
    from longstride.parallel.cp import shard_for_cp
    from tests.test_attention_patterns import make_model, packed_batch

    model = make_model("mistral", 7)
    model.config.use_cache = False  # with a cache, transformers' own mask does not look for packed rows either
    use_longstride_attention(model)
    batch = packed_batch()
    ids, pos = batch["input_ids"], batch["position_ids"]
    with pytest.raises(NotImplementedError, match=r"holds more than causal attention \(packed documents"):
        model(input_ids=ids, position_ids=pos)
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    with pytest.raises(NotImplementedError, match=r"holds padding \(zeros in attention_mask\)"):
        model(input_ids=ids, attention_mask=pad)
    right = pad.flip(1)  # right padding: every real token is computed exactly, as eager does
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, attention_mask=right).logits[0, :-5]
    use_longstride_attention(model)
    assert (model(input_ids=ids, attention_mask=right).logits[0, :-5] - ref).abs().max() < 1e-5
    local, layout = shard_for_cp(batch, True, CPContext())
    with pytest.raises(NotImplementedError, match="holds padding"):  # padding is refused even with documents
        model(input_ids=ids, position_ids=pos, attention_mask=pad, doc_layout=layout)
    model(input_ids=local["input_ids"], position_ids=local["position_ids"], doc_layout=layout)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    model(input_ids=ids)
    block = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()  # a caller's own 4D mask
    block[..., 30:, :30] = False
    with pytest.raises(NotImplementedError, match="a mask built outside longstride's mask function"):
        model(input_ids=ids, attention_mask=block)


def test_a_mask_rule_that_sees_later_keys_is_refused_with_documents_too():
    """A model whose own mask rule opens later keys to a query (Step 3.7's use_bidirectional_attention, an or-mask of
    transformers' create_causal_mask) was computed as plain causal whenever a doc_layout came with the call (training
    and eval ppl always pass one): 0.87 away from eager. Refused now, with or without a doc_layout: any or/and
    function of the model's own without evaluating it, transformers' prefix / image blocks (block_sequence_ids)
    where a query's next key is open, at the chunk's own positions; its causal, window, chunk and packed-document
    masks pass the probe, and a plain causal call is not probed."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function,
                                            chunked_causal_mask_function, or_masks, packed_sequence_mask_function,
                                            sliding_window_causal_mask_function)
    from transformers.models.step3p7 import configuration_step3p7, modeling_step3p7

    from longstride.parallel.attention import no_mask, sees_later
    from longstride.parallel.cp import DocLayout

    cfg = configuration_step3p7.Step3p7TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_local_experts=2, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, share_expert_dim=16, mlp_layer_types=["dense", "dense"],
        layer_types=["full_attention", "full_attention"], pad_token_id=0, sliding_window=64)
    cfg.use_bidirectional_attention = True
    model = modeling_step3p7.Step3p7TextModel(cfg).eval()
    use_longstride_attention(model)
    ids = torch.randint(1, 64, (1, 16))
    for layout in (None, DocLayout(None, cp=CPContext(kernel="sdpa"))):
        with pytest.raises(NotImplementedError, match="the model's own mask holds a rule of its own"):
            model(input_ids=ids, **({"doc_layout": layout} if layout else {}))
    call = dict(batch_size=2, q_length=12, q_offset=0, kv_length=12, kv_offset=0, allow_is_causal_skip=False)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    blocks = torch.full((2, 12), -1)
    blocks[1, 3:6] = 0  # an image block of 3 tokens in the second row
    for fn in (causal_mask_function, sliding_window_causal_mask_function(4), chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)),
               and_masks(causal_mask_function, packed_sequence_mask_function(docs))):
        assert not sees_later(fn, **call) and not no_mask(mask_function=fn, **call).rule
    assert sees_later(and_masks(lambda b, h, q, kv: q >= 0, packed_sequence_mask_function(docs)), **call)
    assert sees_later(or_masks(causal_mask_function, blockwise_overlay(blocks)), **call)
    assert not sees_later(or_masks(causal_mask_function, blockwise_overlay(torch.full((2, 12), -1))), **call)

    def never(*_):
        raise AssertionError("not evaluated")
    assert sees_later(never, use_vmap=True, **call), "a model's own or/and function: a rule, not evaluated"
    assert not sees_later(never, **{**call, "allow_is_causal_skip": True}), "a plain causal call holds no rule"
    # a chunk of a prefill past position 9 (RULER's prefill_mask passes the offsets on): the block is at 10-11 there
    late = torch.full((2, 16), -1)
    late[1, 10:12] = 0
    chunk = {**call, "q_length": 6, "q_offset": 10, "kv_length": 16, "kv_offset": 0}
    assert sees_later(or_masks(causal_mask_function, blockwise_overlay(late)), **chunk)
    assert not sees_later(or_masks(causal_mask_function, blockwise_overlay(late)), **{**chunk, "q_offset": 0})


WINDOW_CASES = {  # a layer's call against the mask transformers' eager attention builds for it
    # listed sliding layers, use_sliding_window=False: the calls pass no window, the mask has one
    "smollm3_inconsistent": (lambda: T.SmolLM3ForCausalLM(T.SmolLM3Config(
        **SMALL, sliding_window=8, use_sliding_window=False, pad_token_id=0, bos_token_id=0, eos_token_id=1,
        layer_types=["sliding_attention", "full_attention"])), "asks for no window and transformers' own mask for it "
                                                               "holds one of 8"),
    # the calls pass no window, the mask has one (PhiMoE), or the other way round (OLMoE): 0.2 off eager before
    "phimoe": (lambda: T.PhimoeForCausalLM(T.PhimoeConfig(**SMALL, sliding_window=8, num_local_experts=2)),
               "asks for no window and transformers' own mask for it holds one of 8"),
    "olmoe": (lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**SMALL, sliding_window=8, num_experts=2,
                                                       num_experts_per_tok=1)),
              "asks for a window or chunk of 8 and transformers' own mask for it holds none"),
    # Mistral takes layer_types as an extra key and windows every layer, calls and mask alike: computed
    "mistral_with_layer_types": (lambda: T.MistralForCausalLM(T.MistralConfig(
        **SMALL, sliding_window=8, layer_types=["sliding_attention", "full_attention"])), None),
    "mistral_window_past_the_sequence": (lambda: T.MistralForCausalLM(T.MistralConfig(
        **SMALL, sliding_window=4096, layer_types=["sliding_attention", "full_attention"])), None),
}


@pytest.mark.parametrize("name", sorted(WINDOW_CASES))
def test_a_layer_whose_call_and_mask_disagree_on_its_window_is_refused(name):
    """transformers' eager attention windows a layer by the mask the model builds for it; the attention call by its
    sliding_window keyword. Where they differ, the model's own attention implementations disagree too (flash follows
    the call, eager the mask): refused, naming both. Where they agree longstride equals eager."""
    make, refused = WINDOW_CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    model.config.use_cache = False
    ids = torch.randint(2, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids).logits
    use_longstride_attention(model)
    if refused:
        with pytest.raises(NotImplementedError, match=re.escape(refused)):
            model(input_ids=ids)
    else:
        assert (model(input_ids=ids).logits - ref).abs().max() < 1e-5


def test_a_recipe_trains_a_soft_capped_checkpoint_and_refuses_a_kernel_without_the_cap(tmp_path, capfd):
    """`longstride train` with model=checkpoint on Gemma 2 (soft-capped scores, local + global layers): with
    parallel.kernel=sdpa, exit 2 at validation naming the kernel and the config field, before the data is read;
    with the default kernel (auto: math here) two stages train, the stage log naming the kernel."""
    from longstride.data.files import list_files, stdlib_root
    from longstride.data.tokenizer import train_bpe
    from longstride.recipes.train import run
    from tests.conftest import compose_cfg

    ckpt = tmp_path / "gemma2"
    tok = train_bpe([open(p, encoding="utf-8").read() for p in list_files(stdlib_root(), "**/*.py")[:20]], 300)
    config = T.Gemma2Config(**{**SMALL, "vocab_size": len(tok)}, sliding_window=64, max_position_embeddings=128,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    T.Gemma2ForCausalLM(config).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    args = ["recipe=extend_pretrained", f"model.checkpoint={ckpt}", f"data.tokenizer={ckpt}",
            f"paths.output_root={tmp_path}/out", "logger.wandb_mode=disabled", "logger.progress_bar=false"]
    proc = run_module("longstride.recipes.train", [*args, "parallel.kernel=sdpa"],
                      {**os.environ, "WANDB_MODE": "disabled"}, os.getcwd(), 300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.kernel=sdpa has no logit soft-capping" in proc.stderr, proc.stderr[-2000:]
    assert "config.attn_logit_softcapping" in proc.stderr and not (tmp_path / "out").exists()
    small = [f"recipe.stages.{name}.{key}={value}" for name, length in (("x2", 256), ("x4", 512))
             for key, value in (("seq_len", length), ("steps", 3), ("batch_tokens", 2 * length), ("save_every", 0),
                                ("mlp_tile_tokens", 128))]
    finals = run(compose_cfg(args + small + ["data.sources.stdlib.max_docs=10", "data.eval_sequences=1"]))
    assert len(finals) == 2 and T.AutoConfig.from_pretrained(finals[-1]).attn_logit_softcapping == 50.0
    log = "".join(capfd.readouterr())
    assert log.count("attention kernel math") == 2, log[-3000:]


def test_a_gemma3_config_s_soft_cap_is_not_taken_for_one_its_attention_applies():
    """transformers' Gemma 3 keeps attn_logit_softcapping in its config but never passes it to attention: a config
    that sets it (a converted checkpoint) is computed as the model computes it, uncapped, on any kernel (before:
    auto picked the slow math kernel and sdpa was refused naming the field)."""
    from longstride.parallel.pattern import config_softcap

    config = T.Gemma3TextConfig(**SMALL, sliding_window=16, attn_logit_softcapping=0.5)
    assert config_softcap(config) is None and config_softcap(T.Gemma2Config(**SMALL)) == 50.0
    torch.manual_seed(0)
    model = T.Gemma3ForCausalLM(config).eval()
    for p in model.parameters():  # scores well past the field's cap, where a cap would change them
        p.data.mul_(4)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        use_longstride_attention(model)
        got = model(input_ids=ids, doc_layout=DocLayout(None)).logits  # the sdpa kernel, which cannot cap
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_mla_value_heads_and_training_dropout_are_refused():
    """DeepSeek-V3's latent attention has value heads of another size than its query/key heads, which the kernels
    cannot take (it used to fail deep inside the CPU flash op); attention dropout is refused in a model being
    trained and accepted in one being evaluated (eval mode drops nothing)."""
    ds = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**{**SMALL, "head_dim": None}, kv_lora_rank=16, q_lora_rank=16,
                                                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                                    n_routed_experts=2, num_experts_per_tok=1,
                                                    first_k_dense_replace=2))
    with pytest.raises(NotImplementedError, match=r"config.v_head_dim=6 differs from the query/key head size 12"):
        use_longstride_attention(ds)
    q, k, v = torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 6)
    with pytest.raises(NotImplementedError, match="value heads of size 6 against query heads of size 12"):
        longstride_attention(torch.nn.Module(), q, k, v, None)
    qwen = T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, attention_dropout=0.1))
    assert unsupported_attention(qwen) == ["config.attention_dropout=0.1 (attention dropout while training; set it "
                                           "to 0.0 in the checkpoint's config.json to train without it)"]
    assert unsupported_attention(qwen.eval()) == []
    with pytest.raises(NotImplementedError, match=r"attention dropout 0.1 while training \(the model's "
                                                  r"config.attention_dropout\): .* set attention_dropout to 0.0"):
        longstride_attention(torch.nn.Module(), q, k, k, None, dropout=0.1)  # a model switched while in eval mode
