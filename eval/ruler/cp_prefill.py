"""Context-parallel prefill for generation: with several processes, a long prompt's forward pass is
split over them with zig-zag ring attention (parallel/), and every rank ends with the full KV cache.

The first P' tokens of a P-token prompt (P' the largest multiple of 2 x world below P) are sharded
zig-zag; each layer's post-RoPE keys and values are caught inside the ring attention call, gathered
from every rank and put back in sequence order into a transformers DynamicCache. `generate` then
runs the remaining P - P' prompt tokens and the decoding on every rank from that cache, so each
rank's prefill activations are 1/world of the prompt's.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from longstride.eval.hf_adapter import DynamicCache, attention_implementation, new_cache
from longstride.model.loss import decoder
from longstride.parallel.attention import auto_kernel, longstride_attention, no_mask
from longstride.parallel.config import CPDegrees, ParallelDims
from longstride.parallel.cp import CPContext, cp_context, shard_for_cp
from longstride.parallel.zigzag import unshard

NAME = "longstride_kv"


def _attention_keeping_kv(module, query, key, value, attention_mask, kv_out=None, **kwargs):
    # key/value: (B, Hkv, l, D) after RoPE, this rank's zig-zag share
    kv_out[module.layer_idx] = (key, value)
    return longstride_attention(module, query, key, value, attention_mask, **kwargs)


def world_cp(device_type: str) -> CPContext:
    """A ring over every process (cp_context; cp_prefill picks the kernel for the model's device). Collective:
    build it once per run, not per prompt."""
    n = dist.get_world_size()
    return cp_context("ring", ParallelDims.from_world(n, n), CPDegrees(ring=n), device_type, "sdpa")


@torch.no_grad()
def cp_prefill(model, ids: list[int], cp: CPContext) -> DynamicCache:
    """The KV cache of the first P' tokens of `ids` (see the module docstring), on every rank."""
    device = next(model.parameters()).device
    step = 2 * cp.degrees.ring
    length = (len(ids) - 1) // step * step  # at least one prompt token is left for generate
    cache = new_cache(model)
    if length == 0:
        return cache
    full = torch.tensor(ids[:length], device=device)[None]
    batch = {"input_ids": full, "position_ids": torch.arange(length, device=device)[None]}
    cp = dataclasses.replace(cp, kernel=auto_kernel(model, ring=cp.method is not None))
    local, layout = shard_for_cp(batch, False, cp)
    kv: dict[int, tuple] = {}
    with attention_implementation(model, NAME, _attention_keeping_kv, no_mask):
        decoder(model)(input_ids=local["input_ids"], position_ids=local["position_ids"], doc_layout=layout,
                       kv_out=kv, use_cache=False)
    for layer in range(len(kv)):
        parts = []
        for x in kv[layer]:
            x = x.contiguous()  # every rank sends and receives (B, Hkv, l, D)-contiguous bytes, whatever its layout
            shards = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(cp.degrees.ring)]
            dist.all_gather(shards, x)
            parts.append(unshard(shards, dim=2, assignment=layout.plan.assignment))  # (B, Hkv, P', D) in order
        cache.update(parts[0], parts[1], layer)
    return cache
