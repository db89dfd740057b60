"""Schema of the `parallel` config group and all degree arithmetic, validated in one place."""
from __future__ import annotations

from dataclasses import dataclass

CP_IMPLS = ("ring", "ulysses", "upipe", "hybrid")
KERNELS = ("auto", "sdpa", "flash_attn", "math")


@dataclass
class ParallelConfig:
    cp_impl: str = "ring"  # how a stage with cp > 1 splits the sequence; the degree is per stage
    kernel: str = "auto"  # auto: flash_attn on CUDA when installed, else sdpa (per document)
    fsdp: str = "auto"  # FSDP2 over all dp x cp ranks; auto: on for several CUDA ranks, DDP otherwise


@dataclass(frozen=True)
class ParallelDims:
    """world = dp x cp; rank r is (dp_rank, cp_rank) = divmod(r, cp): CP groups are contiguous
    ranks, so with cp <= GPUs per node a CP ring stays inside a node."""

    world: int
    dp: int
    cp: int

    @classmethod
    def from_world(cls, world: int, cp: int, where: str = "parallel") -> "ParallelDims":
        if cp < 1:
            raise ValueError(f"{where}: cp={cp} must be >= 1")
        if world % cp:
            raise ValueError(
                f"{where}: world size {world} is not divisible by cp {cp}; "
                f"launch a multiple of {cp} processes or pick cp from {[d for d in range(1, world + 1) if world % d == 0]}"
            )
        dims = cls(world, world // cp, cp)
        dims.validate()
        return dims

    def validate(self) -> None:
        if self.world != self.dp * self.cp:
            raise ValueError(f"world size {self.world} != dp {self.dp} x cp {self.cp}")

    def dp_rank(self, rank: int) -> int:
        return rank // self.cp

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp

    def mesh(self, device_type: str):
        """The (dp, cp) DeviceMesh over the world; mesh["cp"] is this rank's ring, mesh["dp"] its data
        replicas. Collective: every rank calls it, in the same order."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
