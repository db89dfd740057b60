"""A check for refactors, kept beside the tests whose micro recipe it runs (not collected by pytest):
bitwise reproducibility of training across a change: runs the micro recipe (the test suite's 64 -> 128 ->
256-token, 3-stage recipe on 60 stdlib files) under every parallel layout, and records each step's loss and
gradient norm, the validation losses and the SHA-256 of every checkpoint's weights. A refactor that does not
change the math gives the same record (STYLE rule 14).

    python -m tests.bitwise --out /tmp/before            # on the old tree
    python -m tests.bitwise --out /tmp/after             # on the new tree
    python -m tests.bitwise --compare /tmp/before /tmp/after

Layouts: one process; ring, ring with selective checkpointing and balance=docs (micro-batch 2), Ulysses,
UPipe (2 heads per stage) and FSDP2 on 2 gloo processes (cp=2 in stages 2 and 3); hybrid ring 2 x Ulysses
2 on 4 processes; streaming data on one process. About 2 minutes on 2 CPU cores. `--only tiny_recipe` runs
the README's main job instead (the real tiny recipe, about 3 minutes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CP2 = ["recipe.stages.s2_2k.cp=2", "recipe.stages.s3_4k.cp=2"]
LAYOUTS = {  # name -> (processes, overrides)
    "single": (1, []),
    "ring": (2, CP2),
    "ring_selective_docs": (2, CP2 + ["model.checkpoint_mode=selective", "parallel.balance=docs",
                                      "recipe.stages.s3_4k.micro_batch_size=2"]),
    "ulysses": (2, CP2 + ["parallel.cp_impl=ulysses"]),
    "upipe": (2, CP2 + ["parallel.cp_impl=upipe", "parallel.upipe_heads=2"]),
    "hybrid": (4, ["recipe.stages.s1_256.batch_tokens=1024", "recipe.stages.s2_2k.cp=4", "recipe.stages.s3_4k.cp=4",
                   "parallel.cp_impl=hybrid", "parallel.ulysses=2"]),
    "fsdp2": (2, CP2 + ["parallel.fsdp=true"]),
    "streaming": (1, ["data.streaming=true"]),
    # the README's main job: the real tiny recipe (256 -> 2K -> 4K, ring cp=2 with tiles and checkpointing), 3 min
    "tiny_recipe": (2, None),
}


def micro(root: Path, cache: Path) -> list[str]:
    from tests.conftest import micro_overrides

    return micro_overrides(root, cache)


def launch(n: int, args: list[str], log: Path) -> int:
    from tests.conftest import accelerate_launch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled"}
    head = accelerate_launch(n) if n > 1 else [sys.executable]
    with open(log, "w") as f:
        return subprocess.run([*head, "-m", "longstride.recipes.train", *args], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT).returncode


def record(root: Path) -> dict:
    """Per file: the metrics' (step, loss, grad_norm, val_loss) rows, or the weights' SHA-256."""
    out = {}
    for m in sorted(root.rglob("metrics.jsonl")):
        rows = [json.loads(line) for line in m.read_text().splitlines() if line.strip()]
        out[str(m.relative_to(root))] = [{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r}
                                         for r in rows]
    for f in sorted({*root.rglob("model.safetensors"), *root.rglob(".metadata")}):
        out[f"{f.parent.relative_to(root)}/weights"] = weights_digest(f.parent)
    return out


def weights_digest(directory: Path) -> str:
    """SHA-256 over a checkpoint's weights by name (the LM head tied to the embedding once), whatever the
    format: an HF directory's safetensors or a step checkpoint's DCP shards (the optimizer's left out)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if (directory / "model.safetensors").exists():
        weights = load_file(str(directory / "model.safetensors"))
    else:
        with tempfile.TemporaryDirectory() as d:
            dcp_to_torch_save(str(directory), f"{d}/all.pt")
            weights = {k.removeprefix("lm."): v for k, v in  # files this check's own runs wrote
                       torch.load(f"{d}/all.pt", weights_only=False)["model"].items()}
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    cache, summary = out / "cache", json.loads(path.read_text()) if path.exists() else {}
    for name in only:
        n, extra = LAYOUTS[name]
        args = micro(out / name, cache) + extra if extra is not None else [
            "recipe=tiny", "logger.wandb_mode=disabled", "logger.progress_bar=false", f"paths.output_root={out / name}",
            f"paths.cache_dir={cache}-tiny"]
        rc = launch(n, args, out / f"{name}.log")
        summary[name] = record(out / name) if rc == 0 else {"exit": rc}
        print(f"{name:22s} {n} process(es): exit {rc}, {len(summary[name])} files recorded", flush=True)
    path.write_text(json.dumps(summary, indent=1, sort_keys=True))
    failed = [name for name in only if not recorded(summary[name])]
    if failed:
        sys.exit(f"no complete record (a failed run, or no metrics or weights) for: {', '.join(failed)}; see their logs")


def recorded(layout: dict) -> bool:
    """Whether a layout's record holds what a comparison needs: it ran (no exit code), with metrics and weights."""
    return "exit" not in layout and any(f.endswith("metrics.jsonl") for f in layout) and \
        any(f.endswith("/weights") for f in layout)


def compare(a: Path, b: Path) -> bool:
    """Whether every layout's record is complete on both sides and the same; a run that failed on both sides (or
    recorded nothing) is FAILED, never identical."""
    x, y = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    same = True
    for name in sorted(set(x) | set(y)):
        xs, ys = x.get(name, {}), y.get(name, {})
        diff = sorted(f for f in set(xs) | set(ys) if xs.get(f) != ys.get(f))
        complete = name in x and name in y and recorded(xs) and recorded(ys)
        same &= not diff and complete
        print(f"{name:22s} " + ("FAILED: no complete record on both sides" if not complete else
                                "identical" if not diff else "DIFFERENT: " + ", ".join(diff)))
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for the runs and summary.json")
    ap.add_argument("--only", nargs="*", default=[k for k in LAYOUTS if k != "tiny_recipe"], choices=list(LAYOUTS),
                    help="layouts to run (default: all but tiny_recipe, the 3-minute README main job)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    if not args.out:
        ap.error("give --out DIR (or --compare BEFORE AFTER)")
    run(args.out, args.only)


if __name__ == "__main__":
    main()
