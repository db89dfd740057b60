"""The dense block kernels: one (query block, key block) piece of attention, with its log-sum-exp, on (B, H, Lq, D)
queries and (B, Hkv, Lk, D) keys/values with their own heads (GQA is resolved inside).

    DENSE[kernel] = (fwd, bwd)
    fwd(q, k, v, scale, causal, window=None, softcap=None) -> (out, lse fp32)
    bwd(dout, q, k, v, out, lse, scale, causal, window=None, softcap=None) -> (dq, dk, dv)

causal: causal within the block (queries aligned at the keys' end when there are more keys: the queries are the
keys' suffix), within the window when there is one; else dense, every query sees every key. The backward takes
the *merged* output and log-sum-exp of all the blocks a query sees, which makes each block's gradient exact.
  sdpa  the CPU flash op (aten._scaled_dot_product_flash_attention_for_cpu), which takes no soft-cap
  math  explicit softmax, the reference, with Gemma 2's soft-cap; it holds its scores, so it runs in tiles of
        BAND_TILE query rows
parallel/kernels.py runs them per document, per ring block, and through the varlen contract (varlen.emulate).
"""
from __future__ import annotations

from functools import wraps
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from longstride.parallel.varlen import dense_last, refuse_softcap


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * groups, L, D), query head h reading K/V head h // groups
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def seq_major(like: torch.Tensor, dtype=None, alloc=torch.empty) -> torch.Tensor:
    """A new tensor shaped like `like` (B, H, L, D) over a (B, L, H, D) buffer: the layout of transformers'
    q/k/v and of what its o-projection reads, so transposing back costs no copy."""
    B, H, L, D = like.shape
    return alloc(B, L, H, D, dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def _cpu_flash_fwd(q, k, v, scale, causal, mask=None, softcap=None):
    refuse_softcap(softcap, "sdpa")
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def _cpu_flash_bwd(dout, q, k, v, out, lse, scale, causal, mask=None, softcap=None):
    refuse_softcap(softcap, "sdpa")
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dense_last(dout), q, k, v, dense_last(out), lse.contiguous(), dropout_p=0.0, is_causal=causal, attn_mask=mask,
        scale=scale)


def _outside_autocast(kernel):
    """The math kernel runs inside the attention op, where autocast still reaches: it would run the fp32 score
    matmuls in bf16 (a log-sum-exp off by 3e-2 instead of 5e-7). Switched off around the kernel."""
    @wraps(kernel)
    def run(first, *args, **kwargs):
        if not torch.is_autocast_enabled(first.device.type):
            return kernel(first, *args, **kwargs)
        with torch.autocast(first.device.type, enabled=False):
            return kernel(first, *args, **kwargs)
    return run


def _math_scores(q, k, scale, causal, mask=None, softcap=None, slope=False):
    """(scores, their derivative through the soft-cap or None): scale * q k^T, soft-capped to
    softcap * tanh(x / softcap) when softcap is set (Gemma 2), then masked; in place on one tensor, the tile's
    largest, with a second for the derivative only when `slope` asks for it (the backward)."""
    ct = torch.promote_types(q.dtype, torch.float32)
    k = expand_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)).mul_(scale)
    d = None
    if softcap:
        s.div_(softcap).tanh_()
        d = s.square().neg_().add_(1) if slope else None  # 1 - tanh^2, finite where the mask puts -inf
        s.mul_(softcap)
    if causal:
        s.masked_fill_(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return (s if mask is None else s.add_(mask)), d


@_outside_autocast
def _math_fwd(q, k, v, scale, causal, mask=None, softcap=None):
    s, _ = _math_scores(q, k, scale, causal, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    out = torch.matmul(p, expand_kv(v, q.shape[1] // v.shape[1]).to(s.dtype))
    return out.to(q.dtype), lse


@_outside_autocast
def _math_bwd(dout, q, k, v, out, lse, scale, causal, mask=None, softcap=None):
    # P = exp(S - lse) with the merged lse; dS = P * (dO V^T - rowsum(dO * O)) (FlashAttention-2, Alg. 2),
    # times the soft-cap's slope when there is one; P, dS and the slope are the only score-sized tensors
    groups = q.shape[1] // k.shape[1]
    s, slope = _math_scores(q, k, scale, causal, mask, softcap, slope=True)
    ct = s.dtype
    p = s.sub_(lse.to(ct).unsqueeze(-1)).exp_()
    do = dout.to(ct)
    ve, ke = expand_kv(v, groups).to(ct), expand_kv(k, groups).to(ct)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = torch.matmul(do, ve.transpose(-1, -2)).sub_((do * out.to(ct)).sum(-1, keepdim=True)).mul_(p)
    del p, s
    if slope is not None:
        ds.mul_(slope)
        del slope
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(ct)) * scale
    if groups > 1:
        B, H, L, D = dk.shape
        dk, dv = (x.view(B, H // groups, groups, L, D).sum(2) for x in (dk, dv))
    return dq, dk, dv


# A sliding window on a dense kernel: query tiles of BAND_TILE rows, each against the keys its window reaches,
# under an additive mask of that tile's size (never the whole band). Queries are aligned at the keys' end
# (they are the keys' suffix), each sees key j when 0 <= d < window, d its distance back; every query sees
# itself, so no row of a tile is empty. The math kernel, which holds its scores, runs every block of more than
# BAND_TILE queries so (a causal block as a window of all its keys, a dense one against all keys without a mask):
# its memory grows with the block's length, not its square.
BAND_TILE = 256


def _tile_ranges(lq: int, lk: int, window: Optional[int]) -> list[tuple]:
    """(i0, i1, k0, k1) per tile: its queries and the keys they see; window None: dense, all keys."""
    off, out = lk - lq, []
    for i0 in range(0, lq, BAND_TILE):
        i1 = min(lq, i0 + BAND_TILE)
        out.append((i0, i1, 0, lk) if window is None else (i0, i1, max(0, off + i0 - window + 1), off + i1))
    return out


def _band_tiles(q, k, window: Optional[int]):
    """(query rows, key range, additive mask or None) per tile; window None: dense, every query sees every key.
    On fake tensors (a traced step, recipes/memory/trace.py) only the largest tile runs: each holds what the others
    hold, and tracing every tile of a long sequence took seconds a layer."""
    lq, lk, dtype, device = q.shape[2], k.shape[2], q.dtype, q.device
    off, ranges = lk - lq, _tile_ranges(lq, lk, window)
    if is_fake(q):
        ranges = [max(ranges, key=lambda r: (r[1] - r[0]) * (r[3] - r[2]))]
    for i0, i1, k0, k1 in ranges:
        if window is None:
            yield slice(i0, i1), slice(0, lk), None
            continue
        d = torch.arange(off + i0, off + i1, device=device)[:, None] - torch.arange(k0, k1, device=device)[None]
        mask = torch.zeros(d.shape, dtype=dtype, device=device).masked_fill_((d < 0) | (d >= window), float("-inf"))
        del d  # int64, larger than the mask itself: not kept while the tile runs
        yield slice(i0, i1), slice(k0, k1), mask


def _plain(q, k, window) -> bool:
    # square and the window (if any) reaches every key: the kernel's own causal mask is the whole pattern
    return q.shape[2] == k.shape[2] and (window is None or window >= k.shape[2])


def _whole(q, k, causal: bool, window, tile_all: bool) -> bool:
    # one kernel call for the block: nothing to band, and either a kernel that tiles itself or a block of one tile
    return (not causal or _plain(q, k, window)) and not (tile_all and q.shape[2] > BAND_TILE)


def _tile_window(k, causal: bool, window):
    return (window or k.shape[2]) if causal else None


def _banded_fwd(fwd, tile_all: bool = False):
    """tile_all: query tiles for every block longer than one (the math kernel), not only windowed ones."""
    def run(q, k, v, scale, causal, window=None, softcap=None):
        if _whole(q, k, causal, window, tile_all):
            return fwd(q, k, v, scale, causal, softcap=softcap)
        out, lse = seq_major(q), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
        for rq, rk, mask in _band_tiles(q, k, _tile_window(k, causal, window)):
            out[:, :, rq], lse[:, :, rq] = fwd(q[:, :, rq], k[:, :, rk], v[:, :, rk], scale, False, mask, softcap)
        return out, lse
    return run


def _banded_bwd(bwd, tile_all: bool = False):
    def run(dout, q, k, v, out, lse, scale, causal, window=None, softcap=None):
        if _whole(q, k, causal, window, tile_all):
            return bwd(dout, q, k, v, out, lse, scale=scale, causal=causal, softcap=softcap)
        # fp32 (fp64 stays fp64) as one kernel call gives them; the callers cast or accumulate
        dq = torch.empty_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        dk, dv = (torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
                  for x in (k, v))
        for rq, rk, mask in _band_tiles(q, k, _tile_window(k, causal, window)):
            gq, gk, gv = bwd(dout[:, :, rq], q[:, :, rq], k[:, :, rk], v[:, :, rk], out[:, :, rq], lse[:, :, rq],
                             scale=scale, causal=False, mask=mask, softcap=softcap)
            dq[:, :, rq] = gq
            dk[:, :, rk] += gk
            dv[:, :, rk] += gv
            del gq, gk, gv  # not held while the next tile runs
        return dq, dk, dv
    return run


# fwd(q, k, v, scale, causal, window=None, softcap=None) -> (out, lse);
# bwd(dout, q, k, v, out, lse, scale, causal, window=None, softcap=None)
DENSE = {"sdpa": (_banded_fwd(_cpu_flash_fwd), _banded_bwd(_cpu_flash_bwd)),
          "math": (_banded_fwd(_math_fwd, tile_all=True), _banded_bwd(_math_bwd, tile_all=True))}
