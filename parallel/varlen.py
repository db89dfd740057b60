"""Varlen attention kernels: many (query range, key range) pieces of a batch in one kernel call.

A varlen kernel takes packed q: (Tq, H, D), k/v: (Tk, Hkv, D), int32 cumulative lengths cu_q / cu_k (n+1,) on
the tensors' device and the longest piece of each; piece i's queries q[cu_q[i]:cu_q[i+1]] attend to its keys
k[cu_k[i]:cu_k[i+1]], causally (square pieces) or densely. GQA is resolved inside the kernel (K/V keep their
own heads). Contract (`Varlen`):
    forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap) -> out (Tq, H, D), lse (H, Tq) fp32
    backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap) -> dq, dk, dv
        (packed like q, k, v)
window: None, or a sliding window (causal pieces only): query i of a piece sees key j only when 0 <= d < window,
d = i + (keys - queries) - j; causal pieces with more keys than queries are aligned at their last token (the
queries are the keys' suffix, as flash attention aligns them), which the windowed pieces of a halo use
(parallel/window.py). softcap: None, or the scores' soft-cap softcap * tanh(s / softcap) (Gemma 2), which
flash-attn (>= 2.6.2, not its ROCm build) applies and torch's flash attention does not (refused there).
The backward is handed the *merged* output and LSE of all blocks (ring attention), which makes each piece's
gradient exact. Backends (VARLEN):
    torch_flash  torch's own flash attention, aten._flash_attention_forward/_backward (FA2 built into CUDA
                 torch; FA3/FA4 when activated with torch.nn.attention.activate_flash_attention_impl)
    flash_attn   the flash-attn package: forward through its public varlen function, backward through its
                 varlen backward (flash-attn has no public backward that takes a merged LSE)
`emulate(fwd, bwd)` gives the same contract over the CPU block kernels, checking every input as the CUDA
kernels would: the CPU tests run the packing, the layout conversions and the block math through it.

`VarlenCall` packs the pieces of a batch: all rows of a micro-batch, and all blocks of a ring step, in one
call per mask kind (causal pieces, dense pieces), from views of (B, H, L, D) tensors laid out as (B, L, H, D)
(transformers' layout) without a copy when the pieces tile the batch in order, gathered otherwise.
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from itertools import accumulate
from typing import Callable, NamedTuple, Optional

import torch

from longstride.host_copy import as_device_tensor
from longstride.model.real import real
from longstride.parallel.flash_contract import ContractError, check_layout


class Varlen(NamedTuple):
    forward: Callable
    backward: Callable


class VarlenCall:
    """pieces: [(row, q0, q1, k0, k1)] of (B, H, L, D) tensors whose rows hold L tokens; causal: the
    pieces are square and causal within themselves, else dense rectangles. Each piece is one varlen
    sequence, in the given order. Built once per batch (parallel/kernels.py keeps it with the batch's plan or
    document bounds) and used by every layer's forward and backward."""

    def __init__(self, pieces: list[tuple], length: int, causal: bool, window: Optional[int] = None):
        self._init([(r * length + q0, r * length + q1) for r, q0, q1, _, _ in pieces],
                   [(r * length + k0, r * length + k1) for r, _, _, k0, k1 in pieces], causal, window)

    @classmethod
    def of_ranges(cls, q_ranges: list[tuple], k_ranges: list[tuple], window: Optional[int]) -> "VarlenCall":
        """Causal pieces given as token ranges of the flat (T, H, D) forms of q and of k/v (which may differ in
        length): each piece's queries are the suffix of its keys, with an optional window."""
        call = cls.__new__(cls)
        call._init(q_ranges, k_ranges, True, window)
        return call

    def _init(self, q_ranges, k_ranges, causal: bool, window: Optional[int]) -> None:
        self.causal, self.window = causal, window
        self.q_ranges, self.k_ranges = q_ranges, k_ranges
        q_lens = [b - a for a, b in self.q_ranges]
        k_lens = [b - a for a, b in self.k_ranges]
        if causal and any(a > b for a, b in zip(q_lens, k_lens)) or (causal and window is None and q_lens != k_lens):
            raise ValueError("causal varlen pieces must be square (or, windowed, have at least as many keys)")
        self.cu_q, self.cu_k = list(accumulate(q_lens, initial=0)), list(accumulate(k_lens, initial=0))
        self.max_q, self.max_k = max(q_lens), max(k_lens)
        self._cu: dict = {}  # device -> the int32 cumulative lengths there, copied once

    def _lengths(self, device) -> dict:
        if device not in self._cu:  # copied once per batch, not per layer (without blocking: longstride/host_copy.py)
            with real():  # real even inside a traced step: the call is cached (kernels.py)
                self._cu[device] = tuple(as_device_tensor(c, torch.int32, device) for c in (self.cu_q, self.cu_k))
        cu_q, cu_k = self._cu[device]
        return {"cu_q": cu_q, "cu_k": cu_k, "max_q": self.max_q, "max_k": self.max_k}

    def forward(self, kernel: Varlen, q, k, v, scale: float, softcap: Optional[float] = None):
        """q: (B, H, L, D), k/v: (B, Hkv, L, D) -> packed out (Tq, H, D), lse (H, Tq) fp32."""
        fq, fk, fv = gather(q, self.q_ranges), gather(k, self.k_ranges), gather(v, self.k_ranges)
        return kernel.forward(fq, fk, fv, **self._lengths(q.device), scale=scale, causal=self.causal,
                              window=self.window, softcap=softcap)

    def backward(self, kernel: Varlen, dout, q, k, v, out, lse, scale: float, softcap: Optional[float] = None):
        """dout/out: (B, H, L, D) like q, lse: (B, H, L) fp32 (merged) -> packed dq, dk, dv."""
        g = lambda x: gather(x, self.q_ranges)  # noqa: E731
        flat_lse = lse.transpose(0, 1).reshape(lse.shape[1], -1)  # (H, B*L); a view when lse came from here
        packed_lse = _take(flat_lse, self.q_ranges, dim=1).to(torch.promote_types(q.dtype, torch.float32))
        return kernel.backward(dense_last(g(dout)), g(q), gather(k, self.k_ranges), gather(v, self.k_ranges), g(out),
                               packed_lse.contiguous(), **self._lengths(q.device), scale=scale, causal=self.causal,
                               window=self.window, softcap=softcap)


