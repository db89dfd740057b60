"""Context-parallel methods by name (`parallel.cp_impl`), and a stage's context-parallel context.

Each method is a module that states three things:
    degrees(cfg, cp, heads, where, world) -> CPDegrees   how a stage's cp splits (ring x Ulysses, UPipe's U);
                                                         world: the processes (0: unknown), for its hints
    shard(batch, docs, cp) -> (local batch, plan)    this rank's share of a full PackedBatch, its ring plan
    attention(q, k, v, layout, scale, pattern, sinks) -> out
                                                     the attention every layer runs, with the layer's window or
                                                     chunk and sinks (parallel/pattern.py), computed or refused
Adding a method is its module plus one entry in METHODS; validation (recipes/config/plan.py), the stage and
the attention function read them from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from longstride.parallel import hybrid, ring, ulysses, upipe
from longstride.parallel.blocks import RingPlan, check_doc_runs
from longstride.parallel.config import CPDegrees, ParallelDims, WorldMesh
from longstride.parallel.kernels import doc_bounds
from longstride.parallel.ring import RingComm
from longstride.parallel.ulysses import HeadComm

METHODS = {"ring": ring, "ulysses": ulysses, "upipe": upipe, "hybrid": hybrid}


def method(name: str):
    if name not in METHODS:
        raise ValueError(f"parallel.cp_impl={name!r} is unknown; use one of {list(METHODS)}")
    return METHODS[name]


def cp_degrees(cfg, cp: int, heads: int, where: str = "cp", world: int = 0) -> CPDegrees:
    """The (ring, Ulysses, U) split of a stage's cp under cfg.cp_impl (cfg: ParallelConfig), for a model with
    `heads` query heads; a ValueError naming the fields when it does not divide (the degrees it offers also
    divide `world`, the processes, when given)."""
    impl = method(cfg.cp_impl)
    return CPDegrees() if cp == 1 else impl.degrees(cfg, cp, heads, where, world)


@dataclass(frozen=True)
class CPContext:
    """One stage's context parallelism on this rank: the method (None: one device, no CP), its degrees, this
    rank's place in the ring and in its Ulysses group with their communicators, the attention kernel, and
    the ring's chunk assignment rule (zigzag, or docs: parallel/balance.py, up to balance_chunks per rank) and the
    model's layer patterns that rule weighs ((Pattern, layers), ...: parallel/pattern.model_patterns)."""

    method: Optional[str] = None
    degrees: CPDegrees = CPDegrees()
    ring_rank: int = 0
    ulysses_rank: int = 0
    ring_comm: Optional[RingComm] = None
    head_comm: Optional[HeadComm] = None
    kernel: str = "sdpa"
    balance: str = "zigzag"
    balance_chunks: int = 8
    patterns: tuple = ()


def cp_context(impl: str, dims: ParallelDims, degrees: CPDegrees, device_type: str, kernel: str,
               balance: str = "zigzag", balance_chunks: int = 8, mesh: Optional[WorldMesh] = None,
               patterns: tuple = ()) -> CPContext:
    """This rank's CPContext (dims: the stage's ParallelDims, degrees: cp_degrees(...)): the one factory, for
    training, the HF Trainer path (recipes/hf/trainer.setup_cp) and CP prefill (eval/ruler/cp_prefill). Its
    process groups are a layout of `mesh` (the run's WorldMesh; one is built when none is given). Collective
    when cp > 1."""
    if dims.cp != degrees.cp:
        raise ValueError(f"cp {dims.cp} != ring {degrees.ring} x ulysses {degrees.ulysses}")
    if dims.cp == 1:
        return CPContext(kernel=kernel)
    mesh = (mesh or WorldMesh(device_type, dims.world)).layout(dims, degrees.ulysses)
    comm = RingComm(mesh.get_group("ring")) if degrees.ring > 1 else None
    heads = HeadComm(mesh.get_group("ulysses")) if degrees.ulysses > 1 else None
    return CPContext(impl, degrees, ring_rank=mesh.get_local_rank("ring"), ulysses_rank=mesh.get_local_rank("ulysses"),
                     ring_comm=comm, head_comm=heads, kernel=kernel, balance=str(balance), balance_chunks=balance_chunks,
                     patterns=patterns)


class DocLayout:
    """What attention needs to know about a packed batch: doc_ids (B, L), None for plain causal (one device);
    with CP the documents are encoded in the ring plan instead (parallel/blocks.py); cp the stage's context; bounds:
    per row, (start, end) of each document, read from doc_ids once, when the layout is made, not in every layer.

    A plain object, not a dataclass: FSDP2's input casts (torch.distributed.utils._apply_to_tensors) rebuild every
    dataclass, list and tuple in each layer's keyword arguments, which would copy the bounds, the ring plan and its
    blocks once per layer (and again in a checkpointed layer's recompute); this object reaches every layer as it
    is. It holds no floating-point tensor, so the casts have nothing to change in it."""

    __slots__ = ("doc_ids", "plan", "cp", "bounds")

    def __init__(self, doc_ids: Optional[torch.Tensor], plan: Optional[RingPlan] = None, cp: CPContext = CPContext(),
                 bounds: Optional[list] = None):
        self.doc_ids, self.plan, self.cp = doc_ids, plan, cp
        self.bounds = doc_bounds(doc_ids) if bounds is None and doc_ids is not None else bounds

    def __repr__(self) -> str:
        docs = None if self.doc_ids is None else tuple(self.doc_ids.shape)
        return f"DocLayout(doc_ids={docs}, plan={self.plan is not None}, cp={self.cp})"


def shard_for_cp(batch: dict, doc_masking: bool, cp: CPContext) -> tuple[dict, DocLayout]:
    """A full PackedBatch -> (this rank's share of every tensor, the DocLayout its attention calls read)."""
    docs = batch["doc_ids"] if doc_masking else None
    if cp.method is None:
        if docs is not None:
            check_doc_runs(docs.cpu().numpy())
        return batch, DocLayout(docs, cp=cp)
    length, d = batch["input_ids"].shape[-1], cp.degrees
    if length % d.seq_len_unit:
        raise ValueError(f"a packed batch of {length} tokens, split by cp_impl={cp.method} over ring {d.ring} x "
                         f"ulysses {d.ulysses}: its length must be a multiple of {d.seq_len_unit} (2 chunks per ring "
                         f"rank, each split over the Ulysses group); pack to such a length")
    local, plan = method(cp.method).shard(batch, docs, cp)
    return local, DocLayout(None, plan, cp)
