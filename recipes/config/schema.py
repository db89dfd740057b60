"""The root config schema: typed dataclasses that Hydra composes into (a typo or a wrong type fails there).

Each group's dataclass lives with its package (model/config.py, data/config.py, parallel/config.py);
the groups that belong to the recipe runner are here. The checks across fields, and each stage's
resolved plan, are recipes/config/plan.py's.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

import longstride.model
from longstride.choices import Choice, WandbMode
from longstride.data.config import DataConfig, LongDocConfig
from longstride.model.config import ModelConfig
from longstride.parallel.config import Balance, ParallelConfig
from longstride.recipes.run.schedule import Schedule


class Precision(Choice):
    auto = "auto"  # bf16 where the GPU has it, else fp32
    bf16 = "bf16"
    fp32 = "fp32"


# what a stage's schedule field left unset (null) means; a run recorded before it could be unset holds these values
STAGE_UNSET = {"min_lr_ratio": 0.1, "decay_fraction": 0.2}


@dataclass
class StageConfig:
    seq_len: int = MISSING
    rope_theta: float = MISSING
    batch_tokens: int = MISSING  # tokens per optimizer step, over all data-parallel ranks
    steps: Optional[int] = None  # optimizer steps; or give `tokens`
    tokens: Optional[int] = None  # token budget: steps = tokens // batch_tokens
    micro_batch_size: int = 1  # sequences per forward on each data-parallel rank
    lr: float = 3e-4
    min_lr_ratio: Optional[float] = None  # cosine and wsd: the floor as a share of lr; None = 0.1
    warmup_steps: int = 0
    schedule: Schedule = Schedule.cosine
    decay_fraction: Optional[float] = None  # wsd only: the share of the steps it decays over; None = 0.2
    cp: int = 1
    # source -> token weight; empty or null = data.sources' weights (empty by default, so +mixture.NAME=W can fill it)
    mixture: Optional[Dict[str, float]] = field(default_factory=dict)
    long_docs: Optional[LongDocConfig] = None  # None = data.long_docs
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only the final one
    activation_checkpointing: Optional[bool] = None  # None = model.activation_checkpointing
    checkpoint_layers: Optional[int] = None  # None = model.checkpoint_layers
    mlp_tile_tokens: Optional[int] = None  # None = model.mlp_tile_tokens
    balance: Optional[Balance] = None  # None = parallel.balance

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.tokens // self.batch_tokens

    @property
    def floor_ratio(self) -> float:
        return STAGE_UNSET["min_lr_ratio"] if self.min_lr_ratio is None else self.min_lr_ratio

    @property
    def decay_share(self) -> float:
        return STAGE_UNSET["decay_fraction"] if self.decay_fraction is None else self.decay_fraction


@dataclass
class RecipeConfig:
    name: str = MISSING
    stages: Dict[str, StageConfig] = field(default_factory=dict)


class OptimImpl(Choice):
    """optim.implementation: how AdamW's update runs (recipes/run/step.py adamw_implementation)."""

    auto = "auto"  # fused on GPUs (torchtitan's default), torch's own choice elsewhere (a loop over tensors on CPU)
    fused = "fused"  # one kernel for every tensor's update
    foreach = "foreach"  # torch's multi-tensor ops (torch's own choice on GPUs)
    for_loop = "for_loop"  # one tensor at a time


@dataclass
class OptimConfig:
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    implementation: OptimImpl = OptimImpl.auto


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
    # true: a step checkpoint blocks training only while each rank copies its state to host memory; the files are
    # written and sealed behind the next steps (recipes/checkpoint/background.py: BackgroundSave)
    async_save: bool = False
    # torch.compile of each decoder layer's parts, longstride's attention left out of the graphs (model/compile.py);
    # each stage's first step, and its first validation, compile them. Not with model.checkpoint_mode=selective
    compile: bool = False
    collective_timeout_s: int = 1800  # a collective waiting longer (a stuck rank) fails the run
    resume: bool = True  # false: move a previous run of this directory aside and start afresh
    resume_from: Optional[str] = None  # a step_NNNNNN or final dir of this run: continue from it (config changes allowed)
    # false: a step checkpoint whose data position this stage cannot use (its data changed, or streamed on another
    # dp layout) still resumes its weights, optimizer and step, its data from the start of the epoch
    # (recipes/run/stage_state.py restore_stage); true: such a resume is refused
    resume_data: bool = True
    max_nonfinite_steps: int = 3  # NaN/inf loss or gradient norm: the update is skipped; this many in a row stop the run
    # each stage's step traced at its start (recipes/memory/trace.py, seconds, in a child process of rank 0) and its
    # per-rank memory logged beside the analytic estimate: auto = on GPUs, true, false
    trace_memory: str = "auto"


class ProfileTool(Choice):
    torch = "torch"  # torch.profiler: a Chrome trace and an op table per traced rank
    nsys = "nsys"  # Nsight Systems: the window as its capture range, NVTX ranges per step (CUDA only)


@dataclass
class ProfileConfig:
    """Steps start_step..end_step (1-based, of each stage's own count) traced by torch.profiler (a Chrome trace per
    rank and the ops that took longest) or marked for nsys (recipes/run/profiling.py). 0 = off."""
    tool: ProfileTool = ProfileTool.torch
    start_step: int = 0
    end_step: int = 0  # 0 = start_step (one step)
    stages: Optional[List[str]] = None  # null = every stage
    ranks: Optional[List[int]] = None  # null = every rank
    record_shapes: bool = False  # each op's input shapes (a larger trace)
    with_stack: bool = False  # the Python stack of each op (a much larger trace)
    # CUDA only: the caching allocator's history over the same steps, a snapshot for pytorch.org/memory_viz
    memory_snapshot: bool = False


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    stage: Optional[str] = None  # run only this stage of the recipe


