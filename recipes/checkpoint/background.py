"""train.async_save: a step checkpoint blocks the step only while each rank copies its model and optimizer shard to
host memory (DCP's async_save, parallel/shards.py) and writes its own small files; DCP's thread writes the shards
behind the next steps, then in a thread of BackgroundSave's on every rank the ranks hash a share of the files each
(on the save's own process group, parallel/shards.save_group) and the main rank seals the checkpoint (manifest last,
rename, keep_last's pruning), so until then it is a `.tmp-` directory no resume takes. One save is in flight at a
time: the next save, a stop signal, an error and the end of the stage wait for
it. A failed write (a full disk) is found without blocking at the end of the next step (BackgroundSave.failed,
all-reduced with the stop flag) or at that wait, and raised on every rank as a blocking save's. Cost: host memory
for a copy of what the rank saves until its writes end: under DDP the whole replicated state, under FSDP2 its
shard (copied twice while staging; benchmarks/bench_checkpoint.py --background).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from longstride.parallel.collectives import raise_if_any
from longstride.parallel.shards import save_group
from longstride.recipes.checkpoint.format import CheckpointError, disk_errors, failed_on_another_rank, save_test_kills


class BackgroundSave:
    """The step checkpoint in flight on this rank, if any: its shards' future and the seal that follows."""

    def __init__(self):
        self._shards: Optional[Future] = None
        self._thread: Optional[threading.Thread] = None
        self._path: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._started = self.held = self.sealed_s = 0.0

    @property
    def in_flight(self) -> Optional[str]:
        """The checkpoint being written, until `wait` returns."""
        return self._path

    def track(self, shards: Future, started: float) -> None:
        """The future of the shards this rank started writing (Parallelized.save_state(..., background=True)) in the
        save that began at time.perf_counter() `started` (its copy of the state included in what it held)."""
        if self._path is not None or self._shards is not None:
            raise RuntimeError("a background save started while another is in flight: wait() for it first")
        self._shards, self._started = shards, started

    def abandon(self) -> None:
        """A save that failed before its thread started (writing_checkpoint): its shards are waited for (DCP's
        thread writes into the directory being dropped, on the process group the next save uses) and forgotten."""
        shards, self._shards = self._shards, None
        if shards is not None:
            with contextlib.suppress(BaseException):
                shards.result()

    def finish(self, path: str, digests: Callable[[object], dict], seal: Optional[Callable[[dict], None]]) -> None:
        """After every rank's own files are written (writing_checkpoint): a thread waits for the shards, then takes
        `digests(group)` (a collective over the save's process group: every rank's thread reaches it, or, where
        the shards failed on some rank, every thread raises) and runs `seal(digests)` (the main rank's; None on
        the others)."""
        if self._shards is None:
            raise RuntimeError(f"{path}: a background save with no shards tracked (BackgroundSave.track)")
        shards, self._shards, self._path = self._shards, None, path
        self.held = time.perf_counter() - self._started
        group = save_group()  # made here, in the training thread, where every rank makes it in the same order

        def run() -> None:
            try:
                error = None
                try:
                    shards.result()
                    save_test_kills(os.path.basename(path))
                except BaseException as e:  # noqa: BLE001 - every rank's thread learns it before the hashing
                    error = e
                raise_if_any(error, lambda: failed_on_another_rank(path), group)
                taken = digests(group)
                if seal is not None:
                    seal(taken)
                self.sealed_s = time.perf_counter() - self._started
            except BaseException as e:  # noqa: BLE001 - raised by wait(), in the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name=f"save {os.path.basename(path)}", daemon=False)
        self._thread.start()

    def failed(self) -> bool:
        """Without blocking: the save in flight has ended in an error (wait() raises it)."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def wait(self) -> Optional[str]:
        """Blocks until the save in flight (if any) is written and sealed; returns its path, or None when there
        was none. A failed write raises CheckpointError naming the checkpoint (the earlier ones are intact)."""
        if self._thread is None:
            return None
        self._thread.join()
        path, error = self._path, self._error
        self._thread, self._path, self._error = None, None, None
        if isinstance(error, OSError):
            with disk_errors(path):
                raise error
        if isinstance(error, Exception) and not isinstance(error, CheckpointError):
            raise CheckpointError(f"checkpoint {path} was not completed ({type(error).__name__}: {error}); the "
                                  "earlier checkpoints are intact: rerun to resume from the newest") from error
        if error is not None:
            raise error
        return path
