"""Every causal LM architecture of the installed transformers, built tiny and random, through longstride's attention
on one device against the model's own eager attention, one document at a time: the first comparison `longstride
check` makes (recipes/check/runs.py), over two packed rows of documents, with windows (8 tokens) and chunks
(8 tokens) shorter than the documents where the config has them. Each architecture ends as

  exact        accepted, and the logits, the loss, every layer's output and every gradient within 1e-4 (relative;
               a gradient against the larger of its own and 1e-3 of its layer type's largest), or, beyond it, no
               further from the model's eager attention in fp64 than twice the fp32 eager run is
  WRONG        accepted, and something differs beyond 1e-4: a defect (longstride must compute it or refuse it)
  refused      longstride names what it does not compute (use_longstride_attention raises)
  not built    no tiny model of it here: its config or model did not build (the reason kept), or its own eager
               forward failed
  skipped      a composite (vision, audio) wrapper: its text model is checked under its own text type
  error        accepted, and longstride's run raised something other than a refusal: a defect too

    python -m benchmarks.model_matrix                      # all; resumable: finished architectures are kept
    python -m benchmarks.model_matrix --only llama,gemma2  # some, again

Results: benchmarks/results/model_matrix.json (one entry per model type, written as each ends) and a summary
table printed at the end. CPU, fp32, 1 thread; about 1 to 3 s per architecture.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import time
import traceback

import torch

OUT = os.path.join(os.path.dirname(__file__), "results", "model_matrix.json")
TOL = 1e-4
MAX_PARAMS = 5_000_000
SECONDS = 120  # per architecture: past it, "not built" (timed out)
# set where the architecture's default config has the field (so no setting a model does not read is added)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
            attention_chunk_size=8, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32, kv_lora_rank=16,
            q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
            attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=8)
ROWS = ((5, 20, 23), (30, 18))  # document lengths per row: 48 tokens each


def packed_batch(vocab: int) -> dict:
    """ROWS of random documents packed as training packs them (data/batch.py)."""
    import numpy as np

    from longstride.data.batch import collate, packed_item

    g = np.random.default_rng(0)
    return collate([packed_item([g.integers(3, vocab, n) for n in row], sum(row), pad_id=0) for row in ROWS])


def tiny_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if getattr(default, "sub_configs", None) and "text_config" in default.sub_configs:
        return None
    config = AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items() if hasattr(default, k)})
    for k, v in list(vars(config).items()):  # training mode: a random dropout mask would differ between the runs
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v:
            setattr(config, k, 0.0)
    return config


def check_one(model_type: str) -> dict:
    """One architecture's entry (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from longstride.parallel.cp import CPContext
    from longstride.recipes.check.inputs import param_layer_types
    from longstride.recipes.check.runs import run_eager, run_longstride

    try:
        config = tiny_config(model_type)
    except Exception as e:
        return {"status": "not built", "detail": f"config: {type(e).__name__}: {e}"[:300]}
    if config is None:
        return {"status": "skipped", "detail": "composite config (text_config): see its text model's type"}
    try:
        with torch.device("meta"):  # its size first: a config with fields TINY does not reach stays large
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return {"status": "not built", "detail": f"the tiny config still has {size / 1e6:.0f}M parameters"}
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    except Exception as e:
        return {"status": "not built", "detail": f"model: {type(e).__name__}: {e}"[:300]}
    entry = {"class": type(lm).__name__, "sliding_window": getattr(config, "sliding_window", None),
             "layer_types": sorted(set(getattr(config, "layer_types", None) or [])) or None}
    batch = packed_batch(config.get_text_config().vocab_size)
    try:
        eager = run_eager(lm, batch, True, "cpu")
    except ValueError as e:
        if "longstride" in str(e):  # what `longstride check` reads of the model (recipes/check/inputs.layer_stack)
            return {**entry, "status": "refused", "detail": str(e)[:400]}
        return {**entry, "status": "not built", "detail": f"its eager forward: ValueError: {e}"[:300]}
    except Exception as e:
        return {**entry, "status": "not built", "detail": f"its eager forward: {type(e).__name__}: {e}"[:300]}
    try:
        ours = run_longstride(lm, batch, True, CPContext(kernel="math"), "cpu")
    except NotImplementedError as e:
        return {**entry, "status": "refused", "detail": str(e)[:400]}
    except Exception as e:
        return {**entry, "status": "error", "detail": "".join(traceback.format_exception_only(e))[-400:]}
    groups = param_layer_types(lm)
    errors = worst_errors(ours, eager, groups)
    worst = max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e)
    if all(e <= TOL for e in errors.values()):
        return {**entry, "status": "exact", "errors": errors, "worst": worst}
    # an ill-conditioned gradient (DiffLlama's lambdas: a difference of two attentions) rounds differently in each
    # fp32 run: both judged against the eager run in fp64, longstride's error at most twice eager's own
    truth = run_eager(copy.deepcopy(lm).double(), batch, True, "cpu")
    ours64, eager64 = worst_errors(ours, truth, groups), worst_errors(eager, truth, groups)
    ok = all(ours64[k] <= max(TOL, 2 * eager64[k]) for k in errors)
    return {**entry, "status": "exact" if ok else "WRONG", "errors": errors, "worst": worst,
            "against_fp64": {"longstride": ours64, "eager": eager64}}


