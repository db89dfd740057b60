"""Chunked cross-entropy equals the plain one, in value and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstride.model.loss import IGNORE_INDEX, chunked_cross_entropy_sum


@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
def test_chunked_loss_matches_plain(tile):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 50, 16, generator=gen, requires_grad=True)
    w = torch.randn(40, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 40, (2, 50), generator=gen)
    y[0, 10:20] = IGNORE_INDEX
    y[1, -1] = IGNORE_INDEX
    got = chunked_cross_entropy_sum(h, w, y, tile)
    ref = F.cross_entropy((h @ w.T).reshape(-1, 40), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-6)
    ga = torch.autograd.grad(got, (h, w))
    gb = torch.autograd.grad(ref, (h, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_tile():
    with pytest.raises(ValueError, match="model.loss_tile_tokens"):
        chunked_cross_entropy_sum(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long), 0)


def test_a_batch_without_targets_still_backpropagates_zero():
    """A micro-batch whose tokens are all context only (synthetic loss_on=qa) has no target: its loss is 0
    and backward must still run (a data-parallel rank that skipped it would leave the others waiting)."""
    h = torch.randn(2, 30, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    loss = chunked_cross_entropy_sum(h, w, torch.full((2, 30), IGNORE_INDEX), 8)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEADS = {  # the output-head terms transformers' CausalLM forwards add after lm_head
    "cohere_logit_scale": lambda T: T.CohereForCausalLM(T.CohereConfig(**SMALL, logit_scale=0.25)),
    "granite_logits_scaling": lambda T: T.GraniteForCausalLM(T.GraniteConfig(**SMALL, logits_scaling=4.0)),
    "phi_lm_head_bias": lambda T: T.PhiForCausalLM(T.PhiConfig(**{k: v for k, v in SMALL.items()
                                                                  if k != "num_key_value_heads"})),
    "gemma3_final_softcap": lambda T: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=16,
                                                                             final_logit_softcapping=0.5)),
    "hyperclovax_logits_scaling_multiplies": lambda T: T.HyperCLOVAXForCausalLM(T.HyperCLOVAXConfig(
        **SMALL, logits_scaling=4.0)),
}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_the_chunked_loss_is_the_model_s_own_loss_through_its_whole_output_head(name):
    """Cohere's logit scale, Granite's logits scaling, Phi's lm_head bias and a final logit soft-cap: the chunked
    loss (training and eval ppl) equals the loss on the model's own logits, in value and in gradient."""
    import transformers as T

    from longstride.model.loss import ChunkedLossLM

    torch.manual_seed(0)
    lm = HEADS[name](T)
    if lm.lm_head.bias is not None:
        torch.nn.init.normal_(lm.lm_head.bias, std=1.0)  # Phi starts it at 0, where dropping it changes nothing
    ids = torch.randint(3, 64, (2, 24))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    positions = torch.arange(24).expand(2, 24)
    logits = lm(input_ids=ids, position_ids=positions).logits.float()
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    got = ChunkedLossLM(lm, tile=7)(ids, labels, positions)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert "lm_head.weight" in want_grads or "model.embed_tokens.weight" in want_grads
    for n, p in lm.named_parameters():  # every parameter: the head's weight and bias, the layers, the embeddings
        assert (p.grad is None) == (n not in want_grads), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-5, msg=n)
    with torch.no_grad():
        plain = chunked_cross_entropy_sum(lm.model(input_ids=ids, position_ids=positions).last_hidden_state,
                                          lm.lm_head.weight, labels, 7)
    assert abs(plain.item() - want.item()) > 1e-2  # the head's extra term matters here: the test can fail


def test_config_fields_a_model_does_not_apply_leave_its_head_plain():
    """A Llama config carrying logits_scaling and final_logit_softcapping (which Llama's forward never reads): the
    terms are read off the forward, so the head stays plain, and the loss is the model's own."""
    import transformers as T

    from longstride.model.loss import head_terms

    lm = T.LlamaForCausalLM(T.LlamaConfig(**SMALL, logits_scaling=0.125, final_logit_softcapping=30.0))
    assert head_terms(lm) == (1.0, None)
    assert head_terms(HEADS["granite_logits_scaling"](T)) == (0.25, None)
    assert head_terms(HEADS["hyperclovax_logits_scaling_multiplies"](T)) == (4.0, None)


