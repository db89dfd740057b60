"""Tensors that stay real inside a traced step: the one place that knows the tracer's fake-tensor mode.

`longstride plan` traces a training step under FakeTensorMode (recipes/memory/trace.py). The few small tensors
a kernel makes once and caches across steps (cumulative lengths, head schedules, halo indices), and a probe that
decides a code path, must be real, or a later real run would meet a fake one: they are made under `real()`.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def real():
    """Tensors made inside are real tensors even under a fake-tensor trace (a no-op outside one)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield
