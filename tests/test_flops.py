"""The step's model FLOPs (recipes/run/flops.py): the linear layers' weights and the (query, key) pairs each layer's
pattern lets the document mask keep, against hand counts; mixture-of-experts models not counted; the GPU
benchmark's count the same; the loop's tflops metric within the bounds its batches allow."""
from __future__ import annotations

import json

import torch
import transformers as T

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def test_linear_weights_and_attention_pairs_by_hand():
    """Per layer q 32x32, k and v 32x16, o 32x32, MLP 3 x 32x48; the tied LM head 32x64. One row of two documents
    (6 and 4 tokens): causal layers see 21 + 10 pairs; a 3-token window min(p + 1, 3): 1+2+3+3+3+3 + 1+2+3+3."""
    from longstride.recipes.run.flops import StepFlops

    per_layer = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 48
    doc = torch.tensor([[0] * 6 + [1] * 4])
    llama = StepFlops(T.LlamaForCausalLM(T.LlamaConfig(**SMALL)))
    assert llama.counted and llama.linear == 2 * per_layer + 32 * 64 and llama.width == 32
    assert llama.pairs(doc) == 2 * (21 + 10)
    mistral = StepFlops(T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=3)))
    assert mistral.pairs(doc) == 2 * (15 + 9)
    assert llama.step(10, 62) == 3 * (2 * llama.linear * 10 + 4 * 32 * 62)
    assert llama.pairs(doc, masked=False) == 2 * 55, "data.doc_masking=false: the row attends as one document"


def test_gpt2s_conv1d_projections_are_counted_as_linear_layers():
    """GPT-2 keeps its projections in transformers' Conv1D (a transposed Linear): per layer c_attn 32x96, c_proj
    32x32, c_fc 32x48 and its c_proj 48x32, and the tied head 32x64 (only the head was counted)."""
    from longstride.recipes.run.flops import StepFlops

    config = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=48, vocab_size=64, n_positions=64, bos_token_id=0,
                          eos_token_id=0)
    assert StepFlops(T.GPT2LMHeadModel(config)).linear == 2 * (32 * 96 + 32 * 32 + 32 * 48 + 48 * 32) + 32 * 64


def test_a_vision_language_model_counts_its_text_layers_and_head_only():
    """Gemma 3 4B and up (Gemma3ForConditionalGeneration): the vision tower and projector beside the text decoder
    run on no training token here."""
    from longstride.model.loss import text_decoder
    from longstride.recipes.run.flops import StepFlops
    from tests.test_prefill_patterns import vision_gemma3

    lm = vision_gemma3()
    text = sum(m.weight.numel() for m in text_decoder(lm).modules() if isinstance(m, torch.nn.Linear))
    every = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
    flops = StepFlops(lm)
    assert flops.linear == text + lm.get_output_embeddings().weight.numel() < every


def test_a_mixture_of_experts_model_is_not_counted():
    from longstride.recipes.run.flops import StepFlops

    moe = T.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    assert not StepFlops(T.MixtralForCausalLM(moe)).counted


def test_the_gpu_benchmarks_count_is_the_loops():
    from benchmarks.gpu_bench import SHAPES, train_flops
    from longstride.recipes.run.flops import StepFlops

    shape = SHAPES["smoke"]
    model = T.LlamaForCausalLM(T.LlamaConfig(**shape))
    flops = StepFlops(model)
    doc = torch.tensor([[0] * 40 + [1] * 24])
    pairs = 40 * 41 // 2 + 24 * 25 // 2
    assert train_flops(shape, 64, pairs) == flops.step(64, flops.pairs(doc)) == \
        flops.step(64, shape["num_hidden_layers"] * pairs)


def test_the_loops_tflops_lie_within_what_its_batches_allow(s1_reference):
    """The micro recipe's stage (one process, CPU: no mfu): each step's FLOPs (tflops x seconds, seconds from
    tokens_per_s) lie between the linear layers' alone plus one pair per token per layer and whole-row causal
    attention over every row."""
    from longstride.recipes.run.flops import StepFlops

    lm = T.AutoModelForCausalLM.from_pretrained(s1_reference / "final")
    flops, layers = StepFlops(lm), lm.config.num_hidden_layers
    steps = [json.loads(line) for line in (s1_reference / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "tokens_per_s" in m]
    assert steps and all("mfu" not in m for m in steps)
    tokens, seq = 512, 64  # the micro recipe's batch_tokens and seq_len for s1_256
    low = flops.step(tokens, layers * tokens)
    high = flops.step(tokens, layers * (tokens // seq) * seq * (seq + 1) // 2)
    for m in steps:
        step_flops = m["tflops"] * 1e12 * tokens / m["tokens_per_s"]
        assert low * (1 - 1e-9) <= step_flops <= high * (1 + 1e-9), m["step"]
