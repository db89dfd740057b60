"""eval.ppl on a micro checkpoint: lengths, YaRN at eval time, outputs, bad input."""
from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig

from longstride.eval.cli import parse_ppl
from longstride.eval.ppl import main
from longstride.model.build import load_config_with_yarn
from longstride.model.config import YarnConfig
from tests.conftest import micro_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    micro_checkpoint(d, 300, 128)
    return d


def test_yarn_helper_applies_transformers_yarn(checkpoint):
    config, trained = load_config_with_yarn(str(checkpoint), YarnConfig(factor=2.0))
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == 128
    assert config.rope_parameters["rope_theta"] == 1e4
    assert config.max_position_embeddings == 256
    assert AutoConfig.from_pretrained(checkpoint).rope_parameters["rope_type"] == "default", "saved dir untouched"


@pytest.mark.parametrize("factor, original", [(2.0, -64), (2.0, 0), (None, 128)])
def test_a_yarn_window_that_would_fail_or_do_nothing_is_named(checkpoint, factor, original):
    """A negative window failed later in a logarithm, 0 was replaced by the trained length and a window without a
    factor was ignored: each is refused naming the field."""
    with pytest.raises(ValueError, match=rf"yarn.original_max_position_embeddings={original} must be null \(the "
                                         r"trained length\), or >= 1 tokens together with yarn.factor"):
        load_config_with_yarn(str(checkpoint), YarnConfig(factor=factor, original_max_position_embeddings=original))


def test_ppl_with_and_without_yarn(checkpoint, tmp_path):
    plain = main([f"checkpoint={checkpoint}", "lengths=[64,256]", "max_docs=2", f"out={tmp_path}"])
    yarn = main([f"checkpoint={checkpoint}", "lengths=[64,256]", "max_docs=2", "yarn.factor=2", f"out={tmp_path}"])
    assert [r["length"] for r in plain] == [64, 256]
    assert all(math.isfinite(r["ppl"]) and r["docs"] == 2 for r in plain + yarn)
    assert plain[0]["yarn_factor"] == 1.0 and yarn[0]["yarn_factor"] == 2.0
    assert abs(plain[1]["tail_ppl"] - yarn[1]["tail_ppl"]) > 1e-3, "YaRN changes the rotary frequencies"
    saved = json.loads((tmp_path / "ppl_yarn2.json").read_text())
    assert saved["results"] == yarn
    assert saved["config"]["applied_rope"]["rope_parameters"]["factor"] == 2.0
    assert (tmp_path / "ppl.csv").is_file() and (tmp_path / "ppl.png").stat().st_size > 0
    half = main([f"checkpoint={checkpoint}", "lengths=[64,256]", "max_docs=2", "dtype=bfloat16", f"out={tmp_path}"])
    for p, h in zip(plain, half):  # bf16 weights and activations, the loss in fp32: near, not equal
        assert h["ppl"] != p["ppl"] and abs(math.log(h["ppl"]) - math.log(p["ppl"])) < 0.05, (p, h)
    assert (tmp_path / "ppl_bfloat16.json").is_file()  # beside the float32 run's files, not over them
    assert json.loads((tmp_path / "ppl.json").read_text())["results"] == plain
    assert (tmp_path / "ppl_bfloat16.json").is_file() and json.loads((tmp_path / "ppl.json").read_text())["results"] \
        == plain  # beside the float32 run's files, not over them


@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama4"])
def test_perplexities_are_the_model_s_own_cross_entropy(arch):
    """Whole and last-quarter perplexity against the model's own logits, for a decoder under `model` (Llama) and
    one under `transformer` (GPT-2, which eval ppl once failed on) and Llama 4, whose get_decoder is itself."""
    import torch
    import transformers as T

    from longstride.eval.ppl import perplexities

    torch.manual_seed(0)
    if arch == "llama4":  # its get_decoder returns the causal LM itself
        lm = T.Llama4ForCausalLM(T.Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                    head_dim=16, vocab_size=97))
    elif arch == "gpt2":
        lm = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, n_positions=128))
    else:
        lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, vocab_size=97, bos_token_id=1, eos_token_id=2))
    lm.eval()
    docs = [torch.randint(3, 97, (80,)).tolist() for _ in range(2)]
    got = perplexities(lm, docs, 64, tile=16)
    losses = []
    with torch.no_grad():
        for ids in docs:
            x = torch.tensor(ids[:64])[None]
            losses.append(torch.nn.functional.cross_entropy(lm(x).logits[0, :-1], x[0, 1:], reduction="none"))
    losses = torch.stack(losses)
    assert got["ppl"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-5)
    assert got["tail_ppl"] == pytest.approx(math.exp(losses[:, 48:].mean().item()), rel=1e-5)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="checkpoint=<dir> is required"):
        parse_ppl([])
    with pytest.raises(ValueError, match="has no config.json"):
        parse_ppl([f"checkpoint={tmp_path}"])


