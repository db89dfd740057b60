"""The few collectives over the default process group that the training loop's policies share (losses,
token counts, the non-finite and stop-signal decisions): no-ops in a single process. And host staging for
the CP exchanges: gloo moves host memory, so with gloo (several processes sharing one GPU, the GPU tests)
device tensors travel through host buffers."""
from __future__ import annotations

import pickle
from typing import Callable, Optional

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """Reduces x over all ranks (of `group`: the default group when None) in place and returns it. NCCL reduces
    device tensors only, so a CPU x travels through the current GPU."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl" and x.device.type == "cpu":
            x.copy_(all_reduce(x.to(f"cuda:{torch.cuda.current_device()}"), op, group))
        else:
            dist.all_reduce(x, op=op, group=group)
    return x


def raise_if_any(error: Optional[BaseException], elsewhere: Callable[[], BaseException], group=None) -> None:
    """Collective: each rank says whether its part of a shared piece of work failed (`error`, None: it did not). The
    rank that failed raises its own error, every other one `elsewhere()`, instead of waiting at the next collective
    for a rank that has left (until the launcher or the collective timeout ends it). A no-op in one process but
    for raising `error`. `group`: the ranks that agree (the default group when None), as in the functions below."""
    if all_reduce(torch.tensor([0.0 if error is None else 1.0]), group=group).item():
        raise error if error is not None else elsewhere()


def gathered(value, group=None) -> list:
    """Collective: every rank's `value` (small and picklable), in rank order; [value] in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def differing(values: dict) -> list[str]:
    """Collective: each of `values` (small and picklable, the same names on every rank) that some rank holds
    otherwise than rank 0, as "name: rank 0 has A, rank k B" (the first such rank). Empty when every rank agrees,
    and in one process."""
    every, apart = gathered(values), []
    for name, first in every[0].items():
        other = next(((r, v[name]) for r, v in enumerate(every) if v[name] != first), None)
        if other is not None:
            apart.append(f"{name}: rank 0 has {first!r}, rank {other[0]} {other[1]!r}")
    return apart


def rank_world(group=None) -> tuple[int, int]:
    """(this process's rank, the world size) of `group` (the default group when None); (0, 1) in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def together(fn: Callable, elsewhere: Callable[[], BaseException], main_only: bool = False, group=None):
    """fn() (with `main_only`, on rank 0 alone: None elsewhere), its failure on any rank raised on every rank
    (raise_if_any) instead of the others waiting for the failed one at their next collective. Collective."""
    error = value = None
    if rank_world(group)[0] == 0 or not main_only:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            error = e
    raise_if_any(error, elsewhere, group)
    return value


def main_first(fn: Callable, elsewhere: Callable[[], BaseException]):
    """fn() on rank 0, then on the others (which reuse what rank 0 left behind: a tokenizer, a cache), a failure
    on any rank raised on every rank at that point (together). Collective."""
    main = rank_world()[0] == 0
    first = together(fn, elsewhere, main_only=True)
    rest = together((lambda: None) if main else fn, elsewhere)
    return first if main else rest


def from_main(fn, group=None):
    """fn() run on rank 0 only, and its result (or the exception it raised) handed to every rank: a decision made
    once, the same on all ranks (which checkpoint to resume from: verifying it reads every file). Collective; the
    result small. Rank 0 raises its own exception. One that cannot be pickled, or unpickled on another rank, reaches
    the others as a RuntimeError saying so, instead of leaving them waiting for the broadcast (or raising pickle's
    error); a result that cannot be pickled fails every rank, rank 0 too."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box, outcome = [None], None
    if dist.get_rank(group) == 0:
        try:
            outcome = (True, fn())
        except Exception as e:  # every rank raises it, instead of the others waiting for rank 0
            outcome = (False, e)
        try:
            box[0] = pickle.dumps(outcome)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises, the others must not wait for rank 0
            unsent = RuntimeError(f"rank 0 decided for every rank but could not send {_described(outcome)} "
                                  f"({type(e).__name__}: {_text(e)})")
            box[0] = pickle.dumps((False, unsent))
            if outcome[0]:  # an exception rank 0 raises as its own; a result it cannot send fails here too
                outcome = (False, unsent)
    dist.broadcast_object_list(box, group=group, group_src=0)
    if outcome is None:  # another rank: the broadcast is over, so failing to read it leaves no one waiting
        try:
            outcome = pickle.loads(box[0])
        except Exception as e:  # noqa: BLE001 - an exception class that does not unpickle, a module not found here
            outcome = (False, RuntimeError(f"rank 0's decision for every rank could not be read on this rank "
                                           f"({type(e).__name__}: {_text(e)}); rank 0's log says what it was"))
    ok, value = outcome
    if not ok:
        raise value
    return value


def _described(outcome: tuple) -> str:
    ok, value = outcome
    return f"a result of type {type(value).__name__}" if ok else f"{type(value).__name__}: {_text(value)}"


def _text(e: BaseException) -> str:
    """str(e), or a placeholder where its __str__ fails (a message is still owed to the other ranks)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - any failure of a foreign __str__
        return "<its message could not be read>"


def host_staged(group, x: torch.Tensor) -> bool:
    """Whether x must travel through host memory over `group` (gloo, and x on a device)."""
    return x.device.type != "cpu" and dist.get_backend(group) == "gloo"


class CopyIn:
    """A request after the receive requests it follows: waiting for it copies the received host buffer into
    the device buffer."""

    def __init__(self, device_buf: torch.Tensor, host_buf: torch.Tensor):
        self.device_buf, self.host_buf = device_buf, host_buf

    def wait(self) -> None:
        self.device_buf.copy_(self.host_buf)


def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, group, recv_splits=None, send_splits=None) -> None:
    """dist.all_to_all_single (even splits, or the given rows per rank), staged through host memory where the
    group cannot move device tensors."""
    if not host_staged(group, send):
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        return
    host = torch.empty(recv.shape, dtype=recv.dtype)
    dist.all_to_all_single(host, send.cpu(), recv_splits, send_splits, group=group)
    recv.copy_(host)
