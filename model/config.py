"""Schema of the `model` config group: what model a recipe trains and how its positions work."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from longstride.choices import Choice


class Arch(Choice):
    """model.arch: a SmolLM3-style model built from this group's sizes, or a local HF checkpoint."""

    smollm3 = "smollm3"
    checkpoint = "checkpoint"


class CheckpointMode(Choice):
    """model.checkpoint_mode (model/checkpointing.py)."""

    full = "full"
    selective = "selective"


def check_layers(layers: int, total: int, offload: bool, field: str = "model.checkpoint_layers") -> None:
    """`layers` checkpointed decoder layers of `total`: 1 to total, and with offload every one (the offload hooks
    span the decoder stack: they would move all that a layer outside checkpointing saves)."""
    if not 1 <= layers <= total:
        raise ValueError(f"{field}={layers}: the model has {total} decoder layers; checkpoint 1 to {total} of them "
                         f"({total}: every layer), or switch activation checkpointing off")
    if offload and layers < total:
        raise ValueError(f"{field}={layers} of {total} layers with model.offload_activations=true: offload holds "
                         f"what checkpointed layers keep, so it needs all of them checkpointed; set {field}={total} "
                         "or model.offload_activations=false")


@dataclass
class YarnConfig:
    """YaRN extrapolation (arXiv:2309.00071), applied through transformers' own `rope_parameters`."""

    factor: Optional[float] = None  # None = YaRN off
    # None = the length the model was trained at (model/rope.py trained_length; for a stage's model.yarn, the
    # length before the stage); a RoPE that is already yarn keeps its own (model/rope.py apply_yarn)
    original_max_position_embeddings: Optional[int] = None


@dataclass
class ModelConfig:
    # "smollm3" builds SmolLM3ForCausalLM from the sizes below; "checkpoint" loads `checkpoint`
    # (any local HF causal-LM dir: SmolLM3, Llama, Qwen3, ...) and keeps its architecture.
    arch: Arch = Arch.smollm3
    checkpoint: Optional[str] = None
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None  # None = the tokenizer's length
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    # Hybrid RoPE/NoPE: every `nope_interval`-th layer (1-based) has no RoPE, unless
    # `nope_layers` lists the NoPE layer indices (0-based) explicitly. 0 = RoPE everywhere.
    nope_interval: int = 4
    nope_layers: Optional[List[int]] = None
    yarn: YarnConfig = field(default_factory=YarnConfig)
    # Layer types that each stage's rope_theta and `yarn` are written to, on a model whose config keeps RoPE
    # per layer type (Gemma 3, OLMo 3: [full_attention, sliding_attention]); None = [full_attention] there,
    # and every layer on a model with one rope_parameters (SmolLM3, Llama, Qwen3), which refuses a list.
    # model/rope.py says why.
    rope_layer_types: Optional[List[str]] = None
    # Activation checkpointing of every decoder layer (model/checkpointing.py): full keeps each layer's
    # input only; selective also keeps its matmuls' outputs and attention's output (model/selective.py) and
    # recomputes the rest. Offload holds
    # the checkpointed inputs in pinned host memory on CUDA runs.
    activation_checkpointing: bool = False
    checkpoint_mode: CheckpointMode = CheckpointMode.full
    # Checkpoint the first N decoder layers only (with checkpoint_mode); the others keep all they save, for speed
    # where memory allows (Megatron's block recompute). None = every layer; per stage:
    # recipe.stages.X.checkpoint_layers.
    checkpoint_layers: Optional[int] = None
    offload_activations: bool = False
    # Sequence tile for the chunked cross-entropy: never more than tile x vocab logits at once.
    loss_tile_tokens: int = 1024
    # Tiled layers (model/tiling.py): each layer's MLP, and in pre-norm layers its q/k/v projections,
    # with the norm before them, over tiles of this many tokens, recomputed in backward, so tile x
    # intermediate_size activations and the normed tensors exist one tile at a time. 0 = off.
    mlp_tile_tokens: int = 0
    # RMSNorm layers keep only their input and 1/rms for backward (model/rmsnorm.py); same forward values.
    lean_rms_norm: bool = True
