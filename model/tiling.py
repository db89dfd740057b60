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

import contextlib
import types
import weakref

import torch

# Decoder layers whose forward is exactly the pre-norm form above. A class list, because the order of the
# calls inside a forward is not visible from the module's structure; other layers get the MLP alone tiled.
PRE_NORM_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                   "SmolLM3DecoderLayer"}

# module -> the forward its tiles call, as a function of (module, x) that holds no reference to the module
# (a value that did would keep its weak key, and the model, alive): the class's forward, or one set later
# through set_forward
UNTILED: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this device type; the meta device (a traced step, recipes/trace.py) has none."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _tile_bounds(n: int, tile: int):
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile, *params):
        # x: (..., L, H) -> fn's output (..., L, H'), computed tile by tile without a graph
        ctx.fn, ctx.tile, ctx.params = fn, tile, params  # params by reference: FSDP2 refills their storage
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if autocast_on(device) else None
        ctx.save_for_backward(x)
        out = None
        for s, e in _tile_bounds(x.shape[-2], tile):
            y = fn(x[..., s:e, :])
            if out is None:
                out = y.new_empty(*x.shape[:-1], y.shape[-1])
            out[..., s:e, :] = y
        return out

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        want = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dparams = [None] * len(ctx.params)
        for s, e in _tile_bounds(x.shape[-2], ctx.tile):
            xt = x[..., s:e, :].detach().requires_grad_(dx is not None)
            with torch.enable_grad(), (torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext()):
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


def folded_into_tiles(x: torch.Tensor) -> torch.Tensor:
    """The forward of a norm that runs inside the tiles of the projections after it (tile_mlps): the layer's
    own call of the norm passes its input through, and each tile normalises its tokens."""
    return x


def untiled(module: torch.nn.Module):
    """The forward that `module`'s tiles call: what it was before tiling (or set since by set_forward)."""
    fn = UNTILED.get(module)
    return module.forward if fn is None else types.MethodType(fn, module)


def _keep_untiled(module: torch.nn.Module) -> None:
    if module in UNTILED:
        return
    own = vars(module).get("forward")  # an instance forward set before tiling (set_forward's), else the class's
    assert own is None or (isinstance(own, types.MethodType) and own.__self__ is module), own
    UNTILED[module] = own.__func__ if own is not None else type(module).forward


def set_forward(module: torch.nn.Module, forward) -> None:
    """Gives `module` the forward `forward(module, x)`; on a module that tiling wrapped or folded into tiles,
    replaces what the tiles call instead, so the tiling stays in place."""
    if module in UNTILED:
        UNTILED[module] = forward
    else:
        module.forward = types.MethodType(forward, module)


def _restore(module: torch.nn.Module) -> None:
    fn = UNTILED.pop(module, None)
    if fn is None:
        return
    if fn is type(module).forward:
        del module.forward  # back to the class's own
    else:
        module.forward = types.MethodType(fn, module)


def _tiled_forward(module: torch.nn.Module, norm: torch.nn.Module | None, tile: int):
    """module(norm(x)) tiled. Forwards and parameters are read at call time: FSDP2 swaps parameters in
    and out around each forward, and model/rmsnorm.py may set the norm's forward after tiling
    (set_forward)."""
    def fn(x):
        return untiled(module)(untiled(norm)(x) if norm is not None else x)

    def forward(x):
        params = [*(norm.parameters() if norm is not None else ()), *module.parameters()]
        return tiled_apply(fn, x, params, tile)

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
        norm1.forward = norm2.forward = folded_into_tiles
    return len(layers)
