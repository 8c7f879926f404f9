"""Test set-up: Triton's interpreter on machines without CUDA, and clean skips for GPU-only tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The checkout's top-level kernels/ and autotune/ install as zenflow_triton.kernels and zenflow_triton.autotune. With
# the checkout first on sys.path (``python -m pytest`` puts the working directory there) they would shadow installed
# distributions of those names (transformers >= 5.25 imports Hugging Face's `kernels`): the checkout goes last, where
# it still provides zenflow_triton to a tree that is not installed.
_ROOT = Path(__file__).resolve().parent.parent
_here = [p for p in sys.path if Path(p or ".").resolve() == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _here] + _here

# Must happen before anything imports triton: without CUDA the Triton kernels run in the interpreter on CPU
# tensors, which is how CI checks them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Files whose tests not marked gpu launch the Triton kernels on CPU tensors, which only the interpreter can run.
_INTERPRETED_FILES = {"test_fused_step.py", "test_colnorm.py", "test_merge.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        # On a GPU machine without the interpreter (how the GPU tests must run, compiled), the CPU-tensor Triton
        # tests cannot launch: skip them with the reason instead of failing them.
        if os.environ.get("TRITON_INTERPRET") != "1":
            skip_cpu_triton = pytest.mark.skip(
                reason="launches Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (GPU tests: pytest -m gpu)")
            for item in items:
                if "gpu" not in item.keywords and item.path.name in _INTERPRETED_FILES:
                    item.add_marker(skip_cpu_triton)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def planned_with_synthetic_profile(monkeypatch):
    """Knobs.resolve plans from the synthetic profile instead of looking for this machine's; the list of the
    planner's keyword arguments, one entry per plan."""
    from autotune_profiles import synthetic_profile

    import zenflow_triton.autotune as autotune
    from zenflow_triton.autotune.bridge import QUALITY_ENV_VAR

    real = autotune.plan_for_optimizer
    calls = []

    def fake(**kw):
        calls.append(kw)
        return real(profile=synthetic_profile(), **kw)

    monkeypatch.setattr(autotune, "plan_for_optimizer", fake)
    monkeypatch.delenv(QUALITY_ENV_VAR, raising=False)
    return calls
