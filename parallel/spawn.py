"""Runs a function on n local gloo processes (file rendezvous): the parity tests, `longstride check` and the CPU
benchmarks simulate a context-parallel group with it on one machine.

On a Linux machine without a GPU the processes start from a fork server that has imported torch, transformers and
the first caller's module once, so a rank starts in a fraction of a second instead of importing them again (about
3 s on a 2-core machine).
Each rank still gets the caller's current environment, working directory and sys.path, as a spawned one would,
and exits when its caller dies. What libraries read only while being imported (OMP_NUM_THREADS, MKL_*, HF_HOME)
comes from the environment of the call that started the server: set those before the first call. Elsewhere (a
GPU, whose ranks must not fork from a process that may have touched CUDA; macOS) each rank is a fresh
interpreter, as is every rank under LONGSTRIDE_SPAWN=spawn, and every rank of a process whose server died (a
module it preloads raised there; a warning says so once)."""
from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank failed: the message names the ranks killed by a signal without raising, then gives the traceback of
    the first rank that raised."""


def _record_failure(workdir: str, rank: int) -> None:
    """The raising rank's traceback in failed.<rank>, and that file linked as `first` unless a rank got there
    before it: written aside, then renamed and linked, so a rank terminated midway leaves no partial file, and the
    link (which fails if `first` exists) orders the ranks whatever the filesystem's timestamp resolution."""
    tmp = f"{workdir}/.failed.{rank}"
    with open(tmp, "w") as f:
        f.write(traceback.format_exc())
    os.replace(tmp, f"{workdir}/failed.{rank}")
    with contextlib.suppress(FileExistsError):
        os.link(f"{workdir}/failed.{rank}", f"{workdir}/first")


def exit_with_parent(parent) -> None:
    """In a thread of a process forked by the fork server: ends the process when `parent` (the caller that asked for
    it, multiprocessing.parent_process()) exits or is killed."""
    parent.join()  # returns when the caller's end of the pipe closes: it exited or was killed
    os._exit(1)


def _entry(rank: int, n: int, workdir: str, fn, args, env: dict) -> None:
    # the fork server was started with the environment of the first call; this call's is the one that counts
    os.environ.clear()
    os.environ.update(env)
    # torch sets a parent-death SIGINT, but a rank forked by the server has the server as its parent, and a
    # SIGINT can be ignored or handled: the rank watches its caller itself, whatever started it
    threading.Thread(target=exit_with_parent, args=(multiprocessing.parent_process(),), daemon=True).start()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=n)
    try:
        try:
            fn(rank, n, *args)
        except BaseException:
            # Recorded before this rank's process group is destroyed and before it exits: a peer blocked in a
            # collective with it fails only once its connections close, so an exception raised in Python is
            # recorded first. (An error inside a gloo op that itself closes the connection, such as a timeout,
            # may let the peer record first.)
            _record_failure(workdir, rank)
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


def _failure(workdir: str, processes) -> RankFailed | None:
    """What failed, from the ranks' records and exit codes: ranks killed by a signal without raising (SIGTERM
    aside: the spawn terminates the survivors with it), then the traceback of the first rank that raised; None if
    neither (the spawn's own error says what there is)."""
    failed = {int(p.rsplit(".", 1)[1]): p for p in glob.glob(os.path.join(workdir, "failed.*"))}
    lines = [f"rank {i} died from {signal.Signals(-p.exitcode).name} without raising"
             for i, p in enumerate(processes) if p.exitcode is not None and p.exitcode < 0
             and p.exitcode != -signal.SIGTERM and i not in failed]
    first = os.path.join(workdir, "first")
    if os.path.exists(first):
        rank = next(r for r, p in failed.items() if os.path.samefile(p, first))
        others = ", ".join(str(r) for r in sorted(failed) if r != rank) or "none"
        with open(first) as f:
            lines.append(f"rank {rank} raised first (ranks that raised after it: {others}):\n{f.read()}")
    return RankFailed("\n".join(lines)) if lines else None


