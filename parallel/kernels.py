"""Document-masked causal attention on one device, and the block kernels of ring attention, behind one
small interface.

`doc_attention(q, k, v, doc_ids, scale, kernel)` with q: (B, H, L, D), k/v: (B, Hkv, L, D) returns
(B, H, L, D). Each document attends causally to itself only, within the layer's sliding window or chunk and
with its sinks when it has them (parallel/pattern.py). K/V keep their own (fewer) heads until the kernel call.
Kernels (`parallel.kernel`):
  torch_flash  torch's own flash attention for varlen batches (CUDA, fp16/bf16; parallel/varlen.py): every
               document of every row in one call, and one call per ring step
  flash_attn   the flash-attn package through the same varlen calls (CUDA, when installed)
  sdpa         on CPU, the CPU flash op once per document inside one autograd Function that saves only
               q, k, v, out and lse (K/V with their own heads); on other devices torch SDPA per document
  math         explicit softmax per document, the reference; in tiles of BAND_TILE query rows, so that it holds
               the scores of one tile at a time; with flash_attn the kernels that soft-cap scores (Gemma 2)
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from longstride.parallel.attention_call import CallAttention
from longstride.parallel.blocks import RingPlan, doc_segments
from longstride.parallel.dense import DENSE, expand_kv, seq_major
from longstride.parallel.flash_contract import flash_head_dim
from longstride.parallel.pattern import CAUSAL, Pattern, chunk_bounds, fold_sinks
from longstride.parallel.varlen import (VARLEN, Varlen, VarlenCall, as_block, emulate,
                                        flash_attn_available, flash_attn_softcap_problem, torch_flash_available)

_AVAILABLE = {"torch_flash": torch_flash_available, "flash_attn": flash_attn_available}
FLASH_KERNELS = tuple(_AVAILABLE)  # bf16/fp16 only
SOFTCAP_KERNELS = ("math", "flash_attn")  # the kernels that soft-cap attention scores (Gemma 2)
_INSTALL = {"torch_flash": "install a CUDA build of torch (pip install torch --index-url "
                           "https://download.pytorch.org/whl/cu128, or the build for your CUDA)",
            "flash_attn": "pip install 'longstride[gpu]' (flash-attn, built for your torch and CUDA)"}


def resolve_kernel(kernel: str, device_type: str, ring: bool = False, half: bool = True,
                   assume_available: bool = False, head_dim: int = 0, softcap: bool = False) -> str:
    """The kernel a stage runs. ring: the stage uses ring attention (whose "sdpa" blocks are the CPU flash
    op); half: attention runs in bf16/fp16 (the flash kernels take nothing else); head_dim: the model's head
    size when known (0: not checked); softcap: the model soft-caps its attention scores (Gemma 2), which only
    math and flash_attn (>= 2.6.2, not ROCm) compute. auto: torch_flash on CUDA in bf16/fp16 for heads the flash
    kernels take; otherwise, on CUDA, sdpa on one device and math in a ring; sdpa on CPU. With softcap, auto is
    flash_attn where it would run, else math.
    assume_available: as on a GPU machine with the kernels installed (planning for one from here)."""
    available = {k: (lambda: True) if assume_available else f for k, f in _AVAILABLE.items()}
    flash_heads = not head_dim or flash_head_dim(head_dim)
    if kernel in _AVAILABLE:
        if device_type != "cuda" or not available[kernel]():
            raise ValueError(f"parallel.kernel={kernel} needs CUDA and {kernel}; {_INSTALL[kernel]}, or use "
                             "parallel.kernel=auto (sdpa on CPU)")
        if not half:
            raise ValueError(f"parallel.kernel={kernel} runs bf16/fp16 attention but this run is fp32; set "
                             "train.precision=bf16 (or auto) or use parallel.kernel=math")
        if not flash_heads:
            raise ValueError(f"parallel.kernel={kernel}: the model's head size {head_dim} is not one the flash "
                             "kernels take (multiples of 8 up to 256); use parallel.kernel=auto or math")
    if softcap and kernel not in ("auto", *SOFTCAP_KERNELS):
        raise ValueError(f"parallel.kernel={kernel} has no logit soft-capping, which the model's attention applies "
                         "(config.attn_logit_softcapping); use parallel.kernel=auto (math, or flash_attn on CUDA "
                         "when installed) or math")
    capping = (lambda: True) if assume_available else (lambda: flash_attn_softcap_problem() is None)
    if kernel == "auto" and softcap:
        flash = device_type == "cuda" and half and flash_heads and available["flash_attn"]() and capping()
        return "flash_attn" if flash else "math"
    if kernel == "flash_attn" and softcap and not capping():
        raise ValueError(f"parallel.kernel=flash_attn with soft-capped scores: {flash_attn_softcap_problem()}; use "
                         "parallel.kernel=auto or math")
    if kernel == "auto":
        if device_type == "cuda" and half and flash_heads and available["torch_flash"]():
            return "torch_flash"
        return "math" if device_type == "cuda" and ring else "sdpa"
    if ring and device_type == "cuda" and kernel == "sdpa":
        raise ValueError("parallel.kernel=sdpa: ring attention's sdpa blocks are the CPU flash op; on CUDA "
                         "use parallel.kernel=torch_flash (bf16) or math")
    return kernel


def activate_flash_impl(impl: str) -> None:
    """parallel.flash_impl: FA2 is the flash attention built into torch; FA3 / FA4 replace it behind the same
    aten ops (torch.nn.attention.activate_flash_attention_impl; the FA3 / FA4 package must be installed)."""
    if impl == "FA2":
        return
    import torch.nn.attention as attn

    if not hasattr(attn, "activate_flash_attention_impl"):
        raise ValueError(f"parallel.flash_impl={impl} needs torch >= 2.10 (this is {torch.__version__}); use FA2")
    try:
        attn.activate_flash_attention_impl(impl)
    except (ImportError, RuntimeError, ValueError) as e:
        raise ValueError(f"parallel.flash_impl={impl} could not be activated ({e}); install its package or use "
                         f"FA2; torch lists {attn.list_flash_attention_impls()}") from e


def doc_bounds(doc_ids: torch.Tensor) -> list[tuple]:
    """doc_ids: (B, L) document runs per row -> per row, (start, end) of each document."""
    return [doc_segments(row, 0, row.shape[0]) for row in doc_ids.cpu().numpy()]


def doc_attention(q, k, v, doc_ids, scale: float, kernel: str = "sdpa", bounds=None, pattern: Pattern = CAUSAL,
                  sinks=None) -> torch.Tensor:
    """Causal attention within documents. doc_ids: (B, L), or None for plain causal attention; bounds: their
    doc_bounds when the caller has them already (parallel/cp.DocLayout keeps them per batch); pattern: the
    layer's window or chunk; sinks: (H,) sink logits or None.
    q: (B, H, L, D), k/v: (B, Hkv, L, D) -> (B, H, L, D), laid out in memory as (B, L, H, D), the layout
    transformers' o-projection reads, so the transpose back is free."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if bounds is None:
        bounds = doc_bounds(doc_ids) if doc_ids is not None else [[(0, q.shape[2])]] * q.shape[0]
    pattern = pattern.within(q.shape[2])
    bounds = chunk_bounds(bounds, pattern.chunk)
    if kernel == "sdpa" and q.device.type != "cpu" and not pattern.softcap:  # the block kernels' sdpa: the CPU op
        if pattern.window is None and sinks is None:
            return _sdpa_per_document(q, k, v, bounds, scale)
        kernel = "math"  # SDPA has no window-with-documents or sink form: the exact explicit path
    return CallAttention.apply(q, k, v, sinks, _DocCall(tuple(map(tuple, bounds)), kernel, scale, pattern.window,
                                                        pattern.softcap))


