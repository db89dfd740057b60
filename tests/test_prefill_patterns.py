"""RULER's prefill (eval/ruler/attention.py prefill_attention) on models whose attention is not plain causal:
sliding windows (Mistral, Qwen2, Gemma 3, OLMo 3, EXAONE 4), soft-capped scores (Gemma 2) and sinks (GPT-OSS)
and chunks (Llama 4) computed by longstride's block kernels, exact against the model's own eager attention; scores
held one query tile at a time, not prefill_chunk x prompt; generation batched over full caches."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from longstride.eval.hf_adapter import cache_kw
from longstride.eval.ruler import attention
from longstride.eval.ruler import generate as G
from longstride.recipes.memory.trace import LiveBytes
from tests.test_attention_patterns import MODELS, WINDOWS, make_matter, make_model

CPU = torch.device("cpu")
PATTERNED = ["mistral", "qwen2", "gemma3", "gemma2", "gpt_oss", "olmo3", "exaone4"]


def prompt(n: int, vocab: int = 64, seed: int = 1) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def own_forward(model, ids: list[int]):
    """(cache, last-token logits) of one forward of the whole prompt through the model's own (eager) attention."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **{cache_kw(model): DynamicCache(config=model.config)})
    return out.past_key_values, out.logits[0, -1]


@torch.no_grad()
def prefill(model, ids: list[int], chunk: int):
    """generate.py's prefill of one prompt from an empty cache: (cache, last-token logits)."""
    return G._prefill(model, ids, chunk, CPU, cache_kw(model))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def counting(monkeypatch) -> list:
    """Patches prefill_attention's patterned path to count its calls."""
    calls, inner = [], attention._prefill_pattern
    monkeypatch.setattr(attention, "_prefill_pattern", lambda *a: calls.append(a[4]) or inner(*a))
    return calls


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", PATTERNED)
def test_a_chunked_prefill_gives_the_model_s_own_cache_and_logits(name, window, monkeypatch):
    """A 90-token prompt prefilled 32 tokens a forward (windows of 7 and 40 tokens cross the forwards) gives the
    KV cache (each sliding layer's kept tokens) and last-token logits of one forward through the model's eager
    attention; the windowed, soft-capped and sink layers ran longstride's patterned prefill."""
    model = make_model(name, window).eval()
    assert attention.prefill_computes(model)  # its probe forward first: not counted below
    calls = counting(monkeypatch)
    ids = prompt(90)
    cache, logits = prefill(model, ids, 32)
    ref_cache, ref_logits = own_forward(model, ids)
    assert relative(logits, ref_logits) < 1e-5
    for mine, theirs in zip(cache.layers, ref_cache.layers, strict=True):
        assert type(mine) is type(theirs) and mine.keys.shape == theirs.keys.shape
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values,
                                                                                     atol=1e-5)
    assert calls and {p.window for p in calls} <= {window, None}
    if name in ("gemma2", "gpt_oss"):  # every layer: the soft-cap or sinks, also on the full layers
        assert len(calls) == 3 * model.config.num_hidden_layers


@pytest.mark.parametrize("name, drop", [("gemma3", "window"), ("gemma2", "softcap"), ("gpt_oss", "sinks")])
def test_the_prefill_test_fails_without_each_part_of_the_pattern(name, drop, monkeypatch):
    """Control: with the window, soft-cap or sinks left out of the prefill, the logits are off by more than 1e-2
    relative, a thousand times the tolerance above."""
    model = make_model(name, 7).eval()
    ids = prompt(90)
    inner = attention.prefill_pattern

    def without(*args):
        pattern, sinks = inner(*args)
        return (pattern, None) if drop == "sinks" else (dataclasses.replace(pattern, **{drop: None}), sinks)

    monkeypatch.setattr(attention, "prefill_pattern", without)
    _, logits = prefill(model, ids, 32)
    assert relative(logits, own_forward(model, ids)[1]) > 1e-2


@pytest.mark.parametrize("name", ["smollm3_inconsistent", "phimoe", "olmoe"])
def test_a_layer_whose_call_and_mask_disagree_on_its_window_follows_the_mask(name, monkeypatch):
    """Models whose attention calls and masks disagree on a layer's window (training refuses them:
    tests/test_attention_refusal.py): the model's own eager and SDPA attention read the mask, and so does the
    prefill, which gives what the model's own attention gives over the same 16-token forwards."""
    from tests.test_attention_refusal import WINDOW_CASES

    torch.manual_seed(0)
    model = WINDOW_CASES[name][0]().eval()
    model.set_attn_implementation("eager")
    assert attention.prefill_computes(model)
    ids = prompt(60)
    _, logits = prefill(model, ids, 16)
    monkeypatch.setattr(G, "prefill_computes", lambda m: False)
    _, ref = prefill(model, ids, 16)
    assert relative(logits, ref) < 1e-5


