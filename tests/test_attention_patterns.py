"""Sliding windows, chunked attention, soft-capped scores and attention sinks, exact against each model's own eager
attention.

Tiny random models of transformers' own classes: Mistral and Qwen2 (windows), Gemma 3 (local + global layers),
Gemma 2 (local + global layers, soft-capped scores: the math kernel and flash-attn's contract, which alone take
it), GPT-OSS (sinks + windows), Llama 4 (chunked + NoPE layers), OLMo 3 and EXAONE 4 (windows + full), Llama as
the plain causal control, GPT-NeoX as another layout (its decoder under gpt_neox, partial rotary). Logits, loss
and every parameter's gradient with longstride's attention equal the model's eager attention within 1e-5 relative in fp32: on one device with each kernel (the CPU flash op, the math path, the
varlen contract that torch's flash kernel runs on CUDA, emulated here), with and without document masks (the
reference runs each document alone), and under ring (N = 2, 3), Ulysses, UPipe and hybrid on gloo processes,
with windows smaller and larger than a CP chunk and crossing document boundaries.
"""
from __future__ import annotations

import functools
import pytest
import torch
import transformers as T

from longstride.parallel import varlen
from longstride.parallel.attention import use_longstride_attention
from longstride.parallel.config import ParallelConfig, ParallelDims
from longstride.parallel.cp import CPContext, cp_context, cp_degrees, shard_for_cp
from longstride.parallel.dense import DENSE
from longstride.parallel.kernels import SOFTCAP_KERNELS
from longstride.parallel.spawn import run_gloo

L, V = 96, 64
LENGTHS = [30, 1, 50, 15]  # a length-1 document; windows cross document and CP-chunk boundaries
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
MODELS = {  # name -> (config for a window/chunk size, class)
    "llama": (lambda w: T.LlamaConfig(**SMALL), T.LlamaForCausalLM),
    "mistral": (lambda w: T.MistralConfig(**SMALL, sliding_window=w), T.MistralForCausalLM),
    "qwen2": (lambda w: T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=w, max_window_layers=2),
              T.Qwen2ForCausalLM),
    "gemma3": (lambda w: T.Gemma3TextConfig(**SMALL, sliding_window=w, layer_types=["sliding_attention",
                                                                                   "full_attention"] * 2),
               T.Gemma3ForCausalLM),
    # scores of a few units against a soft-cap of 2 (make_model scales q/k up): the cap bends them (Gemma 2's own
    # 50 would not touch a tiny random model's)
    "gemma2": (lambda w: T.Gemma2Config(**SMALL, sliding_window=w, attn_logit_softcapping=2.0,
                                        query_pre_attn_scalar=1, layer_types=["sliding_attention",
                                                                              "full_attention"] * 2),
               T.Gemma2ForCausalLM),
    "gpt_oss": (lambda w: T.GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=w),
                T.GptOssForCausalLM),
    # attn_temperature_tuning scales NoPE layers' queries by the absolute position: off, so that a document alone
    # (the reference) and the same document packed agree
    "llama4": (lambda w: T.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, num_local_experts=1,
                                            attention_chunk_size=w, no_rope_layer_interval=2,
                                            attn_temperature_tuning=False), T.Llama4ForCausalLM),
    # keeps the window on every layer and passes sliding_window=None on its full ones
    "exaone4": (lambda w: T.Exaone4Config(**SMALL, sliding_window=w, layer_types=["sliding_attention",
                                                                                 "full_attention"] * 2),
                T.Exaone4ForCausalLM),
    # another layout: decoder gpt_neox, attention module `attention`, partial rotary, parallel residual
    "gpt_neox": (lambda w: T.GPTNeoXConfig(**{k: v for k, v in SMALL.items() if k not in ("head_dim",
                                                                                         "num_key_value_heads")}),
                 T.GPTNeoXForCausalLM),
    "olmo3": (lambda w: T.Olmo3Config(**{k: v for k, v in SMALL.items() if k != "head_dim"}, sliding_window=w,
                                      eos_token_id=0, pad_token_id=1), T.Olmo3ForCausalLM),
}
WINDOWS = (7, 40)  # smaller than every CP chunk here (16-24 tokens), larger than all of them


