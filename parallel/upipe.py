"""The "upipe" context-parallel method (parallel/cp.py): Ulysses with the query heads in stages of U
(`parallel.upipe_heads`, default the Ulysses degree), so the attention stage holds U heads' worth of
full-sequence buffers instead of all of them. The stages run inside parallel/ulysses.py; their head
schedule is parallel/heads.py.
"""
from __future__ import annotations

from longstride.parallel.config import CPDegrees, check_ulysses, stage_heads
from longstride.parallel.ulysses import attention, shard  # noqa: F401  (the method's sharding and attention)


def degrees(cfg, cp: int, heads: int, where: str, world: int = 0) -> CPDegrees:
    check_ulysses(cp, cp, heads, where, within=world)
    if cfg.ulysses:
        raise ValueError(f"parallel.ulysses={cfg.ulysses} is read by cp_impl=hybrid (the Ulysses degree inside each "
                         "ring rank); cp_impl=upipe splits heads over all cp ranks: drop parallel.ulysses")
    return CPDegrees(1, cp, stage_heads(cfg.upipe_heads, cp, heads))
