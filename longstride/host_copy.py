"""Host-to-device copies that do not make the host wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA device waits for every kernel queued before it on the stream,
so the host cannot queue the next layer or micro-batch while the GPU works. Staged through pinned memory and issued
with non_blocking=True the copy is queued like a kernel; torch's pinned allocator keeps the staging buffer until the
copy has run. Elsewhere (CPU, meta) a plain copy.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; a host tensor bound for CUDA goes through pinned memory without blocking."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_device_tensor(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list or array as a `dtype` tensor on `device` (to_device)."""
    return to_device(torch.as_tensor(values, dtype=dtype), device)
