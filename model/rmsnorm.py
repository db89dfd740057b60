"""A memory-lean backward for transformers' RMSNorm layers.

transformers' RMSNorm (Llama, Mistral, Qwen2/3, SmolLM3) is `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`
written as plain tensor ops, so autograd keeps the normalised tensor and its cast beside the input:
two more (tokens x hidden) tensors per norm, for every norm of the layer being recomputed. The
Function below computes the same forward and keeps only the input and 1/rms (one float per token);
backward rebuilds the normalised tensor from them (the fused-RMSNorm idea of Liger-Kernel, here in
plain torch so it runs on any device):
    y = w * xh,  xh = x r,  r = (mean(x^2) + eps)^-1/2
    dw = sum_tokens dy * xh,  dx = r (g - xh mean(g xh)),  g = dy * w
The norm's `forward` is replaced on the instance only; parameters and checkpoints stay plain.
"""
from __future__ import annotations

import torch

from longstride.model.tiling import set_forward

# transformers' RMSNorm classes with exactly the formula above (Gemma's (1 + w) form is not one of them)
LLAMA_STYLE = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm"}


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


def lean_rms_norms(model: torch.nn.Module) -> int:
    """Gives every Llama-style RMSNorm of a transformers model the lean backward; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_STYLE:
            set_forward(module, lambda x, _m=module: rms_norm(x, _m.weight, _m.variance_epsilon))
            count += 1
    return count
