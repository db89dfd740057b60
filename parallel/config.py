"""Schema of the `parallel` config group, the dp x cp split of the world (ParallelDims) and the degree
checks the CP methods share (each method's own degree rule is in its module: parallel/cp.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from longstride.choices import Choice


class Balance(Choice):
    zigzag = "zigzag"  # 2 chunks per rank (r and 2N-1-r): exact for plain causal attention
    docs = "docs"  # parallel/balance.py: chunks dealt per batch for equal within-document work


class Kernel(Choice):
    # the attention kernel behind every block (parallel/kernels.py)
    auto = "auto"
    torch_flash = "torch_flash"
    flash_attn = "flash_attn"
    sdpa = "sdpa"
    math = "math"


class FlashImpl(Choice):
    # which flash attention torch_flash runs (torch.nn.attention.activate_flash_attention_impl)
    FA2 = "FA2"  # built into CUDA builds of torch
    FA3 = "FA3"  # Hopper; needs the FA3 package (flash_attn_interface)
    FA4 = "FA4"


@dataclass
class ParallelConfig:
    cp_impl: str = "ring"  # a method of parallel/cp.py METHODS: how a stage with cp > 1 splits the sequence
    # auto: torch_flash on CUDA in bf16 for heads it takes (torch's own varlen flash attention), sdpa on CPU
    kernel: Kernel = Kernel.auto
    flash_impl: FlashImpl = FlashImpl.FA2  # the flash attention behind torch_flash: FA2, or FA3 / FA4 where installed
    fsdp: str = "auto"  # FSDP2 over all dp x cp ranks; auto: on for several CUDA ranks, DDP otherwise
    ulysses: int = 0  # hybrid only: the Ulysses degree inside each ring rank (ring degree = cp / ulysses)
    upipe_heads: int = 0  # U, query heads per stage; 0: upipe, the Ulysses degree; hybrid, all heads (no stages)
    # The ring's chunk assignment per batch: zigzag (2 chunks per rank, exact for plain causal attention) or
    # docs (parallel/balance.py: up to balance_chunks chunks per rank, dealt so that every rank's
    # within-document attention work is as equal as the batch's documents allow). Per stage too.
    balance: Balance = Balance.zigzag
    balance_chunks: int = 8


@dataclass(frozen=True)
class CPDegrees:
    """How a stage's cp splits: cp = ring x ulysses. stage_heads: UPipe's U (query heads per stage over
    the Ulysses group); 0 runs all heads at once (plain Ulysses)."""

    ring: int = 1
    ulysses: int = 1
    stage_heads: int = 0

    @property
    def cp(self) -> int:
        """The context-parallel degree: ring x ulysses."""
        return self.ring * self.ulysses

    @property
    def seq_len_unit(self) -> int:
        """A split sequence's length must be a multiple of this: the ring's 2 x ring chunks, each split over the
        Ulysses group (ring x lcm(2, ulysses) covers both)."""
        return self.ring * math.lcm(2, self.ulysses)

    def plain_ulysses(self, heads: int) -> int:
        """The Ulysses degree where all `heads` query heads run in one stage (plain Ulysses, alone or inside a ring),
        whose head-layout q and K/V selective checkpointing keeps (model/memory.ulysses_keeps); 1 otherwise."""
        return self.ulysses if self.ulysses > 1 and self.stage_heads in (0, heads) else 1


def describe_cp(impl: str, d: CPDegrees, kv_heads: int = 0) -> str:
    """' upipe: ring 2 x ulysses 2, 2 heads per stage' for the stage log; states the K/V heads that travel
    when they are replicated to divide by the Ulysses degree."""
    parts = [f"ring {d.ring}"] if d.ring > 1 else []
    parts += [f"ulysses {d.ulysses}"] if d.ulysses > 1 else []
    text = f" {impl}: " + " x ".join(parts) + (f", {d.stage_heads} heads per stage" if d.stage_heads else "")
    if d.ulysses > 1 and kv_heads % d.ulysses:
        text += f", K/V {kv_heads} heads replicated to {math.lcm(kv_heads, d.ulysses)} for the all-to-all"
    return text


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(choices: list[int], x: int) -> list[int]:
    return sorted(sorted(choices, key=lambda c: (abs(c - x), c))[:2])


def check_ulysses(u: int, cp: int, heads: int, where: str, within: int = 0) -> None:
    """A Ulysses degree u must divide the query heads (the all-to-all splits them over u ranks). K/V heads
    need no check: when they do not divide by u they are replicated (parallel/heads.py). within: what the degree
    must also divide (hybrid: the cp; Ulysses over all cp ranks: the processes, when known), so that the degrees
    offered pass the next check too."""
    if heads % u:
        ok = [d for d in divisors(heads) if d > 1 and not (within and within % d)]
        raise ValueError(f"{where}={cp}: the Ulysses degree {u} must divide the model's {heads} query heads; "
                         f"valid Ulysses degrees are {ok} (nearest: {_nearest(ok, u)}), or use parallel.cp_impl=ring")


def stage_heads(upipe_heads: int, u: int, heads: int) -> int:
    """UPipe's U from parallel.upipe_heads (0: the Ulysses degree), checked; 0 when U is all the heads."""
    U = upipe_heads or u
    if U % u or heads % U:
        ok = [d for d in divisors(heads) if d % u == 0]
        raise ValueError(f"parallel.upipe_heads={U} must be a multiple of the Ulysses degree {u} and divide the "
                         f"{heads} query heads; valid: {ok} (nearest: {_nearest(ok, U)})")
    return 0 if U == heads else U