def test_a_launched_ppl_is_refused_before_every_process_runs_all_of_it(checkpoint, monkeypatch):
    """Under torchrun each process would run the whole eval on one GPU and write the same files."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"longstride eval ppl runs in one process: launch it with python -m"):
        parse_ppl([f"checkpoint={checkpoint}"])


@pytest.mark.parametrize("override, message", [
    ("lengths=[4]", r"lengths=\[4\]: give token lengths >= 8"),
    ("tile=0", "tile=0 must be >= 1"),
    ("max_docs=0", "max_docs=0 must be >= 1"),
    ("docs_dir=/no/such/dir", "docs_dir='/no/such/dir' is not a directory"),
])
def test_bad_settings_are_named_before_the_model_loads(checkpoint, override, message):
    with pytest.raises(ValueError, match=message):
        parse_ppl([f"checkpoint={checkpoint}", override])


def test_too_few_long_documents_fail_before_the_weights_load(checkpoint, tmp_path, monkeypatch):
    from longstride.eval import ppl

    def loaded(*args, **kwargs):
        raise AssertionError("the documents are checked before the model loads")

    monkeypatch.setattr(ppl, "load_eval_model", loaded)
    (tmp_path / "short.txt").write_text("a few words")
    with pytest.raises(ValueError, match="no document of >= 64 tokens among the 1 files"):
        main([f"checkpoint={checkpoint}", "lengths=[64]", f"docs_dir={tmp_path}", "glob=*.txt", f"out={tmp_path}/o"])


class _Tok:
    """A tokenizer that, like Llama's, puts BOS (id 9) before text unless told not to: one id per character."""

    def __init__(self, bos_first: bool):
        self.bos_token_id, self.bos_first = 9, bos_first

    def __call__(self, text, add_special_tokens=True, split_special_tokens=False):
        return {"input_ids": ([9] if add_special_tokens and self.bos_first else []) + [10 + ord(c) % 50 for c in text]}


@pytest.mark.parametrize("bos_first", [True, False])
def test_documents_open_with_bos_where_the_tokenizer_puts_one(tmp_path, bos_first):
    from longstride.eval.cli import PplConfig
    from longstride.eval.ppl import long_documents

    (tmp_path / "a.py").write_text("x = 1\n" * 20)
    cfg = PplConfig(docs_dir=str(tmp_path))
    (doc,) = long_documents(_Tok(bos_first), cfg, 50)
    body = [10 + ord(c) % 50 for c in "x = 1\n" * 20]
    assert doc == ([9] + body if bos_first else body)


@pytest.mark.parametrize("name, kernel", [("mistral", "sdpa"), ("gemma3", "sdpa"), ("gemma2", "math"),
                                          ("gpt_oss", "sdpa"), ("llama4", "sdpa")])