def worst_errors(got, ref, groups: dict) -> dict:
    """The worst relative error of the logits, the loss, the layer outputs and the gradients (recipes/check/report)."""
    from longstride.recipes.check.report import grad_errors, rel

    return {"logits": rel(got.logits, ref.logits), "loss": rel(got.loss.reshape(1), ref.loss.reshape(1)),
            "outputs": max((rel(a, b) for a, b in zip(got.outputs, ref.outputs)), default=0.0),
            "grads": max(grad_errors(got, ref, groups).values(), default=0.0)}


class _TimedOut(BaseException):
    """Past SECONDS: a BaseException, so no `except Exception` inside an architecture's check takes it."""


def _timed_out(signum, frame):
    raise _TimedOut


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    from transformers import __version__ as hf_version
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, hf_version, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    finally:
        torch.set_num_threads(threads)


def _run(args, hf_version: str, mapping: dict) -> int:
    done = json.load(open(args.out)) if os.path.exists(args.out) else {}
    if done.get("transformers") != hf_version or done.get("torch") != torch.__version__:
        done = {"transformers": hf_version, "torch": torch.__version__, "tolerance": TOL, "models": {}}
    only = [t for t in args.only.split(",") if t]
    types = only or sorted(mapping)
    # the alarm is borrowed (pytest-timeout may hold it): its handler and timer are given back at the end
    handler, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    try:
        for t in types:
            if t not in done["models"] or only:
                _check_timed(t, done, args.out)
    finally:
        signal.signal(signal.SIGALRM, handler)
        if timer[0]:  # what was left of it, less the time the sweep took (at least a moment: 0 would cancel it)
            signal.setitimer(signal.ITIMER_REAL, max(timer[0] - (time.monotonic() - started), 1e-3), timer[1])
    counts = {}
    for e in done["models"].values():
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    print(f"transformers {hf_version}, torch {torch.__version__}: {counts}")
    return 1 if counts.get("WRONG") or counts.get("error") else 0


def _check_timed(t: str, done: dict, out: str) -> None:
    """One architecture's entry, within SECONDS, written to `out` at once."""
    t0 = time.perf_counter()
    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(SECONDS)
    try:
        entry = check_one(t)
    except _TimedOut:
        entry = {"status": "not built", "detail": f"timed out after {SECONDS} s"}
    finally:
        signal.alarm(0)
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    done["models"][t] = entry
    print(f"{t:<28} {entry['status']:<10} {entry.get('worst', '')!s:<24} {entry.get('detail', '')[:100]}",
          flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(done, f, indent=1, sort_keys=True)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    raise SystemExit(main())
