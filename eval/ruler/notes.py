"""A line for the user from the eval commands, said once: under a launcher (`eval compare` over several ranks,
torchrun) by the first rank only, the others computing the same thing."""
from __future__ import annotations

import os
import sys


def note(msg: str, who: str = "eval.ruler") -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{who}: {msg}", file=sys.stderr, flush=True)
