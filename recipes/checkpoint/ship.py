"""Ship a trained checkpoint into the repository: its HF files copied, a manifest of how it was made.

    python -m longstride.recipes.checkpoint.ship outputs/tiny_base/s1_256/final model/shipped/tiny_base_256

The manifest (recipes/checkpoint/format.py's, so `verify` checks it) lists every file's size and SHA-256 and adds
the provenance: the run's recipe and overrides (from the run's config.yaml and run.json), the stage and
its training seed, the commit, and the checkpoint's RULER scores at its trained length and 2x it
(niah_single_1 and the in-format synth_kv), measured here on `--samples` samples each (20 by default).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess

from longstride.recipes.checkpoint.format import MANIFEST, verify, write_manifest
from longstride.whole_dir import staged

SHIPPED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")
WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors$|model\.safetensors\.index\.json$")  # one file or shards


def shipped_files(final: str) -> list[str]:
    """The files of `final` a shipped model holds: SHIPPED_FILES where present, and its weights (one
    model.safetensors, or the shards a large model is saved in with their index); a ValueError without weights."""
    names = sorted(os.listdir(final))
    weights = [n for n in names if WEIGHTS.match(n)]
    if not any(n.endswith(".safetensors") for n in weights):
        raise ValueError(f"{final} holds no safetensors weights (model.safetensors or model-*-of-*.safetensors); "
                         "ship a final checkpoint")
    return [n for n in names if n in SHIPPED_FILES] + weights


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(final: str) -> dict:
    """What made `final` (<run>/<stage>/final): the run's recipe, its command-line overrides and seed."""
    from omegaconf import OmegaConf

    stage_dir = os.path.dirname(os.path.normpath(final))
    run = os.path.dirname(stage_dir)
    cfg = OmegaConf.load(os.path.join(run, "config.yaml"))
    overrides_path = os.path.join(run, ".hydra", "overrides.yaml")
    overrides = list(OmegaConf.load(overrides_path)) if os.path.isfile(overrides_path) else []
    return {"recipe": cfg.recipe.name, "stage": os.path.basename(stage_dir), "overrides": overrides,
            "train_seed": cfg.train.seed, "data_seed": cfg.data.seed,
            "command": "accelerate launch --config_file configs/accelerate/cpu.yaml -m longstride.recipes.train "
                       + " ".join(overrides or [f"recipe={cfg.recipe.name}"])}


def own_scores(directory: str, samples: int, name: str) -> dict:
    """RULER at the trained length and 2x it: {task: {length: score}}, written under outputs/eval/ship-<name>."""
    from longstride.eval.ruler.compare import main as compare

    from transformers import AutoConfig

    from longstride.model.rope import trained_length

    trained = trained_length(AutoConfig.from_pretrained(directory))
    res = compare([f"checkpoints=[{directory}]", f"lengths=[{trained},{2 * trained}]", "yarn=[]",
                   f"num_samples={samples}", f"out={os.path.join('outputs', 'eval', 'ship-' + name)}"])
    return {"samples": samples, "scores": res["rows"][0]["scores"], "skipped": res["skipped"]}


def ship(final: str, dest: str, samples: int) -> dict:
    problem = verify(final)
    if problem:
        raise ValueError(f"{final} does not verify ({problem}); ship a finished, intact final checkpoint")
    if os.path.exists(dest):
        raise ValueError(f"{dest} exists; move it aside first (a shipped model is never overwritten in place)")
    names = shipped_files(final)
    extra = {"made_by": provenance(final), "commit": commit()}
    # built beside dest and renamed into place (longstride/whole_dir.py): dest exists only whole, with its manifest
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise ValueError(f"{parent} does not exist; create it, or ship to a folder inside an existing one")
    with staged(dest) as staging:
        for name in names:
            shutil.copy2(os.path.join(final, name), os.path.join(staging, name))
        extra["ruler"] = own_scores(staging, samples, os.path.basename(os.path.normpath(dest)))
        write_manifest(staging, 1, extra)
    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("final", help="a run's <stage>/final checkpoint")
    ap.add_argument("dest", help="the folder to create, e.g. model/shipped/tiny_base_256")
    ap.add_argument("--samples", type=int, default=20, help="RULER samples per task and length for the manifest")
    args = ap.parse_args()
    extra = ship(args.final, args.dest, args.samples)
    print(json.dumps(extra, indent=1))
    print(f"shipped {args.final} to {args.dest} ({MANIFEST} written)")


if __name__ == "__main__":
    main()