def make_model(name: str, window: int) -> torch.nn.Module:
    make, cls = MODELS[name]
    torch.manual_seed(11)
    cfg = make(window)
    cfg._attn_implementation = "eager"
    return make_matter(cls(cfg).float())


@torch.no_grad()
def make_matter(model: torch.nn.Module) -> torch.nn.Module:
    """Sinks drawn away from their zero init, and q/k scaled so that scores reach the soft-cap's bend."""
    for mod in model.modules():
        if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
            mod.sinks.normal_(0, 2)
        if getattr(mod, "attn_logit_softcapping", None):
            mod.q_proj.weight.mul_(10)
            mod.k_proj.weight.mul_(10)
    return model


def packed_batch(doc_masking: bool = True) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (1, L), generator=g)
    lens = torch.tensor(LENGTHS)
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), lens)[None]
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    labels = torch.full_like(ids, -100)
    labels[0, :-1] = ids[0, 1:]
    if doc_masking:
        labels[0, lens.cumsum(0) - 1] = -100  # no label across a document boundary
    pos = (torch.arange(L) - starts)[None] if doc_masking else torch.arange(L)[None]
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc, "index": torch.arange(L)[None]}


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@functools.lru_cache(maxsize=None)  # the same for every kernel and CP method: computed once per process
def eager_reference(name: str, window: int, doc_masking: bool):
    """(logits (L, V), loss, grads) of the model's own eager attention; with document masks each document runs
    alone. Callers only read them."""
    model = make_model(name, window)
    batch = packed_batch(doc_masking)
    spans = [(0, L)]
    if doc_masking:
        ends = torch.tensor(LENGTHS).cumsum(0).tolist()
        spans = list(zip([0, *ends[:-1]], ends))
    logits = []
    for s, e in spans:
        out = model(input_ids=batch["input_ids"][:, s:e], position_ids=batch["position_ids"][:, s:e]).logits
        _loss(out, batch["labels"][:, s:e]).backward()
        logits.append(out.detach()[0])
    loss = _loss(torch.cat(logits)[None], batch["labels"])
    return torch.cat(logits), loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def longstride_run(name: str, window: int, doc_masking: bool, cp: CPContext):
    """(token indices, local logits, local loss, grads) with longstride's attention on this rank's share."""
    model = make_model(name, window)
    use_longstride_attention(model)
    local, layout = shard_for_cp(packed_batch(doc_masking), doc_masking, cp)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], doc_layout=layout).logits
    loss = _loss(logits, local["labels"])
    loss.backward()
    return local["index"][0], logits.detach()[0], loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def check(case: str, ref, logits, loss, grads) -> None:
    ref_logits, ref_loss, ref_grads = ref
    assert rel(logits, ref_logits) <= 1e-5, f"{case}: logits differ by {rel(logits, ref_logits):.2e}"
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
    worst = max(ref_grads, key=lambda k: rel(grads[k], ref_grads[k]))
    assert rel(grads[worst], ref_grads[worst]) <= 1e-5, \
        f"{case}: gradient of {worst} differs by {rel(grads[worst], ref_grads[worst]):.2e}"


SOFT_CAPPED = ("gemma2",)
KERNELS = {name: SOFTCAP_KERNELS if name in SOFT_CAPPED else ("sdpa", "math", "torch_flash") for name in MODELS}


def cp_kernel(name: str) -> str:
    return "math" if name in SOFT_CAPPED else "sdpa"


@pytest.mark.parametrize("name,kernel", [(name, kernel) for name in sorted(MODELS) for kernel in KERNELS[name]])
def test_one_device_equals_eager(name, kernel, monkeypatch):
    # the varlen contract CUDA runs, over the CPU flash op (over the math kernel where scores are soft-capped)
    monkeypatch.setitem(varlen.VARLEN, "torch_flash", varlen.emulate(*DENSE["sdpa"]))
    monkeypatch.setitem(varlen.VARLEN, "flash_attn", varlen.emulate(*DENSE["math"]))
    for window in WINDOWS:
        for doc_masking in (True, False):
            ref = eager_reference(name, window, doc_masking)
            _, logits, loss, grads = longstride_run(name, window, doc_masking, CPContext(kernel=kernel))
            check(f"{name} window/chunk {window} doc_masking={doc_masking} kernel={kernel}", ref, logits, loss, grads)


def test_the_patterns_change_the_result():
    """The control: without its window, or its soft-cap, the same model computes something else (so the checks
    above can fail)."""
    model = make_model("mistral", 7)
    ids = packed_batch()["input_ids"]
    windowed = model(ids).logits
    model.config.sliding_window = None
    assert rel(model(ids).logits, windowed) > 1e-2
    model = make_model("gemma2", 40)
    capped = model(ids).logits
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert rel(model(ids).logits, capped) > 1e-2


@pytest.mark.parametrize("kernel", ["sdpa", "torch_flash"])
def test_a_kernel_without_soft_capping_is_refused(kernel, monkeypatch):
    """sdpa and torch's flash attention have no soft-cap: a soft-capped layer run on them fails naming the kernel
    and the fix, before computing anything (the plan picks math or flash_attn for such a model)."""
    monkeypatch.setitem(varlen.VARLEN, "torch_flash", varlen.emulate(*DENSE["sdpa"]))
    with pytest.raises(NotImplementedError, match=f"parallel.kernel={kernel} does not; use parallel.kernel=auto"):
        longstride_run("gemma2", 7, True, CPContext(kernel=kernel))


def _cp_worker(rank: int, n: int, par: ParallelConfig, path: str) -> None:
    import torch.distributed as dist

    cps = {kernel: cp_context(par.cp_impl, ParallelDims(n, 1, n), cp_degrees(par, n, heads=4), "cpu", kernel,
                              par.balance) for kernel in ("sdpa", "math")}
    out = {}
    for name in sorted(MODELS):
        for window in WINDOWS:
            for doc_masking in (True, False):
                index, logits, loss, grads = longstride_run(name, window, doc_masking, cps[cp_kernel(name)])
                for t in (loss, *grads.values()):
                    dist.all_reduce(t)  # the global loss and gradients are sums over CP ranks
                full = torch.zeros(L, V)
                full[index] = logits
                dist.all_reduce(full)  # each token's logits come from the one rank that holds it
                out[name, window, doc_masking] = (full, loss, grads)
    if rank == 0:
        torch.save(out, path)


CP = {  # name: (processes, parallel config); 4 query / 2 K/V heads
    "ring2": (2, ParallelConfig(cp_impl="ring")),
    "ring3": (3, ParallelConfig(cp_impl="ring")),
    "ulysses2": (2, ParallelConfig(cp_impl="ulysses")),
    "upipe2_U2": (2, ParallelConfig(cp_impl="upipe", upipe_heads=2)),
    "hybrid_ring2xulysses2": (4, ParallelConfig(cp_impl="hybrid", ulysses=2)),
    "ring2_balance_docs": (2, ParallelConfig(cp_impl="ring", balance="docs")),
}


@pytest.mark.parametrize("impl", list(CP))
def test_context_parallel_equals_eager(impl, tmp_path):
    n, par = CP[impl]
    path = str(tmp_path / "cp.pt")
    run_gloo(_cp_worker, n, par, path)
    got = torch.load(path)
    for (name, window, doc_masking), (logits, loss, grads) in got.items():
        check(f"{impl} {name} window/chunk {window} doc_masking={doc_masking}",
              eager_reference(name, window, doc_masking), logits, loss, grads)