def test_windowed_capped_sink_and_chunked_models_score_with_longstride_attention(name, kernel):
    """eval ppl switches the decoder to longstride's attention (their eager attention held L x L scores per head):
    windows of 7, Gemma 2's cap on the math kernel, GPT-OSS's sinks, Llama 4's chunks, each perplexity the model's
    own eager cross entropy within 1e-5 relative."""
    import torch

    from longstride.eval.ppl import perplexities, ppl_attention
    from tests.test_attention_patterns import make_model

    lm = make_model(name, 7).eval()
    docs = [torch.randint(2, 64, (80,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    with torch.no_grad():
        own = torch.stack([torch.nn.functional.cross_entropy(lm(torch.tensor([d[:64]])).logits[0, :-1],
                                                             torch.tensor(d[1:64]), reduction="none") for d in docs])
    layout = ppl_attention(lm)
    assert layout.cp.kernel == kernel and lm.config._attn_implementation == "longstride"
    got = perplexities(lm, docs, 64, 16, layout)
    assert got["ppl"] == pytest.approx(math.exp(own.mean().item()), rel=1e-5)
    assert got["tail_ppl"] == pytest.approx(math.exp(own[:, 48:].mean().item()), rel=1e-5)


def test_a_model_longstride_does_not_compute_keeps_its_own_attention(capsys):
    """A bidirectional Gemma 3 (use_bidirectional_attention): eval ppl leaves it on its own attention, saying why."""
    import transformers as T

    from longstride.eval.ppl import ppl_attention

    lm = T.Gemma3ForCausalLM(T.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, use_bidirectional_attention=True)).eval()
    own = lm.config._attn_implementation
    assert ppl_attention(lm) is None and lm.config._attn_implementation == own
    err = capsys.readouterr().err
    assert "Gemma3ForCausalLM runs its own attention" in err and "bidirectional attention" in err, err


def test_a_vision_language_gemma_3_scores_its_text_decoder_with_longstride_attention(monkeypatch):
    """Gemma 3 4B and up (Gemma3ForConditionalGeneration): the text decoder switches (its attention calls reach
    longstride's doc_attention), the vision tower keeps its own; the perplexity is the model's own."""
    import torch

    from longstride.eval.ppl import perplexities, ppl_attention
    from longstride.parallel import attention
    from longstride.parallel.cp import CPContext, DocLayout
    from tests.test_prefill_patterns import vision_gemma3

    lm = vision_gemma3()
    docs = [torch.randint(2, 64, (80,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    with torch.no_grad():
        own = torch.stack([torch.nn.functional.cross_entropy(lm(torch.tensor([d[:64]])).logits[0, :-1],
                                                             torch.tensor(d[1:64]), reduction="none") for d in docs])
    layout = ppl_attention(lm)
    assert layout.cp.kernel == "sdpa"
    layout = DocLayout(layout.doc_ids, layout.plan, CPContext(kernel="math"))  # a kernel only this layout names
    calls, inner = [], attention.doc_attention
    monkeypatch.setattr(attention, "doc_attention", lambda *a, **k: calls.append(k["kernel"]) or inner(*a, **k))
    got = perplexities(lm, docs, 64, 16, layout)
    assert calls == ["math"] * 2 * lm.config.text_config.num_hidden_layers  # the layout reached every layer
    assert lm.config.vision_config._attn_implementation != "longstride"
    assert got["ppl"] == pytest.approx(math.exp(own.mean().item()), rel=1e-5)


def test_a_call_asking_for_more_than_its_config_shows_keeps_the_model_s_own_attention(capsys):
    """Attention calls that pass a position bias: ppl_attention's two-token probe meets longstride's refusal, puts
    the decoder back on its own attention and says why; the perplexity is the model's own."""
    import torch

    from longstride.eval.ppl import perplexities, ppl_attention
    from tests.test_attention_patterns import make_model

    lm = make_model("llama", 0).eval()
    for layer in lm.model.layers:
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, f=forward, **k: f(*a, position_bias=torch.zeros(1), **k)
    assert ppl_attention(lm) is None and lm.config._attn_implementation == "eager"
    assert "runs its own attention" in capsys.readouterr().err
    docs = [torch.randint(2, 64, (80,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    with torch.no_grad():
        own = torch.stack([torch.nn.functional.cross_entropy(lm(torch.tensor([d[:64]])).logits[0, :-1],
                                                             torch.tensor(d[1:64]), reduction="none") for d in docs])
    assert perplexities(lm, docs, 64, 16)["ppl"] == pytest.approx(math.exp(own.mean().item()), rel=1e-5)


def test_a_dynamic_ntk_checkpoint_scores_each_length_as_if_alone(checkpoint, tmp_path):
    """A dynamic NTK RoPE keeps the scale of the longest forward so far, so lengths=[256,192] scored 192 with 256's
    scale (past the 128 max positions both extrapolate): the lengths run shortest first, each as in a run alone."""
    import shutil

    dynamic = tmp_path / "dynamic"
    shutil.copytree(checkpoint, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_scaling", None)
    (dynamic / "config.json").write_text(json.dumps(config))
    (dynamic / "manifest.json").unlink(missing_ok=True)
    both = main([f"checkpoint={dynamic}", "lengths=[256,192]", "max_docs=1", f"out={tmp_path / 'both'}"])
    alone = main([f"checkpoint={dynamic}", "lengths=[192]", "max_docs=1", f"out={tmp_path / 'alone'}"])
    by = {r["length"]: r["ppl"] for r in both}
    assert by[192] == alone[0]["ppl"], (by, alone)
    assert [r["length"] for r in both] == [192, 256]
