"""Build or load a transformers causal LM for a stage: sizes, NoPE pattern, RoPE base, YaRN.

Models are transformers' own classes (SmolLM3ForCausalLM from scratch; any AutoModelForCausalLM
from a checkpoint), so every saved stage loads with plain `AutoModelForCausalLM.from_pretrained`.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, SmolLM3Config, SmolLM3ForCausalLM

from longstride.model.config import ModelConfig, YarnConfig
from longstride.model.model_dir import check_checkpoint_dir
from longstride.model.rope import (YARN_ORIGINAL_RULE, apply_yarn, max_positions, record_trained_length, rope_entries,
                                   rope_targets, set_rope_base, trained_length, yarn_original_ok)


def nope_pattern(num_layers: int, interval: int, explicit: Optional[list] = None) -> list[int]:
    """SmolLM3's `no_rope_layers`: 1 = the layer uses RoPE, 0 = NoPE."""
    if explicit is not None:
        bad = [i for i in explicit if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"model.nope_layers has indices {bad} outside 0..{num_layers - 1}; "
                f"list 0-based layer indices below model.num_hidden_layers={num_layers}"
            )
        return [0 if i in set(explicit) else 1 for i in range(num_layers)]
    if interval < 0:
        raise ValueError(f"model.nope_interval={interval} must be >= 0 (0 = RoPE on every layer)")
    if interval == 0:
        return [1] * num_layers
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


def pattern_interval(pattern: list[int]) -> Optional[int]:
    """The no_rope_layer_interval that SmolLM3's rule (`nope_pattern`) turns into `pattern`, for readers that rebuild
    the layers from it: one past the depth for RoPE everywhere, None where no interval gives the pattern."""
    first_nope = pattern.index(0) if 0 in pattern else len(pattern)
    return first_nope + 1 if nope_pattern(len(pattern), first_nope + 1, None) == pattern else None


def smollm3_config(cfg: ModelConfig, vocab_size: int, eos_id: int, pad_id: int, seq_len: int,
                   rope_theta: float, bos_id: Optional[int] = None) -> SmolLM3Config:
    """A from-scratch model's config; bos_id: the tokenizer's BOS (None: one without, EOS named in its place)."""
    pattern = nope_pattern(cfg.num_hidden_layers, cfg.nope_interval, cfg.nope_layers)
    return SmolLM3Config(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.initializer_range,
        no_rope_layers=pattern,
        no_rope_layer_interval=pattern_interval(pattern) or 4,  # no interval gives it: scratch_notes says so
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        max_position_embeddings=seq_len,
        bos_token_id=eos_id if bos_id is None else bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=False,
    )


VOCAB_PADDING = 128  # rows past the tokenizer's ids a from-scratch model may embed unremarked (a size rounded up)


def scratch_notes(cfg: ModelConfig, tokenizer_ids: int) -> list[str]:
    """What a from-scratch model's sizes do that a user may not mean, said at its stage's start: a model.vocab_size
    far past the tokenizer's ids (rows never used: a size meant for another tokenizer), and attention that is not
    model.hidden_size wide (a model.head_dim kept from the config file copied while hidden_size or heads changed), and
    a NoPE pattern other than every 4th layer, which runtimes that fix SmolLM3's NoPE at every 4th layer (or rebuild
    it from no_rope_layer_interval) do not reproduce."""
    notes = []
    pattern = nope_pattern(cfg.num_hidden_layers, cfg.nope_interval, cfg.nope_layers)
    if pattern != nope_pattern(cfg.num_hidden_layers, 4, None):
        kind = "has no interval form" if pattern_interval(pattern) is None else "is not every 4th layer"
        notes.append(f"the NoPE layers {[i for i, rope in enumerate(pattern) if not rope]} {kind}: config.json's "
                     "no_rope_layers holds them (transformers, vLLM, SGLang and MLX read it), but a runtime that "
                     "fixes SmolLM3's NoPE at every 4th layer or rebuilds it from no_rope_layer_interval (GGUF "
                     "conversions) would run those layers with other RoPE; see docs/features.md")
    if cfg.vocab_size and cfg.vocab_size - tokenizer_ids >= VOCAB_PADDING:
        notes.append(f"model.vocab_size={cfg.vocab_size} embeds {cfg.vocab_size - tokenizer_ids} rows that the "
                     f"tokenizer's {tokenizer_ids} ids never use; set model.vocab_size=null (the tokenizer's size), "
                     "or train a tokenizer of that size (data.vocab_size)")
    width = cfg.num_attention_heads * (cfg.head_dim or 0)
    if cfg.head_dim and width != cfg.hidden_size:
        notes.append(f"attention is {width} wide (model.num_attention_heads={cfg.num_attention_heads} x "
                     f"model.head_dim={cfg.head_dim}), not model.hidden_size={cfg.hidden_size}; model.head_dim=null "
                     "makes it hidden_size / num_attention_heads")
    return notes


def load_config_with_yarn(checkpoint: str, yarn: YarnConfig, layer_types: Optional[list[str]] = None,
                          field: str = "rope_layer_types") -> tuple[PretrainedConfig, int]:
    """A saved checkpoint's config with YaRN applied (to `layer_types` on a model with RoPE per layer type, see
    model/rope.py; `field` names them in errors), for evaluation beyond the trained length, and its max
    positions before YaRN."""
    if not yarn_original_ok(yarn.factor, yarn.original_max_position_embeddings):
        raise ValueError(f"yarn.original_max_position_embeddings={yarn.original_max_position_embeddings} must be "
                         + YARN_ORIGINAL_RULE.format("yarn"))
    config = AutoConfig.from_pretrained(checkpoint)
    trained = trained_length(config)
    if layer_types is not None:  # checked also where no YaRN reads it (a compare's rows without YaRN)
        rope_targets(config.get_text_config(decoder=True), layer_types, field)
    if yarn.factor is not None:  # 0 or 1 is refused by apply_yarn, not taken for "off"
        apply_yarn(config, yarn.factor, yarn.original_max_position_embeddings, layer_types, field, stretch=True,
                   yarn_field="yarn")
    return config, trained


def stage_config(cfg: ModelConfig, rope_theta: float, seq_len: int, vocab_size: int, eos_id: int, pad_id: int,
                 init_from: Optional[str] = None, bos_id: Optional[int] = None) -> PretrainedConfig:
    """The config a stage's model has (build_model's, and a traced step's: recipes/memory/trace.py): from `init_from`
    or `cfg.checkpoint`, else the model group's sizes; the stage's RoPE base and length set, YaRN applied when
    configured (both on the layer types `cfg.rope_layer_types` selects, model/rope.py), no KV cache."""
    source = init_from or (cfg.checkpoint if cfg.arch == "checkpoint" else None)
    before = seq_len  # the window YaRN (model.yarn) extends by default: the source's trained length
    if source is not None:
        check_checkpoint_dir(source, "model.checkpoint" if init_from is None else "previous stage checkpoint")
        config = AutoConfig.from_pretrained(source)
        if init_from is not None and cfg.arch == "smollm3":  # the sizes this config gives must be the ones it continues
            check_continued_sizes(config, smollm3_config(cfg, vocab_size, eos_id, pad_id, seq_len, rope_theta),
                                  init_from)
        before = trained_length(config)
        config = set_rope_base(config, rope_theta, seq_len, cfg.rope_layer_types)
    elif cfg.arch != "smollm3":
        raise ValueError(f"model.arch={cfg.arch!r} is unknown; use 'smollm3' or 'checkpoint'")
    else:
        config = set_rope_base(smollm3_config(cfg, vocab_size, eos_id, pad_id, seq_len, rope_theta, bos_id),
                               rope_theta, seq_len, cfg.rope_layer_types)
    if cfg.yarn.factor is not None:  # YaRN x factor over the window before this stage (the paper's L; the stage: L')
        apply_yarn(config, cfg.yarn.factor, cfg.yarn.original_max_position_embeddings, cfg.rope_layer_types,
                   default_original=before)
    config.use_cache = False
    return config


