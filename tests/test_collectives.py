"""The collectives that keep a run's processes together (parallel/collectives.py): a decision rank 0 makes handed to
every rank (from_main), work rank 0 does first (main_first), and a failure on any rank raised on every rank, so that
no rank is left waiting at a collective for one that has gone."""
from __future__ import annotations

import os
import threading

import pytest

from tests.conftest import report


def _from_main_worker(rank: int, world: int, path: str) -> None:
    import torch

    from longstride.parallel.collectives import from_main

    calls = []

    def decide():
        calls.append(rank)
        return f"rank {rank} decided"

    def fail():
        raise ValueError("no intact checkpoint")

    got = from_main(decide)
    try:
        from_main(fail)
        raised = ""
    except ValueError as e:
        raised = str(e)
    torch.save({"got": got, "calls": calls, "raised": raised}, f"{path}.{rank}")


def test_resume_decision_is_made_on_rank_0_and_shared(tmp_path):
    """The checkpoint to resume from is chosen (verified) on rank 0 only and handed to every rank; an error
    there (no intact checkpoint) is raised on every rank instead of leaving the others waiting."""
    import torch

    from longstride.parallel.spawn import run_gloo

    run_gloo(_from_main_worker, 2, str(tmp_path / "out"))
    for rank in range(2):
        r = torch.load(tmp_path / f"out.{rank}")
        assert r["got"] == "rank 0 decided" and r["calls"] == ([0] if rank == 0 else [])
        assert r["raised"] == "no intact checkpoint"


def _main_first_worker(rank: int, world: int, root: str, failing: int) -> None:
    from longstride.parallel.collectives import main_first

    calls = []

    def build():  # what rank 0 builds first and the others then reuse; rank `failing` cannot
        calls.append(rank)
        if rank == failing:
            raise OSError(f"cache of rank {rank} unreadable")
        return "tokenizer"

    try:
        said = main_first(build, lambda: ValueError("another process could not build the tokenizer"))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the test's subject
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"{failing}-{rank}.txt"), "w") as f:
        f.write(f"{said} {calls}")


@pytest.mark.timeout(120)  # before, a rank whose build failed left the others waiting at the next collective
@pytest.mark.parametrize("failing", [0, 1, -1])
def test_what_rank_0_builds_first_fails_every_rank_where_it_fails(tmp_path, failing):
    """main_first: rank 0 builds (the tokenizer, the corpus cache), then the others reuse it. Rank 0 failing ends the
    others without building; another rank failing ends rank 0 too; each names the failure or the other process."""
    from longstride.parallel.spawn import run_gloo

    run_gloo(_main_first_worker, 2, str(tmp_path), failing)
    said = [(tmp_path / f"{failing}-{r}.txt").read_text() for r in range(2)]
    elsewhere = "ValueError: another process could not build the tokenizer"
    expect = {0: ["OSError: cache of rank 0 unreadable [0]", f"{elsewhere} []"],
              1: [f"{elsewhere} [0]", "OSError: cache of rank 1 unreadable [1]"],
              -1: ["tokenizer [0]", "tokenizer [1]"]}[failing]
    assert said == expect, said


class _TwoArgs(Exception):
    """An exception that pickles but does not unpickle: its __init__ takes two arguments, its args hold one."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")


def _unsendable_worker(rank: int, world: int, root: str, case: str) -> None:
    from longstride.parallel.collectives import from_main

    def decide():  # rank 0's decision, which cannot travel to the others as it is
        if case == "attribute":
            e = OSError("stage.json unreadable")
            e.handle = threading.Lock()  # an exception's attributes travel with it; a lock does not pickle
            raise e
        if case == "init":
            raise _TwoArgs("trainer.pt", "truncated")
        return lambda: "a result that does not pickle"

    report(os.path.join(root, f"{case}{rank}.txt"), lambda: from_main(decide), lambda value: f"returned {value!r}")


@pytest.mark.timeout(120)  # before: rank 0 failed to pickle and left rank 1 waiting in the broadcast
@pytest.mark.parametrize("case", ["attribute", "init", "result"])
def test_a_decision_that_cannot_travel_still_ends_every_rank(tmp_path, case):
    """from_main hands rank 0's result or exception to the others by pickling it. An exception carrying an
    unpicklable attribute failed on rank 0 inside the broadcast and left the others waiting for it (for the collective
    timeout); one whose __init__ does not match its args raised a TypeError about pickling on the others. Now rank 0
    raises its own exception and the others a RuntimeError naming it; an unpicklable result fails every rank."""
    from longstride.parallel.spawn import run_gloo

    run_gloo(_unsendable_worker, 2, str(tmp_path), case)
    said = [(tmp_path / f"{case}{r}.txt").read_text() for r in range(2)]
    if case == "result":
        assert said[0] == said[1], said
        assert said[0].startswith("RuntimeError: rank 0 decided for every rank but could not send a result of type "
                                  "function ("), said
    elif case == "attribute":
        assert said == ["OSError: stage.json unreadable", "RuntimeError: rank 0 decided for every rank but could not "
                        "send OSError: stage.json unreadable (TypeError: cannot pickle '_thread.lock' object)"], said
    else:
        assert said[0] == "_TwoArgs: trainer.pt: truncated", said
        assert said[1].startswith("RuntimeError: rank 0's decision for every rank could not be read on this rank "
                                  "(TypeError: "), said
        assert said[1].endswith("; rank 0's log says what it was"), said