def dense_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is dense, which is all the CPU flash op, the CUDA flash kernels and the
    block kernels need (transformers' transposed q/k/v are); a contiguous copy otherwise (a broadcast gradient,
    such as sum()'s, has stride 0 there)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def flat(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*L, H, D): a view when x lies over a (B, L, H, D) buffer (transformers' q/k/v, the
    ring's buffers), a copy otherwise."""
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B * L, H, D)


def gather(x: torch.Tensor, ranges: list[tuple]) -> torch.Tensor:
    """The token ranges of flat(x) packed in order: a slice (no copy) when they follow each other."""
    return _take(flat(x), ranges, dim=0)


def _take(x: torch.Tensor, ranges: list[tuple], dim: int) -> torch.Tensor:
    """x's ranges along `dim`, concatenated in order; a slice when each range starts where the last ended."""
    if all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:])):
        return x.narrow(dim, ranges[0][0], ranges[-1][1] - ranges[0][0])
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def as_block(packed: torch.Tensor, rows: slice) -> torch.Tensor:
    """A piece of packed (T, H, D) output or gradient -> (1, H, T, D), the layout of one row's block."""
    return packed[rows].transpose(0, 1).unsqueeze(0)


# ---- torch's own flash attention ----

def torch_flash_available() -> bool:
    return (torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.backends.cuda.is_flash_attention_available())


