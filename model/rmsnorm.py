"""A memory-lean backward for transformers' RMSNorm layers.

transformers' RMSNorm (Llama, Mistral, Qwen2/3, SmolLM3) is `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`
written as plain tensor ops, so autograd keeps the normalised tensor and its cast beside the input:
two more (tokens x hidden) tensors per norm, for every norm of the layer being recomputed. The
Function below computes the same forward and keeps only the input and 1/rms (one float per token);
backward rebuilds the normalised tensor from them (the fused-RMSNorm idea of Liger-Kernel, here in
plain torch so it runs on any device):
    y = w * xh,  xh = x r,  r = (mean(x^2) + eps)^-1/2
    dw = sum_tokens dy * xh,  dx = r (g - xh mean(g xh)),  g = dy * w
The norm's `forward` is replaced on the instance only (model/prepare.patch_model); parameters and
checkpoints stay plain.
"""
from __future__ import annotations

import types

import torch

from longstride.model.real import real


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        # x: (..., H) any float dtype; weight: (H,). Output dtype as transformers': weight's and x's promoted.
        r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (x.float() * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xh = x.float() * r  # fp32, as forward computed it before the cast
        dw = dx = None
        if ctx.needs_input_grad[1]:
            dw = (dy * xh.to(x.dtype)).reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = (dy * weight).to(x.dtype).float()
            dx = (r * (g - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


@torch.no_grad()
def computes_rms_norm(module: torch.nn.Module) -> bool:
    """Whether `module` is an RMSNorm of exactly the formula above: a 1-D `weight`, a float
    `variance_epsilon`, and on a probe input the same output as rms_norm (Gemma's (1 + w) form, or any other
    module, fails). The probe runs on the CPU with a real random weight swapped in for the module's own, so it
    also decides for a model built without memory (meta or fake weights: recipes/memory/trace.py); a local generator
    draws it, so the global RNG is untouched."""
    w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(w, torch.nn.Parameter) or w.ndim != 1 or not isinstance(eps, float):
        return False
    with real():
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(w.shape[0], generator=g).to(w.dtype)
        x = torch.randn(3, w.shape[0], generator=g).to(w.dtype)
        module.weight = torch.nn.Parameter(probe, requires_grad=False)
        try:
            got = module.forward(x)  # its own forward: patch_model probes before it patches
        finally:
            module.weight = w
        tol = 1e-5 if w.dtype == torch.float32 else 1e-2
        return torch.allclose(got, rms_norm(x, probe, eps), rtol=tol, atol=tol)


def _lean_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, norm.weight, norm.variance_epsilon)


def lean_forwards(model: torch.nn.Module) -> dict:
    """norm -> the lean forward, for every Llama-style RMSNorm of a transformers model (computes_rms_norm).
    Changes nothing: model/prepare.patch_model sets them."""
    return {m: types.MethodType(_lean_forward, m) for m in model.modules() if computes_rms_norm(m)}
