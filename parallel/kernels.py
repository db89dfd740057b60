"""Document-masked causal attention on one device, behind one small interface.

`doc_attention(q, k, v, layout, scale, kernel)` with q: (B, H, L, D), k/v: (B, Hkv, L, D) returns
(B, H, L, D). Each document attends causally to itself only. K/V keep their own (fewer) heads
until the kernel call. Kernels:
  flash_attn  flash-attn's varlen function (CUDA, when installed)
  sdpa        torch SDPA once per document (any device; CPU picks its flash kernel)
  math        explicit softmax per document, the reference
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def resolve_kernel(kernel: str, device_type: str) -> str:
    if kernel == "auto":
        return "flash_attn" if device_type == "cuda" and flash_attn_available() else "sdpa"
    if kernel == "flash_attn" and not flash_attn_available():
        raise ValueError("parallel.kernel=flash_attn but flash-attn is not installed with CUDA; "
                         "pip install 'longstride[gpu]' or use parallel.kernel=sdpa")
    return kernel


def doc_bounds(doc_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """doc_ids: (B, L) non-decreasing per row -> per row, (start, end) of each document."""
    out = []
    for row in doc_ids:
        change = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        edges = [0, *change.tolist(), row.numel()]
        out.append(list(zip(edges[:-1], edges[1:])))
    return out


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * groups, L, D), query head h reading K/V head h // groups
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def math_attention(q, k, v, scale, causal=True):
    # q: (B, H, Lq, D), k/v: (B, H, Lk, D); causal aligns the last query with the last key
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _flash_varlen(q, k, v, bounds, scale):
    from flash_attn import flash_attn_varlen_func

    B, H, L, D = q.shape
    lens = [e - s for row in bounds for s, e in row]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    pack = lambda x: x.transpose(1, 2).reshape(B * L, x.shape[1], D)  # noqa: E731  (total, heads, D)
    out = flash_attn_varlen_func(pack(q), pack(k), pack(v), cu, cu, max(lens), max(lens),
                                 softmax_scale=scale, causal=True)
    return out.reshape(B, L, H, D).transpose(1, 2)


def doc_attention(q, k, v, doc_ids, scale: float, kernel: str = "sdpa") -> torch.Tensor:
    """Causal attention within documents. doc_ids: (B, L), or None for plain causal attention."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    bounds = doc_bounds(doc_ids) if doc_ids is not None else [[(0, q.shape[2])]] * q.shape[0]
    if kernel == "flash_attn":
        return _flash_varlen(q, k, v, bounds, scale)
    groups = q.shape[1] // k.shape[1]
    rows = []
    for b, row in enumerate(bounds):
        kb, vb = expand_kv(k[b:b + 1], groups), expand_kv(v[b:b + 1], groups)
        parts = []
        for s, e in row:
            qs, ks, vs = q[b:b + 1, :, s:e], kb[:, :, s:e], vb[:, :, s:e]
            if kernel == "math":
                parts.append(math_attention(qs, ks, vs, scale))
            else:
                parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0)