def test_a_head_with_a_learned_scale_is_refused_rather_than_left_untrained():
    """Dory's output head multiplies the logits by a learned logit_scale (1 at init, so the logits and the loss equal
    the model's own there): the chunked loss would never train it (found by benchmarks/model_matrix.py: its
    gradient 0 against the model's own loss's), so the model is refused, naming the tensor."""
    import transformers as T

    from longstride.model.loss import ChunkedLossLM

    lm = T.DoryForCausalLM(T.DoryConfig(**SMALL, head_dim=8))
    assert "logit_scale" in dict(lm.get_output_embeddings().named_parameters())
    with pytest.raises(NotImplementedError, match=r"DoryForCausalLM's output head DoryLMHead holds learned tensors "
                                                  r"besides its weight and bias \(logit_scale\)"):
        ChunkedLossLM(lm)


def test_a_decoder_without_one_stack_of_its_layers_is_named():
    """decoder_layers finds the decoder's list of config.num_hidden_layers layers (layers, h, ...), and names a model
    with none (an encoder-decoder, a config whose count the list does not match) instead of an AttributeError."""
    from types import SimpleNamespace

    from longstride.model.loss import decoder_layers

    class Body(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.h = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))

    class LM(torch.nn.Module):
        def __init__(self, n, layers):
            super().__init__()
            self.config, self.transformer = SimpleNamespace(num_hidden_layers=layers), Body(n)

        def get_decoder(self):
            return self.transformer

    lm = LM(3, 3)
    assert decoder_layers(lm) is lm.transformer.h
    with pytest.raises(ValueError, match=r"LM: longstride trains a decoder with one stack of "
                                         r"config.num_hidden_layers=4 layers, and Body holds 0 such lists"):
        decoder_layers(LM(3, 4))


def test_a_router_load_balancing_loss_is_refused_rather_than_dropped(tmp_path):
    """A mixture of experts with output_router_logits=true adds its router's load-balancing term to its own loss
    (measured: GPT-OSS's loss differs with it); longstride's chunked loss computes cross-entropy only and the HF
    Trainer would scale the term by the process count, so a recipe's validation and the Trainer path refuse it,
    naming the config field; with the field false (transformers' default) both accept the model. NEFTune under CP
    (noise scaled by the rank's share of the row) is refused too."""
    import re

    import transformers as T

    from longstride.recipes.config.model_checks import model_shape
    from longstride.recipes.hf.trainer import check_loss_setup
    from tests.conftest import compose_cfg

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(**small, output_router_logits=True, router_aux_loss_coef=0.5))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        balanced = model(ids, labels=ids).loss
        model.config.output_router_logits = False
        plain = model(ids, labels=ids).loss
        model.config.output_router_logits = True
    assert abs(balanced - plain) > 1e-3, "the term the refusal guards is a real part of the model's loss"
    model.save_pretrained(tmp_path / "moe")
    args = T.TrainingArguments("unused", report_to=[], use_cpu=True)
    field = "its config sets output_router_logits=true (router_aux_loss_coef=0.5)"
    with pytest.raises(NotImplementedError, match=re.escape(field)):
        check_loss_setup(args, 1, True, None, model.config)
    base = ["recipe=extend_pretrained", f"model.checkpoint={tmp_path / 'moe'}", "logger.wandb_mode=disabled",
            "recipe.stages.x2.mlp_tile_tokens=0", "recipe.stages.x4.mlp_tile_tokens=0"]
    with pytest.raises(ValueError, match=re.escape(f"model.checkpoint={tmp_path / 'moe'}: {field}")):
        model_shape(compose_cfg(base))
    model.config.output_router_logits = False
    model.save_pretrained(tmp_path / "moe")
    model_shape(compose_cfg(base))
    check_loss_setup(args, 1, True, None, model.config)
    noisy = T.TrainingArguments("unused", report_to=[], use_cpu=True, neftune_noise_alpha=5.0)
    check_loss_setup(noisy, 2, True, None, model.config, cp=1)
    with pytest.raises(NotImplementedError, match=re.escape("neftune_noise_alpha=5.0 under cp=2")):
        check_loss_setup(noisy, 2, True, None, model.config, cp=2)


def test_the_balancing_coefficient_is_found_under_each_moe_s_own_name():
    """JetMoE names it aux_loss_coef and DBRX ffn_config.moe_loss_weight: with output_router_logits=true their
    balancing term was dropped without a word, only router_aux_loss_coef being read. A zero coefficient adds no
    term and passes."""
    import transformers as T

    from longstride.model.loss import router_aux_loss

    assert "(aux_loss_coef=0.01)" in router_aux_loss(T.JetMoeConfig(output_router_logits=True))
    assert "(ffn_config.moe_loss_weight=0.01)" in router_aux_loss(T.DbrxConfig(output_router_logits=True))
    assert router_aux_loss(T.JetMoeConfig(output_router_logits=True, aux_loss_coef=0.0)) is None
    assert router_aux_loss(T.JetMoeConfig()) is None
