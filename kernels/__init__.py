"""Kernels of zenflow_triton, installed as ``zenflow_triton.kernels``.

- ``reference``: plain-torch twins of every op (the oracle; the backend for CPU tensors).
- ``fused_step``: Triton, one pass over a gradient (scores, AdamW on selected columns, accumulate the rest).
- ``colnorm``: Triton, per-column squared norms alone (selection steps).
- ``merge``: Triton, write the host snapshot into unselected columns.
- ``cpu_adamw``: numba, masked AdamW over host buffers with a model-dtype snapshot in the same pass.

Triton modules import triton lazily, so ``import zenflow_triton.kernels`` works without it.
"""

from . import reference

__all__ = ["reference"]
