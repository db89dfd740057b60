"""The few collectives over the default process group that the training loop's policies share (losses,
token counts, the non-finite and stop-signal decisions): no-ops in a single process."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduces x over all ranks in place and returns it. NCCL reduces device tensors only, so a CPU x
    travels through the current GPU."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and x.device.type == "cpu":
            x.copy_(all_reduce(x.to(f"cuda:{torch.cuda.current_device()}"), op))
        else:
            dist.all_reduce(x, op=op)
    return x


def from_main(fn):
    """fn() run on rank 0 only, and its result (or the exception it raised) handed to every rank: a decision made
    once, the same on all ranks (which checkpoint to resume from: verifying it reads every file). Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as e:  # every rank raises it, instead of the others waiting for rank 0
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value
