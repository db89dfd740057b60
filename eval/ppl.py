"""Perplexity vs context length of any local HF causal-LM checkpoint, with and without YaRN.

For each length L, the first L tokens of every long local document (at least max(lengths) tokens in the
checkpoint's own tokenizer, so every length scores the same documents) are scored; reported: perplexity over all
L tokens and over the last quarter (where long context helps or extrapolation breaks). Loss is chunked: no L x V
logits.

    longstride eval ppl checkpoint=outputs/tiny/s3_4k/final lengths=[1024,2048,4096,8192]
    longstride eval ppl checkpoint=outputs/tiny/s3_4k/final lengths=[4096,8192] yarn.factor=2
    (or python -m longstride.eval.ppl ...)
Writes <out>/ppl[_yarnF][_DTYPE].json, .csv and .png (_DTYPE when dtype= is not float32; default out:
outputs/eval/<checkpoint path>, see eval/cli.py; never inside the checkpoint unless out= says so).
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from longstride.data.files import list_files, stdlib_root
from longstride.data.tokenizer import bos_prefix
from longstride.eval.cli import PplConfig, default_out, parse_ppl, results_stem
from longstride.eval.load import DTYPES, applied_rope, eval_config, eval_tokenizer, load_eval_model
from longstride.model.loss import chunked_cross_entropy_sum, decoder, output_head, text_decoder
from longstride.model.rope import has_rope, max_positions, yarn_unit
from longstride.overrides import run


def docs_root(cfg: PplConfig) -> Path:
    return stdlib_root() if cfg.docs_dir is None else Path(cfg.docs_dir)


def long_documents(tokenizer, cfg: PplConfig, min_len: int) -> list[list[int]]:
    """Token ids of up to max_docs local documents of at least min_len tokens, each opening with the BOS token
    where the tokenizer puts one before text (Llama, Gemma: models that have only ever seen text after it)."""
    root = docs_root(cfg)
    start = bos_prefix(tokenizer)  # as training opens each document (data/tokenizer.py)
    docs = []
    for path in list_files(root, cfg.glob):  # sorted: the same documents on every machine
        if os.path.getsize(path) < min_len:  # a token is at least one byte
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        # a special token's text inside a file stays text, as training tokenizes it (data/tokenizer.py tokenize_fn)
        ids = start + tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if len(ids) >= min_len:
            docs.append(ids)
        if len(docs) >= cfg.max_docs:
            break
    return docs


def ppl_attention(model):
    """Switches the model's decoder to longstride's attention where it computes every layer (windows, chunks,
    soft-capped scores and sinks included: Gemma 2's and GPT-OSS's eager attention held L x L scores per head,
    transformers' fp32 SDPA with grouped K/V heads on CUDA falls back to an L x L kernel) and returns the
    document layout its forwards pass, carrying the kernel parallel.kernel=auto picks for this device, dtype and
    model; None, the model's own attention left, where the decoder needs more (parallel/attention.py
    unsupported_attention, or a two-token forward whose calls ask for more). Only the text decoder: a
    vision-language model's vision tower never runs here."""
    from longstride.eval.hf_adapter import probe_refusal
    from longstride.parallel.attention import auto_kernel, unsupported_attention, use_longstride_attention
    from longstride.parallel.cp import CPContext, DocLayout

    body = text_decoder(model)
    found = unsupported_attention(body)
    if found:
        print(f"eval.ppl: note: {type(model).__name__} runs its own attention ({'; '.join(found[:3])})",
              file=sys.stderr)
        return None
    own = body.config._attn_implementation
    use_longstride_attention(body)
    layout = DocLayout(None, cp=CPContext(kernel=auto_kernel(model)))
    refused = probe_refusal(lambda ids: decoder(model)(input_ids=ids, use_cache=False, doc_layout=layout),
                            model.device)
    if refused:
        body.set_attn_implementation(own)
        print(f"eval.ppl: note: {type(model).__name__} runs its own attention ({refused})", file=sys.stderr)
        return None
    return layout


@torch.no_grad()
def perplexities(model, docs: list[list[int]], length: int, tile: int, layout=None) -> dict:
    """Whole and last-quarter perplexity of the first `length` tokens of each document; layout: ppl_attention's
    (longstride's attention), or None for the model's own."""
    total = tail = n_total = n_tail = 0.0
    body, head = decoder(model), output_head(model)
    extra = {} if layout is None else {"doc_layout": layout}
    for ids in docs:
        x = torch.tensor(ids[:length], device=model.device)[None]
        labels = torch.cat([x[:, 1:], torch.full((1, 1), -100, device=x.device)], dim=1)
        hidden = body(input_ids=x, use_cache=False, **extra).last_hidden_state
        q = length - length // 4  # the last quarter scored on its own: each position's logits computed once
        tail_sum = float(chunked_cross_entropy_sum(hidden[:, q:], head, labels[:, q:], tile))
        total += float(chunked_cross_entropy_sum(hidden[:, :q], head, labels[:, :q], tile)) + tail_sum
        tail += tail_sum
        n_total += length - 1
        n_tail += length - 1 - q
    return {"ppl": math.exp(total / n_total), "tail_ppl": math.exp(tail / n_tail), "docs": len(docs)}


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["length"] for r in rows if r["docs"]]
    ax.plot(xs, [r["ppl"] for r in rows if r["docs"]], "o-", label="all tokens")
    ax.plot(xs, [r["tail_ppl"] for r in rows if r["docs"]], "s--", label="last quarter")
    if rows and rows[0].get("trained_len"):
        ax.axvline(rows[0]["trained_len"], color="grey", ls=":", label="trained length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> list[dict]:
    return execute(parse_ppl(argv))


def execute(cfg: PplConfig) -> list[dict]:
    """The command on parsed options (eval/cli.parse_ppl)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    config, base_max = eval_config(cfg.checkpoint, cfg.yarn, cfg.rope_layer_types)
    too_long = [L for L in cfg.lengths if L > max_positions(config)]
    if too_long:
        hint = f" or use yarn.factor={math.ceil(max(too_long) / yarn_unit(config, base_max))}" \
            if not cfg.yarn.factor and has_rope(config) else ""
        print(f"eval.ppl: note: lengths {too_long} exceed the model's max positions "
              f"{max_positions(config)}; they are extrapolation{hint}", file=sys.stderr)
    tok = eval_tokenizer(cfg.checkpoint)  # the documents first: too few fail before the weights load
    docs = long_documents(tok, cfg, max(cfg.lengths))
    if not docs:
        root = docs_root(cfg)
        raise ValueError(f"no document of >= {max(cfg.lengths)} tokens among the {len(list_files(root, cfg.glob))} "
                         f"files matching glob={cfg.glob!r} under {root}; lower lengths, or set docs_dir and glob "
                         "(e.g. glob='**/*.txt')")
    model, tok, info = load_eval_model(cfg.checkpoint, cfg.yarn, cfg.rope_layer_types, dtype=DTYPES[cfg.dtype],
                                       tokenizer=tok)
    beyond = [L for L in cfg.lengths if info.position_limit and L > info.position_limit]
    if beyond:  # an index past the table, not extrapolation: refused before any scoring
        raise ValueError(f"lengths {beyond}: {type(model).__name__} learns a table of {info.position_limit} positions "
                         f"and cannot take longer inputs; give lengths up to {info.position_limit}")
    layout = ppl_attention(model)
    rows = []
    for L in sorted(cfg.lengths):  # shortest first: a dynamic NTK RoPE keeps the scale of the longest forward so far
        r = {"length": L, "yarn_factor": cfg.yarn.factor or 1.0, "trained_len": base_max,
             **perplexities(model, docs, L, cfg.tile, layout)}
        rows.append(r)
        print(f"length {L:>7}  ppl {r['ppl']:9.3f}  last-quarter ppl {r['tail_ppl']:9.3f}  ({r['docs']} docs)")
    out = cfg.out or default_out(cfg.checkpoint)
    os.makedirs(out, exist_ok=True)
    stem = results_stem("ppl", cfg.yarn.factor, cfg.dtype)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"config": {**asdict(cfg), "applied_rope": applied_rope(config)}, "results": rows}, f, indent=2)
    with open(os.path.join(out, f"{stem}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        plot(rows, os.path.join(out, f"{stem}.png"), f"{os.path.basename(os.path.dirname(cfg.checkpoint))}"
             + (f" + YaRN x{cfg.yarn.factor:g}" if cfg.yarn.factor else ""))
    except ImportError:
        print("eval.ppl: matplotlib not installed; skipping the plot (pip install 'longstride[eval]')")
    print(f"eval.ppl: results in {out}")
    return rows


if __name__ == "__main__":
    run("eval.ppl", main)
