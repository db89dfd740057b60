"""Sequence tiling of a decoder layer's position-wise parts: their wide or transient activations exist
for one tile of tokens at a time, in forward and in backward (the idea of Arctic Long Sequence
Training's TiledMLP, applied to more of the layer).

`tiled_apply(fn, x, params, tile)` runs a position-wise `fn` over tiles of x's sequence dimension
with no autograd graph, keeping only x; backward recomputes one tile at a time, writes the tile's
input gradient into one buffer and sums the parameters' gradients, which it returns through autograd
like any op (so DDP and FSDP2 see ordinary gradients). Tiling is exact: each token's output depends
on that token only.

`tile_mlps(model, tile)` applies it to every decoder layer. In the pre-norm layers of the Llama family
(`h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`) the norms are
position-wise too and feed only the projections after them, so they move inside the tiles:
  mlp(post_attention_layernorm(h))    one tiled op that keeps h, which the layer holds anyway;
  q/k/v_proj(input_layernorm(x))      three tiled ops that keep x, the checkpointed layer input;
and neither normed tensor ever exists for the whole sequence in the autograd graph. Other layer
classes get the MLP alone tiled. Forwards are replaced on the module instances only: parameters,
their names and the saved checkpoints stay plain transformers.
"""
from __future__ import annotations

import threading

import torch

# decoder layers whose forward is exactly the pre-norm form above
PRE_NORM_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                   "SmolLM3DecoderLayer"}


_state = threading.local()


def inside_tile() -> bool:
    """True while a tiled op computes its forward: selective checkpointing (model/checkpointing.py)
    must not cache what runs there, since the tiled op recomputes it in its own backward."""
    return getattr(_state, "depth", 0) > 0


def _tile_bounds(n: int, tile: int):
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile, *params):
        # x: (..., L, H) -> fn's output (..., L, H'), computed tile by tile without a graph
        ctx.fn, ctx.tile, ctx.params = fn, tile, params  # params by reference: FSDP2 refills their storage
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        out = None
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            for s, e in _tile_bounds(x.shape[-2], tile):
                y = fn(x[..., s:e, :])
                if out is None:
                    out = y.new_empty(*x.shape[:-1], y.shape[-1])
                out[..., s:e, :] = y
        finally:
            _state.depth -= 1
        return out

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        want = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dparams = [None] * len(ctx.params)
        for s, e in _tile_bounds(x.shape[-2], ctx.tile):
            xt = x[..., s:e, :].detach().requires_grad_(dx is not None)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                yt = ctx.fn(xt)
            inputs = ([xt] if dx is not None else []) + [ctx.params[i] for i in want]
            grads = torch.autograd.grad(yt, inputs, dy[..., s:e, :], allow_unused=True)
            if dx is not None:
                dx[..., s:e, :] = grads[0]
                grads = grads[1:]
            for i, g in zip(want, grads):  # summed over tiles in fp32 (bf16 parameters under FSDP2)
                if g is not None:
                    dparams[i] = g.float() if dparams[i] is None else dparams[i].add_(g)
        dparams = [g if g is None else g.to(p.dtype) for g, p in zip(dparams, ctx.params)]
        return (dx, None, None, *dparams)


def tiled_apply(fn, x: torch.Tensor, params, tile: int) -> torch.Tensor:
    """fn(x) for a position-wise fn whose parameters are `params`, over tiles of `tile` tokens."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return _Tiled.apply(x, fn, tile, *params)
    if x.shape[-2] <= tile:
        return fn(x)
    return torch.cat([fn(t) for t in x.split(tile, dim=-2)], dim=-2)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _keep_untiled(module: torch.nn.Module) -> None:
    if "__untiled_forward__" not in vars(module):
        module.__untiled_forward__ = module.forward


def set_forward(module: torch.nn.Module, forward) -> None:
    """Replaces a module's forward; on a module that tiling wrapped or folded into tiles, replaces what
    the tiles call instead, so the tiling stays in place."""
    if "__untiled_forward__" in vars(module):
        module.__untiled_forward__ = forward
    else:
        module.forward = forward


def _restore(module: torch.nn.Module) -> None:
    if "__untiled_forward__" in vars(module):
        module.forward = module.__untiled_forward__
        del module.__untiled_forward__


def _tiled_forward(module: torch.nn.Module, norm: torch.nn.Module | None, tile: int):
    """module(norm(x)) tiled. Forwards and parameters are read at call time: FSDP2 swaps parameters in
    and out around each forward, and model/rmsnorm.py may set the norm's forward after tiling
    (set_forward)."""
    def fn(x):
        return module.__untiled_forward__(norm.__untiled_forward__(x) if norm is not None else x)

    def forward(x):
        params = [*(norm.parameters() if norm is not None else ()), *module.parameters()]
        return tiled_apply(fn, x, params, tile)

    forward.longstride_tile = tile
    return forward


def tile_mlps(model: torch.nn.Module, tile: int) -> int:
    """Tiles the position-wise parts of every decoder layer of a transformers causal LM (see the module
    docstring); returns how many layers. tile <= 0: off. Calling it again re-tiles from the original
    forwards, never nesting."""
    layers = model.model.layers
    for layer in layers:
        for module in layer.modules():
            _restore(module)
    if tile <= 0:
        return 0
    for layer in layers:
        if type(layer).__name__ not in PRE_NORM_LAYERS:
            _keep_untiled(layer.mlp)
            layer.mlp.forward = _tiled_forward(layer.mlp, None, tile)
            continue
        attn, norm1, norm2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        for module in (layer.mlp, norm1, norm2, attn.q_proj, attn.k_proj, attn.v_proj):
            _keep_untiled(module)
        layer.mlp.forward = _tiled_forward(layer.mlp, norm2, tile)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.forward = _tiled_forward(proj, norm1, tile)
        norm1.forward = norm2.forward = _identity
    return len(layers)
