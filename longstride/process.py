"""What a longstride command does to its process as a whole (called by the command entry points, never on import).

A command's process imports torch, transformers, datasets and accelerate, and Python's last act at exit is a garbage
collection over all of their objects: about 0.9 s a process on a 2-core CPU machine (`python -c "import
longstride.recipes.train, transformers, datasets, accelerate"`: 4.3 s to exit, 3.5 s with the objects frozen first).
A launch of N ranks pays it N + 1 times, and the test suite starts hundreds of such processes.
"""
from __future__ import annotations

import atexit
import gc


def skip_exit_collection() -> None:
    """Freeze every object at exit, before the interpreter's final collection, so that it examines none of them.
    What a command writes is closed by then (each file in a `with`, metrics.jsonl flushed every step and closed at
    the stage's end, wandb finished in `finally`); only finalizers of objects caught in reference cycles would be
    skipped, and the operating system reclaims their memory. Registered once however often it is called (a test
    or a Hydra multirun calls a command's main more than once in one process)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True


_registered = False
