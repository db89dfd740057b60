"""The key=value command line of the eval entry points: overrides merged into a dataclass schema
(a mistyped key fails naming it), and ValueErrors shown as one line with exit status 2."""
from __future__ import annotations

import sys
from typing import Callable

from omegaconf import OmegaConf

from model.build import check_checkpoint_dir


def parse_overrides(schema: type, argv: list[str], example: str):
    """argv (key=value ...) into an instance of `schema`, whose `checkpoint` must be an HF model dir."""
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_cli(argv)))
    except Exception as e:  # omegaconf's own errors name the key
        raise ValueError(f"bad argument: {e}".splitlines()[0]) from None
    if not cfg.checkpoint:
        raise ValueError(f"checkpoint=<dir> is required ({example})")
    check_checkpoint_dir(cfg.checkpoint, "checkpoint")
    return cfg


def run(name: str, main: Callable[[list[str]], object]) -> None:
    try:
        main(sys.argv[1:])
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)
