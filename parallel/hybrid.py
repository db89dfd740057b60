"""The "hybrid" context-parallel method (parallel/cp.py): Ulysses groups of `parallel.ulysses` ranks inside
each rank of a ring, cp = ring x ulysses; the all-to-all stays inside a node while the ring crosses nodes.
With `parallel.upipe_heads` the heads go in UPipe stages. Attention is Ulysses over the ring-local
sequence, with the ring underneath (parallel/ulysses.py).
"""
from __future__ import annotations

from longstride.parallel import ring, ulysses
from longstride.parallel.config import CPDegrees, check_ulysses, divisors, stage_heads
from longstride.parallel.pattern import CAUSAL, Pattern
from longstride.parallel.ulysses import shard  # noqa: F401  (the method's sharding: ring share, then Ulysses piece)


def degrees(cfg, cp: int, heads: int, where: str, world: int = 0) -> CPDegrees:
    u = cfg.ulysses
    if u < 1 or cp % u:
        raise ValueError(f"parallel.ulysses={u}: hybrid needs a Ulysses degree that divides {where}={cp} "
                         f"(ring degree = cp / ulysses) and the model's {heads} query heads; set parallel.ulysses to "
                         f"one of {[d for d in divisors(cp) if heads % d == 0]}")
    check_ulysses(u, cp, heads, where, within=cp)
    if u == 1 and cfg.upipe_heads:
        raise ValueError(f"parallel.upipe_heads={cfg.upipe_heads} splits a Ulysses group's heads into stages, and "
                         f"parallel.ulysses=1 makes no group ({where}={cp} is all ring); drop parallel.upipe_heads or "
                         f"set parallel.ulysses to one of {[d for d in divisors(cp) if d > 1]}")
    return CPDegrees(cp // u, u, stage_heads(cfg.upipe_heads, u, heads) if cfg.upipe_heads else 0)


def attention(q, k, v, layout, scale: float, pattern: Pattern = CAUSAL, sinks=None):
    """Ulysses over the ring-local sequence; with parallel.ulysses=1 (no Ulysses group) the plain ring."""
    impl = ring.attention if layout.cp.head_comm is None else ulysses.attention
    return impl(q, k, v, layout, scale, pattern=pattern, sinks=sinks)
