"""One device mesh per run: every stage's context-parallel groups and FSDP2's shards come from the run's
WorldMesh (parallel/config.py); a stage with a split seen before reuses its process groups."""
from __future__ import annotations

import torch
import torch.distributed as dist

from longstride.parallel.spawn import run_gloo


def _worker(rank, world):
    from torch.distributed import device_mesh

    from longstride.parallel.config import CPDegrees, ParallelDims, WorldMesh
    from longstride.parallel.cp import cp_context
    from longstride.parallel.fsdp import apply_fsdp

    built = []
    real = device_mesh.init_device_mesh
    device_mesh.init_device_mesh = lambda *a, **k: built.append(a) or real(*a, **k)
    try:
        mesh = WorldMesh("cpu", world)
        dims = ParallelDims.from_world(world, world)
        ring = cp_context("ring", dims, CPDegrees(ring=world), "cpu", "sdpa", mesh=mesh)
        uly = cp_context("ulysses", dims, CPDegrees(ulysses=world), "cpu", "sdpa", mesh=mesh)
        again = cp_context("ring", dims, CPDegrees(ring=world), "cpu", "sdpa", mesh=mesh)  # a later stage, same split
        dp_only = cp_context("ring", ParallelDims.from_world(world, 1), CPDegrees(), "cpu", "sdpa", mesh=mesh)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        apply_fsdp(model, list(model), "cpu", world, mesh=mesh)
        assert len(built) == 1, f"{len(built)} meshes built in one run"
        assert again.ring_comm.group is ring.ring_comm.group, "a stage with a split seen before made new process groups"
        assert dp_only.method is None and dp_only.ring_comm is None
        assert (ring.ring_rank, uly.ulysses_rank) == (rank, rank)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=ring.ring_comm.group)
        u = torch.tensor([float(rank + 1)])
        dist.all_reduce(u, group=uly.head_comm.group)
        assert t.item() == u.item() == world * (world + 1) / 2
        assert model[0].weight.to_local().shape == (4 // world, 4), "FSDP2 shards over the world mesh"
    finally:
        device_mesh.init_device_mesh = real


def test_one_mesh_per_run_serves_every_stage_and_fsdp():
    run_gloo(_worker, 2)


def _timeout_worker(rank, world):
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from longstride.parallel.config import ParallelDims, WorldMesh

    c10d._set_pg_timeout(timedelta(seconds=77))  # as train.collective_timeout_s sets the default group's
    mesh = WorldMesh("cpu", world)
    for cp, ulysses in ((world, 1), (world, world), (1, 1)):
        view = mesh.layout(ParallelDims.from_world(world, cp), ulysses)
        for name in view.mesh_dim_names:
            group = view.get_group(name)
            got = group._get_backend(torch.device("cpu")).options._timeout
            assert got == timedelta(seconds=77), (cp, ulysses, name, got)


def test_every_stage_group_waits_as_long_as_the_world_group():
    """torch gives a new process group its backend's default timeout (30 minutes on gloo, 10 on NCCL), not the
    default group's; the run's collective timeout must reach the ring, Ulysses and data-parallel groups too."""
    run_gloo(_timeout_worker, 2)


def test_degrees_that_do_not_multiply_out_are_refused_naming_every_factor():
    """ParallelDims built directly (the check command, benchmarks) skipped from_world's arithmetic, and nothing
    compared a stage's cp with its ring x ulysses: a layout of other sizes than the ranks it spans."""
    import pytest

    from longstride.parallel.config import CPDegrees, ParallelDims
    from longstride.parallel.cp import cp_context

    with pytest.raises(ValueError, match=r"world size 6 != dp 2 x cp 2"):
        ParallelDims(6, 2, 2)
    with pytest.raises(ValueError, match=r"cp 4 != ring 2 x ulysses 1"):
        cp_context("ring", ParallelDims(4, 1, 4), CPDegrees(ring=2), "cpu", "sdpa")
