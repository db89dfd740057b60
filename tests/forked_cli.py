"""`python -m MODULE ARGS` for the tests' command-line runs (conftest.run_cli), in a process forked from a server that
imported torch, transformers and the training modules once: a run starts in a fraction of a second instead of
importing them again (about 7 CPU-s on a 2-core machine, some 45 runs in the suite).

The child is the command as its own process: its own pid (the fault tests' SIGKILL and SIGTERM reach it alone), this
call's environment and working directory, its stdout and stderr captured, its exit code (a signal's as -N, as
subprocess reports it), its non-daemon threads joined and atexit's handlers run at its end; numpy's global generator
and datasets' fingerprint generator reseeded. What it shares with the server: what libraries read while being
imported comes from the pytest worker's environment when the server started (conftest sets OMP_NUM_THREADS=1 and the
offline switches there), and the string hash seed. The interpreter's own finalization does not run: the suite's
`accelerate launch` runs are fresh interpreters, and `fresh=True` starts one (as does every run where the fork
server cannot serve: not Linux, CUDA present, LONGSTRIDE_SPAWN=spawn, a server that died). The fork server is
multiprocessing's, shared with parallel/spawn.run_gloo's ranks.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback

from longstride.parallel.spawn import exit_with_parent, forkserver_usable

# what a training run imports, in the fork server once (read only when it starts; run_gloo's own list is a subset).
# Not longstride.recipes.train itself: the command runs it as __main__, as `python -m` does, from no earlier copy.
PRELOAD = ["torch", "torch.distributed", "transformers", "accelerate", "datasets", "hydra", "numpy",
           "longstride.recipes.run.stage", "longstride.recipes.run.tracking", "longstride.recipes.config.plan",
           "longstride.recipes.checkpoint.format", "longstride.data.corpus"]


def _reseed() -> None:
    import numpy as np

    np.random.seed()  # a fresh interpreter's global generator is seeded from the OS, not the server's state
    if "datasets.fingerprint" in sys.modules:
        import random

        sys.modules["datasets.fingerprint"].fingerprint_rng = random.Random()


def _child(module: str, args: list, env: dict, cwd: str, out: str, err: str) -> None:
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # python -m puts the working directory first
    threading.Thread(target=exit_with_parent, args=(multiprocessing.parent_process(),), daemon=True).start()
    _reseed()
    sys.modules.pop(module, None)
    sys.argv = [module, *args]
    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    # as an interpreter leaves (a multiprocessing child ends in os._exit): non-daemon threads, then atexit's handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def run_module(module: str, args: list, env: dict, cwd: str, timeout: int, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """`python -m module *args` with `env` in `cwd`, as subprocess.run(..., capture_output=True, text=True,
    timeout=timeout) returns it."""
    argv = [sys.executable, "-m", module, *args]
    if fresh or not forkserver_usable():
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    from multiprocessing import forkserver

    if not forkserver._forkserver._forkserver_pid:  # not started yet: this list is the one it imports
        multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")

        def read(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        p = multiprocessing.get_context("forkserver").Process(target=_child, args=(module, args, env, cwd, out, err))
        try:
            p.start()
        except (EOFError, ConnectionError):  # the server died (a module it preloads raised): a fresh interpreter
            return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        try:
            p.join(timeout)
            if p.is_alive():
                raise subprocess.TimeoutExpired(argv, timeout, read(out), read(err))
        finally:  # a timeout, or the test interrupted (pytest-timeout, Ctrl-C): the run ends with it
            if p.is_alive():
                p.kill()
                p.join()
        return subprocess.CompletedProcess(argv, p.exitcode, read(out), read(err))
