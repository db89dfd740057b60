"""The model group's checks, before anything is built: a checkpoint's directory, what of its model longstride does
not compute (attention beyond causal windows, chunks, sinks and soft-caps; a router's load-balancing loss; MLPs
tiles cannot carry), the fields only a new model reads, model.rope_layer_types; and the model's shape the stages'
plans read (recipes/config/plan.py)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from longstride.model.config import ModelConfig
from longstride.model.model_dir import check_checkpoint_dir
from longstride.model.rope import apply_yarn, rope_targets
from longstride.parallel.attention import head_shape
from longstride.parallel.pattern import config_softcap
from longstride.recipes.config.schema import Config


def _check_model_supported(cfg: Config, split_longest: int, tiles: bool = True) -> None:
    """A checkpoint whose attention longstride does not implement (sliding windows, chunks, sinks...), whose loss
    holds a router's load-balancing term, or whose MLPs model.mlp_tile_tokens cannot tile, is refused here, before
    any data or weights are read: the model is built on the meta device, without memory. tiles: whether the
    stages' tiles are checked (not by a command that runs no tiled layer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longstride.model.loss import decoder_layers, router_aux_loss
    from longstride.model.tiling import untileable
    from longstride.parallel.attention import check_supported

    m = cfg.model

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m.checkpoint))
    try:
        check_supported(skeleton, split_longest)
        decoder_layers(skeleton)  # one stack of layers, which checkpointing, tiling and FSDP wrap
        why = router_aux_loss(skeleton.config)
        if why:
            raise ValueError(why)
    except (NotImplementedError, ValueError) as e:
        raise ValueError(f"model.checkpoint={m.checkpoint}: {e}") from None
    tiled = [f"model.mlp_tile_tokens={m.mlp_tile_tokens}"] if m.mlp_tile_tokens and tiles else []
    tiled += [f"recipe.stages.{n}.mlp_tile_tokens={s.mlp_tile_tokens}" for n, s in cfg.recipe.stages.items()
              if s.mlp_tile_tokens and tiles]
    why = untileable(skeleton) if tiled else None
    if why:
        raise ValueError(f"{', '.join(tiled)}: {m.checkpoint}'s {why}; set {'them' if len(tiled) > 1 else 'it'} "
                         "to 0 (activation checkpointing saves memory there)")


# What only a new model (model.arch=smollm3) reads: a checkpoint keeps its own sizes and NoPE layers
NEW_MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                    "initializer_range", "nope_interval", "nope_layers")


def _check_new_model_fields(m: ModelConfig) -> None:
    """model.arch=checkpoint with a NEW_MODEL_FIELDS field set away from its default is refused, naming it: the
    checkpoint's architecture is what trains, and the setting would be dropped."""
    default = ModelConfig()
    found = [f"model.{k}={getattr(m, k)}" for k in NEW_MODEL_FIELDS if getattr(m, k) != getattr(default, k)]
    if found:
        raise ValueError(f"{', '.join(found)}: read only for a new model (model.arch=smollm3), and model.arch="
                         f"checkpoint keeps {m.checkpoint}'s architecture (its sizes and NoPE layers); drop "
                         f"{'them' if len(found) > 1 else 'it'}, or change that checkpoint's config.json")


class ModelShape(NamedTuple):
    heads: int  # query heads
    head_dim: int
    layers: int  # decoder layers; 0 where a checkpoint's config does not say
    softcap: bool  # its attention soft-caps scores (Gemma 2), which only some kernels compute


def model_shape(cfg: Config, split_longest: Optional[int] = None, tiles: bool = True) -> ModelShape:
    """What the stages' plans read of the model (a checkpoint's from its config, read once), after the model
    group's checks (tiles: the stages' MLP tiles among them)."""
    m = cfg.model
    if m.checkpoint and m.arch != "checkpoint":
        raise ValueError(f"model.checkpoint={m.checkpoint} is read only with model.arch=checkpoint, and "
                         f"model.arch={m.arch} would build a new model from scratch; add model=checkpoint "
                         "(the config group) or drop model.checkpoint")
    if m.arch == "checkpoint":
        from transformers import AutoConfig

        if not m.checkpoint:
            raise ValueError("model.arch=checkpoint needs model.checkpoint=<local HF model dir>")
        _check_new_model_fields(m)
        check_checkpoint_dir(m.checkpoint, "model.checkpoint")
        if split_longest is None:  # the longest stage a recipe splits over CP ranks
            split_longest = max((s.seq_len for s in cfg.recipe.stages.values() if s.cp > 1), default=0)
        _check_model_supported(cfg, split_longest, tiles)
        config = AutoConfig.from_pretrained(m.checkpoint)
        text = config.get_text_config()  # a multimodal config's decoder
        layers = getattr(text, "num_hidden_layers", 0) or 0
        return ModelShape(*head_shape(config), layers, bool(config_softcap(text)))
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                         f"model.num_key_value_heads={m.num_key_value_heads}")
    return ModelShape(m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads,
                      m.num_hidden_layers, False)


def _check_rope_layer_types(m: ModelConfig) -> None:
    """model.rope_layer_types against the model's own config (model/rope.py's rules), before anything is built:
    a layer type it has no RoPE entry for, or a per-type choice on a model with one rope_parameters, fails here."""
    from transformers import AutoConfig, SmolLM3Config

    config = AutoConfig.from_pretrained(m.checkpoint) if m.arch == "checkpoint" else SmolLM3Config()
    rope_targets(config.get_text_config(decoder=True), m.rope_layer_types)
    if m.yarn.factor is not None:  # YaRN over another scaling, or another factor than the checkpoint's: refused here
        apply_yarn(config, m.yarn.factor, m.yarn.original_max_position_embeddings, m.rope_layer_types)