def vision_gemma3() -> torch.nn.Module:
    """A tiny Gemma 3 as its 4B and larger checkpoints load through AutoModelForCausalLM:
    Gemma3ForConditionalGeneration, a SigLIP vision tower (bidirectional) beside the text decoder (windows of 7)."""
    text = dict(MODELS["llama"][0](0).to_dict(), sliding_window=7, layer_types=["sliding_attention",
                                                                                 "full_attention"] * 2)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "sliding_window", "layer_types")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = T.Gemma3Config(text_config={k: text[k] for k in keys}, vision_config=vision, mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    return model


def test_a_vision_language_gemma_3_prefills_its_text_decoder():
    """The vision tower never runs on RULER's text; the text decoder's windows are computed."""
    model = vision_gemma3()
    assert attention.prefill_computes(model)
    ids = prompt(60)
    _, logits = prefill(model, ids, 16)
    assert relative(logits, own_forward(model, ids)[1]) < 1e-5


def test_what_the_prefill_does_not_compute_is_refused_not_dropped():
    """A caller's tensor mask, a position bias or bidirectional attention reaching prefill_attention are refused
    naming what was asked, as longstride's training attention refuses them."""
    model = make_model("gemma3", 7).eval()
    layer = next(m for m in model.modules() if type(m).__name__ == "Gemma3Attention")
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="this call's mask holds more"):
        attention.prefill_attention(layer, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=r"an additive position bias \(position_bias\)"):
        attention.prefill_attention(layer, q, kv, kv, None, position_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="bidirectional attention"):
        attention.prefill_attention(layer, q, kv, kv, None, is_causal=False)


def test_a_call_asking_for_more_than_its_config_shows_prefills_on_the_model_s_own_attention(capsys):
    """Attention calls that pass a position bias (which no config field shows): the two-token probe finds the refusal
    before any prompt's cache is written, and the prompts prefill on the model's own attention, with a note."""
    model = make_model("llama", 0).eval()
    for layer in model.model.layers:
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, f=forward, **k: f(*a, position_bias=torch.zeros(1), **k)
    assert not attention.prefill_computes(model)
    assert "generates on its own attention" in capsys.readouterr().err
    ids = prompt(60)
    _, logits = prefill(model, ids, 16)
    assert relative(logits, own_forward(model, ids)[1]) < 1e-5


@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_a_chunked_layer_s_prefill_gives_the_model_s_own_cache_and_logits(chunk, monkeypatch):
    """Llama 4 (chunked layers, NoPE full layers between them): a 90-token prompt prefilled 13 tokens a forward
    (chunks of 7, 16 and 40 tokens cross the forwards unaligned) gives the cache and last-token logits of one eager
    forward; the chunked layers ran `_prefill_chunks`, placed by the positions their mask call gave."""
    model = make_model("llama4", chunk).eval()
    assert attention.prefill_computes(model)
    calls, inner = [], attention._prefill_chunks
    monkeypatch.setattr(attention, "_prefill_chunks", lambda *a: calls.append(a[6:]) or inner(*a))
    ids = prompt(90)
    cache, logits = prefill(model, ids, 13)
    ref_cache, ref_logits = own_forward(model, ids)
    assert relative(logits, ref_logits) < 1e-5
    for mine, theirs in zip(cache.layers, ref_cache.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape and torch.allclose(mine.keys, theirs.keys, atol=1e-5)
    chunked = model.config.layer_types.count("chunked_attention")
    assert len(calls) == chunked * 7  # 90 tokens in 7 forwards
    # (first query's position, first key's): the first forward from 0; the last from 78, its keys from the chunk - 1
    # tokens the model's sliding cache kept
    assert calls[0] == (0, 0) and calls[-1] == (78, max(0, 78 - chunk + 1))


def test_the_chunked_prefill_test_fails_without_the_chunks(monkeypatch):
    """Control: the chunked layers computed as plain causal ones move the logits by more than 1e-2 relative."""
    model = make_model("llama4", 7).eval()
    ids = prompt(90)
    inner = attention.prefill_pattern
    monkeypatch.setattr(attention, "prefill_pattern",
                        lambda *a: (dataclasses.replace(inner(*a)[0], chunk=None), inner(*a)[1]))
    _, logits = prefill(model, ids, 13)
    assert relative(logits, own_forward(model, ids)[1]) > 1e-2


def test_a_chunked_layer_without_its_positions_is_refused():
    """prefill_attention reached on a chunked layer without prefill_mask's positions refuses it, naming it."""
    model = make_model("llama4", 16).eval()
    layer = next(m for m in model.modules() if type(m).__name__ == "Llama4TextAttention" and
                 model.config.layer_types[m.layer_idx] == "chunked_attention")
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="chunked attention layer, whose chunks count from positions"):
        attention.prefill_attention(layer, q, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), None)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "gemma2", "gpt_oss", "llama4"])
