"""Test set-up: Triton's interpreter on machines without CUDA, and clean skips for GPU-only tests."""

from __future__ import annotations

import os

import pytest
import torch

# Must happen before anything imports triton: without CUDA the Triton kernels run in the interpreter on CPU
# tensors, which is how CI checks them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
