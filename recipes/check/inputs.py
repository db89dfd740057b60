"""What `longstride check` runs on: the stage's first packed batch (its own tokenizer, mixture and packing), the
stage's model in fp32, and how that model's decoder layers and parameters group by layer type (config.layer_types;
"other" outside the decoder layers) for the runs (recipes/check/runs.py) and the table (recipes/check/report.py)."""
from __future__ import annotations

import dataclasses
import os

import torch

from longstride.parallel.pattern import has_sinks, layer_types as pattern_layer_types
from longstride.recipes.check.job import Job


def stage_batch(job: Job) -> tuple[dict, Job]:
    """The stage's first micro-batch (a PackedBatch of job.rows x job.seq_len) and the job with the tokenizer's
    sizes; the data pipeline's own errors name the stage."""
    from longstride.data.corpus import build_corpus, build_tokenizer
    from longstride.data.pipeline import stage_loader, stage_sequences
    from longstride.data.stream import streaming_stage
    from longstride.recipes.run.faults import stage_input

    cfg, s = job.cfg, job.cfg.recipe.stages[job.stage]
    index = list(cfg.recipe.stages).index(job.stage)
    # one batch: no loader workers, and no held-out documents (a check never validates; the recipe's would be
    # sized for its stages' lengths, not the check's seq_len)
    data = dataclasses.replace(cfg.data, num_workers=0, eval_sequences=0)
    cache = os.path.abspath(cfg.paths.cache_dir)
    with stage_input(job.stage):
        tok = build_tokenizer(data, cache)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if data.streaming:
            loader, _, _ = streaming_stage(data, tok, job.seq_len, pad_id=pad, mixture=s.mixture,
                                           micro_batch_size=job.rows, dp_rank=0, dp=1, cache_dir=cache)
        else:
            train, _ = stage_sequences(data, build_corpus(data, tok, cache), job.seq_len, pad, s.mixture,
                                       s.long_docs)
            loader = stage_loader(train, job.rows, 0, 1, data, index)
        batch = next(iter(loader))
    job = dataclasses.replace(job, vocab=len(tok), eos=tok.eos_token_id, pad=pad)
    config = stage_model_config(job)
    check_vocab(config, batch)
    missed = unexercised(config, batch, job.cfg.data.doc_masking, job.cfg.recipe.stages[job.stage].seq_len)
    if missed and not job.allow_unexercised:
        raise ValueError(f"stage {job.stage}: the check's batch ({job.rows} x {job.seq_len} tokens) would pass "
                         f"without testing {'; '.join(missed)}. Give a longer seq_len= or more rows=, data with "
                         "shorter documents (several to a row) and longer ones (beyond the window), or "
                         "allow_unexercised=true to check the rest anyway")
    return batch, dataclasses.replace(job, unexercised=tuple(missed))


def stage_model_config(job: Job):
    """The stage's model config (its RoPE base, its length, the tokenizer's sizes), without weights."""
    from longstride.model.build import stage_config

    s = job.cfg.recipe.stages[job.stage]
    return stage_config(job.cfg.model, s.rope_theta, s.seq_len, job.vocab, job.eos, job.pad)


def unexercised(config, batch: dict, doc_masking: bool, stage_len: int) -> list[str]:
    """What the model computes that this batch never tests: document masks when no row holds two documents with
    loss targets; a window or chunk of w tokens when no document (the whole row, without document masking) is
    longer than w, so it cuts nothing. A window or chunk of at least the stage's length (`stage_len`) cuts nothing
    in training either (Pattern.within): it is not asked for. Empty when the batch tests everything."""
    from longstride.model.loss import IGNORE_INDEX
    from longstride.parallel.pattern import config_patterns

    B, L = batch["input_ids"].shape
    if doc_masking:  # documents with a loss target (not the padding, not one-token documents)
        rows = [[e - s for s, e in doc_spans(batch["doc_ids"][b]) if (batch["labels"][b, s:e] != IGNORE_INDEX).any()]
                for b in range(B)]
    else:
        rows = [[L]] * B
    longest, missed = max((n for row in rows for n in row), default=0), []
    if doc_masking and all(len(row) < 2 for row in rows):
        missed.append("document masks (no row holds two documents)")
    patterns = [p.within(stage_len) for p, _ in config_patterns(config)]
    for kind, size in sorted({(k, v) for p in patterns for k, v in (("window", p.window), ("chunk", p.chunk)) if v}):
        if longest <= size:
            missed.append(f"the {size}-token {kind} (the longest {'document' if doc_masking else 'row'} has "
                          f"{longest} tokens)")
    return missed


