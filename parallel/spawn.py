"""Runs a function on n local gloo processes (torch.multiprocessing spawn, file rendezvous): the parity tests
and the CPU benchmarks simulate a context-parallel group with it on one machine."""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, n: int, init_file: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n)
    try:
        fn(rank, n, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's and C++'s teardown. Process groups still referenced
    # (by a DDP or FSDP2 module, a device mesh) are otherwise freed during finalization, which can abort a process
    # whose work is done; CI once saw a rank die with "terminate called without an active exception" (SIGABRT),
    # not reproduced in 18 runs of that test here. What fn wrote is on disk; a failure above still raises, and the
    # spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, n: int, *args) -> None:
    """fn(rank, world, *args) on n processes; raises if any process fails."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(n, os.path.join(d, "rendezvous"), fn, args), nprocs=n, join=True)


def gather_cat(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (same shape on all ranks), in rank order."""
    x = x.contiguous()  # one agreed layout on every rank, whatever layout x had
    parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts
