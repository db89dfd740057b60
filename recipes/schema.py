"""The root config schema and its validation: every check runs before any data or model work.

Each group's dataclass lives with its package (model/config.py, data/config.py,
parallel/config.py); the groups that belong to the recipe runner are here.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from longstride.data.config import DataConfig, LongDocConfig
from longstride.data.sources import check_synthetic
from longstride.model.config import ModelConfig
from longstride.choices import Choice, WandbMode
from longstride.parallel.config import Balance, ParallelConfig, ParallelDims, cp_degrees
from longstride.parallel.fsdp import use_fsdp
from longstride.parallel.kernels import resolve_kernel
from longstride.recipes.schedule import Schedule


class Precision(Choice):
    auto = "auto"  # bf16 where the GPU has it, else fp32
    bf16 = "bf16"
    fp32 = "fp32"


@dataclass
class StageConfig:
    seq_len: int = MISSING
    rope_theta: float = MISSING
    batch_tokens: int = MISSING  # tokens per optimizer step, over all data-parallel ranks
    steps: Optional[int] = None  # optimizer steps; or give `tokens`
    tokens: Optional[int] = None  # token budget: steps = tokens // batch_tokens
    micro_batch_size: int = 1  # sequences per forward on each data-parallel rank
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    schedule: Schedule = Schedule.cosine
    decay_fraction: float = 0.2  # wsd only
    cp: int = 1
    mixture: Optional[Dict[str, float]] = None  # source -> token weight; None = data.sources weights
    long_docs: Optional[LongDocConfig] = None  # None = data.long_docs
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only the final one
    activation_checkpointing: Optional[bool] = None  # None = model.activation_checkpointing
    mlp_tile_tokens: Optional[int] = None  # None = model.mlp_tile_tokens
    balance: Optional[Balance] = None  # None = parallel.balance

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.tokens // self.batch_tokens


@dataclass
class RecipeConfig:
    name: str = MISSING
    stages: Dict[str, StageConfig] = field(default_factory=dict)


@dataclass
class OptimConfig:
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class LoggerConfig:
    wandb_mode: WandbMode = WandbMode.offline
    project: str = "longstride"
    entity: Optional[str] = None
    log_every: int = 1
    progress_bar: bool = True


@dataclass
class PathsConfig:
    output_root: str = "outputs"
    cache_dir: str = ".cache/longstride"


@dataclass
class TrainConfig:
    seed: int = 0
    precision: Precision = Precision.auto  # auto: bf16 where the GPU has it, else fp32
    keep_last: int = 2  # step checkpoints kept per stage (final ones are always kept)
    crash_at_step: Optional[int] = None  # fault injection for resume tests: SIGKILL after this step
    collective_timeout_s: int = 1800  # a collective waiting longer (a stuck rank) fails the run
    resume: bool = True  # false: move a previous run of this directory aside and start afresh
    resume_from: Optional[str] = None  # a step_NNNNNN or final dir of this run: continue from it (config changes allowed)
    max_nonfinite_steps: int = 3  # NaN/inf loss or gradient norm: the update is skipped; this many in a row stop the run


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stage: Optional[str] = None  # run only this stage of the recipe


# The root schema is the base of configs/config.yaml, so Hydra types every field while composing:
# any schema field can be overridden from the command line, and a typo fails at once.
ConfigStore.instance().store(name="longstride_schema", node=Config)


def unknown_keys(node, path: str = "") -> list[str]:
    """Keys of typed nodes that their dataclass does not declare (Hydra's `+key=` can add them)."""
    found = []
    if isinstance(node, DictConfig):
        declared = {f.name for f in fields(t)} if is_dataclass(t := OmegaConf.get_type(node)) else None
        for key in node.keys():
            full = f"{path}.{key}" if path else str(key)
            if declared is not None and key not in declared:
                found.append(full)
            elif not OmegaConf.is_missing(node, key):
                found += unknown_keys(node._get_node(key), full)
    return found


def to_schema(raw: DictConfig) -> Config:
    """Composed Hydra config -> typed Config; unknown keys, wrong types and missing values fail here."""
    unknown = unknown_keys(raw)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}: check their spelling against the schema in the "
                         "group's config.py (model/config.py, data/config.py, ...)")
    missing = sorted(OmegaConf.missing_keys(raw))
    if missing:
        raise ValueError(f"config fields {missing} have no value (???); set them on the command line, "
                         f"for example {missing[0]}=...")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        return OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        raise ValueError(f"unknown config key {e.full_key!r}: check its spelling against the schema in "
                         f"the group's config.py ({e.msg.splitlines()[0]})") from None
    except ValidationError as e:
        raise ValueError(f"config field {e.full_key}: {e.msg.splitlines()[0]}") from None


def selected_stages(cfg: Config) -> list[str]:
    names = list(cfg.recipe.stages)
    if cfg.stage is None:
        return names
    if cfg.stage not in names:
        raise ValueError(f"stage={cfg.stage!r} is not in recipe {cfg.recipe.name!r}; its stages are {names}")
    return [cfg.stage]


def _check_model(m: ModelConfig) -> int:
    """Checks the model group; returns its query head count (read from config.json for a checkpoint)."""
    if m.arch == "checkpoint":
        if not m.checkpoint:
            raise ValueError("model.arch=checkpoint needs model.checkpoint=<local HF model dir>")
        path = os.path.join(m.checkpoint, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model.checkpoint={m.checkpoint!r} is not an HF model directory with a config.json")
        with open(path) as fh:
            return json.load(fh)["num_attention_heads"]
    if m.arch != "smollm3":
        raise ValueError(f"model.arch={m.arch!r} is unknown; use smollm3 or checkpoint")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                         f"model.num_key_value_heads={m.num_key_value_heads}")
    return m.num_attention_heads


def _check_cp_length(f: str, s: StageConfig, par: ParallelConfig, heads: int) -> None:
    d = cp_degrees(par, s.cp, heads, where=f"{f}.cp")
    if d.ulysses == 1 and s.seq_len % (2 * s.cp):
        raise ValueError(f"{f}.seq_len={s.seq_len} is not divisible by 2 x cp = {2 * s.cp} "
                         f"(the zig-zag layout cuts it into 2 x cp chunks); use a multiple of {2 * s.cp}")
    if s.seq_len % (2 * d.ring) or (s.seq_len // d.ring) % d.ulysses:
        raise ValueError(f"{f}.seq_len={s.seq_len}: {par.cp_impl} with ring {d.ring} x ulysses {d.ulysses} needs "
                         f"a multiple of {d.ring * math.lcm(2, d.ulysses)}")


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


def _check_ranges(cfg: Config) -> None:
    """Numbers that must lie in a range, each with the field and the range in the message."""
    m = cfg.model
    rules = [("optim.eps", cfg.optim.eps, cfg.optim.eps > 0, "> 0"),
             ("optim.weight_decay", cfg.optim.weight_decay, cfg.optim.weight_decay >= 0, ">= 0"),
             ("optim.grad_clip", cfg.optim.grad_clip, cfg.optim.grad_clip >= 0, ">= 0 (0 = no clipping)"),
             ("optim.betas", list(cfg.optim.betas), len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas),
              "two numbers in [0, 1), e.g. [0.9,0.95]"),
             ("model.loss_tile_tokens", m.loss_tile_tokens, m.loss_tile_tokens >= 1, ">= 1 (e.g. 1024)"),
             ("data.eval_sequences", cfg.data.eval_sequences, cfg.data.eval_sequences >= 0, ">= 0"),
             ("train.keep_last", cfg.train.keep_last, cfg.train.keep_last >= 0, ">= 0 (0 = keep every one)"),
             ("train.max_nonfinite_steps", cfg.train.max_nonfinite_steps, cfg.train.max_nonfinite_steps >= 1,
              ">= 1 (3 is the default)"),
             ("train.collective_timeout_s", cfg.train.collective_timeout_s, cfg.train.collective_timeout_s >= 1,
              ">= 1 second (1800 is the default)")]
    if m.arch != "checkpoint":
        rules += [(f"model.{k}", getattr(m, k), getattr(m, k) >= 1, ">= 1")
                  for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                            "num_key_value_heads")]
    for name, s in cfg.recipe.stages.items():
        f = f"recipe.stages.{name}"
        rules += [(f"{f}.micro_batch_size", s.micro_batch_size, s.micro_batch_size >= 1, ">= 1"),
                  (f"{f}.lr", s.lr, s.lr > 0, "> 0"),
                  (f"{f}.min_lr_ratio", s.min_lr_ratio, 0 <= s.min_lr_ratio <= 1, "in [0, 1]"),
                  (f"{f}.decay_fraction", s.decay_fraction, 0 < s.decay_fraction <= 1, "in (0, 1]"),
                  (f"{f}.save_every", s.save_every, s.save_every >= 0, ">= 0 (0 = only the final checkpoint)"),
                  (f"{f}.cp", s.cp, s.cp >= 1, ">= 1")]
    for field_name, value, ok, want in rules:
        if not ok:
            raise ValueError(f"{field_name}={value} must be {want}")
    root = cfg.paths.output_root
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"paths.output_root={root!r} is a file; give a directory (it is created if missing)")


def validate(cfg: Config, world_size: int) -> None:
    """Every user-facing check, with the field and the fix; nothing is built before it passes."""
    bad = non_finite_fields(cfg)
    if bad:
        raise ValueError(f"config fields {', '.join(bad)} are not finite numbers; give finite values")
    _check_ranges(cfg)
    if cfg.train.resume_from and not cfg.train.resume:
        raise ValueError("train.resume=false (start afresh) and train.resume_from (continue from a checkpoint) "
                         "contradict each other; give one")
    first = next(iter(cfg.recipe.stages), None)
    if cfg.stage and cfg.stage != first and (cfg.train.resume_from or not cfg.train.resume):
        raise ValueError(f"stage={cfg.stage} with train.resume=false or train.resume_from: those decide where the "
                         "run starts over (a later stage needs the earlier ones' checkpoints); drop stage=")
    r = cfg.recipe
    heads = _check_model(cfg.model)
    if not r.stages:
        raise ValueError(f"recipe {r.name!r} lists no stages; add recipe.stages.<name> entries")
    prev_len = 0
    for name, s in r.stages.items():
        f = f"recipe.stages.{name}"
        if s.seq_len <= prev_len:
            raise ValueError(f"{f}.seq_len={s.seq_len} must be larger than the previous stage's {prev_len}: "
                             "stages must increase in length")
        prev_len = s.seq_len
        if s.rope_theta <= 0:
            raise ValueError(f"{f}.rope_theta={s.rope_theta} must be positive (for example 1e4, 5e5, 1e6)")
        if (s.steps is None) == (s.tokens is None):
            raise ValueError(f"{f}: give exactly one of steps or tokens (got steps={s.steps}, tokens={s.tokens})")
        if s.total_steps <= 0:
            raise ValueError(f"{f}: the stage has {s.total_steps} optimizer steps; raise steps or tokens")
        if not 0 <= s.warmup_steps < s.total_steps:
            raise ValueError(f"{f}.warmup_steps={s.warmup_steps} must be in [0, {s.total_steps})")
        if s.cp > 1:
            _check_cp_length(f, s, cfg.parallel, heads)
        if s.mlp_tile_tokens is not None and s.mlp_tile_tokens < 0:
            raise ValueError(f"{f}.mlp_tile_tokens={s.mlp_tile_tokens} must be >= 0 (0 = off, e.g. 4096 = tiled)")
        dims = ParallelDims.from_world(world_size, s.cp, where=f"{f}.cp")
        per_step = dims.dp * s.micro_batch_size * s.seq_len
        if s.batch_tokens % per_step:
            raise ValueError(f"{f}.batch_tokens={s.batch_tokens} is not a multiple of dp {dims.dp} x "
                             f"micro_batch_size {s.micro_batch_size} x seq_len {s.seq_len} = {per_step}")
        if s.mixture is not None:
            unknown = set(s.mixture) - set(cfg.data.sources)
            if unknown:
                raise ValueError(f"{f}.mixture names {sorted(unknown)}, not in data.sources {list(cfg.data.sources)}")
    selected_stages(cfg)
    if not cfg.data.sources:
        raise ValueError("data.sources is empty; pick a data config (data=stdlib, data=files, ...) or add a source")
    for name, src in cfg.data.sources.items():
        if src.kind in ("local_dir", "files", "disk") and not src.path:
            raise ValueError(f"data.sources.{name}.path is not set; data.sources.{name}.path=... "
                             f"({src.kind} sources read local paths)")
        if src.kind == "synthetic":
            check_synthetic(src, f"data.sources.{name}")
    if cfg.parallel.balance_chunks < 2:
        raise ValueError(f"parallel.balance_chunks={cfg.parallel.balance_chunks} must be >= 2 (chunks per ring rank "
                         "that balance=docs may use; 8 is a good default)")
    use_fsdp(cfg.parallel.fsdp, "cpu", world_size)  # a valid choice?
    ring = any(s.cp > 1 for s in r.stages.values())
    resolve_kernel(cfg.parallel.kernel, "cuda" if torch.cuda.is_available() else "cpu", ring)  # installed?
    if cfg.model.mlp_tile_tokens < 0:
        raise ValueError(f"model.mlp_tile_tokens={cfg.model.mlp_tile_tokens} must be >= 0 (0 = off, e.g. 4096)")
    if cfg.data.streaming:
        if cfg.data.long_docs.min_tokens or any(s.long_docs and s.long_docs.min_tokens for s in r.stages.values()):
            raise ValueError("data.long_docs upsampling needs the in-memory corpus (it counts every document's "
                             "length first); set data.long_docs.min_tokens=0 or data.streaming=false")
        if cfg.data.num_workers:
            raise ValueError(f"data.num_workers={cfg.data.num_workers}: the streaming packer runs in the training "
                             "process; set data.num_workers=0 with data.streaming=true")
        if cfg.data.stream_open_seqs < 1:
            raise ValueError(f"data.stream_open_seqs={cfg.data.stream_open_seqs} must be >= 1 (64 is a good default)")
    if cfg.data.tokenizer and not os.path.isdir(cfg.data.tokenizer):
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r} is not a directory; give a local HF tokenizer dir "
                         "or null to train a BPE on the corpus")