PRELOAD = ["torch", "torch.distributed", "transformers"]


def forkserver_usable() -> bool:
    """Whether processes may start from the fork server: LONGSTRIDE_SPAWN is forkserver (the default; spawn: a fresh
    interpreter each), on Linux, without CUDA, and this process's server has not died."""
    chosen = os.environ.get("LONGSTRIDE_SPAWN", "forkserver")
    if chosen not in ("forkserver", "spawn"):
        raise ValueError(f"LONGSTRIDE_SPAWN={chosen!r}: use 'forkserver' (the default) or 'spawn'")
    return chosen == "forkserver" and sys.platform.startswith("linux") and not torch.cuda.is_available() \
        and not _server_died


def _start_method(fn) -> str:
    """'forkserver' on Linux without CUDA, else 'spawn'; LONGSTRIDE_SPAWN=spawn forces a fresh interpreter per
    rank. The server's first start imports PRELOAD and fn's module (the models and modules a test or check
    builds: most of a rank's start); later calls reuse it, and import their own function's module in each rank.
    Never on a GPU machine: a module imported in the server might touch CUDA, and no forked rank could then use
    it."""
    if not forkserver_usable():
        return "spawn"
    # fn's module imported without error here, so it imports in the server; a script's __main__ does not
    own = [fn.__module__] if fn.__module__ in sys.modules and fn.__module__ != "__main__" else []
    multiprocessing.set_forkserver_preload([*PRELOAD, *own])  # read only when the server starts
    return "forkserver"


_server_died = False  # this process's fork server died: its later calls spawn


def _start(fn, n: int, workdir: str, args):
    global _server_died
    method = _start_method(fn)  # spawn once the server died
    try:
        return mp.start_processes(_entry, args=(n, workdir, fn, args, dict(os.environ)), nprocs=n, join=False,
                                  start_method=method)
    except (EOFError, ConnectionError) as e:
        if method != "forkserver":
            raise
        # the server died before forking a rank: a module it preloads raised while being imported there
        _server_died = True
        warnings.warn(f"the gloo ranks' fork server died ({e!r}: a module it imports raised); this process starts "
                      "its ranks with spawn from now on (LONGSTRIDE_SPAWN=spawn does so from the start)")
        return _start(fn, n, workdir, args)


def rank_accelerator(rank: int, world: int, **kwargs):
    """For tests and benchmarks only, inside a run_gloo rank (it sets this process's launch environment): an
    accelerate Accelerator that knows the launch. accelerate reads RANK and WORLD_SIZE, which `accelerate launch`
    sets and run_gloo does not; without them it reports one process and prepare() wraps nothing in DDP, so each
    rank would train its own copy. The process group already exists and is kept, and so is the rank's thread count
    (accelerate would set cores / world where OMP_NUM_THREADS is unset)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS=str(torch.get_num_threads()))
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, **kwargs)
    assert acc.num_processes == world and acc.process_index == rank, (acc.num_processes, acc.process_index)
    return acc


def run_gloo(fn, n: int, *args) -> None:
    """fn(rank, world, *args) on n processes. If a rank failed, raises RankFailed naming the ranks killed by a
    signal and the traceback of the first rank that raised: the peers it left waiting in a collective fail too,
    and the spawn reports whichever process it saw exit first."""
    with tempfile.TemporaryDirectory() as d:
        ctx = _start(fn, n, d, args)
        try:
            while not ctx.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failure = _failure(d, ctx.processes)
            if failure is None:
                raise
            raise failure from e
        finally:  # interrupted (Ctrl-C, a test's timeout): no rank is left running, nor the caller's exit waiting
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


def gather_cat(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (same shape on all ranks), in rank order."""
    x = x.contiguous()  # one agreed layout on every rank, whatever layout x had
    parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts
