"""What the eval commands read from a checkpoint's config and their arguments, refused or taken as the model means it:
YaRN over Phi-3's top-level window, models without RoPE (GPT-2), yarn.factor=0, rope_layer_types without YaRN, a
haystack no task reads, a default out= inside the checkpoint, prefill chunks under longrope and dynamic NTK."""
from __future__ import annotations

import os

import pytest
import torch
import transformers as T

from longstride.model.build import load_config_with_yarn
from longstride.model.config import YarnConfig

SMALL = dict(vocab_size=300, eos_token_id=0, pad_token_id=1, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _save(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


def test_yarn_on_phi3_runs_over_the_window_it_reports(tmp_path):
    """Phi-3 keeps original_max_position_embeddings at the top level too, and transformers standardises it back
    over the rope entry when it builds the model: YaRN x2 ran over 128 positions while eval reported 256. The
    model's frequencies now are YaRN x2 over the trained length (or the window given), as on a Llama of the same
    head size."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    wide = {**SMALL, "hidden_size": 128, "num_attention_heads": 2}  # head size 64: YaRN's ramp sees the window
    path = _save(T.Phi3ForCausalLM(T.Phi3Config(**wide, max_position_embeddings=256,
                                                original_max_position_embeddings=128)), tmp_path / "phi3")
    for original, want in ((None, 256), (200, 200)):
        config, _ = load_config_with_yarn(path, YarnConfig(factor=2, original_max_position_embeddings=original))
        model = T.AutoModelForCausalLM.from_pretrained(path, config=config)
        llama = T.LlamaConfig(**wide, max_position_embeddings=2 * want,
                              rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                               "original_max_position_embeddings": want})
        expect, scale = ROPE_INIT_FUNCTIONS["yarn"](llama, "cpu")
        assert torch.allclose(model.model.rotary_emb.inv_freq, expect), original
        assert model.model.rotary_emb.attention_scaling == pytest.approx(scale)


def test_a_model_without_rope_is_refused_yarn_and_lengths_past_its_learned_positions(tmp_path, capsys):
    """GPT-2 keeps no rope_parameters: YaRN is refused by name, and its learned table of positions ends at 128: a
    longer length is refused (ppl) or skipped (ruler) before any scoring, where it failed with an index error;
    the skip suggests no YaRN. GPT-J's rotary_dim RoPE has no table: it extrapolates as before."""
    from longstride.data.tokenizer import train_bpe
    from longstride.eval import ppl
    from longstride.eval.load import learned_positions
    from longstride.eval.cli import RulerConfig
    from longstride.eval.ruler.run import main, reachable_lengths

    path = _save(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=128)),
                 tmp_path / "gpt2")
    train_bpe(["a few words for a tokenizer"] * 4, 300).save_pretrained(path)
    with pytest.raises(ValueError, match="GPT2Config keeps no rope_parameters"):
        load_config_with_yarn(path, YarnConfig(factor=2))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "long.txt").write_text(" ".join(f"word{i}" for i in range(400)))
    with pytest.raises(ValueError, match=r"lengths \[256\]: GPT2LMHeadModel learns a table of 128 positions"):
        ppl.main([f"checkpoint={path}", "lengths=[64,256]", f"docs_dir={tmp_path}/docs", "glob=*.txt",
                  f"out={tmp_path}/out"])
    ok, skipped = reachable_lengths(RulerConfig(checkpoint=path, lengths=[64, 256]), 128, 128, rope=False)
    assert ok == [64] and "yarn" not in skipped[0].lower() and "extrapolate=true" in skipped[0]
    with pytest.raises(ValueError, match="no length within the model's 128 learned positions"):
        main([f"checkpoint={path}", "lengths=[256]", "extrapolate=true", "tasks=[synth_kv]", "num_samples=1",
              f"out={tmp_path}/ruler"])
    assert "length 256 skipped: GPT2LMHeadModel learns a table of 128 positions" in capsys.readouterr().err
    assert learned_positions(T.GPTJForCausalLM(T.GPTJConfig(vocab_size=300, n_embd=32, n_layer=1, n_head=4,
                                                            rotary_dim=4))) is None


def test_yarn_factor_zero_and_unread_rope_layer_types_are_refused(tmp_path):
    llama = _save(T.LlamaForCausalLM(T.LlamaConfig(**SMALL)), tmp_path / "llama")
    with pytest.raises(ValueError, match=r"yarn.factor=0.0 must be > 1"):
        load_config_with_yarn(llama, YarnConfig(factor=0.0))
    gemma = _save(T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, head_dim=8)), tmp_path / "gemma3")
    with pytest.raises(ValueError, match=r"rope_layer_types=\['bogus'\]"):  # no YaRN reads it: still checked
        load_config_with_yarn(gemma, YarnConfig(), ["bogus"])
    with pytest.raises(ValueError, match="rope_layer_types=.*one rope_parameters"):
        load_config_with_yarn(llama, YarnConfig(), ["full_attention"])


def test_a_haystack_is_checked_even_when_no_task_reads_it(ruler_checkpoint, tmp_path):
    from longstride.eval.ruler.run import main

    with pytest.raises(ValueError, match="haystack="):
        main([f"checkpoint={ruler_checkpoint}", "tasks=[synth_kv]", "lengths=[512]", f"haystack={tmp_path}/none",
              f"out={tmp_path}/out"])