def test_greedy_answers_equal_the_model_s_own_generate(name, monkeypatch):
    """Four prompts of 40-90 tokens, three of them sharing their first 40-50 (prefix caching: those prefixes are not
    prefilled again), decoded together in one left-padded batch that keeps every token in every layer (the masks
    apply the windows of 7, in longstride's CPU decode attention, Gemma 2's cap and GPT-OSS's sinks included), and
    one
    at a time on the model's own sliding caches (batch_size=1): both answer what transformers' generate answers
    with the model's eager attention. The drafts asked for are off (a rejected draft's holes would shift windows).
    Llama 4's chunked rows run alone on its sliding caches."""
    from longstride.data.tokenizer import train_bpe

    tok = train_bpe(["some words to train a tokenizer on, and a few more words"] * 4, 300)
    make, cls = MODELS[name]
    config = make(7)
    config.vocab_size, config.eos_token_id, config.pad_token_id = len(tok), tok.eos_token_id, tok.pad_token_id
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = make_matter(cls(config).float()).eval()
    base = prompt(90, len(tok), seed=5)
    prompts = [base[:40], base[:50] + prompt(20, len(tok), seed=6), base, prompt(70, len(tok), seed=7)]
    want = [tok.decode(model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=[],
                                      pad_token_id=tok.pad_token_id)[0, len(p):].tolist(), skip_special_tokens=True)
            for p in prompts]
    alone, inner = [], G._one_at_a_time
    monkeypatch.setattr(G, "_one_at_a_time", lambda *a: alone.append(a[1]) or inner(*a))
    prefilled, prefill_inner = [], G._prefill
    monkeypatch.setattr(G, "_prefill", lambda m, ids, chunk, d, kw, cache=None: prefilled.append(
        len(ids) - (cache.get_seq_length() if cache is not None else 0)) or prefill_inner(m, ids, chunk, d, kw, cache))
    decoded, (decode, mask) = [], attention._ATTENTION[attention.DECODE_ATTENTION]
    monkeypatch.setitem(attention._ATTENTION, attention.DECODE_ATTENTION,
                        (lambda *a, **k: decoded.append(1) or decode(*a, **k), mask))
    if name == "llama4":  # chunks count positions, which left padding moves off the columns: every row alone
        assert G.greedy_generate(model, tok, prompts, 8, prefill_chunk=32, draft=3) == want and len(alone) == 1
        return
    assert G.greedy_generate(model, tok, prompts, 8, prefill_chunk=32, draft=3) == want and not alone
    assert sum(prefilled) == sum(map(len, prompts)) - 40 - 50  # two prompts from their shared prefixes
    assert decoded  # longstride's CPU decode attention, the cap's and the sinks' included
    assert G.greedy_generate(model, tok, prompts, 8, prefill_chunk=32, batch_size=1) == want and len(alone) == 4


def test_a_patterned_prefill_holds_a_tile_of_scores_not_the_chunk_s(monkeypatch):
    """Gemma 2 (soft-capped scores on sliding and full layers), a 1,024-token prompt in one forward: the most
    bytes alive at once (LiveBytes, the weights excluded) under the patterned prefill are under a quarter of the
    model's own eager attention's, which holds every head's 1,024 x 1,024 scores several times over."""
    model = make_model("gemma2", 64).eval()
    ids = prompt(1024)
    peaks = {}
    for ours in (True, False):
        monkeypatch.setattr(G, "prefill_computes", lambda m, ours=ours: ours)
        with LiveBytes() as live:
            prefill(model, ids, 1024)
        peaks[ours] = live.peak
    assert peaks[True] < peaks[False] / 4, peaks
