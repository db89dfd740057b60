"""Document-masked causal attention on one device, behind one small interface.

`doc_attention(q, k, v, layout, scale, kernel)` with q: (B, H, L, D), k/v: (B, Hkv, L, D) returns
(B, H, L, D). Each document attends causally to itself only. K/V keep their own (fewer) heads
until the kernel call. Kernels:
  flash_attn  flash-attn's varlen function (CUDA, when installed)
  sdpa        on CPU, the CPU flash op once per document inside one autograd Function that saves only
              q, k, v, out and lse (K/V with their own heads); on other devices torch SDPA per document
  math        explicit softmax per document, the reference
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from longstride.parallel.blocks import doc_segments


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def resolve_kernel(kernel: str, device_type: str, ring: bool = False) -> str:
    """The kernel a stage runs. ring: the stage uses ring attention, whose "sdpa" blocks are the CPU
    flash op; on CUDA the ring runs on flash-attn, or on the math kernel when asked for."""
    if kernel == "flash_attn" and not flash_attn_available():
        raise ValueError("parallel.kernel=flash_attn but flash-attn is not installed with CUDA; "
                         "pip install 'longstride[gpu]' or use parallel.kernel=sdpa")
    if kernel == "auto":
        kernel = "flash_attn" if device_type == "cuda" and flash_attn_available() else "sdpa"
        if ring and device_type == "cuda" and kernel == "sdpa":
            kernel = "math"
    if ring and device_type == "cuda" and kernel == "sdpa":
        raise ValueError("parallel.kernel=sdpa: ring attention's sdpa blocks are the CPU flash op; on CUDA "
                         "install flash-attn (pip install 'longstride[gpu]') or use parallel.kernel=math")
    return kernel


def doc_bounds(doc_ids: torch.Tensor) -> list[tuple]:
    """doc_ids: (B, L) document runs per row -> per row, (start, end) of each document."""
    return [doc_segments(row, 0, row.shape[0]) for row in doc_ids.cpu().numpy()]


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * groups, L, D), query head h reading K/V head h // groups
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def seq_major(like: torch.Tensor, dtype=None, alloc=torch.empty) -> torch.Tensor:
    """A new tensor shaped like `like` (B, H, L, D) over a (B, L, H, D) buffer: the layout of transformers'
    q/k/v and of what its o-projection reads, so transposing back costs no copy."""
    B, H, L, D = like.shape
    return alloc(B, L, H, D, dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def dense_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is dense, which is all the CPU flash op and the block kernels need
    (transformers' transposed q/k/v are); a contiguous copy otherwise."""
    return x if x.stride(-1) == 1 else x.contiguous()


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
    """Causal attention within documents. doc_ids: (B, L), or None for plain causal attention.
    q: (B, H, L, D), k/v: (B, Hkv, L, D) -> (B, H, L, D), laid out in memory as (B, L, H, D), the layout
    transformers' o-projection reads, so the transpose back is free."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    bounds = doc_bounds(doc_ids) if doc_ids is not None else [[(0, q.shape[2])]] * q.shape[0]
    if kernel == "flash_attn":
        return _flash_varlen(q, k, v, bounds, scale)
    if kernel == "sdpa" and q.device.type != "cpu":  # the block kernels' sdpa is the CPU flash op
        return _sdpa_per_document(q, k, v, bounds, scale)
    return _DocAttention.apply(q, k, v, tuple(map(tuple, bounds)), kernel, scale)


def _sdpa_per_document(q, k, v, bounds, scale):
    rows = []
    for b, row in enumerate(bounds):
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
                 for s, e in row]
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]).transpose(1, 2)


def doc_attention_forward(q, k, v, bounds, kernel: str, scale: float):
    """(out, lse): each document of each row through the block kernel, written in place, so that no
    concatenation copy, no K/V expansion and no transpose copy exists. out: (B, H, L, D) over a
    (B, L, H, D) buffer; lse: (B, H, L) fp32."""
    B, H, L, D = q.shape
    fwd = _DENSE[kernel][0]
    if B == 1 and len(bounds[0]) == 1:  # one document: the kernel's own output, no copy
        return fwd(q, k, v, scale, True)
    out = seq_major(q)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    for b, row in enumerate(bounds):
        for s, e in row:
            o, l = fwd(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], scale, True)
            out[b:b + 1, :, s:e] = o
            lse[b:b + 1, :, s:e] = l
    return out, lse


def doc_attention_backward(dout, q, k, v, out, lse, bounds, kernel: str, scale: float):
    """(dq, dk, dv), each in its input's layout, one document at a time."""
    bwd = _DENSE[kernel][1]
    if q.shape[0] == 1 and len(bounds[0]) == 1:
        return bwd(dout, q, k, v, out, lse, scale, True)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))  # empty_like keeps the (B, L, H, D) strides
    for b, row in enumerate(bounds):
        for s, e in row:
            r = (slice(b, b + 1), slice(None), slice(s, e))
            gq, gk, gv = bwd(dout[r], q[r], k[r], v[r], out[r], lse[r], scale, True)
            dq[r], dk[r], dv[r] = gq, gk, gv
    return dq, dk, dv


