"""Every check of a run's config, then each stage resolved once into a frozen StagePlan.

Nothing is built before `validate` passes: each user-facing check lives here (the model group's in
recipes/config/model_checks.py; or in the one function of the package it calls: a data source kind's check, the CP
method's degrees, the kernel's availability), with the field and the fix in its message. The stage then consumes its plan and computes none of it
again.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, is_dataclass
from typing import Optional

from longstride.choices import check_wandb
from longstride.data.config import DataConfig
from longstride.data.sources import check_manual_held_out, check_source
from longstride.data.synthetic import check_filler_held_out
from longstride.model.compile import check_compile
from longstride.model.model_dir import check_checkpoint_weights
from longstride.model.config import ModelConfig, check_layers
from longstride.model.rope import YARN_ORIGINAL_RULE, yarn_original_ok
from longstride.parallel.config import CPDegrees, ParallelConfig, ParallelDims
from longstride.parallel.cp import cp_degrees
from longstride.parallel.fsdp import use_fsdp
from longstride.parallel.kernels import resolve_kernel
from longstride.recipes.config.model_checks import _check_rope_layer_types, model_shape
from longstride.recipes.config.schema import Config, StageConfig, selected_stages
from longstride.recipes.run.profiling import check_profile
from longstride.recipes.run.step import StepSpec


@dataclass(frozen=True)
class StagePlan:
    """One stage as it will run on this launch: its config, the dp x cp split, how cp splits (degrees), the
    attention kernel, FSDP2 or DDP, how its step is built (activation checkpointing and its offload, the MLP and
    loss tiles, document masking: recipes/run/step.StepSpec), the ring's chunk assignment rule and the
    micro-batches per optimizer step."""

    name: str
    index: int
    stage: StageConfig
    dims: ParallelDims
    degrees: CPDegrees
    kernel: str
    fsdp: bool
    step: StepSpec
    balance: str
    accum: int


@dataclass(frozen=True)
class Unplanned:
    """A stage this launch does not run (stage= names another one, or its final is written) whose layout does not fit
    this launch's processes (a 4K stage run on 8 GPUs, the next ones on 16): planned with the processes it ran on,
    which this launch does not know. Should it train after all (its final damaged), train_stage refuses it with
    `error`."""

    name: str
    index: int
    stage: StageConfig
    error: str


def non_finite_fields(node, path: str = "") -> list[str]:
    """Dotted names of NaN / inf floats anywhere in a config (dataclasses, dicts, lists)."""
    if isinstance(node, float):
        return [] if math.isfinite(node) else [f"{path}={node}"]
    if is_dataclass(node):
        items = ((f.name, getattr(node, f.name)) for f in fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return []
    return [bad for k, v in items for bad in non_finite_fields(v, f"{path}.{k}" if path else str(k))]


def _range_rules(cfg: Config) -> list[tuple]:
    """(field, value, ok, what it must be) for every number that must lie in a range."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    rules = [("optim.eps", o.eps, o.eps > 0, "> 0"),
             ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
             ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0 = no clipping)"),
             ("optim.betas", list(o.betas), len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
              "two numbers in [0, 1), e.g. [0.9,0.95]"),
             ("model.loss_tile_tokens", m.loss_tile_tokens, m.loss_tile_tokens >= 1, ">= 1 (e.g. 1024)"),
             ("model.mlp_tile_tokens", m.mlp_tile_tokens, m.mlp_tile_tokens >= 0, ">= 0 (0 = off, e.g. 4096)"),
             ("data.eval_sequences", cfg.data.eval_sequences, cfg.data.eval_sequences >= 0, ">= 0"),
             ("data.stream_open_seqs", cfg.data.stream_open_seqs, cfg.data.stream_open_seqs >= 1,
              ">= 1 (64 is a good default)"),
             ("parallel.balance_chunks", cfg.parallel.balance_chunks, cfg.parallel.balance_chunks >= 2,
              ">= 2 (chunks per ring rank that balance=docs may use; 8 is a good default)"),
             ("train.keep_last", t.keep_last, t.keep_last >= 0, ">= 0 (0 = keep every one)"),
             ("train.max_nonfinite_steps", t.max_nonfinite_steps, t.max_nonfinite_steps >= 1, ">= 1 (3 is the default)"),
             ("train.collective_timeout_s", t.collective_timeout_s, t.collective_timeout_s >= 1,
              ">= 1 second (1800 is the default)"),
             ("train.trace_memory", t.trace_memory, str(t.trace_memory).lower() in ("auto", "true", "false"),
              "auto, true or false"),
             ("logger.log_every", cfg.logger.log_every, cfg.logger.log_every >= 1, ">= 1 (1 = every step)"),
             ("data.num_workers", cfg.data.num_workers, cfg.data.num_workers >= 0,
              ">= 0 (0 = in the training process)"),
             ("data.tokenizer_train_bytes", cfg.data.tokenizer_train_bytes, cfg.data.tokenizer_train_bytes >= 1,
              ">= 1 (bytes of text the BPE is trained on when data.tokenizer=null; e.g. 8000000)"),
             ("data.vocab_size", cfg.data.vocab_size, cfg.data.vocab_size > 256 or bool(cfg.data.tokenizer),
              "> 256 (the BPE trained when data.tokenizer=null holds the 256 bytes and then merges; e.g. 4096)"),
             ("data.seed", cfg.data.seed, cfg.data.seed >= 0, ">= 0 (numpy's seeds are non-negative; e.g. 1234)")]
    y = m.yarn
    rules += [("model.yarn.original_max_position_embeddings", y.original_max_position_embeddings,
               yarn_original_ok(y.factor, y.original_max_position_embeddings), YARN_ORIGINAL_RULE.format("model.yarn"))]
    docs = [("data.long_docs", cfg.data.long_docs)] + [(f"recipe.stages.{n}.long_docs", s.long_docs)
                                                       for n, s in cfg.recipe.stages.items() if s.long_docs]
    rules += [(f"{f}.min_share", ld.min_share, not ld.min_tokens or 0 <= ld.min_share < 1,
               "in [0, 1) (the share of a stage's tokens from long documents)") for f, ld in docs]
    if m.arch != "checkpoint":
        rules += [(f"model.{k}", getattr(m, k), getattr(m, k) >= 1, ">= 1")
                  for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                            "num_key_value_heads")]
        layers = m.num_hidden_layers
        rules += [("model.nope_interval", m.nope_interval, m.nope_interval >= 0,
                   ">= 0 (every n-th layer without RoPE; 0 = RoPE on every layer)"),
                  ("model.nope_layers", m.nope_layers, m.nope_layers is None or all(
                      0 <= i < layers for i in m.nope_layers),
                   f"0-based layer indices in 0..{layers - 1} (the last layer is {layers - 1})"),
                  ("model.head_dim", m.head_dim, m.head_dim is None or (m.head_dim >= 2 and m.head_dim % 2 == 0),
                   "null (hidden_size / num_attention_heads) or an even number (RoPE rotates pairs)"),
                  ("model.num_attention_heads", m.num_attention_heads, m.head_dim is not None or (
                      m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads == 0
                      and (m.hidden_size // m.num_attention_heads) % 2 == 0),
                   f"a divisor of model.hidden_size={m.hidden_size} leaving an even head size (RoPE rotates pairs), "
                   "or set model.head_dim"),
                  ("model.rms_norm_eps", m.rms_norm_eps, m.rms_norm_eps > 0, "> 0 (e.g. 1e-6)"),
                  ("model.initializer_range", m.initializer_range, m.initializer_range > 0, "> 0 (e.g. 0.02)"),
                  ("model.vocab_size", m.vocab_size, m.vocab_size is None or m.vocab_size >= cfg.data.vocab_size
                   or bool(cfg.data.tokenizer), f"null (the tokenizer's size) or >= data.vocab_size "
                                                f"{cfg.data.vocab_size}, the ids the tokenizer makes")]
    streamed = cfg.data.streaming  # a streamed source of weight 0 is read only where a stage's mixture names it
    rules += [(f"data.sources.{n}.weight", src.weight, src.weight >= 0 if streamed else src.weight > 0,
               ">= 0 (a share of the tokens)" if streamed else "> 0 (a share of the tokens; a source no stage reads "
               "is dropped from data.sources)") for n, src in cfg.data.sources.items()]
    for name, s in cfg.recipe.stages.items():
        f = f"recipe.stages.{name}"
        rules += [(f"{f}.seq_len", s.seq_len, s.seq_len >= 2, ">= 2 tokens (e.g. 4096)"),
                  (f"{f}.batch_tokens", s.batch_tokens, s.batch_tokens >= 1, ">= 1 (tokens per optimizer step)"),
                  (f"{f}.mixture", s.mixture, not s.mixture or (all(w >= 0 for w in s.mixture.values())
                                                                 and sum(s.mixture.values()) > 0),
                   "source weights >= 0 with a positive sum (empty or null = data.sources' weights)"),
                  (f"{f}.rope_theta", s.rope_theta, s.rope_theta > 0, "positive (for example 1e4, 5e5, 1e6)"),
                  (f"{f}.micro_batch_size", s.micro_batch_size, s.micro_batch_size >= 1, ">= 1"),
                  (f"{f}.lr", s.lr, s.lr > 0, "> 0"),
                  (f"{f}.min_lr_ratio", s.min_lr_ratio, 0 <= s.floor_ratio <= 1, "in [0, 1]"),
                  (f"{f}.decay_fraction", s.decay_fraction, 0 < s.decay_share <= 1, "in (0, 1]"),
                  (f"{f}.save_every", s.save_every, s.save_every >= 0, ">= 0 (0 = only the final checkpoint)"),
                  (f"{f}.cp", s.cp, s.cp >= 1, ">= 1"),
                  (f"{f}.mlp_tile_tokens", s.mlp_tile_tokens, s.mlp_tile_tokens is None or s.mlp_tile_tokens >= 0,
                   ">= 0 (0 = off, e.g. 4096 = tiled)")]
    return rules


def _check_numbers(cfg: Config) -> None:
    """Every number finite and in its range, naming the field."""
    bad = non_finite_fields(cfg)
    if bad:
        raise ValueError(f"config fields {', '.join(bad)} are not finite numbers; give finite values")
    for field_name, value, ok, want in _range_rules(cfg):
        if not ok:
            raise ValueError(f"{field_name}={value} must be {want}")


def _check_run(cfg: Config) -> None:
    """Finite numbers in range, consistent restart options, a usable output root."""
    _check_numbers(cfg)
    check_wandb(cfg.logger.wandb_mode, "logger.wandb_mode")
    root = cfg.paths.output_root
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"paths.output_root={root!r} is a file; give a directory (it is created if missing)")
    if cfg.train.resume_from and not cfg.train.resume:
        raise ValueError("train.resume=false (start afresh) and train.resume_from (continue from a checkpoint) "
                         "contradict each other; give one")
    first = next(iter(cfg.recipe.stages), None)
    if cfg.stage and cfg.stage != first and (cfg.train.resume_from or not cfg.train.resume):
        raise ValueError(f"stage={cfg.stage} with train.resume=false or train.resume_from: those decide where the "
                         "run starts over (a later stage needs the earlier ones' checkpoints); drop stage=")


def _check_data(cfg: Config) -> None:
    d, stages = cfg.data, cfg.recipe.stages.values()
    if not d.sources:
        raise ValueError("data.sources is empty; pick a data config (data=stdlib, data=files, ...) or add a source")
    for name, src in d.sources.items():
        check_source(src, f"data.sources.{name}")
    check_filler_held_out(d.sources)
    check_manual_held_out(d.sources)
    for name, s in cfg.recipe.stages.items():
        unknown = set(s.mixture or ()) - set(d.sources)
        if unknown:
            raise ValueError(f"recipe.stages.{name}.mixture names {sorted(unknown)}, not in data.sources "
                             f"{list(d.sources)}")
    if d.tokenizer and not os.path.isdir(d.tokenizer):
        raise ValueError(f"data.tokenizer={d.tokenizer!r} is not a directory; give a local HF tokenizer dir "
                         "or null to train a BPE on the corpus")
    if cfg.model.arch == "checkpoint":
        check_checkpoint_weights(cfg.model.checkpoint, "model.checkpoint")
    _check_tokenizer(cfg.model, d.tokenizer)
    if not d.streaming:
        return
    if d.long_docs.min_tokens or any(s.long_docs and s.long_docs.min_tokens for s in stages):
        raise ValueError("data.long_docs upsampling needs the in-memory corpus (it counts every document's "
                         "length first); set data.long_docs.min_tokens=0 or data.streaming=false")
    if d.num_workers:
        raise ValueError(f"data.num_workers={d.num_workers}: the streaming packer runs in the training "
                         "process; set data.num_workers=0 with data.streaming=true")


def _check_tokenizer(m: ModelConfig, tokenizer: Optional[str]) -> None:
    """A given data.tokenizer loads, and its ids fit the model's embedding (a checkpoint's, or model.vocab_size);
    a pretrained model reads the ids of its own tokenizer, so data.tokenizer=null (a new BPE trained on the corpus)
    is refused for one."""
    from transformers import AutoConfig

    from longstride.data.tokenizer import load_tokenizer
    from longstride.model.model_dir import has_tokenizer

    checkpoint = m.checkpoint if m.arch == "checkpoint" else None
    if checkpoint and not tokenizer:
        hint = checkpoint if has_tokenizer(checkpoint) else "<its tokenizer dir>"
        raise ValueError(f"model.checkpoint={checkpoint} with data.tokenizer=null would train a new tokenizer, whose "
                         f"ids mean nothing to the pretrained model; set data.tokenizer={hint}")
    if not tokenizer:
        return
    tok = load_tokenizer(tokenizer)
    # the ids the data can hold: the base vocabulary's, and the special tokens packing writes (EOS, pad); not every
    # added token (Gemma 3's tokenizer adds an image token past its models' 262,144 embeddings, never in text)
    size = max([tok.vocab_size] + [i + 1 for i in (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
                                   if i is not None])
    vocab, what = ((AutoConfig.from_pretrained(checkpoint).get_text_config(decoder=True).vocab_size,
                    f"model.checkpoint={checkpoint} embeds") if checkpoint else (m.vocab_size, "model.vocab_size is"))
    if vocab and size > vocab:
        fix = (f"use the model's own tokenizer (data.tokenizer={checkpoint} when it holds one)" if checkpoint else
               "raise it or set model.vocab_size=null (the tokenizer's size)")
        raise ValueError(f"data.tokenizer={tokenizer} makes ids up to {size - 1} but {what} {vocab}; {fix}")


def check_model_and_data(cfg: Config, split_longest: Optional[int] = None) -> int:
    """The model group's and the data's checks as `validate` runs them (every number in range, a checkpoint that
    exists and whose attention longstride computes when `split_longest` tokens are split over CP ranks,
    model.rope_layer_types, the data sources), without a stage's training plan; returns the model's query head
    shape. For a command that runs one stage's step outside training (longstride check)."""
    _check_numbers(cfg)
    shape = model_shape(cfg, split_longest, tiles=False)  # the check runs no tiled layer
    _check_rope_layer_types(cfg.model)
    _check_data(cfg)
    return shape


def _check_schedule_fields(f: str, s: StageConfig) -> None:
    """A schedule field the stage's schedule never reads is refused rather than silently ignored."""
    kind = str(s.schedule)
    if s.decay_fraction is not None and kind != "wsd":
        raise ValueError(f"{f}.decay_fraction={s.decay_fraction} is read only by schedule: wsd, and this stage's "
                         f"schedule is {kind}; set {f}.decay_fraction=null or {f}.schedule=wsd")
    if s.min_lr_ratio is not None and kind == "constant":
        raise ValueError(f"{f}.min_lr_ratio={s.min_lr_ratio}: schedule: constant keeps the lr at its peak and has no "
                         f"floor; set {f}.min_lr_ratio=null or {f}.schedule to cosine or wsd")


def _check_stage_shape(f: str, s: StageConfig, prev_len: int, degrees: CPDegrees, impl: str) -> None:
    """Length order, step budget, and the sequence cut that the stage's CP layout needs."""
    if s.seq_len < prev_len:  # an equal length is a data or schedule change at that length (a warm-up, an anneal)
        raise ValueError(f"{f}.seq_len={s.seq_len} is shorter than the previous stage's {prev_len}: stages keep "
                         "or increase their length; reorder the stages or raise seq_len")
    if (s.steps is None) == (s.tokens is None):
        raise ValueError(f"{f}: give exactly one of steps or tokens (got steps={s.steps}, tokens={s.tokens})")
    if s.total_steps <= 0:
        raise ValueError(f"{f}: the stage has {s.total_steps} optimizer steps; raise steps or tokens")
    if not 0 <= s.warmup_steps < s.total_steps:
        raise ValueError(f"{f}.warmup_steps={s.warmup_steps} must be in [0, {s.total_steps})")
    _check_schedule_fields(f, s)
    decay_start = s.total_steps - max(int(round(s.total_steps * s.decay_share)), 1)  # run/schedule.py's wsd
    if str(s.schedule) == "wsd" and s.warmup_steps > decay_start:
        raise ValueError(f"{f}.warmup_steps={s.warmup_steps} runs into the wsd decay, which starts at step "
                         f"{decay_start} of {s.total_steps} (decay_fraction={s.decay_share}): the lr would jump "
                         f"from the warmup into the decay; lower warmup_steps to at most {decay_start} or "
                         "decay_fraction")
    if s.cp == 1:
        return
    if degrees.ulysses == 1 and s.seq_len % (2 * s.cp):
        raise ValueError(f"{f}.seq_len={s.seq_len} is not divisible by 2 x cp = {2 * s.cp} "
                         f"(the zig-zag layout cuts it into 2 x cp chunks); use a multiple of {2 * s.cp}")
    if s.seq_len % degrees.seq_len_unit:
        raise ValueError(f"{f}.seq_len={s.seq_len}: {impl} with ring {degrees.ring} x ulysses {degrees.ulysses} "
                         f"needs a multiple of {degrees.seq_len_unit}")


def resolve_precision(precision: str, assume_gpu: bool = False, on_gpu: bool = True) -> str:
    """train.precision -> accelerate's mixed_precision ("bf16" | "no"); assume_gpu: for a bf16 GPU that this
    machine need not have (longstride plan); on_gpu=False: the run is on the CPU though a GPU is there."""
    import torch

    if precision == "fp32":
        return "no"
    bf16_ok = assume_gpu or (on_gpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if precision == "bf16" and not bf16_ok:
        raise ValueError("train.precision=bf16 needs a GPU with bf16; use train.precision=auto or fp32")
    return "bf16" if bf16_ok else "no"


def plan_stage(cfg: Config, index: int, name: str, world: int, device_type: str, heads: int,
               prev_len: int = 0, assume_gpu: bool = False, head_dim: int = 0, layers: int = 0,
               softcap: bool = False) -> StagePlan:
    """One stage checked and resolved for `world` processes on `device_type` (cuda | cpu); assume_gpu: for
    CUDA GPUs with bf16 and torch's flash attention that this machine need not have (longstride plan);
    head_dim: the model's head size, which decides whether the flash kernels take it (0: not checked); layers:
    its decoder layers, the range of checkpoint_layers (0: not checked); softcap: the model soft-caps its
    attention scores, which picks the kernel."""
    s, m, par, f = cfg.recipe.stages[name], cfg.model, cfg.parallel, f"recipe.stages.{name}"
    dims = ParallelDims.from_world(world, s.cp, where=f"{f}.cp")
    degrees = cp_degrees(par, s.cp, heads, where=f"{f}.cp", world=world)
    _check_stage_shape(f, s, prev_len, degrees, par.cp_impl)
    if s.balance is not None and degrees.ring < 2:  # a stage's own setting that would do nothing
        raise ValueError(f"{f}.balance={s.balance} deals a ring's chunks, and stage {name} runs no ring (cp {s.cp}"
                         f"{f', all {par.cp_impl}' if s.cp > 1 else ''}); drop {f}.balance")
    per_step = dims.dp * s.micro_batch_size * s.seq_len
    if s.batch_tokens % per_step:
        raise ValueError(f"{f}.batch_tokens={s.batch_tokens} is not a multiple of dp {dims.dp} x "
                         f"micro_batch_size {s.micro_batch_size} x seq_len {s.seq_len} = {per_step} (the tokens of "
                         f"one micro-batch on every data-parallel rank); set {f}.batch_tokens="
                         f"{-(-s.batch_tokens // per_step) * per_step}"
                         + (f", or raise {f}.cp (fewer data-parallel ranks)" if dims.dp > 1 else ""))
    ac = checkpointed(cfg, s)
    ac_layers = _checkpoint_layers(cfg, name, ac, layers, device_type)
    check_compile(cfg.train.compile, m.checkpoint_mode if ac else "none")
    half = device_type == "cuda" and resolve_precision(str(cfg.train.precision), assume_gpu) == "bf16"
    kernel = resolve_kernel(str(par.kernel), device_type, ring=s.cp > 1, half=half, assume_available=assume_gpu,
                            head_dim=head_dim, softcap=softcap)
    if str(par.flash_impl) != "FA2" and kernel != "torch_flash":
        raise ValueError(f"parallel.flash_impl={par.flash_impl} applies to parallel.kernel=torch_flash, and this "
                         f"stage runs {kernel}; use parallel.flash_impl=FA2")
    return StagePlan(
        name, index, s, dims, degrees, kernel=kernel,
        fsdp=use_fsdp(par.fsdp, device_type, world),
        step=StepSpec(checkpointing=m.checkpoint_mode if ac else "none",
                      offload=bool(ac and m.offload_activations and device_type == "cuda"),
                      mlp_tile=m.mlp_tile_tokens if s.mlp_tile_tokens is None else s.mlp_tile_tokens,
                      lean_norms=m.lean_rms_norm, loss_tile=m.loss_tile_tokens, doc_masking=cfg.data.doc_masking,
                      checkpoint_layers=ac_layers, compile=cfg.train.compile),
        balance=str(par.balance if s.balance is None else s.balance), accum=s.batch_tokens // per_step)


def checkpointed(cfg: Config, s: StageConfig) -> bool:
    """Whether a stage runs activation checkpointing: its own setting, else the model's."""
    own = s.activation_checkpointing
    return bool(cfg.model.activation_checkpointing if own is None else own)


def _checkpoint_layers(cfg: Config, name: str, ac: bool, layers: int, device_type: str) -> Optional[int]:
    """The stage's checkpoint_layers (its own, else the model's, which applies to the stages that checkpoint), checked:
    a stage's own needs checkpointing on; 1 to the model's layers, and every layer where offload is on; None where it
    is every layer."""
    s, m = cfg.recipe.stages[name], cfg.model
    n, field = ((s.checkpoint_layers, f"recipe.stages.{name}.checkpoint_layers") if s.checkpoint_layers is not None
                else (m.checkpoint_layers, "model.checkpoint_layers"))
    if n is None or (not ac and s.checkpoint_layers is None):
        return None
    if not ac:
        raise ValueError(f"{field}={n} is read with activation checkpointing, and stage {name} runs without it; set "
                         f"model.activation_checkpointing=true (or recipe.stages.{name}.activation_checkpointing"
                         f"=true), or drop {field}")
    check_layers(n, layers or n, m.offload_activations and device_type == "cuda", field)
    return None if n == layers else n


def _check_unread(cfg: Config, plans: dict) -> None:
    """Settings that no stage of the recipe reads, refused rather than silently doing nothing."""
    m = cfg.model
    if not any(checkpointed(cfg, s) for s in cfg.recipe.stages.values()):
        unread = [f"model.checkpoint_layers={m.checkpoint_layers}"] if m.checkpoint_layers is not None else []
        unread += ["model.offload_activations=true"] if m.offload_activations else []
        unread += [f"model.checkpoint_mode={m.checkpoint_mode}"] if str(m.checkpoint_mode) != "full" else []
        if unread:
            raise ValueError(f"{', '.join(unread)}: read with activation checkpointing, and no stage runs it; set "
                             "model.activation_checkpointing=true (or a stage's activation_checkpointing), or drop "
                             f"{'them' if len(unread) > 1 else 'it'}")
    docs = [f"recipe.stages.{n}.balance" for n, s in cfg.recipe.stages.items() if str(s.balance) == "docs"]
    docs += ["parallel.balance"] if str(cfg.parallel.balance) == "docs" else []
    if docs and not cfg.data.doc_masking:
        raise ValueError(f"{docs[0]}=docs balances the work of document-masked attention, and data.doc_masking=false "
                         "attends across documents (each rank then takes zig-zag chunks); drop it or mask documents")
    rings = [p.degrees.ring for p in plans.values() if isinstance(p, StagePlan)]
    if str(cfg.parallel.balance) == "docs" and rings and max(rings) < 2:
        raise ValueError(f"parallel.balance=docs deals a ring's chunks, and no stage of recipe {cfg.recipe.name} runs "
                         f"a ring (parallel.cp_impl={cfg.parallel.cp_impl}); drop parallel.balance")
    stages_docs = any(str(s.balance or cfg.parallel.balance) == "docs" for s in cfg.recipe.stages.values())
    if cfg.parallel.balance_chunks != ParallelConfig.balance_chunks and not stages_docs:
        raise ValueError(f"parallel.balance_chunks={cfg.parallel.balance_chunks} is read by balance=docs, and no stage "
                         "balances by documents; drop it, or set parallel.balance=docs")
    if cfg.data.stream_open_seqs != DataConfig.stream_open_seqs and not cfg.data.streaming:
        raise ValueError(f"data.stream_open_seqs={cfg.data.stream_open_seqs} is read by streamed packing, and "
                         "data.streaming=false packs in memory; drop it, or set data.streaming=true")


def validate(cfg: Config, world: int, device_type: str = "cpu", assume_gpu: bool = False,
             check_data: bool = True, runs: Optional[list[str]] = None) -> dict[str, StagePlan | Unplanned]:
    """Every user-facing check, with the field and the fix; returns each stage's plan. Nothing is built
    before it passes. assume_gpu / check_data=False: plan for GPUs this machine lacks, without the data
    (longstride plan). runs: the stages this launch may train (None: every one); another stage's plan that does not
    fit `world` processes is Unplanned, not an error."""
    _check_run(cfg)
    shape = model_shape(cfg)
    _check_rope_layer_types(cfg.model)
    if not cfg.recipe.stages:
        raise ValueError(f"recipe {cfg.recipe.name!r} lists no stages; add recipe.stages.<name> entries")
    split = any(s.cp > 1 for s in cfg.recipe.stages.values())
    for key in ("ulysses", "upipe_heads"):  # read only where a stage splits its sequence: set, they would do nothing
        if getattr(cfg.parallel, key) and not split:
            raise ValueError(f"parallel.{key}={getattr(cfg.parallel, key)} splits a stage's cp ranks, and no stage of "
                             f"recipe {cfg.recipe.name} has cp > 1; drop parallel.{key} or give a stage cp > 1")
    plans, prev_len = {}, 0
    for index, name in enumerate(cfg.recipe.stages):
        try:
            plans[name] = plan_stage(cfg, index, name, world=world, device_type=device_type, heads=shape.heads,
                                     prev_len=prev_len, assume_gpu=assume_gpu, head_dim=shape.head_dim,
                                     layers=shape.layers, softcap=shape.softcap)
        except ValueError as e:
            if runs is None or name in runs:
                raise
            plans[name] = Unplanned(name, index, cfg.recipe.stages[name], str(e))
        prev_len = plans[name].stage.seq_len
    _check_unread(cfg, plans)
    check_profile(cfg.profile, {n: p.stage.total_steps for n, p in plans.items()}, selected_stages(cfg), world,
                  device_type)
    if check_data:
        _check_data(cfg)
    return plans