@dataclass(frozen=True)
class ParallelDims:
    """world = dp x cp; rank r is (dp_rank, cp_rank) = divmod(r, cp): CP groups are contiguous
    ranks, so with cp <= GPUs per node a CP ring stays inside a node."""

    world: int
    dp: int
    cp: int

    def __post_init__(self):  # built directly too (benchmarks, the check command): the same arithmetic holds
        if min(self.world, self.dp, self.cp) < 1 or self.world != self.dp * self.cp:
            raise ValueError(f"world size {self.world} != dp {self.dp} x cp {self.cp}; every degree >= 1")

    @classmethod
    def from_world(cls, world: int, cp: int, where: str = "parallel") -> "ParallelDims":
        if cp < 1:
            raise ValueError(f"{where}: cp={cp} must be >= 1")
        if world % cp:
            raise ValueError(
                f"{where}: world size {world} is not divisible by cp {cp}; "
                f"launch a multiple of {cp} processes or pick cp from {divisors(world)}"
            )
        return cls(world, world // cp, cp)

    def dp_rank(self, rank: int) -> int:
        return rank // self.cp


class WorldMesh:
    """The run's one DeviceMesh: every rank along a single "world" dimension, built once (collective: every
    rank makes it, in the same order). FSDP2 shards over it as it is (each rank holds 1/world of the model
    whatever the dp x cp split), and each stage's (dp, ring, ulysses) layout is a view of it
    (DeviceMesh._unflatten, made once per layout and kept): stages with the same split share their process
    groups and no stage builds a mesh of its own. Ulysses groups are contiguous ranks (inside a node), rings
    stride across them."""

    def __init__(self, device_type: str, world: int):
        from torch.distributed import device_mesh

        self.world = world
        self.mesh = device_mesh.init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
        self._layouts: dict = {}

    def layout(self, dims: ParallelDims, ulysses: int = 1):
        """The (dp, ring, ulysses) view for a stage's dims; ring x ulysses = cp. Collective the first time."""
        if dims.world != self.world:
            raise ValueError(f"a stage of {dims.world} ranks on a mesh of {self.world}")
        if dims.cp % ulysses:
            raise ValueError(f"cp {dims.cp} is not ring x ulysses {ulysses} for any whole ring degree: the Ulysses "
                             "degree must divide cp")
        key = (dims.dp, dims.cp // ulysses, ulysses)
        if key not in self._layouts:
            view = self.mesh._unflatten(0, key, ("dp", "ring", "ulysses"))
            world_timeout(view)
            self._layouts[key] = view
        return self._layouts[key]


def world_group_timeout():
    """How long the world's default group waits (train.collective_timeout_s, given where the launcher made it), or
    None for a fake process group (the memory trace, recipes/memory/trace.py): nothing waits there."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    options = getattr(world._get_backend(world._device_types[0]), "options", None)
    return None if options is None else options._timeout


def world_timeout(view) -> None:
    """Every process group of a mesh view waits as long as the world's default group (world_group_timeout): torch
    gives a new group its backend's default instead, 10 minutes for NCCL, so a ring or Ulysses collective would
    abort sooner than the run was told."""
    from torch.distributed import distributed_c10d as c10d

    timeout = world_group_timeout()
    if timeout is None:
        return
    for name in view.mesh_dim_names:
        c10d._set_pg_timeout(timeout, view.get_group(name))