class _DocAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, kernel, scale):
        out, lse = doc_attention_forward(q, k, v, bounds, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (bounds, kernel, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = doc_attention_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None


# ---- Block kernels: one (query block, key block) piece of ring attention, with its log-sum-exp ----
#
# block_forward(kernel, q, k, v, scale, segments) -> (out, lse)
# block_backward(kernel, dout, q, k, v, out, lse, scale, segments) -> (dq, dk, dv)
# q: (B, H, Lq, D), k/v: (B, Hkv, Lk, D) with their own heads (GQA is resolved inside the kernel),
# lse: (B, H, Lq) fp32. segments=None: a dense rectangle, every query sees every key. segments=[(s, e), ...]:
# the block is square and each segment attends causally within itself (varlen-causal). The backward
# takes the *merged* output and log-sum-exp of all blocks, which makes each block's gradient exact.

def _cpu_flash_fwd(q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_bwd(dout, q, k, v, out, lse, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dense_last(dout), q, k, v, dense_last(out), lse.contiguous(), 0.0, causal, scale=scale)


def _math_scores(q, k, scale, causal):
    ct = torch.promote_types(q.dtype, torch.float32)
    k = expand_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_fwd(q, k, v, scale, causal):
    s = _math_scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), expand_kv(v, q.shape[1] // v.shape[1]).to(s.dtype))
    return out.to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, scale, causal):
    # P = exp(S - lse) with the merged lse; dS = P * (dO V^T - rowsum(dO * O)) (FlashAttention-2, Alg. 2)
    groups = q.shape[1] // k.shape[1]
    s = _math_scores(q, k, scale, causal)
    ct = s.dtype
    p = torch.exp(s - lse.to(ct).unsqueeze(-1))
    do = dout.to(ct)
    ve, ke = expand_kv(v, groups).to(ct), expand_kv(k, groups).to(ct)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - (do * out.to(ct)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(ct)) * scale
    if groups > 1:
        B, H, L, D = dk.shape
        dk, dv = (x.view(B, H // groups, groups, L, D).sum(2) for x in (dk, dv))
    return dq, dk, dv


def _flash_call(fn, **kw):
    # flash-attn's private varlen functions changed their arguments across 2.x releases; pass only what
    # this release takes (window_size as a pair in <= 2.6, as two ints later).
    import inspect

    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kw["window_size"] = (-1, -1)
    else:
        kw.update(window_size_left=-1, window_size_right=-1)
    return fn(**{k: v for k, v in kw.items() if k in params})


def _flash_block(q, k, v, segments):
    # (1, H, L, D) -> (L, H, D) and cu_seqlens for flash-attn's varlen layout
    lq, lk = q.shape[2], k.shape[2]
    if segments is None:
        cu_q, cu_k, mq, mk = [0, lq], [0, lk], lq, lk
    else:
        cu_q = [0, *[e for _, e in segments]]
        cu_k, mq = cu_q, max(e - s for s, e in segments)
        mk = mq
    cu = lambda c: torch.tensor(c, dtype=torch.int32, device=q.device)  # noqa: E731
    flat = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731
    return flat(q), flat(k), flat(v), cu(cu_q), cu(cu_k), mq, mk


def _flash_fwd(q, k, v, scale, segments):
    from flash_attn import flash_attn_interface as fa

    outs, lses = [], []
    for b in range(q.shape[0]):
        fq, fk, fv, cq, ck, mq, mk = _flash_block(q[b:b + 1], k[b:b + 1], v[b:b + 1], segments)
        res = _flash_call(fa._flash_attn_varlen_forward, q=fq, k=fk, v=fv, cu_seqlens_q=cq, cu_seqlens_k=ck,
                          max_seqlen_q=mq, max_seqlen_k=mk, dropout_p=0.0, softmax_scale=scale,
                          causal=segments is not None, softcap=0.0, alibi_slopes=None, return_softmax=False)
        outs.append(res[0].transpose(0, 1))  # (H, L, D)
        lses.append(res[1].reshape(q.shape[1], -1)[:, :q.shape[2]].float())  # (H, L)
    return torch.stack(outs), torch.stack(lses)


def _flash_bwd(dout, q, k, v, out, lse, scale, segments):
    from flash_attn import flash_attn_interface as fa

    grads = []
    for b in range(q.shape[0]):
        fq, fk, fv, cq, ck, mq, mk = _flash_block(q[b:b + 1], k[b:b + 1], v[b:b + 1], segments)
        fdo, fo = dout[b].transpose(0, 1).contiguous(), out[b].transpose(0, 1).contiguous()
        dq, dk, dv = torch.empty_like(fq), torch.empty_like(fk), torch.empty_like(fv)
        _flash_call(fa._flash_attn_varlen_backward, dout=fdo, q=fq, k=fk, v=fv, out=fo,
                    softmax_lse=lse[b].contiguous(), dq=dq, dk=dk, dv=dv, cu_seqlens_q=cq, cu_seqlens_k=ck,
                    max_seqlen_q=mq, max_seqlen_k=mk, dropout_p=0.0, softmax_scale=scale,
                    causal=segments is not None, softcap=0.0, alibi_slopes=None, deterministic=False,
                    rng_state=None)
        grads.append([x.transpose(0, 1) for x in (dq, dk, dv)])
    return tuple(torch.stack(g) for g in zip(*grads))


_DENSE = {"sdpa": (_cpu_flash_fwd, _cpu_flash_bwd), "math": (_math_fwd, _math_bwd)}


def block_forward(kernel: str, q, k, v, scale: float, segments=None):
    if kernel == "flash_attn":
        return _flash_fwd(q, k, v, scale, segments)
    fwd = _DENSE[kernel][0]
    if segments is None:
        return fwd(q, k, v, scale, False)
    parts = [fwd(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale, True) for s, e in segments]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)


def block_backward(kernel: str, dout, q, k, v, out, lse, scale: float, segments=None):
    if kernel == "flash_attn":
        return _flash_bwd(dout, q, k, v, out, lse, scale, segments)
    bwd = _DENSE[kernel][1]
    if segments is None:
        return bwd(dout, q, k, v, out, lse, scale, False)
    parts = [bwd(dout[:, :, s:e], q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], out[:, :, s:e], lse[:, :, s:e],
                 scale, True) for s, e in segments]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(g, dim=2) for g in zip(*parts))