def test_the_default_out_is_never_inside_the_checkpoint(ruler_checkpoint, tmp_path, monkeypatch):
    from longstride.eval.cli import default_out
    from longstride.eval.cli import parse_ppl

    monkeypatch.chdir(ruler_checkpoint)
    with pytest.raises(ValueError, match="working directory is inside checkpoint='.'"):
        parse_ppl(["checkpoint=."])
    os.symlink(ruler_checkpoint, tmp_path / "link")
    with pytest.raises(ValueError, match="working directory is inside checkpoint"):  # named through a link
        default_out(str(tmp_path / "link"))
    parse_ppl(["checkpoint=.", "out=/tmp/elsewhere"])  # out= given: taken
    monkeypatch.chdir(os.path.dirname(ruler_checkpoint))
    assert default_out(str(ruler_checkpoint)) == os.path.join("outputs", "eval", os.path.basename(ruler_checkpoint))


def _phi3_longrope():
    window = 64
    short = [1.0] * 4
    return T.Phi3Config(**SMALL, max_position_embeddings=256, original_max_position_embeddings=window,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
                                         "long_factor": [4.0] * 4, "original_max_position_embeddings": window})


def test_prefill_chunks_that_would_rotate_keys_otherwise_are_refused():
    """longrope takes its long factors only in a forward reaching past its window: prefill chunks that do not
    reach it rotated a prompt's first keys with the short ones (2e-3 off one forward here). Refused; a chunk past
    the window gives the one forward's logits. Dynamic NTK rescales by each forward's length: one chunk only."""
    from longstride.eval.hf_adapter import cache_kw, check_prefill_chunk
    from longstride.eval.ruler.generate import _prefill

    torch.manual_seed(0)
    model = T.Phi3ForCausalLM(_phi3_longrope()).eval()
    prompt = torch.randint(2, 300, (150,)).tolist()
    with pytest.raises(ValueError, match=r"prefill_chunk=32: .*rope_type=longrope.*set prefill_chunk > 64"):
        check_prefill_chunk(model.config, 32, len(prompt))
    check_prefill_chunk(model.config, 32, 64)  # prompts within the window: every forward short, as one forward
    check_prefill_chunk(model.config, 65, len(prompt))
    with torch.no_grad():
        full = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        _, chunked = _prefill(model, prompt, 65, torch.device("cpu"), cache_kw(model))
    assert torch.allclose(chunked, full, atol=1e-5), (chunked - full).abs().max()
    dynamic = T.LlamaConfig(**SMALL, max_position_embeddings=64,
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"lengths up to 150: the model's rope_type=dynamic .* give lengths up to 64"):
        check_prefill_chunk(dynamic, 150, 150)  # one chunk too: prefix caching shares keys across prompts
    check_prefill_chunk(dynamic, 32, 64)
    # why: the scale a long forward set stays for a shorter one after it (its scores depend on the order of work)
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(dynamic).eval()
    short, long = torch.randint(2, 60, (1, 100)), torch.randint(2, 60, (1, 150))
    with torch.no_grad():
        fresh = lm(input_ids=short).logits
        lm(input_ids=long)
        after = lm(input_ids=short).logits
    assert not torch.allclose(fresh, after, atol=1e-4)


def test_a_checkpoint_with_its_own_yarn_reaches_as_far_as_that_yarn(tmp_path):
    """Qwen3's documented YaRN switch: x4 over 256 beside a declared 320 max positions. Lengths up to 1024 are in
    reach (they were skipped past 320, with a hint that would have made it x8), and the hint for longer ones counts
    in that reach."""
    from longstride.eval.cli import RulerConfig
    from longstride.eval.ruler.run import reachable_lengths
    from longstride.model.rope import max_positions, yarn_unit

    config = T.Qwen3Config(**SMALL, head_dim=8, max_position_embeddings=320,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                            "original_max_position_embeddings": 256})
    path = _save(T.Qwen3ForCausalLM(config), tmp_path / "qwen3")
    config, trained = load_config_with_yarn(path, YarnConfig())
    assert max_positions(config) == yarn_unit(config, trained) == 1024
    ok, skipped = reachable_lengths(RulerConfig(checkpoint=path, lengths=[512, 1024, 3000]), max_positions(config),
                                    yarn_unit(config, trained))
    assert ok == [512, 1024] and "add yarn.factor=3 (YaRN)" in skipped[0], skipped
    stretched, _ = load_config_with_yarn(path, YarnConfig(factor=3))
    assert max_positions(stretched) == 3072 >= 3000  # the hint's factor reaches the length


def test_soft_capped_full_attention_decodes_as_the_model_s_own_generate():
    """Gemma 2 with full attention in every layer: its soft-capped scores are the model's own attention's to
    compute (they failed at the first prompt); greedy answers equal transformers' generate."""
    from longstride.data.tokenizer import train_bpe
    from longstride.eval.ruler.generate import greedy_generate

    tok = train_bpe(["some words to train a tokenizer on, and a few more words"] * 4, 300)
    config = T.Gemma2Config(**{**SMALL, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
                            head_dim=8, layer_types=["full_attention"] * 2, attn_logit_softcapping=5.0)
    torch.manual_seed(0)
    model = T.Gemma2ForCausalLM(config).eval()
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (40, 70)]
    got = greedy_generate(model, tok, prompts, 8, prefill_chunk=32)
    for p, answer in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=[],
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert answer == tok.decode(ref, skip_special_tokens=True)