def build_model(
    cfg: ModelConfig,
    rope_theta: float,
    seq_len: int,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    init_from: Optional[str] = None,
    seed: int = 0,
    resume: Optional[str] = None,
    bos_id: Optional[int] = None,
) -> torch.nn.Module:
    """The model for one stage, in fp32: from `init_from` (a previous stage's checkpoint), else from
    `cfg.checkpoint`, else freshly initialised from `seed`. The stage's RoPE base is written into
    the config before the rotary embedding is built, so its inverse frequencies are right. `resume`: a step
    checkpoint to resume, whose model is built from its saved config (no weights read: the shards fill them).
    bos_id: the tokenizer's BOS, which a from-scratch config names (None: EOS in its place)."""
    source = init_from or (cfg.checkpoint if cfg.arch == "checkpoint" else None)
    if resume is not None:  # a step checkpoint: its config is the stage's; its weights come from its shards
        config = AutoConfig.from_pretrained(resume)
        # a step checkpoint written before stages recorded their length: record it, so the stage's final has it
        record_trained_length(config, seq_len)
        if source is None or os.path.isfile(os.path.join(source, "config.json")):  # else: nothing to compare with
            planned = stage_config(cfg, rope_theta, seq_len, vocab_size, eos_id, pad_id, init_from, bos_id)
            check_resumed_architecture(config, planned, resume)
            check_resumed_rope(config, planned, resume)
        text = config.get_text_config(decoder=True)  # resumed at a longer seq_len: max positions as set_rope_base sets
        text.max_position_embeddings = max(int(seq_len), int(text.max_position_embeddings or 0))
        config.use_cache = text.use_cache = False  # saved with it on for generate(); a stage trains without
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return from_saved_config(resume, config)
    config = stage_config(cfg, rope_theta, seq_len, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id,
                          init_from=init_from, bos_id=bos_id)
    if source is not None:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = SmolLM3ForCausalLM(config)
    return model


def from_saved_config(directory: str, config: PretrainedConfig) -> torch.nn.Module:
    """An fp32 model of `config` without weights (a sharded checkpoint's shards fill them), with the generation
    config saved beside it (from_config would derive a new one from config.json: its eos list, sampling settings
    lost in the stage's final and in an export)."""
    from transformers import GenerationConfig

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model


# RoPE types whose frequencies do not read max positions (a stage may resume at another seq_len under them)
LENGTH_FREE_ROPE = (None, "default", "linear")


# What a step checkpoint's model is built with and a config could now give otherwise (model.* of a new model)
ARCHITECTURE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "tie_word_embeddings", "no_rope_layers")


def architecture_changes(saved: PretrainedConfig, planned: PretrainedConfig, fields=ARCHITECTURE) -> list[tuple]:
    """(field, saved value, planned value) of each of `fields` on which two configs' text models differ."""
    theirs, mine = saved.get_text_config(decoder=True), planned.get_text_config(decoder=True)
    return [(k, getattr(theirs, k, None), getattr(mine, k, None)) for k in fields
            if getattr(theirs, k, None) != getattr(mine, k, None)]


def check_continued_sizes(saved: PretrainedConfig, planned: PretrainedConfig, source: str) -> None:
    """A stage continues the previous stage's model: model.* sizes or NoPE layers that differ from it (given with
    train.resume_from, or changed between runs) are refused, naming each, not logged as applied and dropped."""
    fields = [k for k in (*ARCHITECTURE, "rms_norm_eps") if k != "vocab_size"]  # the vocabulary: the tokenizer's
    name = {"no_rope_layers": "nope_interval / nope_layers"}
    changed = [f"model.{name.get(k, k)} gives {mine} where it has {theirs}"
               for k, theirs, mine in architecture_changes(saved, planned, fields)]
    if changed:
        raise ValueError(f"{source} (the model this stage continues) was built with other sizes than this config "
                         f"gives: {'; '.join(changed)}. A stage cannot change its predecessor's architecture; give the "
                         "settings it was built with")


