"""Runs a function on n local gloo processes (torch.multiprocessing spawn, file rendezvous): the parity tests
and the CPU benchmarks simulate a context-parallel group with it on one machine."""
from __future__ import annotations

import glob
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank's function raised; the message is that rank's traceback (the first rank to fail, when several did)."""


def _entry(rank: int, n: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=n)
    try:
        try:
            fn(rank, n, *args)
        except BaseException:
            # Written before this rank closes its connections, so before any peer can fail because of it: the
            # first file written is the cause, whichever process the spawn happens to see exit first.
            with open(f"{workdir}/failed.{rank}", "w") as f:
                f.write(traceback.format_exc())
            raise
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's and C++'s teardown. Process groups still referenced
    # (by a DDP or FSDP2 module, a device mesh) are otherwise freed during finalization, which can abort a process
    # whose work is done; CI once saw a rank die with "terminate called without an active exception" (SIGABRT).
    # What fn wrote is on disk; a failure above still raises, and the spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, n: int, *args) -> None:
    """fn(rank, world, *args) on n processes; raises RankFailed with the first failing rank's traceback if fn
    raised on any rank, or the spawn's own error if a process died without raising."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_entry, args=(n, d, fn, args), nprocs=n, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failed = sorted(glob.glob(os.path.join(d, "failed.*")), key=lambda p: os.stat(p).st_mtime_ns)
            if not failed:
                raise
            first = failed[0]
            with open(first) as f:
                cause = f.read()
            others = ", ".join(p.rsplit(".", 1)[1] for p in failed[1:]) or "none"
            raise RankFailed(f"rank {first.rsplit('.', 1)[1]} failed (ranks that failed after it: {others}):\n"
                             f"{cause}") from e


def gather_cat(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (same shape on all ranks), in rank order."""
    x = x.contiguous()  # one agreed layout on every rank, whatever layout x had
    parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts
