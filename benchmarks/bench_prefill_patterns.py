"""RULER's prefill on models whose attention is not plain causal: longstride's patterned prefill
(eval/ruler/attention.py: block kernels in query tiles) against the model's own attention (what eval ran for them
before: eager for Gemma 2's soft-capped scores and GPT-OSS's sinks, SDPA with a mask tensor for Gemma 3's windows).
One prompt, one forward of `prefill_chunk` = the prompt (eval's default chunk is 8,192 tokens), no grad: median
time and the most bytes alive at once (recipes/memory/trace.LiveBytes: every tensor the ops return, the weights
excluded; a kernel's internal buffers are not tensors and not counted).

    python -m benchmarks.bench_prefill_patterns            # 2K, 4K, 8K tokens, 3 reps
    python -m benchmarks.bench_prefill_patterns --quick    # 1K and 2K, 1 rep
    python -m benchmarks.bench_prefill_patterns --generate # greedy_generate: batched vs one at a time

Writes benchmarks/results/bench_prefill_patterns.json. Two layers (one local, one global), 8 query / 4 K/V heads
of 64, fp32, random weights (time and memory do not depend on them).

--generate: RULER's greedy generation (eval/ruler/generate.py greedy_generate) of 8 prompts of 2K tokens that share
their first 1,800 (a haystack up to its needle), 32 new tokens each, on the same models: one batch that keeps every
token in every layer (prefix caching, one decode forward per step for all rows) against each prompt alone on the
model's own sliding caches (batch_size=1: how a sliding-window model ran before). Same answers checked; median of
3, written to benchmarks/results/bench_generate_patterns.json (`--shared 0 --new 64`: nothing shared, longer answers,
the batched decode alone: bench_generate_patterns_shared0_new64.json).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as T

from benchmarks.common import print_table, write_results

SHAPE = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=16384)
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
MODELS = {  # name -> (what it adds to causal attention, model)
    "gemma2": ("soft-cap 50, window 4096", lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **SHAPE, sliding_window=4096, attn_logit_softcapping=50.0, layer_types=LOCAL_GLOBAL))),
    "gemma3": ("window 1024", lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **SHAPE, sliding_window=1024, layer_types=LOCAL_GLOBAL))),
    "gpt_oss": ("sinks, window 128", lambda: T.GptOssForCausalLM(T.GptOssConfig(
        **SHAPE, sliding_window=128, num_local_experts=2, num_experts_per_tok=1, layer_types=LOCAL_GLOBAL))),
}


def measure(model, length: int, ours: bool, reps: int) -> dict:
    from longstride.eval.hf_adapter import cache_kw
    from longstride.eval.ruler import generate
    from longstride.recipes.memory.trace import LiveBytes

    ids = torch.randint(2, SHAPE["vocab_size"], (length,), generator=torch.Generator().manual_seed(0)).tolist()
    old, generate.prefill_computes = generate.prefill_computes, lambda m: ours
    try:
        times, peak = [], 0
        for _ in range(reps):
            with torch.no_grad(), LiveBytes() as live:
                start = time.perf_counter()
                _, logits = generate._prefill(model, ids, length, torch.device("cpu"), cache_kw(model))
                times.append(time.perf_counter() - start)
            peak = max(peak, live.peak)
    finally:
        generate.prefill_computes = old
    return {"seconds": statistics.median(times), "peak_mib": peak / 2 ** 20, "logits": logits}


class _Tokenizer:
    """Enough of a tokenizer for greedy_generate on random weights: no end token, ids decoded as numbers."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def generation(reps: int, rows: int = 8, length: int = 2048, shared: int = 1800, new: int = 32) -> list[dict]:
    from longstride.eval.ruler.generate import greedy_generate

    g = torch.Generator().manual_seed(0)
    haystack = torch.randint(2, SHAPE["vocab_size"], (shared,), generator=g).tolist()
    prompts = [haystack + torch.randint(2, SHAPE["vocab_size"], (length - shared,), generator=g).tolist()
               for _ in range(rows)]
    out = []
    for name, (what, make) in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        model.generation_config.eos_token_id = None
        times, answers = {}, {}
        for batch_size in (1, 0):
            runs = []
            for _ in range(reps):
                start = time.perf_counter()
                answers[batch_size] = greedy_generate(model, _Tokenizer(), prompts, new, batch_size=batch_size)
                runs.append(time.perf_counter() - start)
            times[batch_size] = statistics.median(runs)
        out.append({"model": name, "pattern": what, "prompts": rows, "tokens": length, "shared": shared, "new": new,
                    "alone_s": times[1], "batched_s": times[0], "time_ratio": times[0] / times[1],
                    "same_answers": answers[0] == answers[1]})
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--generate", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shared", type=int, default=1800, help="--generate: prompt tokens the prompts share")
    p.add_argument("--new", type=int, default=32, help="--generate: new tokens per prompt")
    args = p.parse_args(argv)
    if args.generate:
        rows = generation(args.reps, shared=args.shared, new=args.new)
        print_table(rows, ["model", "pattern", "prompts", "tokens", "shared", "new", "alone_s", "batched_s",
                           "time_ratio", "same_answers"])
        name = "bench_generate_patterns" + ("" if (args.shared, args.new) == (1800, 32) else
                                            f"_shared{args.shared}_new{args.new}")
        print(write_results(name, rows, {"shape": SHAPE, "reps": args.reps}))
        return rows
    lengths, reps = ([1024, 2048], 1) if args.quick else ([2048, 4096, 8192], args.reps)
    rows = []
    for name, (what, make) in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        own = model.config._attn_implementation
        for length in lengths:
            mine, theirs = (measure(model, length, ours, reps) for ours in (True, False))
            diff = ((mine.pop("logits") - theirs["logits"]).abs().max() / theirs.pop("logits").abs().max()).item()
            rows.append({"model": name, "pattern": what, "length": length, "own": own,
                         "own_s": theirs["seconds"], "ours_s": mine["seconds"],
                         "own_peak_mib": theirs["peak_mib"], "ours_peak_mib": mine["peak_mib"],
                         "time_ratio": mine["seconds"] / theirs["seconds"],
                         "peak_ratio": mine["peak_mib"] / theirs["peak_mib"], "logits_rel_diff": diff})
    print_table(rows, ["model", "pattern", "length", "own", "own_s", "ours_s", "own_peak_mib", "ours_peak_mib",
                       "time_ratio", "peak_ratio", "logits_rel_diff"])
    if not args.quick:
        print(write_results("bench_prefill_patterns", rows, {"shape": SHAPE, "reps": reps, "dtype": "float32"}))
    return rows


if __name__ == "__main__":
    main()
