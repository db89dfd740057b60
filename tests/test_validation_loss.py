"""The held-out loss a stage logs (recipes/run/stage.py validation_loss) over data-parallel ranks, under DDP and
FSDP2: the token mean over every held-out sequence, as one process computes it, when the sequences do not divide
evenly among the ranks (8 over 3). FSDP2 gathers the parameters over all ranks in every forward, so ranks that ran
different numbers of forwards hung there until the collective timeout."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from longstride.parallel.spawn import rank_accelerator, run_gloo


def _held_out(n: int = 8) -> list[dict]:
    from longstride.data.batch import packed_item
    from tests.test_cp_model import L

    rng = np.random.default_rng(1)
    return [packed_item([rng.integers(2, 50, int(rng.integers(5, 60))), rng.integers(2, 50, 30)], L, 1)
            for _ in range(8)][:n]


def _validation(rank: int, world: int, fsdp: bool, n: int, out: str) -> None:
    from longstride.parallel.config import ParallelDims, WorldMesh
    from longstride.parallel.parallelize import parallelize
    from longstride.recipes.run.stage import validation_loss
    from longstride.recipes.run.step import StepSpec, build_step
    from tests.test_cp_model import tiny_model

    acc = rank_accelerator(rank, world)
    built = build_step(tiny_model().lm, StepSpec(loss_tile=20))
    model = parallelize(built.module, built.module.lm.model.layers, fsdp, acc, WorldMesh("cpu", world))
    run = types.SimpleNamespace(held_out=_held_out(n), plan=types.SimpleNamespace(dims=ParallelDims(world, world, 1)),
                                prep=built.prep, model=model)
    loss = validation_loss(types.SimpleNamespace(accelerator=acc), run)
    torch.save(loss, f"{out}.{rank}")


@pytest.mark.parametrize("n", [8, 2])  # 3 ranks: shares of 3, 3, 2; and 1, 1, 0
def test_held_out_loss_over_ranks_that_share_it_unevenly(tmp_path, n):
    run_gloo(_validation, 1, False, n, str(tmp_path / "one"))  # the reference: one process, every sequence
    want = torch.load(tmp_path / "one.0")
    for fsdp in (False, True):
        run_gloo(_validation, 3, fsdp, n, str(tmp_path / f"three_{fsdp}"))
        got = [torch.load(tmp_path / f"three_{fsdp}.{r}") for r in range(3)]
        assert all(abs(g - want) <= 1e-5 * abs(want) for g in got), (fsdp, got, want)
