"""What makes a folder a local HF model directory that commands can load, judged from its files alone (no torch,
no transformers: the commands check their `checkpoint=` while parsing, before anything heavy is imported):
config.json, readable weights, a manifest that matches where one was written, a tokenizer saved beside it."""
from __future__ import annotations

import json
import os

from safetensors import SafetensorError, safe_open

from longstride.model.manifest import check_manifest

STEP_METADATA = ".metadata"  # torch.distributed.checkpoint's index file: a sharded step checkpoint (parallel/shards.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one of them


def has_tokenizer(path: str) -> bool:
    """Whether an HF directory holds a tokenizer (a checkpoint saved with its tokenizer does)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def check_checkpoint_dir(path: str, field_name: str) -> None:
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise ValueError(f"{field_name}={path!r} {what}; point it at a local HF model directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{field_name}={path!r} has no config.json; it must be a directory written by save_pretrained")
    if os.path.isfile(os.path.join(path, STEP_METADATA)):  # a step checkpoint: training state, no HF weights
        raise ValueError(f"{field_name}={path!r} is a sharded step checkpoint (training state, not an HF model); "
                         f"convert it first: longstride export-hf checkpoint={path} out=DIR, then use DIR")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_checkpoint_weights(path: str, field_name: str) -> None:
    """An HF model directory whose weights from_pretrained can read: a weights file (or index) there, and every
    safetensors file's header whole (a truncated or torn copy fails here, naming the file, before any compute);
    a directory longstride wrote (a final, an export, a shipped model) also matches its manifest file by file."""
    check_manifest(path, field_name)

    found = [f for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))]
    if not found:
        raise ValueError(f"{field_name}={path!r} has no weights (none of {', '.join(WEIGHT_FILES)}); point it at a "
                         "directory written by save_pretrained, weights included")
    files = ["model.safetensors"] if found[0] == "model.safetensors" else []
    if found[0] == "model.safetensors.index.json":
        with open(os.path.join(path, found[0])) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="numpy"):  # the header only; "pt" would import torch
                pass
        except (SafetensorError, OSError) as e:  # a torn file, or a shard the index names that is missing
            raise ValueError(f"{field_name}={path!r}: {name} cannot be read ({e}); copy the checkpoint again") from None
