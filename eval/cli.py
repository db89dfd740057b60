"""The eval commands' checkpoint argument on top of longstride/overrides.py's key=value parsing."""
from __future__ import annotations

import os

from longstride.model.build import check_checkpoint_dir, check_checkpoint_weights
from longstride.overrides import parse, writable_dir


def parse_overrides(schema: type, argv: list[str], command: str, doc: str, example: str):
    """argv (key=value ...) into an instance of `schema`, whose `checkpoint` must be an HF model dir with readable
    weights, and whose results folder (`out`, or default_out) one can write to."""
    cfg = parse(schema, argv, command, doc)
    if not cfg.checkpoint:
        raise ValueError(f"checkpoint=<dir> is required ({example})")
    check_checkpoint_dir(cfg.checkpoint, "checkpoint")
    check_checkpoint_weights(cfg.checkpoint, "checkpoint")
    if hasattr(cfg, "out"):
        writable_dir(cfg.out or default_out(cfg.checkpoint))
    return cfg


def results_stem(command: str, yarn_factor, dtype="float32") -> str:
    """The name an eval command's files share: ruler / ppl, _yarnF with YaRN, _DTYPE when not float32 (beside, not
    over, a float32 run's files): ruler_yarn2_bfloat16.json. Scripts that read the files build the name here."""
    return (command + (f"_yarn{float(yarn_factor):g}" if yarn_factor else "")
            + ("" if str(dtype) == "float32" else f"_{dtype}"))


def default_out(checkpoint: str) -> str:
    """Where results go without out=: outputs/eval/<checkpoint path, '/' as '-'> (the path relative to
    the working directory without a leading outputs/, or its last three parts), never inside the
    checkpoint, which may be uploaded as it is."""
    path = os.path.abspath(checkpoint)
    real = os.path.realpath(path)  # a checkpoint reached through a link is still the folder the cwd is in
    if os.path.commonpath([real, os.path.realpath(os.getcwd())]) == real:
        raise ValueError(f"out: the working directory is inside checkpoint={checkpoint!r}, so the default out "
                         "(outputs/eval/...) would write into the checkpoint; give out=DIR, or run from outside it")
    rel = os.path.relpath(path)
    parts = rel.split(os.sep) if not rel.startswith("..") else path.split(os.sep)[-3:]
    if len(parts) > 1 and parts[0] == "outputs":
        parts = parts[1:]
    return os.path.join("outputs", "eval", "-".join(p for p in parts if p))
