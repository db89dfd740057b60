"""parallel/spawn.run_gloo: every rank's result reaches the caller, and a rank that fails fails the call with its own
traceback or signal, not the peer's broken connection (a finished rank leaves through os._exit, so nothing but its
files and its exit status comes back)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from longstride.parallel.spawn import RankFailed, run_gloo


def _sum_ranks(rank, world, out):
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    torch.save(x, f"{out}.{rank}")


def _rank1_fails_while_rank0_waits(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here until rank 1's death breaks the connection, then raises too


def _rank1_killed_while_rank0_waits(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # an out-of-memory kill, a segfault: nothing raised, nothing recorded
    dist.all_reduce(torch.ones(1))


def _write_env(rank, world, out, name):
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{os.environ.get(name)} {os.getcwd()} {torch.get_num_threads()} {os.getppid()}")


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_and_directory_at_each_call(tmp_path, monkeypatch, method):
    """The fork server outlives a call and was started with the first call's environment: a later call's
    environment (tests and `longstride check` pass settings to the ranks through it) must still reach its ranks."""
    from longstride.parallel import spawn

    if method == "forkserver" and (sys.platform != "linux" or torch.cuda.is_available()):
        pytest.skip("the fork server is used on Linux without CUDA only")
    monkeypatch.setenv("LONGSTRIDE_SPAWN", method)
    assert spawn._start_method(_write_env) == method
    for value in ("first", "second"):
        monkeypatch.setenv("LONGSTRIDE_TEST_SPAWN_VALUE", value)
        (tmp_path / value).mkdir()
        monkeypatch.chdir(tmp_path / value)
        run_gloo(_write_env, 2, str(tmp_path / value / "out"), "LONGSTRIDE_TEST_SPAWN_VALUE")
        got = [(tmp_path / value / f"out.{r}").read_text().split() for r in range(2)]
        assert [g[:3] for g in got] == [[value, str(tmp_path / value), "1"]] * 2
        assert all((int(g[3]) == os.getpid()) == (method == "spawn") for g in got), "forked by the server"


def test_a_bad_start_method_is_named(monkeypatch):
    from longstride.parallel import spawn

    monkeypatch.setenv("LONGSTRIDE_SPAWN", "fork")
    with pytest.raises(ValueError, match="LONGSTRIDE_SPAWN='fork': use 'forkserver'"):
        spawn._start_method(_write_env)


CALLER = """
import os, sys, time
from longstride.parallel.spawn import run_gloo
from tests.test_spawn import _sleep_forever
run_gloo(_sleep_forever, 2, sys.argv[1])
"""


def _sleep_forever(rank, world, out):
    # a rank busy where a signal cannot reach it (torch's parent-death SIGINT would otherwise end a spawned one)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.1)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_exit_when_their_caller_is_killed(tmp_path, method):
    import subprocess

    from tests.conftest import REPO
    from tests.test_faults import all_gone

    env = {**os.environ, "LONGSTRIDE_SPAWN": method}
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(tmp_path / "pid")], cwd=REPO, env=env)
    pids = []
    try:
        deadline = time.time() + 120
        while len(pids) < 2 and time.time() < deadline and caller.poll() is None:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]
            time.sleep(0.1)
        assert len(pids) == 2, caller.poll()
        caller.kill()  # SIGKILL: nothing of the caller runs, only the ranks' own watch can end them
        caller.wait()
        assert all_gone(pids, 30), "ranks outlived their caller"
    finally:
        caller.kill()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_every_rank_writes_its_result(tmp_path):
    run_gloo(_sum_ranks, 2, str(tmp_path / "sum"))
    assert [torch.load(tmp_path / f"sum.{r}").item() for r in range(2)] == [3.0, 3.0]


@pytest.mark.parametrize("attempt", range(3))  # the peer's error races the cause's; each attempt must name the cause
def test_a_failing_rank_fails_the_call_with_its_own_traceback(attempt):
    with pytest.raises(RankFailed, match=r"(?s)^rank 1 raised first .*rank 1 fails on purpose"):
        run_gloo(_rank1_fails_while_rank0_waits, 2)


@pytest.mark.parametrize("attempt", range(2))
def test_a_killed_rank_is_named_with_its_signal(attempt):
    with pytest.raises(RankFailed, match=r"^rank 1 died from SIGKILL without raising"):
        run_gloo(_rank1_killed_while_rank0_waits, 2)


FAULTY = """
import sys
import torch
import torch.distributed as dist
if sys.argv[:1] == ["-c"]:  # the fork server runs as `python -c ...`; the caller and its ranks do not
    raise RuntimeError("raises in the fork server only")
def work(rank, world, out):
    x = torch.ones(1)
    dist.all_reduce(x)
    open(f"{out}.{rank}", "w").write(str(x.item()))
"""

FAULTY_CALLER = """
from faulty import work
from longstride.parallel.spawn import run_gloo
if __name__ == "__main__":
    run_gloo(work, 2, "first")
    run_gloo(work, 2, "second")
"""


@pytest.mark.skipif(sys.platform != "linux" or torch.cuda.is_available(), reason="the fork server's fault")
def test_a_fork_server_killed_by_an_import_falls_back_to_spawn_once_and_says_so(tmp_path):
    """A module the server preloads raises there (not an ImportError, which it ignores): the server dies before
    forking a rank. The call and the next still run, spawned, with one warning."""
    import subprocess

    (tmp_path / "faulty.py").write_text(FAULTY)
    (tmp_path / "caller.py").write_text(FAULTY_CALLER)
    r = subprocess.run([sys.executable, "caller.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LONGSTRIDE_SPAWN": "forkserver"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "raises in the fork server only" in r.stderr  # the fault happened
    assert r.stderr.count("the gloo ranks' fork server died (EOFError") == 1, r.stderr[-3000:]
    assert [(tmp_path / f"{call}.{rank}").read_text() for call in ("first", "second") for rank in (0, 1)] == ["2.0"] * 4


def test_a_forked_command_past_its_timeout_is_killed_and_its_exit_codes_are_a_processs(tmp_path):
    """tests/forked_cli.run_module (run_cli's runner): a command past its timeout raises TimeoutExpired with what it
    printed, and is gone; a command's sys.exit code, and a signal's death as -N, come back as subprocess gives them."""
    import subprocess

    from tests.forked_cli import run_module

    pid_file = tmp_path / "pid"
    stmt = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('started', flush=True); " \
           "time.sleep(120)"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_module("timeit", ["-n", "1", "-r", "1", stmt], dict(os.environ), str(tmp_path), timeout=3)
    assert "started" in e.value.output
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    ok = run_module("json.tool", ["--help"], dict(os.environ), str(tmp_path), timeout=60)
    assert ok.returncode == 0 and "usage" in ok.stdout
    bad = run_module("json.tool", [str(tmp_path / "missing.json")], dict(os.environ), str(tmp_path), timeout=60)
    assert bad.returncode == 2 and "missing.json" in bad.stderr
    killed = run_module("timeit", ["-n", "1", "-r", "1", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                        dict(os.environ), str(tmp_path), timeout=60)
    assert killed.returncode == -signal.SIGKILL
