"""GPU tests: every test here carries the `gpu` marker and is skipped without CUDA. On a GPU machine
`python -m benchmarks.gpu_check` runs them with the GPU benchmarks; `pytest -m gpu tests/gpu` alone works too."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run python -m benchmarks.gpu_check on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