def _sdpa_per_document(q, k, v, bounds, scale):
    # K/V repeated to the query heads: with enable_gqa, SDPA in fp32 on CUDA has no fused kernel (flash takes
    # no fp32, the memory-efficient one no GQA) and falls back to math, an L x L matrix per head
    k, v = (expand_kv(x, q.shape[1] // k.shape[1]) for x in (k, v))
    rows = []
    for b, row in enumerate(bounds):
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                is_causal=True, scale=scale).transpose(1, 2)
                 for s, e in row]
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]).transpose(1, 2)


def doc_attention_forward(q, k, v, bounds, kernel: str, scale: float, window=None, softcap=None):
    """(out, lse): each document of each row through the block kernel, written in place, so that no
    concatenation copy, no K/V expansion and no transpose copy exists. out: (B, H, L, D) over a
    (B, L, H, D) buffer; lse: (B, H, L) fp32. window: a sliding window, or None; softcap: the scores'
    soft-cap, or None."""
    B, H, L, D = q.shape
    if kernel in VARLEN:  # every document of every row in one call
        out, lse = _doc_call(bounds, L, window).forward(VARLEN[kernel], q, k, v, scale, softcap)
        return out.view(B, L, H, D).transpose(1, 2), lse.view(H, B, L).transpose(0, 1)
    fwd = DENSE[kernel][0]
    if B == 1 and len(bounds[0]) == 1:  # one document: the kernel's own output, no copy
        return fwd(q, k, v, scale, True, window, softcap)
    out = seq_major(q)
    lse = torch.empty(B, H, L, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)  # fp64 stays fp64
    for b, row in enumerate(bounds):
        for s, e in row:
            o, l = fwd(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], scale, True, window, softcap)
            out[b:b + 1, :, s:e] = o
            lse[b:b + 1, :, s:e] = l
    return out, lse


def doc_attention_backward(dout, q, k, v, out, lse, bounds, kernel: str, scale: float, window=None, softcap=None):
    """(dq, dk, dv), each in its input's layout, one document at a time (one call for a varlen kernel)."""
    if kernel in VARLEN:
        B, _, L, D = q.shape
        grads = _doc_call(bounds, L, window).backward(VARLEN[kernel], dout, q, k, v, out=out, lse=lse, scale=scale,
                                                      softcap=softcap)
        return tuple(g.view(B, L, g.shape[1], D).transpose(1, 2) for g in grads)
    bwd = DENSE[kernel][1]
    if q.shape[0] == 1 and len(bounds[0]) == 1:
        return bwd(dout, q, k, v, out, lse, scale=scale, causal=True, window=window, softcap=softcap)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))  # empty_like keeps the (B, L, H, D) strides
    for b, row in enumerate(bounds):
        for s, e in row:
            r = (slice(b, b + 1), slice(None), slice(s, e))
            gq, gk, gv = bwd(dout[r], q[r], k[r], v[r], out[r], lse[r], scale=scale, causal=True, window=window,
                             softcap=softcap)
            dq[r], dk[r], dv[r] = gq, gk, gv
    return dq, dk, dv


def _doc_call(bounds, length: int, window=None) -> VarlenCall:
    return _cached_doc_call(tuple(map(tuple, bounds)), length, window)


@lru_cache(maxsize=8)
def _cached_doc_call(bounds: tuple, length: int, window) -> VarlenCall:
    # the batch's documents are the same in every layer's forward and backward: one VarlenCall per batch (and
    # window: a model's local and global layers alternate)
    return VarlenCall([(b, s, e, s, e) for b, row in enumerate(bounds) for s, e in row], length, causal=True,
                      window=window)


class _DocCall(NamedTuple):
    bounds: tuple  # per row, (start, end) of each document (or document chunk) run
    kernel: str
    scale: float
    window: Optional[int]
    softcap: Optional[float] = None

    def forward(self, q, k, v, sinks=None):
        out, lse = doc_attention_forward(q, k, v, self.bounds, kernel=self.kernel, scale=self.scale,
                                         window=self.window, softcap=self.softcap)
        return fold_sinks(out, lse, sinks)

    def backward(self, dout, q, k, v, out, lse):
        return doc_attention_backward(dout, q, k, v, out, lse, bounds=self.bounds, kernel=self.kernel,
                                      scale=self.scale, window=self.window, softcap=self.softcap)


# ---- Block kernels (parallel/dense.py): one (query block, key block) piece of ring attention ----
#
# block_forward(kernel, q, k, v, scale, segments) -> (out, lse)
# block_backward(kernel, dout, q, k, v, out, lse, scale, segments) -> (dq, dk, dv)
# q: (B, H, Lq, D), k/v: (B, Hkv, Lk, D) with their own heads (GQA is resolved inside the kernel),
# lse: (B, H, Lq) fp32. segments=None: a dense rectangle, every query sees every key. segments=[(s, e), ...]:
# the block is square and each segment attends causally within itself (varlen-causal). The backward
# takes the *merged* output and log-sum-exp of all blocks, which makes each block's gradient exact.

def varlen_kernel(kernel: str) -> Varlen:
    """The varlen form of any kernel: the CUDA kernels themselves, the dense ones one piece at a time."""
    return VARLEN[kernel] if kernel in VARLEN else _DENSE_VARLEN[kernel]


_DENSE_VARLEN = {name: emulate(*pair) for name, pair in DENSE.items()}


def block_forward(kernel: str, q, k, v, scale: float, segments=None, softcap=None):
    fwd = DENSE[kernel][0]
    if segments is None:
        return fwd(q, k, v, scale, False, softcap=softcap)
    parts = [fwd(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale, True, softcap=softcap) for s, e in segments]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)


def block_backward(kernel: str, dout, q, k, v, out, lse, scale: float, segments=None, softcap=None):
    bwd = DENSE[kernel][1]
    if segments is None:
        return bwd(dout, q, k, v, out, lse, scale=scale, causal=False, softcap=softcap)
    parts = [bwd(dout[:, :, s:e], q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], out[:, :, s:e], lse[:, :, s:e],
                 scale=scale, causal=True, softcap=softcap) for s, e in segments]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(g, dim=2) for g in zip(*parts))


# ---- One ring step: all its blocks, over all rows ----
#
# step: [(rows, [Block, ...]), ...] (parallel/blocks.RingPlan.steps[t]); q: (B, H, Lq, D), k/v: (B, Hkv, Lk, D)
# the K/V held at that step. A dense kernel runs block by block; a varlen kernel runs the whole step in one
# call per mask kind (the varlen-causal blocks, the dense rectangles), every row included.

def step_forward(kernel: str, q, k, v, plan: RingPlan, t: int, scale: float, softcap=None):
    """Yields (rows, block, out, lse) for each block of the plan's step t; out: (rows, H, lq, D), lse fp32."""
    if kernel not in VARLEN:
        for rows, blocks in plan.steps[t]:
            for b in blocks:
                o, l = block_forward(kernel, q[rows, :, b.q0:b.q1], k[rows, :, b.k0:b.k1], v[rows, :, b.k0:b.k1],
                                     scale, b.segments, softcap)
                yield rows, b, o, l
        return
    for call, items in _step_calls(plan, t, q.shape[2], k.shape[2]):
        out, lse = call.forward(VARLEN[kernel], q, k, v, scale, softcap)
        for row, b, sq, _ in items:
            yield slice(row, row + 1), b, as_block(out, sq), lse[:, sq].unsqueeze(0)


def step_backward(kernel: str, dout, q, k, v, out, lse, plan: RingPlan, t: int, scale: float, softcap=None):
    """Yields (rows, block, dq, dk, dv) for each block of the plan's step t, given the merged out and lse."""
    if kernel not in VARLEN:
        for rows, blocks in plan.steps[t]:
            for b in blocks:
                r, c = (rows, slice(None), slice(b.q0, b.q1)), (rows, slice(None), slice(b.k0, b.k1))
                yield (rows, b, *block_backward(kernel, dout[r], q[r], k[c], v[c], out=out[r], lse=lse[r],
                                                scale=scale, segments=b.segments, softcap=softcap))
        return
    for call, items in _step_calls(plan, t, q.shape[2], k.shape[2]):
        dq, dk, dv = call.backward(VARLEN[kernel], dout, q, k, v, out=out, lse=lse, scale=scale, softcap=softcap)
        for row, b, sq, sk in items:
            yield slice(row, row + 1), b, as_block(dq, sq), as_block(dk, sk), as_block(dv, sk)


def _step_calls(plan: RingPlan, t: int, lq: int, lk: int) -> list:
    """[(VarlenCall, [(row, block, its packed query slice, its packed key slice)])] of step t, one per mask
    kind; built once per batch (kept in plan.derived) and reused by every layer, forward and backward."""
    if lq != lk:
        raise ValueError(f"ring blocks need equal local query and key lengths, got {lq} and {lk}")
    key = ("varlen", t)
    if key not in plan.derived:
        plan.derived[key] = list(_build_step_calls(plan.steps[t], lq))
    return plan.derived[key]


def _build_step_calls(step: list, length: int):
    groups = {True: ([], []), False: ([], [])}  # causal?: (pieces, items)
    for rows, blocks in step:
        for row in range(rows.start or 0, rows.stop):
            for b in blocks:
                pieces, items = groups[b.segments is not None]
                first = len(pieces)
                if b.segments is None:
                    pieces.append((row, b.q0, b.q1, b.k0, b.k1))
                else:
                    pieces += [(row, b.q0 + s, b.q0 + e, b.k0 + s, b.k0 + e) for s, e in b.segments]
                items.append((row, b, first, len(pieces)))
    for causal, (pieces, items) in groups.items():
        if pieces:
            call = VarlenCall(pieces, length, causal)
            yield call, [(row, b, slice(call.cu_q[i], call.cu_q[j]), slice(call.cu_k[i], call.cu_k[j]))
                         for row, b, i, j in items]