def _windows(window: Optional[int]) -> dict:
    # flash attention's window counts the keys left of the aligned one: window - 1 (right: 0, it is causal)
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def refuse_softcap(softcap, kernel: str) -> None:
    """A kernel without a soft-cap handed one (resolve_kernel and the attention call refuse it first)."""
    if softcap:
        raise ValueError(f"parallel.kernel={kernel} has no logit soft-capping; use parallel.kernel=math (or flash_attn "
                         "on CUDA)")


def _torch_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    _check_half(q, "torch_flash")
    refuse_softcap(softcap, "torch_flash")
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                            scale=scale, **_windows(window))
    return out, _packed_lse(lse, q)


def _torch_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window=None,
                          softcap=None):
    refuse_softcap(softcap, "torch_flash")
    # dropout is 0: the philox state is not read; the shapes are those torch's own varlen_attn passes
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0,
                                                    causal, rng, unused, scale=scale, **_windows(window))


def _check_half(q: torch.Tensor, name: str) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"parallel.kernel={name} runs fp16/bf16 attention, got {q.dtype}; train with "
                         "train.precision=bf16 (or auto on a GPU; a Trainer: bf16=True), or use parallel.kernel=math")


def _packed_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"the flash kernel returned a log-sum-exp of shape {tuple(lse.shape)}, expected the "
                           f"unpadded varlen layout (heads, tokens) = {(q.shape[1], q.shape[0])}; this torch / "
                           "flash-attn build is not supported by longstride's varlen kernels")
    return lse


# ---- flash-attn (optional package) ----

def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


SOFTCAP_FLASH_ATTN = "2.6.2"  # the first flash-attn whose backward soft-caps (2.6.0/2.6.1: the forward only)


def flash_attn_softcap_problem() -> Optional[str]:
    """Why the installed flash-attn cannot train with soft-capped scores, or None: not installed, a ROCm build (its
    CK kernels take softcap and ignore it), or a release before SOFTCAP_FLASH_ATTN."""
    try:
        import flash_attn
    except ImportError:
        return "flash-attn is not installed (pip install 'longstride[gpu]')"
    return _softcap_problem(getattr(flash_attn, "__version__", "0"), bool(torch.version.hip))


@lru_cache(maxsize=4)
def _softcap_problem(version: str, hip: bool) -> Optional[str]:
    if hip:
        return "flash-attn's ROCm build ignores softcap"
    release = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731  "2.6.3.post1" -> (2, 6, 3)
    if release(version) < release(SOFTCAP_FLASH_ATTN):
        return f"flash-attn {version} has no soft-capped backward (upgrade to >= {SOFTCAP_FLASH_ATTN})"
    return None


def _check_softcap(softcap) -> None:
    problem = softcap and flash_attn_softcap_problem()
    if problem:
        raise ValueError(f"parallel.kernel=flash_attn with soft-capped scores: {problem}; use parallel.kernel=math")


def _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
    from flash_attn import flash_attn_varlen_func

    _check_half(q, "flash_attn")
    _check_softcap(softcap)
    out, lse, _ = _flash_call(flash_attn_varlen_func, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
                              window=window, softcap=softcap or 0.0, return_attn_probs=True)
    return out, _packed_lse(lse, q)


def _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window=None,
                         softcap=None):
    from flash_attn import flash_attn_interface as fa

    _check_softcap(softcap)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_call(fa._flash_attn_varlen_backward, dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(),
                softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=softcap or 0.0,
                alibi_slopes=None, deterministic=False, rng_state=None, window=window)
    return dq, dk, dv


def _flash_params(fn) -> tuple[set, str]:
    """(the argument names, the name) of a flash-attn function: from 2.7 on its private ones are torch.library
    custom ops, whose own signature is (*args, **kwargs); the function they wrap has the names."""
    import inspect

    target = getattr(fn, "_init_fn", fn)
    name = getattr(target, "__name__", repr(fn))
    params = inspect.signature(target).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise ValueError(f"cannot read the arguments of this flash-attn build's {name} (a wrapper of *args, "
                         "**kwargs); use parallel.kernel=torch_flash, or a flash-attn release longstride knows (2.x)")
    return set(params), name