def check_resumed_architecture(saved: PretrainedConfig, planned: PretrainedConfig, resume: str) -> None:
    """A resumed stage keeps the architecture its step checkpoint was trained with: a config that now gives it other
    sizes or NoPE layers (model.*, through train.resume_from) is refused, naming each, never logged while the
    checkpoint's goes on."""
    changed = [f"{k} (was {theirs}, now {mine})" for k, theirs, mine in architecture_changes(saved, planned)]
    if changed:
        raise ValueError(f"the step checkpoint {resume} was trained with another architecture than this config gives "
                         f"the stage: {'; '.join(changed)}. A stage's model (model.* sizes, nope_interval, "
                         "nope_layers) cannot change mid-stage; resume with the settings it was written with, or start "
                         "the stage over from the previous stage's final (train.resume_from=<previous stage>/final)")


def check_resumed_rope(saved: PretrainedConfig, planned: PretrainedConfig, resume: str) -> None:
    """A resumed stage keeps the RoPE its step checkpoint was trained with: a config that now gives the stage another
    one (a changed rope_theta, model.yarn or model.rope_layer_types, through train.resume_from) is refused, never
    logged as applied while the checkpoint's goes on. rope_parameters are compared (YaRN's factor and original
    window are in them), and max positions too where a RoPE type reads them (dynamic NTK, longrope, ...): under
    plain RoPE a stage may resume at another seq_len."""
    def rope(config):
        text = config.get_text_config(decoder=True)
        reads_length = any(e.get("rope_type") not in LENGTH_FREE_ROPE for _, e in rope_entries(text))
        return text.rope_parameters or {}, max_positions(config) if reads_length else None

    (theirs, their_len), (mine, my_len) = rope(saved), rope(planned)
    if (theirs, their_len) != (mine, my_len):
        length = f" over {their_len} positions" if their_len or my_len else ""
        raise ValueError(f"the step checkpoint {resume} was trained with RoPE {theirs}{length}, and this config gives "
                         f"the stage {mine}{f' over {my_len} positions' if length else ''}: a stage's RoPE (its "
                         "rope_theta, model.yarn, model.rope_layer_types, and the seq_len a length-dependent RoPE "
                         "reads) cannot change mid-stage. Resume with the settings it was written with, or start the "
                         "stage over from the previous stage's final (train.resume_from=<previous stage>/final)")


def save_config(lm: torch.nn.Module, directory: str) -> None:
    """`lm`'s config and generation config as save_pretrained writes them (its class as `architectures`, its
    parameters' dtype; a NoPE interval that rebuilds its NoPE list where one does), for a directory whose weights
    are written another way (shards, a streamed gather). Saved with the KV cache on: training runs without it
    (stage_config), a user's generate() on a final needs it."""
    lm.config.architectures = [type(lm).__name__]
    lm.config.dtype = next(iter(lm.parameters())).dtype
    interval = pattern_interval(list(lm.config.no_rope_layers)) if getattr(lm.config, "no_rope_layers", None) else None
    if interval:  # an interval that rebuilds the list (a base saved before one did)
        lm.config.no_rope_layer_interval = interval
    config, generation = copy.deepcopy(lm.config), copy.deepcopy(lm.generation_config)
    for c in {id(c): c for c in (config, config.get_text_config(decoder=True), generation)}.values():
        c.use_cache = True
    config.save_pretrained(directory)
    generation.save_pretrained(directory)
    _mirror_rope_keys(os.path.join(directory, "config.json"))


def _mirror_rope_keys(path: str) -> None:
    """Also write one RoPE's base under the key readers older than transformers 5 take (`rope_theta`): without it
    such a reader silently uses its class's default base, not the stage's bumped one. transformers 5 takes the base
    from `rope_parameters` over it. A scaling (a stage's model.yarn) is not mirrored as `rope_scaling`: transformers 5
    reads `rope_scaling` over `rope_parameters`, so a copy left stale by a later edit would win."""
    with open(path) as f:
        saved = json.load(f)
    rope = saved.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:  # none, or one per layer type (Gemma 3, OLMo 3)
        return
    saved["rope_theta"] = rope["rope_theta"]
    with open(path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
