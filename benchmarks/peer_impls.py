"""The attention implementations that benchmarks/bench_peers.py compares, behind one small interface, and what
it measures them with: the fp64 reference, the collective byte counter, the mask and layout helpers.

Every implementation gets the same thing on each rank: leaf tensors q: (1, Lloc, H, D), k/v: (1, Lloc, Hkv, D)
(transformers' projection layout, contiguous), its share of the sequence in its own layout (zig-zag: rank r
holds chunks r and 2N-1-r; contiguous: rank r holds the r-th N-th), and returns out: (1, Lloc, H, D) for
out.backward(dout). The peers are imported only when their row runs; a missing one is a reason, not an error.

  longstride_ring     parallel/ring.py (zig-zag ring, document blocks from parallel/blocks.py)
  longstride_ulysses  parallel/ulysses.py, all heads in one stage
  longstride_upipe    parallel/ulysses.py in stages of U = N query heads (parallel/heads.py)
  ringmaster_zigzag   axolotl-ringmaster's zig-zag ring (its explicit-softmax blocks on CPU)
  torch_cp_flex       torch's context parallel, Flex path: K/V all-gathered, eager flex_attention
  deepspeed_ulysses   deepspeed.sequence.layer.DistributedAttention around torch SDPA (causal only)
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {"smollm2": Shape("smollm2", 9, 3, 64), "gqa8": Shape("gqa8", 8, 2, 128)}


# ---------------------------------------------------------------------------------------------- inputs, layouts

def make_inputs(shape: Shape, length: int, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, dout over the whole sequence, (1, L, heads, D) fp32; the same on every rank and for every row."""
    g = torch.Generator().manual_seed(seed)
    heads = (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
    return [torch.randn(1, length, h, shape.head_dim, generator=g) for h in heads]


def zigzag_index(length: int, n: int, rank: int) -> torch.Tensor:
    c = length // (2 * n)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def local_index(layout: str, length: int, n: int, rank: int) -> torch.Tensor:
    """The global positions this rank holds, in its local order."""
    if layout == "zigzag":
        return zigzag_index(length, n, rank)
    c = length // n
    return torch.arange(rank * c, (rank + 1) * c)


def doc_starts(doc: Optional[torch.Tensor], length: int) -> torch.Tensor:
    """(L,) the first position of each position's document (0 everywhere for plain causal)."""
    if doc is None:
        return torch.zeros(length, dtype=torch.long)
    new = torch.ones(length, dtype=torch.bool)
    new[1:] = doc[1:] != doc[:-1]
    starts = torch.where(new, torch.arange(length), torch.zeros(length, dtype=torch.long))
    return torch.cummax(starts, 0).values


# ---------------------------------------------------------------------------------------------- fp64 reference

def reference(q, k, v, dout, doc: Optional[torch.Tensor], scale: float, budget: int = 256 << 20):
    """Single-process fp64 attention forward + backward, in query blocks so that no L x L matrix per head
    exists (at 32K one would be 8 GiB): each block of queries meets only the keys from its first query's
    document start to its last query. q, dout: (1, L, H, D), k/v: (1, L, Hkv, D) -> out, dq, dk, dv fp64 in
    the same layouts. Written from the definition (softmax(q k^T * scale + mask) v), independent of every
    implementation measured."""
    _, L, H, D = q.shape
    g = H // k.shape[2]
    qd, dod = (x[0].double().transpose(0, 1) for x in (q, dout))  # (H, L, D)
    kd, vd = (x[0].double().repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
    out, dq = torch.empty_like(qd), torch.empty_like(qd)
    dk, dv = torch.zeros_like(kd), torch.zeros_like(kd)
    starts = doc_starts(doc, L)
    pos = torch.arange(L)
    block = max(16, 1 << int(math.log2(max(1, budget // (H * L * 8)))))
    for i0 in range(0, L, block):
        i1 = min(L, i0 + block)
        k0 = int(starts[i0])
        allowed = (pos[k0:i1][None, :] <= pos[i0:i1][:, None]) & (pos[k0:i1][None, :] >= starts[i0:i1][:, None])
        s = (qd[:, i0:i1] @ kd[:, k0:i1].transpose(1, 2)) * scale
        s.masked_fill_(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        o = p @ vd[:, k0:i1]
        out[:, i0:i1] = o
        do = dod[:, i0:i1]
        dp = do @ vd[:, k0:i1].transpose(1, 2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        del dp
        dq[:, i0:i1] = ds @ kd[:, k0:i1] * scale
        dk[:, k0:i1] += ds.transpose(1, 2) @ qd[:, i0:i1] * scale
        dv[:, k0:i1] += p.transpose(1, 2) @ do
    dk, dv = (x.unflatten(0, (H // g, g)).sum(1) for x in (dk, dv))  # the GQA group's gradients sum
    return [x.transpose(0, 1)[None].contiguous() for x in (out, dq, dk, dv)]


# ---------------------------------------------------------------------------------------------- bytes sent

class ByteCounter:
    """Counts the bytes this rank hands to the collectives torch.distributed exposes (point-to-point sends in
    batch_isend_irecv, all_to_all_single, all_gather(_into_tensor), reduce_scatter_tensor), by wrapping them for
    the duration of a `with`: the payload that leaves this rank for other ranks (an all-to-all's own piece and
    an all-gather's own copy excluded), not what the backend's algorithm re-forwards."""

    NAMES = ("batch_isend_irecv", "all_to_all_single", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        self.bytes = 0

    def _sent(self, name, args, kwargs) -> int:
        n = dist.get_world_size(kwargs.get("group"))
        if name == "batch_isend_irecv":
            return sum(op.tensor.numel() * op.tensor.element_size() for op in args[0] if op.op.__name__ == "isend")
        if name == "all_to_all_single":
            x = kwargs["input"] if "input" in kwargs else args[1]
            splits = kwargs.get("input_split_sizes") or (args[3] if len(args) > 3 else None)
            total = x.numel() * x.element_size()
            if splits:
                row = total // x.shape[0]
                return total - row * splits[dist.get_rank(kwargs.get("group"))]
            return total * (n - 1) // n
        if name == "all_gather":
            x = kwargs["tensor"] if "tensor" in kwargs else args[1]
        elif name == "all_gather_into_tensor":
            x = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
        else:  # reduce_scatter_tensor: every piece but one's own leaves
            x = kwargs["input"] if "input" in kwargs else args[1]
            return x.numel() * x.element_size() * (n - 1) // n
        return x.numel() * x.element_size() * (n - 1)

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed.distributed_c10d as c10d

        saved = {}
        for name in self.NAMES:
            fn = getattr(dist, name)
            saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                self.bytes += self._sent(_name, args, kwargs)
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapper)
            setattr(c10d, name, wrapper)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
                setattr(c10d, name, fn)


# ---------------------------------------------------------------------------------------------- implementations

@dataclass(frozen=True)
class Impl:
    name: str
    package: Optional[str]  # the peer's distribution (pip name), None for longstride
    module: Optional[str]  # what must be importable
    layout: str  # "zigzag" or "contiguous"
    masks: tuple  # the masks it can run
    bytes_how: str  # "counted" (wrapped collectives) or "computed" (from the algorithm)
    # (shape, length, n) -> why it cannot run, or None
    unsupported: Callable = lambda shape, length, n: None

    def available(self) -> Optional[str]:
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"{self.package} not installed (pip install -e \".[peers]\")"
        return None

    def reason(self, shape: Shape, length: int, mask: str, n: int) -> Optional[str]:
        if mask not in self.masks:
            return MASK_REASONS[self.name]
        return self.available() or self.unsupported(shape, length, n)


MASK_REASONS = {
    "deepspeed_ulysses": "causal only: DistributedAttention hands its local attention no document boundaries "
                         "(ALST's packed-document path is flash_attention_2 varlen through position_ids, CUDA)",
}


def _ulysses_heads(shape: Shape, length: int, n: int) -> Optional[str]:
    if shape.heads % n:
        return (f"{shape.heads} query heads do not split over {n} ranks (parallel/heads.py needs N | U | H); "
                "3 ranks would")
    return None


def _explicit_budget(what: str, elems: Callable):
    """A row whose implementation materialises H x Lq x Lk fp32 score matrices on CPU: refused before it
    starts when a rough peak (`elems` fp32 values) would not fit the per-rank budget of this benchmark."""
    def check(shape: Shape, length: int, n: int) -> Optional[str]:
        est = elems(shape, length, n) * 4
        if est > BUDGET_BYTES:
            return f"{what}: about {est / GiB:.0f} GiB per rank (estimated), over the {BUDGET_BYTES / GiB:.0f} GiB budget"
        return None
    return check


BUDGET_BYTES = 8 * GiB


def _flex_on_cpu(shape: Shape, length: int, n: int) -> Optional[str]:
    """torch's Flex CP runs its forward on CPU (eager flex_attention, dense math), but the first backward raises
    (seen at 1K on this machine, torch 2.13): refused up front instead of spawning ranks to watch it fail.
    BENCH_PEERS_TRY_FLEX=1 tries anyway (a newer torch may have the backward)."""
    import os

    if os.environ.get("BENCH_PEERS_TRY_FLEX") != "1" and not torch.cuda.is_available():
        return ("FlexAttention does not support backward on CPU (NotImplementedError from torch "
                f"{torch.__version__} at the first backward); its forward runs (eager, dense H x L/N x L math)")
    return None

IMPLS = {
    "longstride_ring": Impl("longstride_ring", None, None, "zigzag", ("causal", "docs"), "counted"),
    "longstride_ulysses": Impl("longstride_ulysses", None, None, "contiguous", ("causal", "docs"), "counted",
                               _ulysses_heads),
    "longstride_upipe": Impl("longstride_upipe", None, None, "contiguous", ("causal", "docs"), "counted",
                             _ulysses_heads),
    "ringmaster_zigzag": Impl("ringmaster_zigzag", "axolotl-ringmaster", "ringmaster", "zigzag", ("causal", "docs"),
                              "counted", _explicit_budget(
                                  "explicit-softmax blocks (H x L/N x L/N fp32 scores, probabilities, their gradients)",
                                  lambda s, L, n: 5 * s.heads * (L // n) ** 2)),
    "torch_cp_flex": Impl("torch_cp_flex", "torch", "torch.nn.attention.flex_attention", "zigzag", ("causal", "docs"),
                          "computed", _flex_on_cpu),
    "deepspeed_ulysses": Impl("deepspeed_ulysses", "deepspeed", "deepspeed", "contiguous", ("causal",), "counted"),
}


def build(name: str, shape: Shape, length: int, n: int, rank: int, doc: Optional[torch.Tensor], scale: float):
    """This rank's attention call for implementation `name`: fn(q, k, v) -> out, all (1, Lloc, heads, D).
    doc: (L,) document ids of the whole sequence, None for plain causal. Collective (every rank calls it)."""
    group = dist.group.WORLD
    if name.startswith("longstride_"):
        from longstride.parallel.blocks import ring_plan
        from longstride.parallel.ring import RingComm, ring_attention
        from longstride.parallel.ulysses import HeadComm, ulysses_attention

        docs = None if doc is None else doc[None]
        if name == "longstride_ring":
            plan, comm = ring_plan(docs, 1, length, n, rank), RingComm(group)
            return lambda q, k, v: ring_attention(*(x.transpose(1, 2) for x in (q, k, v)), plan, "sdpa", scale,
                                                  comm).transpose(1, 2)
        plan, heads = ring_plan(docs, 1, length, 1, 0), HeadComm(group)
        U = n if name == "longstride_upipe" else 0
        return lambda q, k, v: ulysses_attention(*(x.transpose(1, 2) for x in (q, k, v)), plan, "sdpa", scale, None,
                                                 heads, U).transpose(1, 2)
    if name == "ringmaster_zigzag":
        from ringmaster.ring.zigzag import zigzag_ring_attention

        # its CPU path is the document-masked one; plain causal is one document
        bounds = [0, length] if doc is None else \
            [0, *(torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist(), length]
        cu = torch.tensor(bounds, dtype=torch.int32)
        return lambda q, k, v: zigzag_ring_attention(*(x.transpose(1, 2) for x in (q, k, v)), group=group,
                                                     scaling=scale, cu_seqlens=cu)
    if name == "torch_cp_flex":
        return _torch_flex(shape, length, n, doc, scale)
    if name == "deepspeed_ulysses":
        return _deepspeed(shape, scale, group)
    raise ValueError(f"unknown implementation {name!r}; known: {list(IMPLS)}")


def _torch_flex(shape: Shape, length: int, n: int, doc: Optional[torch.Tensor], scale: float):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (_ContextParallel,
                                                                                   _create_cp_block_mask)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    class Attend(torch.nn.Module):
        def forward(self, query, key, value, block_mask=None):
            return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)

    mesh = DeviceMesh("cpu", list(range(n)))
    attn = parallelize_module(Attend(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    if doc is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
    # head-tail is the zig-zag layout (rank r: chunks r and 2N-1-r), so the inputs are sharded as for the rings
    block_mask = _create_cp_block_mask(mask_mod, 1, 1, length, length, device_mesh=mesh,
                                       load_balancer=_HeadTailLoadBalancer(length, n, "cpu"))
    return lambda q, k, v: attn(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask).transpose(1, 2)


def _deepspeed(shape: Shape, scale: float, group):
    import deepspeed
    import deepspeed.comm
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    def local(q, k, v, *args, **kwargs):
        # (1, L, h, D) with this rank's heads over the whole sequence: torch's SDPA (the CPU flash kernel)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o.transpose(1, 2)

    attn = DistributedAttention(local, group, scatter_idx=2, gather_idx=1, num_kv_heads=shape.kv_heads)
    return lambda q, k, v: attn(q, k, v, 0)


def computed_bytes(name: str, shape: Shape, length: int, n: int) -> int:
    """Bytes a rank sends in one forward + backward, from the algorithm, where they are not counted: torch's
    Flex CP all-gathers K and V (each rank's shard to N-1 ranks) and reduce-scatters dK and dV (N-1 of N
    pieces of the full-length gradients leave each rank), fp32."""
    assert name == "torch_cp_flex", name
    kv_local = 2 * shape.kv_heads * (length // n) * shape.head_dim * 4
    return kv_local * (n - 1) + kv_local * n * (n - 1) // n
