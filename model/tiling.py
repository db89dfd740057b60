"""Sequence tiling of a decoder layer's position-wise parts: their wide or transient activations exist
for one tile of tokens at a time, in forward and in backward (the idea of Arctic Long Sequence
Training's TiledMLP, applied to more of the layer).

`tiled_apply(fn, x, params, tile)` runs a position-wise `fn` over tiles of x's sequence dimension
with no autograd graph, keeping only x; backward recomputes one tile at a time, writes the tile's
input gradient into one buffer and sums the parameters' gradients, which it returns through autograd
like any op (so DDP and FSDP2 see ordinary gradients). Tiling is exact: each token's output depends
on that token only; the tiles' recompute replays the random state their forward drew from (dropout, sampled
experts).

`tiled_forwards(model, tile, forward_of)` makes the tiled forwards of every decoder layer (model/prepare.py
sets them). In the pre-norm layers of the Llama family
(`h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`) the norms are
position-wise too and feed only the projections after them, so they move inside the tiles:
  mlp(post_attention_layernorm(h))    one tiled op that keeps h, which the layer holds anyway;
  q/k/v_proj(input_layernorm(x))      three tiled ops that keep x, the checkpointed layer input;
and neither normed tensor ever exists for the whole sequence in the autograd graph. Other layer
classes get the MLP alone tiled. Forwards are replaced on the module instances only (by patch_model, which
can undo them): parameters, their names and the saved checkpoints stay plain transformers.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap

import torch

from longstride.model.loss import decoder_layers

# Decoder layers whose forward is exactly the pre-norm form above. A class list, because the order of the
# calls inside a forward is not visible from the module's structure; other layers get the MLP alone tiled.
PRE_NORM_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                   "SmolLM3DecoderLayer"}


def pre_norm(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer has the pre-norm form (PRE_NORM_LAYERS), also once FSDP2 has wrapped its class."""
    return any(c.__name__ in PRE_NORM_LAYERS for c in type(layer).__mro__)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this device type; the meta device (a traced step, recipes/memory/trace.py) has none."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _tile_bounds(n: int, tile: int):
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


def _rng_state(device: torch.device):
    """The random state the tiles' forward starts from (CPU, and the tiles' GPU): backward recomputes the tiles in
    the same order from it, so each draws the same dropout masks and sampled experts as in forward (Seed-OSS's MLP
    dropout, PhiMoE's sampled routing); None on the meta device of a traced step, which draws nothing real."""
    if device.type == "meta":
        return None
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed(state, device: torch.device):
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if state[1] is not None else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile, *params):
        # x: (..., L, H) -> fn's output (..., L, H'), computed tile by tile without a graph
        ctx.fn, ctx.tile, ctx.params = fn, tile, params  # params by reference: FSDP2 refills their storage
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if autocast_on(device) else None
        ctx.save_for_backward(x)
        ctx.rng = _rng_state(x.device)
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
        with _replayed(ctx.rng, x.device):  # the tiles in forward's order, drawing what forward drew
            for s, e in _tile_bounds(x.shape[-2], ctx.tile):
                xt = x[..., s:e, :].detach().requires_grad_(dx is not None)
                with torch.enable_grad(), (torch.autocast(*ctx.autocast) if ctx.autocast else
                                           contextlib.nullcontext()):
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
    """The forward of a norm that runs inside the tiles of the projections after it: the layer's own call of
    the norm passes its input through, and each tile normalises its tokens."""
    return x


def _tiled(module: torch.nn.Module, call, norm: torch.nn.Module | None, norm_call, tile: int, wrap=None):
    """The forward module(norm(x)) tiled, from the two modules' forwards before tiling (`call`, `norm_call`:
    callables of x); wrap: what each tile's function goes through (None: nothing). Parameters are read at call
    time: FSDP2 swaps them in and out around each forward."""
    def fn(x):
        return call(norm_call(x) if norm is not None else x)

    fn = wrap(fn) if wrap is not None else fn

    # never traced by torch.compile (a compiled part around it breaks its graph here): _Tiled's backward calls
    # autograd.grad, and the closure would be guarded per module; under train.compile each tile's fn is compiled
    @torch.compiler.disable
    def forward(x):
        params = [*(norm.parameters() if norm is not None else ()), *module.parameters()]
        return tiled_apply(fn, x, params, tile)

    forward.tiled = True
    return forward


def runs_tiled(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is a tiled one (tiled_forwards) or a norm folded into the tiles after it."""
    forward = vars(module).get("forward")
    return forward is folded_into_tiles or getattr(forward, "tiled", False)


def forward_tree(cls: type):
    """The syntax tree of a module class's forward, read from its source (what only running it would show
    otherwise, which validation's meta device cannot); None where there is no source."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None


def _returns_tuple(module: torch.nn.Module) -> bool:
    """Whether the module's forward returns a tuple (`return out, scores`): a mixture of experts' output can only
    be known by running it (grouped matmuls)."""
    tree = forward_tree(type(module))
    return tree is not None and any(isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)
                                    for n in ast.walk(tree))


def untileable(model: torch.nn.Module) -> str | None:
    """Why model.mlp_tile_tokens cannot tile `model`'s MLPs, or None: a decoder layer without an `mlp` (Llama 4's
    feed_forward) or one whose `mlp` returns more than its output (GPT-OSS's router scores), which tiles would not
    carry. A mixture of experts returning its output alone (Mixtral, Qwen2-MoE) routes each token by itself: tiled
    exactly."""
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            return f"{type(layer).__name__} has no `mlp` to tile"
        if _returns_tuple(mlp):
            return f"{type(layer).__name__}'s mlp ({type(mlp).__name__}) returns more than its output"
    return None


def tiled_forwards(model: torch.nn.Module, tile: int, forward_of, wrap=None) -> dict:
    """module -> its tiled forward, for the position-wise parts of every decoder layer of a transformers
    causal LM (see the module docstring); `forward_of(module)` is the forward each tile calls (the module's
    own, or the lean norm's); wrap: what each tile's function goes through (train.compile: model/compile.py
    compile_tile), None: nothing. Changes nothing: model/prepare.patch_model sets them. tile <= 0: none."""
    if tile <= 0:
        return {}
    why = untileable(model)
    if why:
        raise NotImplementedError(f"model.mlp_tile_tokens={tile}: {why}; set model.mlp_tile_tokens=0")
    out = {}
    for layer in decoder_layers(model):
        if not pre_norm(layer):
            out[layer.mlp] = _tiled(layer.mlp, forward_of(layer.mlp), None, None, tile, wrap)
            continue
        attn, norm1, norm2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        out[layer.mlp] = _tiled(layer.mlp, forward_of(layer.mlp), norm2, forward_of(norm2), tile, wrap)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            out[proj] = _tiled(proj, forward_of(proj), norm1, forward_of(norm1), tile, wrap)
        out[norm1] = out[norm2] = folded_into_tiles
    return out