# The root schema is the base of configs/config.yaml, so Hydra types every field while composing:
# any schema field can be overridden from the command line, and a typo fails at once.
ConfigStore.instance().store(name="longstride_schema", node=Config)

# The models shipped with the package (model/shipped/, installed with it): `${shipped:tiny_base_256}` in a config
# is that folder's absolute path, so a recipe that starts from one runs from any working directory.
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(longstride.model.__file__)), "shipped")
OmegaConf.register_new_resolver("shipped", lambda name: os.path.join(SHIPPED, name), replace=True)


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


# Dicts of weights whose keys the user names: a {...} given on the command line is the whole dict (Hydra would merge
# it into the recipe's, keeping every weight it does not name)
WEIGHT_DICTS = ("recipe.stages.*.mixture", "data.sources.*.synthetic.kinds")


def replace_weight_dicts(raw: DictConfig, overrides: list[str]) -> None:
    """Sets each WEIGHT_DICTS key that `overrides` gives a {...} (key=, +key=, ++key=) to exactly that dict, as the
    user wrote it: `recipe.stages.s2_2k.mixture={stdlib:1.0}` trains on stdlib only, not stdlib beside the recipe's
    other weights. Later overrides of single weights (mixture.a=0.5) still apply on top, in order."""
    parsed = _parsed_overrides(overrides)
    for i, o in enumerate(parsed):
        key = o.key_or_group
        if not _weight_dict(o):
            continue
        OmegaConf.update(raw, key, o.value(), merge=False)
        for later in parsed[i + 1:]:  # a single weight set or removed after the dict (a key it may lack: open)
            name = later.key_or_group
            if not name.startswith(key + ".") or (not later.is_delete() and isinstance(later.value(), dict)):
                continue
            node = OmegaConf.select(raw, key)
            with open_dict(node):
                if later.is_delete():
                    node.pop(name[len(key) + 1:], None)
                else:
                    OmegaConf.update(raw, name, later.value(), merge=False)


def weight_dict_keys(overrides: list[str]) -> list[str]:
    """The WEIGHT_DICTS keys that `overrides` give a {...} (replace_weight_dicts replaces them whole)."""
    return [o.key_or_group for o in _parsed_overrides(overrides) if _weight_dict(o)]


def _parsed_overrides(overrides: list[str]) -> list:
    """Hydra's parse of the key=value and ~key overrides (flags and bare words left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([o for o in overrides if "=" in o or o.startswith("~")])


def _weight_dict(o) -> bool:
    """Whether a parsed override gives a WEIGHT_DICTS key a whole {...}."""
    return (not o.is_delete() and isinstance(o.value(), dict)
            and any(dotted_match(o.key_or_group, pattern) for pattern in WEIGHT_DICTS))


def dotted_match(key: str, pattern: str) -> bool:
    """Whether dotted `key` matches `pattern` component by component, `*` standing for any one component."""
    parts, want = key.split("."), pattern.split(".")
    return len(parts) == len(want) and all(w == "*" or w == p for p, w in zip(parts, want))


def to_schema(raw: DictConfig, overrides: tuple = ()) -> Config:
    """Composed Hydra config (and the command line's `overrides`: replace_weight_dicts) -> typed Config; unknown
    keys, wrong types and missing values fail here."""
    if overrides:
        replace_weight_dicts(raw, list(overrides))
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


class AddedStageError(ValueError):
    """A stage added on the command line, with how to add one instead (added_stage_hint)."""


# what cannot be added on the command line: (the override's prefix, its config class, what it is, its group, where
# it lives in that group's file)
_TYPED_ENTRIES = (("recipe.stages", "StageConfig", "a stage of this recipe", "recipe", "recipe.stages"),
                  ("data.sources", "SourceConfig", "a source of this data config", "data", "sources"))


def added_stage_hint(overrides: list[str], error: str) -> str:
    """How to add a stage (or a data source), when `error` is Hydra failing on an override that adds one: OmegaConf
    cannot build a typed stage or source from the command line (`+recipe.stages.NEW={...}`,
    `recipe.stages.NEW.seq_len=...`, `+data.sources.NEW={...}`). "" if not."""
    for arg in overrides:
        for prefix, cls, what, group, under in _TYPED_ENTRIES:
            m = re.match(r"\+{0,2}" + re.escape(prefix) + r"\.([^.=]+)", arg)
            if m and (f"subclass of {cls}" in error or f"Key '{m.group(1)}' is not in struct" in error):
                kind = what.split()[1]
                return (f"{arg}: {prefix}.{m.group(1)} is not {what}, and a {kind} cannot be added on the command "
                        f"line (Hydra cannot build a typed {kind} from an override). Add it in a {group} file: copy "
                        f"one of longstride's configs/{group}/*.yaml to DIR/{group}/NAME.yaml, add the {kind} under "
                        f"{under} there, and run with --config-dir DIR {group}=NAME (docs/recipes.md, \"Your own "
                        "recipe\")")
    return ""


def selected_stages(cfg: Config) -> list[str]:
    names = list(cfg.recipe.stages)
    if cfg.stage is None:
        return names
    if cfg.stage not in names:
        raise ValueError(f"stage={cfg.stage!r} is not in recipe {cfg.recipe.name!r}; its stages are {names}")
    return [cfg.stage]
