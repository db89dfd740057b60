"""A sharded step checkpoint as an HF model directory, on one process, without a process group:

    longstride export-hf checkpoint=outputs/tiny_extend/s2_2k/step_000020 out=exports/s2_step20

The step checkpoint is verified against its manifest, its model is built from the config saved beside the
shards, the weights are read from the shards (re-assembled from whichever ranks wrote them; the optimizer's
are not read), and the directory (save_pretrained + tokenizer + a manifest naming the source) is written
under a temporary name and renamed into place. Any command that takes `checkpoint=DIR` takes the result.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from longstride.model.model_dir import STEP_METADATA
from longstride.overrides import parse, run
from longstride.whole_dir import staged


@dataclass
class ExportConfig:
    checkpoint: Optional[str] = None  # a step checkpoint (outputs/<recipe>/<stage>/step_NNNNNN), required
    out: Optional[str] = None  # the HF directory to write, required; must not exist


def export_hf(checkpoint: str, out: str) -> str:
    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint={checkpoint!r} does not exist; give a step checkpoint, e.g. "
                         "outputs/<recipe>/<stage>/step_000020")
    if not os.path.isfile(os.path.join(checkpoint, STEP_METADATA)):
        raise ValueError(f"checkpoint={checkpoint!r} is not a sharded step checkpoint (no {STEP_METADATA}); a stage's "
                         "final is already an HF directory")
    # imported here: `longstride export-hf --help` and a bad path answer without torch
    from torch.distributed.checkpoint.api import CheckpointException
    from transformers import AutoConfig, AutoTokenizer

    from longstride.model.build import from_saved_config, save_config
    from longstride.parallel.shards import UnsafeCheckpoint, load_model_shards
    from longstride.recipes.checkpoint.format import verify, write_manifest

    problem = verify(checkpoint)
    if problem:
        raise ValueError(f"checkpoint={checkpoint!r} is damaged ({problem}); export an intact one")
    if os.path.exists(out):
        raise ValueError(f"out={out!r} exists; choose a new directory")
    model = from_saved_config(checkpoint, AutoConfig.from_pretrained(checkpoint))
    try:
        load_model_shards(checkpoint, model)
    except (UnsafeCheckpoint, CheckpointException) as e:
        raise ValueError(f"checkpoint={checkpoint!r}: {e}") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with staged(out) as tmp:  # a half-written directory never looks like a checkpoint
        model.save_pretrained(tmp)
        save_config(model, tmp)  # the configs as every saved directory has them (RoPE keys for older readers too)
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(tmp)
        write_manifest(tmp, 1, {"exported_from": os.path.abspath(checkpoint)})
    return out


def main(argv: list[str]) -> str:
    cfg = parse(ExportConfig, argv, "longstride export-hf", __doc__)
    if not cfg.checkpoint or not cfg.out:
        raise ValueError("checkpoint=<step dir> and out=<dir> are required")
    out = export_hf(cfg.checkpoint, cfg.out)
    print(f"longstride export-hf: wrote {out}; use it as checkpoint={out}")
    return out


if __name__ == "__main__":
    run("longstride export-hf", main)
