"""longstride's attention inside transformers models, through transformers' registries.

`register()` adds the name "longstride" to AttentionInterface and AttentionMaskInterface. The mask
function returns None (no L x L mask is ever built); the attention function reads the batch's
document layout from the `doc_layout` keyword that the training step passes to the model forward,
which transformers forwards untouched to every attention call.

With context parallelism, `shard_for_cp` cuts a packed batch into this rank's share (zig-zag, or the
document-aware assignment of parallel/balance.py) and builds the ring plan from the full batch's
document ids; the model then sees only local tokens
(RoPE is computed for local positions only) and every attention call runs the ring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from longstride.parallel.balance import balanced_assignment
from longstride.parallel.blocks import RingPlan, check_doc_runs, ring_plan
from longstride.parallel.kernels import doc_attention
from longstride.parallel.ring import RingComm, ring_attention
from longstride.parallel.ulysses import HeadComm, ulysses_attention
from longstride.parallel.zigzag import shard_batch, split_batch, zigzag

NAME = "longstride"


@dataclass
class DocLayout:
    """What attention needs to know about a packed batch. doc_ids: (B, L) or None (plain causal).
    With a plan (CP > 1) the documents are encoded in the plan and doc_ids is unused; heads set means
    Ulysses (UPipe when stage_heads > 0) over the ring-local sequence."""

    doc_ids: Optional[torch.Tensor]
    kernel: str = "sdpa"
    plan: Optional[RingPlan] = None
    comm: Optional[RingComm] = None
    heads: Optional[HeadComm] = None
    stage_heads: int = 0


@dataclass(frozen=True)
class CPContext:
    """This rank's place in its context-parallel group: ring degree n (comm None when 1) x Ulysses
    degree `ulysses` (heads None when 1); stage_heads is UPipe's U (0: all heads at once)."""

    n: int = 1
    rank: int = 0
    comm: Optional[RingComm] = None
    ulysses: int = 1
    ulysses_rank: int = 0
    heads: Optional[HeadComm] = None
    stage_heads: int = 0
    balance: str = "zigzag"  # zigzag | docs: the ring's chunk assignment per batch (parallel/balance.py)
    balance_chunks: int = 8  # docs: the most chunks per ring rank tried

    @property
    def size(self) -> int:
        return self.n * self.ulysses


def cp_context(dims, degrees, device_type: str, balance: str = "zigzag", balance_chunks: int = 8) -> CPContext:
    """This rank's CPContext for a stage: dims a ParallelDims, degrees its CPDegrees (parallel/config.py),
    balance the ring's chunk assignment (zigzag, or docs: parallel/balance.py). Collective (builds the
    device mesh) when cp > 1."""
    if dims.cp == 1:
        return CPContext()
    mesh = dims.mesh(device_type, degrees.ulysses)
    ring = RingComm(mesh.get_group("ring")) if degrees.ring > 1 else None
    heads = HeadComm(mesh.get_group("ulysses")) if degrees.ulysses > 1 else None
    return CPContext(degrees.ring, mesh.get_local_rank("ring"), ring, degrees.ulysses, mesh.get_local_rank("ulysses"),
                     heads, degrees.stage_heads, str(balance), balance_chunks)


def shard_for_cp(batch: dict, doc_masking: bool, kernel: str, cp: CPContext) -> tuple[dict, DocLayout]:
    """A full PackedBatch -> (this rank's share of every tensor, the layout its attention calls read).
    The share is the ring rank's zig-zag share, then its Ulysses rank's contiguous piece of that."""
    docs = batch["doc_ids"] if doc_masking else None
    if cp.size == 1:
        if docs is not None:
            check_doc_runs(docs.cpu().numpy())
        return batch, DocLayout(docs, kernel)
    B, L = batch["input_ids"].shape
    assignment = zigzag(cp.n)
    if cp.balance == "docs" and docs is not None:
        assignment = balanced_assignment(docs.cpu().numpy(), cp.n, cp.balance_chunks)
    local = split_batch(shard_batch(batch, cp.n, cp.rank, assignment), cp.ulysses, cp.ulysses_rank)
    plan = ring_plan(docs, B, L, cp.n, cp.rank, assignment)
    return local, DocLayout(None, kernel, plan, cp.comm, cp.heads, cp.stage_heads)


def longstride_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         doc_layout: Optional[DocLayout] = None, **kwargs):
    # query: (B, H, L, D), key/value: (B, Hkv, L, D) -> ((B, L, H, D), None)
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstride attention")
    layout = doc_layout or DocLayout(None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = _same_dtype(query, key, value)
    if layout.heads is not None:
        out = ulysses_attention(query, key, value, layout.plan, layout.kernel, scale, layout.comm, layout.heads,
                                layout.stage_heads)
    elif layout.plan is not None:
        out = ring_attention(query, key, value, layout.plan, layout.kernel, scale, layout.comm)
    else:
        out = doc_attention(query, key, value, layout.doc_ids, scale, layout.kernel)
    return out.transpose(1, 2).contiguous(), None


def _same_dtype(q, k, v):
    """Under autocast, transformers hands attention q/k in fp32 (RoPE multiplies them by fp32 cos/sin) and v in
    the autocast dtype; the kernels and the ring's messages need one dtype: autocast's (as SDPA would cast
    to), else the widest of the three. A cast keeps the tensor's (B, L, H, D) memory layout."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(NAME, longstride_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def use_longstride_attention(model: torch.nn.Module) -> None:
    register()
    model.set_attn_implementation(NAME)
