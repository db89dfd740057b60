"""Tiled MLP: each decoder layer's MLP applied over sequence tiles and recomputed in backward, so
its wide (tile x intermediate_size) activations exist for one tile at a time instead of for the
whole sequence (the idea of Arctic Long Sequence Training's TiledMLP).

The MLP is position-wise, so tiling is exact. Each tile runs under torch's non-reentrant
checkpoint: forward keeps only the tile's input (a view of the layer's normed hidden states, which
exist anyway) and backward recomputes the tile. The layer's `mlp.forward` is replaced on the
instance only: parameters, their names and the saved checkpoints stay plain transformers.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def tiled(forward, tile: int):
    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= tile:
            return forward(x)
        tiles = x.split(tile, dim=-2)
        if torch.is_grad_enabled() and x.requires_grad:
            return torch.cat([checkpoint(forward, t, use_reentrant=False) for t in tiles], dim=-2)
        return torch.cat([forward(t) for t in tiles], dim=-2)

    tiled_forward.longstride_tile = tile
    return tiled_forward


def tile_mlps(model: torch.nn.Module, tile: int) -> int:
    """Tiles the MLP of every decoder layer of a transformers causal LM; returns how many. tile <= 0: off."""
    if tile <= 0:
        return 0
    layers = model.model.layers
    for layer in layers:
        forward = getattr(layer.mlp.forward, "__wrapped_mlp__", layer.mlp.forward)
        layer.mlp.forward = tiled(forward, tile)
        layer.mlp.forward.__wrapped_mlp__ = forward
    return len(layers)
