"""`python -m MODULE ARGS` for the tests' command-line runs (conftest.run_cli), in a process forked from a server that
imported torch, transformers and the training modules once: a run starts in a fraction of a second instead of
importing them again (about 7 CPU-s on a 2-core machine, some 45 runs in the suite).

The child is the command as its own process: its own pid (the fault tests' SIGKILL and SIGTERM reach it alone), this
call's environment and working directory, its stdout and stderr captured, its exit code (a signal's as -N, as
subprocess reports it), atexit's handlers run at its end. What libraries read only while being imported comes from
the environment of the first call (the suite's runs all set OMP_NUM_THREADS=1 and the offline switches); a run that
needs another is started fresh (`fresh=True`), as is every run where the fork server cannot serve (not Linux, CUDA
present, LONGSTRIDE_SPAWN=spawn). The fork server is multiprocessing's, shared with parallel/spawn.run_gloo's ranks.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback

# what a training run imports: in the fork server once (read only when it starts; run_gloo's own list is a subset)
PRELOAD = ["torch", "torch.distributed", "transformers", "accelerate", "datasets", "hydra",
           "longstride.recipes.train", "longstride.recipes.run.stage", "longstride.recipes.run.tracking",
           "longstride.recipes.config.plan", "longstride.recipes.checkpoint.format", "longstride.data.corpus"]


def _watch(parent) -> None:
    parent.join()  # returns when the caller's end of the pipe closes: it exited or was killed
    os._exit(1)


def _child(module: str, args: list, env: dict, cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    threading.Thread(target=_watch, args=(multiprocessing.parent_process(),), daemon=True).start()
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a multiprocessing child leaves through os._exit: run them as an interpreter's exit would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forkable() -> bool:
    import torch

    return (os.environ.get("LONGSTRIDE_SPAWN", "forkserver") == "forkserver" and sys.platform.startswith("linux")
            and not torch.cuda.is_available())


def run_module(module: str, args: list, env: dict, cwd: str, timeout: int, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """`python -m module *args` with `env` in `cwd`, as subprocess.run(..., capture_output=True, text=True,
    timeout=timeout) returns it."""
    argv = [sys.executable, "-m", module, *args]
    if fresh or not _forkable():
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    if not forkserver._forkserver._forkserver_pid:  # not started yet: this list is the one it imports
        multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        p = ctx.Process(target=_child, args=(module, args, env, cwd, out, err))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(argv, timeout)

        def read(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        return subprocess.CompletedProcess(argv, p.exitcode, read(out), read(err))