def _flash_call(fn, window=None, **kw):
    # flash-attn's varlen functions changed their arguments across 2.x releases; pass only what this release
    # takes (window_size as a pair in <= 2.6, as two ints later); a soft-cap it does not take is refused
    params, name = _flash_params(fn)
    if kw.get("softcap") and "softcap" not in params:  # behind the version check: a build that lies about it
        raise ValueError(f"this flash-attn build's {name} takes no softcap; install flash-attn >= "
                         f"{SOFTCAP_FLASH_ATTN}, or use parallel.kernel=math")
    left, right = (-1, -1) if window is None else (window - 1, 0)
    if "window_size" in params:
        kw["window_size"] = (left, right)
    elif "window_size_left" in params:
        kw.update(window_size_left=left, window_size_right=right)
    elif window is not None:  # flash-attn < 2.3 has no windows: the layer would attend to its whole document
        raise ValueError(f"this flash-attn build's {name} takes no window size, and this layer attends within "
                         f"a window of {window}; install flash-attn >= 2.3, or use parallel.kernel=torch_flash or math")
    return fn(**{k: v for k, v in kw.items() if k in params})


VARLEN = {"torch_flash": Varlen(_torch_flash_forward, _torch_flash_backward),
          "flash_attn": Varlen(_flash_attn_forward, _flash_attn_backward)}


# ---- the same contract over the CPU block kernels (tests) ----

def emulate(fwd: Callable, bwd: Callable) -> Varlen:
    """A Varlen over dense block kernels fwd(q, k, v, scale, causal, window, softcap) -> (out, lse) and
    bwd(dout, q, k, v, out, lse, scale, causal, window, softcap) on (1, H, l, D) tensors, one piece at a time. It
    checks what the CUDA kernels require of their inputs (dense last dimension, int32 cumulative lengths on the
    tensors' device that end at the packed lengths, GQA heads), so a layout mistake fails on CPU too."""
    def pieces(q, k, lengths: dict, *same_dtype):
        _check_contract(q, k, lengths, *same_dtype)
        cq, ck = lengths["cu_q"].tolist(), lengths["cu_k"].tolist()
        return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]

    def one(x, s):  # (T, H, D) -> (1, H, l, D)
        return x[s].transpose(0, 1).unsqueeze(0)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        out = torch.empty_like(q)
        # fp32 as the CUDA kernels give it; fp64 inputs (the CPU reference tests) keep an fp64 log-sum-exp
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        lengths = {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k}
        for sq, sk in pieces(q, k, lengths, v):
            o, l = fwd(one(q, sq), one(k, sk), one(v, sk), scale, causal, window, softcap)
            out[sq] = o[0].transpose(0, 1)
            lse[:, sq] = l[0]
        return out, lse

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.promote_types(q.dtype, torch.float32), \
            (lse.shape, lse.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lengths = {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k}
        for sq, sk in pieces(q, k, lengths, v, out, dout):
            g = bwd(one(dout, sq), one(q, sq), one(k, sk), one(v, sk), out=one(out, sq), lse=lse[:, sq].unsqueeze(0),
                    scale=scale, causal=causal, window=window, softcap=softcap)
            dq[sq], dk[sk], dv[sk] = (x[0].transpose(0, 1) for x in g)
        return dq, dk, dv

    return Varlen(forward, backward)


def _check_contract(q, k, lengths: dict, *same_dtype) -> None:
    check_layout(q, k, lengths["cu_q"], lengths["cu_k"], *same_dtype)
    for cu, x, m in ((lengths["cu_q"], q, lengths["max_q"]), (lengths["cu_k"], k, lengths["max_k"])):
        lens = cu.diff()
        if not (cu[0] == 0 and cu[-1] == x.shape[0] and (lens > 0).all() and int(lens.max()) == m):
            raise ContractError(f"cumulative lengths {cu.tolist()} with max {m}: they start at 0, end at the "
                                f"{x.shape[0]} packed tokens and hold pieces of 1 to max tokens, the longest max")
