"""parallel/spawn.run_gloo: every rank's result reaches the caller, and a rank that fails fails the call (a finished
rank leaves through os._exit, so nothing but its files and its exit status comes back)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from longstride.parallel.spawn import run_gloo


def _sum_ranks(rank, world, out):
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    torch.save(x, f"{out}.{rank}")


def _rank1_fails(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_every_rank_writes_its_result(tmp_path):
    run_gloo(_sum_ranks, 2, str(tmp_path / "sum"))
    assert [torch.load(tmp_path / f"sum.{r}").item() for r in range(2)] == [3.0, 3.0]


def test_a_failing_rank_fails_the_call():
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        run_gloo(_rank1_fails, 2)
