"""How every eval command (ruler, compare, ppl) loads a checkpoint: one device and dtype policy.

    model, tokenizer, meta = load_eval_model("outputs/tiny/s3_4k/final", YarnConfig(factor=2))

The checkpoint's config with YaRN applied (model/build.py's load_config_with_yarn, on `rope_layer_types` where
RoPE is per layer type), its tokenizer, and the model through plain AutoModelForCausalLM.from_pretrained in
`dtype` (default float32: the same numbers on a GPU as on the CPU), moved to `device` (default this process's
GPU when there is one, else the CPU), in eval mode.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from longstride.model.build import load_config_with_yarn
from longstride.model.config import YarnConfig
from longstride.model.rope import max_positions

# eval/cli.Dtype, the commands' dtype= choice, as a torch dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EvalModelInfo:
    device: torch.device
    dtype: torch.dtype
    max_positions: int  # the model's max positions, YaRN's stretch included
    trained: int  # its max positions before YaRN: the length it was trained at
    position_limit: Optional[int] = None  # a table of learned positions ends here (GPT-2, OPT): no longer input


def learned_positions(model: torch.nn.Module) -> Optional[int]:
    """How many positions a model's learned position table holds (GPT-2's wpe, OPT's embed_positions less its
    offset); None for a model without one (RoPE, ALiBi): past it the model cannot run at all, not even as
    extrapolation."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding) and name.split(".")[-1] in ("wpe", "embed_positions",
                                                                              "position_embeddings"):
            return mod.num_embeddings - int(getattr(mod, "offset", 0))
    return None


def eval_device() -> str:
    """Where an eval runs its model: this process's GPU when there is one, else the CPU."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def eval_config(checkpoint: str, yarn: Optional[YarnConfig] = None, rope_layer_types: Optional[list[str]] = None):
    """(the checkpoint's config with YaRN applied, its max positions before YaRN), without loading weights:
    what a command checks its lengths against before it loads the model."""
    return load_config_with_yarn(checkpoint, yarn or YarnConfig(), rope_layer_types)


def applied_rope(config) -> dict:
    """The RoPE an eval ran with, YaRN applied, under config.json's keys: what to write into the checkpoint's
    config.json to load the same model elsewhere (the original length YaRN used is the trained one, not
    necessarily the checkpoint's max_position_embeddings)."""
    text = config.get_text_config(decoder=True)
    return {"rope_parameters": copy.deepcopy(getattr(text, "rope_parameters", None)),  # None: no RoPE (GPT-2)
            "max_position_embeddings": max_positions(config)}


def eval_tokenizer(checkpoint: str):
    """The checkpoint's own tokenizer (loaded before its weights: samples and documents are checked with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def load_eval_model(checkpoint: str, yarn: Optional[YarnConfig] = None, rope_layer_types: Optional[list[str]] = None,
                    device: Optional[str] = None, dtype: Optional[torch.dtype] = None, tokenizer=None):
    """(model, tokenizer, EvalModelInfo) of an HF model dir, with YaRN (None or factor None: off), on `device`
    (None: eval_device()) in `dtype` (None: float32), in eval mode; `tokenizer`: the checkpoint's, already loaded
    (eval_tokenizer: what a command checks its samples with before the weights load)."""
    from transformers import AutoModelForCausalLM

    config, trained = eval_config(checkpoint, yarn, rope_layer_types)
    tokenizer = tokenizer or eval_tokenizer(checkpoint)
    dtype = dtype or torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, dtype=dtype)
    model = model.to(device or eval_device()).eval()
    info = EvalModelInfo(next(model.parameters()).device, dtype, max_positions(config), trained,
                         learned_positions(model))
    return model, tokenizer, info
