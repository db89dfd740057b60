"""What a longstride command does to its process as a whole (called by the command entry points, never on import):
the exit collection skipped, and the training's CUDA allocator setting.

A command's process imports torch, transformers, datasets and accelerate, and Python's last act at exit is a garbage
collection over all of their objects: about 0.9 s a process on a 2-core CPU machine (`python -c "import
longstride.recipes.train, transformers, datasets, accelerate"`: 4.3 s to exit, 3.5 s with the objects frozen first).
A launch of N ranks pays it N + 1 times, and the test suite starts hundreds of such processes.
"""
from __future__ import annotations

import atexit
import gc
import os


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


def cuda_allocator_default() -> None:
    """Expandable segments for torch's CUDA caching allocator, unless the user configured it
    (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF): packed batches of changing document layouts make buffers of new
    sizes step after step, which fragment fixed-size segments until a stage the memory plan fits runs out of memory;
    the GPU measurements behind the plan's allowance ran with them (benchmarks/device_window.py). Read at the
    allocator's first use: called before the training touches CUDA."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