def load_model(job: Job, device: torch.device) -> torch.nn.Module:
    """The stage's model as training builds it (its RoPE base, its config at the stage's length), in fp32; weights a
    checkpoint lacks are initialised from train.seed, so every process holds the same model."""
    from longstride.model.build import build_model

    cfg, s = job.cfg, job.cfg.recipe.stages[job.stage]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        lm = build_model(cfg.model, s.rope_theta, s.seq_len, job.vocab, job.eos, job.pad, seed=cfg.train.seed)
    return lm.float().eval().to(device)


def check_vocab(config, batch: dict) -> None:
    """The batch's token ids against the model's vocabulary (read from its config, no weights)."""
    vocab, top = config.get_text_config(decoder=True).vocab_size, int(batch["input_ids"].max())
    if top >= vocab:
        raise ValueError(f"data.tokenizer: the batch has token id {top} but the model's vocabulary is {vocab}; use the "
                         "model's own tokenizer (data.tokenizer=<the checkpoint dir>)")


def layer_stack(lm) -> tuple[str, torch.nn.ModuleList]:
    """(dotted name, module) of the model's stack of decoder layers (model/loss.decoder_layers finds it)."""
    from longstride.model.loss import decoder_layers as stack

    layers = stack(lm)
    return next(name for name, mod in lm.named_modules() if mod is layers), layers


def lm_layer_types(lm, n: int) -> list[str]:
    """Each of the n decoder layers' type (parallel/pattern.layer_types)."""
    return pattern_layer_types(lm.config.get_text_config(decoder=True), n)


def param_layer_types(lm) -> dict[str, str]:
    """Parameter name -> its decoder layer's type, "other" outside the decoder layers."""
    prefix, layers = layer_stack(lm)
    types = lm_layer_types(lm, len(layers))
    out = {}
    for name, _ in lm.named_parameters():
        rest = name[len(prefix) + 1:].split(".", 1)[0] if name.startswith(prefix + ".") else ""
        out[name] = types[int(rest)] if rest.isdigit() else "other"
    return out


def describe_layers(lm, seq_len: int) -> str:
    """'sliding_attention: window 16 (layers 0, 2); full_attention (layers 1, 3)': what each layer type computes
    (with its soft-cap, Gemma 2's attn_logit_softcapping, and its sinks)."""
    from longstride.parallel.pattern import layer_pattern

    cfg = lm.config.get_text_config(decoder=True)
    _, layers = layer_stack(lm)
    seen: dict = {}
    for i, (t, layer) in enumerate(zip(lm_layer_types(lm, len(layers)), layers)):
        attn, what = getattr(layer, "self_attn", None), []
        if attn is not None:
            p = layer_pattern(attn, getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None,
                              getattr(attn, "attn_logit_softcapping", None))
            what += [f"{k} {v}" + (f" (>= seq_len {seq_len}: cuts nothing here)" if v >= seq_len else "")
                     for k, v in (("window", p.window), ("chunk", p.chunk)) if v]
            if p.softcap:
                what.append(f"scores soft-capped at {p.softcap:g}")
            if has_sinks(attn):
                what.append("sinks")
        seen.setdefault((t, ", ".join(what)), []).append(i)
    return "; ".join(f"{t}{': ' + w if w else ''} (layers {', '.join(map(str, ix))})" for (t, w), ix in seen.items())


def doc_spans(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document run of one row."""
    ids = doc_ids.tolist()
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))
