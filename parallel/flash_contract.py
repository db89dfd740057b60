"""What CUDA's varlen flash attention requires of its inputs, checked at the aten ops themselves.

torch's meta kernels for `aten._flash_attention_forward` / `_backward` compute output shapes and check little
else: an int64 cumulative-length tensor, fp32 inputs, a transposed log-sum-exp or a host tensor beside
device ones all pass there and fail (or silently misread) on a GPU. `FlashOpCheck` is a dispatch mode that
holds every call of those ops to the checks of the CUDA entry points (FA2's mha_varlen_fwd / mha_varlen_bwd)
and to how longstride calls them (no dropout, no debug mask, an explicit softmax scale), after torch's own
dispatcher has parsed the call against the op's schema. A traced step (recipes/memory/trace.py) runs under it;
`check_layout` is shared with the CPU emulation of the kernels (parallel/varlen.emulate).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstride.parallel.attention_call import is_attention_op, run_inside

HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """An input a CUDA varlen kernel would reject, or silently misread: dtype, layout, device or shape."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ContractError(what)


def check_layout(q, k, cu_q, cu_k, *same_dtype) -> None:
    """Packed (T, H, D) q/k/v (and out, dout) of one dtype, on one device, with a dense last dimension and GQA
    heads; int32 contiguous 1-D cumulative lengths on the tensors' device, as many for queries as for keys.
    Reads no values."""
    _need(q.dim() == 3 and k.dim() == 3 and q.shape[2] == k.shape[2],
          f"q {tuple(q.shape)}, k {tuple(k.shape)}: packed (tokens, heads, head_dim) with one head_dim")
    _need(all(x.dtype == q.dtype for x in (k, *same_dtype)), "q, k, v, out and dout share one dtype")
    _need(all(x.stride(-1) == 1 for x in (q, k, *same_dtype)), "varlen kernels need a dense last dimension")
    _need(all(x.device == q.device for x in (k, *same_dtype)), "q, k, v, out and dout on one device")
    _need(q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _need(cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(),
              f"{name} must be a contiguous 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
        _need(cu.device == q.device, f"{name} is on {cu.device}, the attention's tensors on {q.device}")
    _need(cu_q.shape == cu_k.shape, "as many query pieces as key pieces")


def _bind(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def flash_head_dim(head_dim: int) -> bool:
    """Whether the CUDA flash kernels (torch's FA2, flash-attn) take heads of this size: multiples of 8 up to 256."""
    return head_dim % 8 == 0 and 0 < head_dim <= 256


def _check_call(a: dict, lse_name: str = "") -> None:
    q, k, v = a["query"], a["key"], a["value"]
    extra = [a["grad_out"], a["out"]] if "grad_out" in a else []
    check_layout(q, k, a["cum_seq_q"], a["cum_seq_k"], v, *extra)
    _need(q.dtype in HALF, f"flash kernels take fp16/bf16, got {q.dtype}")
    _need(flash_head_dim(q.shape[2]), f"head_dim {q.shape[2]}: flash kernels take multiples of 8 "
          "up to 256")
    _need(all(isinstance(a[n], int) and a[n] > 0 for n in ("max_q", "max_k")), "max_q / max_k: positive ints")
    _need(a["dropout_p"] == 0.0, "longstride runs attention without dropout")
    left, right = a.get("window_size_left"), a.get("window_size_right")
    if left is not None or right is not None:  # a sliding window: causal, left >= 0 keys back, none ahead
        _need(a["is_causal"] and isinstance(left, int) and left >= 0 and right == 0,
              f"a windowed call needs is_causal, window_size_left >= 0 and window_size_right 0, got "
              f"{a['is_causal']}, {left!r}, {right!r}")
    _need(isinstance(a.get("scale"), float) and a["scale"] > 0, f"scale={a.get('scale')!r}: pass the softmax "
          "scale by keyword (a positional float lands in another argument)")
    if "grad_out" in a:
        lse = a["logsumexp"]
        _need(a["grad_out"].shape == q.shape and a["out"].shape == q.shape, "out and dout shaped like q")
        _need(tuple(lse.shape) == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
              and lse.device == q.device, f"the merged log-sum-exp must be contiguous (heads, tokens) = "
              f"{(q.shape[1], q.shape[0])} fp32 on {q.device}, got {tuple(lse.shape)} {lse.dtype} on {lse.device}")
    else:
        _need(a["return_debug_mask"] is False, "return_debug_mask must be False (a positional argument too many?)")


class FlashOpCheck(TorchDispatchMode):
    """Every aten flash-attention call checked as the CUDA kernel checks its inputs; `calls` counts them,
    `windowed` those with a sliding window."""

    FORWARD = torch.ops.aten._flash_attention_forward.default
    BACKWARD = torch.ops.aten._flash_attention_backward.default

    def __init__(self):
        super().__init__()
        self.calls = self.windowed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_attention_op(func):  # longstride's attention: the flash calls inside it are checked
            return run_inside(self, args, kwargs)
        if func in (self.FORWARD, self.BACKWARD):
            _check_call(_bind(func, args, kwargs))
            self.calls += 1
            self.windowed += kwargs.get("window_size_left") is not None
        out = func(*args, **kwargs)
        if func is self.FORWARD:
            q, lse = args[0], out[1]
            _need(tuple(lse.shape) == (q.shape[1], q.shape[0]), f"the kernel's log-sum-exp {tuple(lse.shape)} is "
                  f"not the unpadded varlen layout (heads, tokens) = {(q.shape[1], q.shape[0])}")
        return out
